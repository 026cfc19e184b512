"""Parameter counts and edgevl package sizes of the real checkpoints, computed from their shapes.

    python benchmarks/package_sizes.py            # the README's table (no download needed)

Shapes come from the models built on PyTorch's meta device: Youtu-LLM-2B from transformers'
``YoutuConfig`` defaults (its docstring names tencent/Youtu-LLM-2B), Youtu-VL-4B-Instruct from its
config values (``YOUTU_VL_4B`` below: docs/models/youtu_vl.md, sections 2.1 and 2.2) through the
project's reference.
Bytes follow what ``edgevl convert`` writes (``package_bytes``; tests/project/test_benchmark_scripts.py
checks the rule against real conversions of tiny checkpoints in every dtype):

- Gemm weights in the package dtype: 4 bytes (fp32), 2 (fp16, bf16), or for q8 one byte per
  value plus an fp32 scale per row (int8 Gemm), except the Gemms q8 keeps in bf16 (the
  attention projections but q_b_proj: ``youtu.q8_keeps_bf16``; the vision tower and merger);
- norm weights and biases in fp32;
- a tied float lm_head doubles as the embedding table; q8 (or untied) packages store the table
  separately in bf16 (or the package dtype).
"""

from __future__ import annotations

import math

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "q8": 2}   # float storage (q8: bf16 for what is not quantized)

# Youtu-VL-4B-Instruct's config.json values (docs/models/youtu_vl.md, sections 2.1 and 2.2);
# num_key_value_heads is inferred there (MLA needs it equal to the attention heads)
YOUTU_VL_4B = dict(
    vocab_size=283386, hidden_size=2560, intermediate_size=9728, num_hidden_layers=40, num_attention_heads=32,
    num_key_value_heads=32, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, tie_word_embeddings=True,
    vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                       patch_size=16, spatial_merge_size=2, window_size=256, fullatt_block_indexes=[7, 15, 23, 26],
                       out_hidden_size=2560))


def shapes_youtu_llm_2b() -> tuple[dict, bool]:
    import torch
    from transformers import YoutuConfig, YoutuForCausalLM

    cfg = YoutuConfig()
    with torch.device("meta"):
        model = YoutuForCausalLM(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}, bool(cfg.tie_word_embeddings)


def shapes_youtu_vl_4b() -> tuple[dict, bool]:
    import torch

    from edgevl.verification.references.youtu_vl import YoutuVLForConditionalGeneration, make_config

    cfg = make_config(**YOUTU_VL_4B)
    with torch.device("meta"):
        model = YoutuVLForConditionalGeneration(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}, True


def package_bytes(shapes: dict, tied: bool, dtype: str) -> int:
    """Bytes of the weight files ``edgevl convert --dtype DTYPE`` writes for these tensors."""
    fb = DTYPE_BYTES[dtype]
    total = 0
    embed = next(k for k in shapes if k.endswith("embed_tokens.weight"))
    for name, shape in shapes.items():
        n = math.prod(shape)
        if name == "lm_head.weight" and tied:
            continue  # the tied head is the embedding (counted there)
        vision = name.startswith(("siglip2.", "merger."))
        if len(shape) == 1 or name.endswith("position_embedding.weight"):
            total += 4 * n if len(shape) == 1 else 0  # norms and biases: fp32; unused table: skipped
        elif name == embed:
            if dtype == "q8" or not tied:
                total += fb * n                          # a table of its own
            if tied:                                     # ... and the head Gemm on the same weights
                total += _gemm_bytes(shape, dtype, fb)
        elif (vision and (dtype != "q8" or "patch_embedding" in name)) or (
                not vision and dtype == "q8" and q8_keeps_bf16(name)):
            total += fb * n                              # float (bf16 in q8 packages; their tower is int8
            #                                              but for the patch embedding)
        else:
            total += _gemm_bytes(shape, dtype, fb)
    return total


def q8_keeps_bf16(name: str) -> bool:
    from edgevl.models.youtu.model import q8_keeps_bf16 as keeps

    return keeps(name.removesuffix(".weight"))


def _gemm_bytes(shape, dtype: str, fb: int) -> int:
    rows, k = shape
    if dtype == "q8":
        return rows * (k + 4)                            # int8 values, an fp32 scale per row
    return rows * k * fb


def params(shapes: dict, tied: bool) -> int:
    return sum(math.prod(s) for k, s in shapes.items()
               if not (tied and k == "lm_head.weight") and not k.endswith("position_embedding.weight"))


def main() -> int:
    rows = [("Youtu-VL-4B-Instruct", *shapes_youtu_vl_4b()), ("Youtu-LLM-2B", *shapes_youtu_llm_2b())]
    print("| checkpoint | parameters | fp32 | fp16 | bf16 | q8 |")
    print("|---|---|---|---|---|---|")
    for name, shapes, tied in rows:
        sizes = [package_bytes(shapes, tied, d) / 2**30 for d in ("fp32", "fp16", "bf16", "q8")]
        print(f"| {name} | {params(shapes, tied) / 1e9:.2f} B | " + " | ".join(f"{s:.1f} GiB" for s in sizes) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
