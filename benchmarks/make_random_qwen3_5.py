"""Write a random-weight Qwen3.5-0.8B-shaped checkpoint (spec qwen3_5_and_youtu_moe.md §1.1).

    python benchmarks/make_random_qwen3_5.py OUT_DIR [--dtype bf16] [--layers N]

Tensor names and shapes come from transformers' own Qwen3_5ForConditionalGeneration built on the
meta device; values are drawn per tensor (std 0.02, norms near their identity, decays spread
like the real init) and written in ~2 GB safetensors shards with an index, like a real download,
without holding the model in memory. Benchmarks feed random ids; the tokenizer saved beside it
is only for loading.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

TEXT = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
            num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
            linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, tie_word_embeddings=True, max_position_embeddings=262144,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "mrope_section": [11, 11, 10],
                             "mrope_interleaved": True, "partial_rotary_factor": 0.25})
VISION = dict(depth=12, hidden_size=768, num_heads=12, intermediate_size=3072, out_hidden_size=1024,
              num_position_embeddings=2304, patch_size=16, spatial_merge_size=2, temporal_patch_size=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (smaller tests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gb", type=float, default=2.0)
    a = ap.parse_args(argv)

    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from edgevl.verification.tokenizers import save_tokenizer, train_tokenizer
    from random_weights import param_count, write_config, write_shards

    text = dict(TEXT)
    if a.layers:
        text["num_hidden_layers"] = a.layers
    cfg = Qwen3_5Config(text_config=text, vision_config=VISION, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shapes.pop("lm_head.weight", None)   # tied
    out = Path(a.out)
    print(f"{param_count(shapes) / 1e9:.2f}B parameters, {len(shapes)} tensors -> {out}", file=sys.stderr)
    g = torch.Generator().manual_seed(a.seed)
    t0 = time.time()

    def draw(name, shape):
        if name.endswith("A_log"):
            return torch.empty(shape).uniform_(0.01, 16, generator=g).log()
        if name.endswith("dt_bias"):
            return torch.ones(shape)
        if "norm" in name and "linear_attn.norm" not in name and "visual" not in name:
            return 0.05 * torch.randn(shape, generator=g)          # (1 + w) norms
        if "norm" in name:
            return 1.0 + 0.05 * torch.randn(shape, generator=g)
        return 0.02 * torch.randn(shape, generator=g)

    write_shards(shapes, out, a.dtype, draw, a.shard_gb)
    write_config(cfg, out, "Qwen3_5ForConditionalGeneration", a.dtype)
    (out / "preprocessor_config.json").write_text(json.dumps(
        {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
         "image_std": [0.5] * 3, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}))
    tok = train_tokenizer(["The quick brown fox jumps over the lazy dog. " * 4, "你好，世界"], vocab_size=300)
    save_tokenizer(tok, out)
    print(f"done in {time.time() - t0:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
