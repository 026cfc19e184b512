"""Write a random-weight checkpoint of a registered model family at a named shape.

    python benchmarks/make_random.py FAMILY OUT [--shape NAME] [--layers N] [--experts N]
                                     [--dtype bf16|fp32] [--seed 0] [--mtp random|echo]
    python benchmarks/make_random.py --list

The checkpoint is the family's own tiny checkpoint (``edgevl.verification.get(FAMILY).make_tiny``:
the real tensor layout, a small tokenizer of the family's kind with its chat template, generation
and preprocessor configs) with the shape's config overrides; token ids in config.json are the
tokenizer's. The benchmarks feed token ids, so the small tokenizer is only there for loading.
``SHAPES`` below names the shapes, the first of a family being its default; ``--layers`` and
``--experts`` change the layer count and routed experts per layer of any shape. The model is built
in memory in fp32 (about 4 bytes a parameter, 8 GB for the Youtu-LLM-2B shape), then written in
``--dtype`` (bf16 by default, as real checkpoints ship).

benchmarks/run.sh builds its checkpoints with it, e.g.
``make_random.py qwen3_5_moe OUT --shape a3b --layers 16 --experts 32``.

``--mtp`` (Qwen3.5 families) adds the multi-token-prediction block: ``random`` drafts at chance;
``echo`` makes drafts that any runtime (llama.cpp's too) accepts: the block is derived from the
model so that it drafts the token the model just predicted (fc passes the hidden half, the layer
adds nothing, norms without gain: its output is the decoder's hidden state rescaled, whose head
argmax is that token), and the embedding table is scaled up (x300) so that the residual stream is
dominated by the current token's row and the (tied-head) model repeats its last token. Speed does
not depend on the values; the acceptance is then ~100 % (``benchmarks/speculative.py`` forces lower
ones).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Shape:
    about: str
    overrides: dict = field(default_factory=dict)   # make_tiny's keyword arguments
    preprocessor: dict = field(default_factory=dict)  # values replaced in preprocessor_config.json
    video_preprocessor: dict = field(default_factory=dict)  # ... and in video_preprocessor_config.json


# Qwen3.5's rotary setting at head size 256 (rotary dim 64: 32 frequencies as T/H/W 11/11/10)
QWEN_ROPE = {"rope_type": "default", "rope_theta": 1e7, "mrope_section": [11, 11, 10], "mrope_interleaved": True,
             "partial_rotary_factor": 0.25}
# Qwen3.5-35B-A3B's per-layer shapes (docs/models/qwen3_5_moe.md, section 2), with 128 experts, not 256
A3B = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
           linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, num_experts=128,
           rope_parameters=QWEN_ROPE)
# the MoE benchmarks: text-only (ForCausalLM), top-8 of 512-wide experts, a 512-wide shared expert,
# transformers' default context length (the tiny config's is 4096)
QWEN_MOE = dict(text_only=True, init_scale=0.02, num_experts_per_tok=8, moe_intermediate_size=512,
                shared_expert_intermediate_size=512, max_position_embeddings=32768)

SHAPES = {
    "youtu": {
        # transformers' YoutuConfig defaults (its docstring names tencent/Youtu-LLM-2B), RoPE theta 10000
        "2b": Shape("Youtu-LLM-2B: 1.96 B parameters, 32 layers, hidden 2048, vocabulary 128256", dict(
            init_scale=0.02, vocab_size=128256, hidden_size=2048, intermediate_size=6144, num_hidden_layers=32,
            num_attention_heads=16, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
            qk_nope_head_dim=128, max_position_embeddings=131072, rope_theta=10000.0)),
        "tiny": Shape("the family's tiny test checkpoint"),
    },
    "youtu_vl": {
        # the vision tower of docs/models/youtu_vl.md section 2.2 with a 1-layer language model
        "4b-vision": Shape("Youtu-VL-4B's vision tower (1152 wide, 27 layers, 16 heads), a 1-layer language model",
                           dict(hidden_size=2560, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                                num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                                qk_rope_head_dim=32, v_head_dim=32,
                                vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                                   num_attention_heads=16, fullatt_block_indexes=[7, 15, 23, 26],
                                                   window_size=256, out_hidden_size=2560)),
                           # the real file's processor keys (llama.cpp's converter reads them)
                           preprocessor={"image_mean": [0.5] * 3, "image_std": [0.5] * 3, "patch_size": 16,
                                         "merge_size": 2, "max_num_patches": 256}),
        "tiny": Shape("the family's tiny test checkpoint"),
    },
    "youtu_moe": {
        "tiny": Shape("the family's tiny test checkpoint"),
    },
    "qwen3_5": {
        # docs/models/qwen3_5.md sections 2 (text) and 7 (vision tower), 8 (the real image processor's
        # mean, std and pixel limits)
        "0.8b": Shape("Qwen3.5-0.8B: 24 layers, hidden 1024, vocabulary 248320, its 12-layer vision tower", dict(
            init_scale=0.02, vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
            num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
            linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
            max_position_embeddings=262144, rope_parameters=QWEN_ROPE,
            vision=dict(depth=12, hidden_size=768, num_heads=12, intermediate_size=3072, num_position_embeddings=2304,
                        patch_size=16, spatial_merge_size=2, temporal_patch_size=2)),
            preprocessor={"image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                          "size": {"shortest_edge": 65536, "longest_edge": 16777216}},
            # the real video processor's budget: 24 M pixels over all sampled frames
            video_preprocessor={"size": {"shortest_edge": 4096, "longest_edge": 25165824}}),
        "tiny": Shape("the family's tiny test checkpoint"),
    },
    "qwen3_5_moe": {
        # not a real model's shape: 8 layers (L L L F twice), 32 experts
        "449m": Shape("449 M parameters: hidden 1024, 8 layers, 32 experts of 512, top-8", dict(
            QWEN_MOE, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
            head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
            linear_value_head_dim=64, num_experts=32,
            rope_parameters=dict(QWEN_ROPE, mrope_section=[5, 6, 5]))),
        # the real model has 40 layers of 256 experts; a layer's per-token work is the same (8 chosen)
        "a3b": Shape("Qwen3.5-35B-A3B's layer shapes over 4 layers (128 experts of 512, top-8; 1.75 B parameters)",
                     dict(QWEN_MOE, num_hidden_layers=4, **A3B)),
        "tiny": Shape("the family's tiny test checkpoint"),
    },
}
# the make_tiny keyword of --layers and of --experts (a family missing from EXPERTS_KEY has no experts)
LAYERS_KEY = "num_hidden_layers"
EXPERTS_KEY = {"youtu_moe": "num_experts", "qwen3_5_moe": "num_experts"}


def overrides(family: str, shape: str, layers: int | None = None, experts: int | None = None) -> dict:
    """make_tiny's keyword arguments for ``shape`` of ``family`` with the --layers/--experts changes."""
    shapes = SHAPES[family]
    if shape not in shapes:
        raise SystemExit(f"make_random: {family} has no shape {shape!r}; it has: {', '.join(shapes)}")
    over = dict(shapes[shape].overrides)
    if layers:
        over[LAYERS_KEY] = layers
    if experts:
        if family not in EXPERTS_KEY:
            raise SystemExit(f"make_random: {family} has no experts (--experts is for {', '.join(EXPERTS_KEY)})")
        over[EXPERTS_KEY[family]] = experts
    return over


def echo_mtp(folder: Path) -> None:
    """Rewrite the checkpoint's MTP block so that it drafts the token the model just predicted, and
    scale the embedding so that the model repeats its last token:
    x = fc([e | h]) = h (fc = [0 | I]), the layer's residual branches zero (o_proj, down_proj and
    the experts' down projections), every norm's gain 1 (zero-centred weights 0): the output is
    h rescaled, so the head's argmax over it is the decoder's own prediction."""
    import torch
    from safetensors.torch import load_file, save_file

    for f in sorted(folder.glob("*.safetensors")):
        t = load_file(str(f))
        if "mtp.fc.weight" not in t:
            continue
        for k, v in t.items():
            if not k.startswith("mtp."):
                continue
            if k == "mtp.fc.weight":
                h = v.shape[0]
                t[k] = torch.cat([torch.zeros(h, h), torch.eye(h)], 1).to(v.dtype)
            elif "norm" in k or k.endswith(("o_proj.weight", "down_proj.weight", "shared_expert_gate.weight")):
                t[k] = torch.zeros_like(v)
        for k in [k for k in t if k.endswith("embed_tokens.weight")]:
            t[k] = (t[k].float() * ECHO_EMBED_SCALE).to(t[k].dtype)
        save_file(t, str(f), metadata={"format": "pt"})


ECHO_EMBED_SCALE = 300   # at init scale 0.02: 6 per element against ~1.5 that 24 layers add


def parameters(folder: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return n


def main(argv=None) -> int:
    from edgevl import models

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family", nargs="?", choices=models.names())
    ap.add_argument("out", nargs="?")
    ap.add_argument("--shape", help="a named shape of the family (default: its first; --list shows them)")
    ap.add_argument("--layers", type=int, help="override the number of decoder layers")
    ap.add_argument("--experts", type=int, help="override the routed experts per layer (MoE families)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mtp", choices=["random", "echo"], help="add the multi-token-prediction block (Qwen3.5)")
    ap.add_argument("--list", action="store_true", help="list the families' shapes and exit")
    a = ap.parse_args(argv)
    if a.list:
        for fam in models.names():
            for name, s in SHAPES.get(fam, {}).items():
                print(f"{fam} --shape {name}: {s.about}")
        return 0
    if not a.family or not a.out:
        ap.error("FAMILY and OUT are required (or --list)")
    if a.family not in SHAPES:
        raise SystemExit(f"make_random: no shapes for {a.family} yet: add them to SHAPES in {__file__}")
    if a.mtp and a.family not in ("qwen3_5", "qwen3_5_moe"):
        raise SystemExit(f"make_random: --mtp is for the Qwen3.5 families; {a.family} has no MTP block")
    shape = a.shape or next(iter(SHAPES[a.family]))
    over = overrides(a.family, shape, a.layers, a.experts)

    from edgevl import verification

    out = Path(a.out)
    t0 = time.time()
    print(f"{a.family} {shape}: {SHAPES[a.family][shape].about} -> {out}", file=sys.stderr)
    verification.get(a.family).make_tiny(out, None, seed=a.seed, dtype=a.dtype, mtp=bool(a.mtp), **over)
    if a.mtp == "echo":
        echo_mtp(out)
    for name, pre in (("preprocessor_config.json", SHAPES[a.family][shape].preprocessor),
                      ("video_preprocessor_config.json", SHAPES[a.family][shape].video_preprocessor)):
        p = out / name
        if pre:
            p.write_text(json.dumps({**(json.loads(p.read_text()) if p.is_file() else {}), **pre}, indent=1))
    n = parameters(out)
    count = f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"
    print(f"{count} parameters written in {time.time() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
