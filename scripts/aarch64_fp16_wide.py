"""fp16 on ARM at real layer widths: the measurement behind docs/arm.md section 4 (not part of CI).

The tiny parity models have dot products of at most a few hundred terms; ncnn's fp16 arithmetic
accumulates in fp16, so its error grows with the width. This builds two random decoder layers
of Youtu-LLM-2B's shape (hidden 2048, FFN 6144, 16 heads, q_lora 1536, kv_lora 512) and
compares the logits of 64 teacher-forced positions with x86 fp32. Run by
``scripts/check-aarch64.sh --fp16-wide`` (about 6 minutes of CPU).

    host WORK          build, convert (fp32, fp16, bf16), x86 logits -> WORK/wide-x86.npz
    target WORK LABEL  (emulated aarch64) fp32 and fp16 logits -> WORK/wide-LABEL.npz
    report WORK LABEL...
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
WIDE = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=2, num_attention_heads=16,
            kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128)
N = 64


def _logits(work: Path, dtype: str) -> np.ndarray:
    import edgevl

    model = edgevl.load(work / f"wide-{dtype}", threads=1)
    ids = [int(x) for x in np.random.default_rng(0).integers(5, model.vocab_size, N)]
    hidden, _ = model.decoder.forward(model.embed(ids), model.decoder.new_cache(), model.positions(ids))
    return model.logits(hidden)


def host(work: Path) -> None:
    import torch

    torch.set_num_threads(1)
    import edgevl
    from edgevl import verification

    ck = verification.get("youtu").make_tiny(work / "wide-checkpoint", "q_lora", seed=3, init_scale=0.02, **WIDE)
    for dtype in ("fp32", "fp16", "bf16"):
        edgevl.convert(ck, work / f"wide-{dtype}", dtype=dtype, progress=False)
    np.savez(work / "wide-x86.npz", **{d: _logits(work, d) for d in ("fp32", "fp16", "bf16")})


def target(work: Path, label: str) -> None:
    import os

    from aarch64_check import _force_fp16_variant

    if os.environ.get("ARM_FP16_VARIANT"):
        _force_fp16_variant(os.environ["ARM_FP16_VARIANT"])
    np.savez(work / f"wide-{label}.npz", **{d: _logits(work, d) for d in ("fp32", "fp16")})


def report(work: Path, labels: list[str]) -> None:
    from aarch64_check import cosines

    ref = np.load(work / "wide-x86.npz")["fp32"].astype(np.float64)

    def row(name, a):
        a = a.astype(np.float64)
        rel = np.linalg.norm(a - ref, axis=1) / np.linalg.norm(ref, axis=1)
        top1 = int((a.argmax(1) == ref.argmax(1)).sum())
        print(f"  {name:28s} mean rel. error {rel.mean():.4f}  min cos {cosines(a, ref).min():.6f}  "
              f"top-1 {top1}/{N} (flat random logits)")

    print(f"2 Youtu-LLM-2B-shaped layers, {N} positions, logits against x86 fp32:")
    x86 = np.load(work / "wide-x86.npz")
    for d in ("fp16", "bf16"):
        row(f"x86 {d}", x86[d])
    for label in labels:
        got = np.load(work / f"wide-{label}.npz")
        row(f"{label} fp32", got["fp32"])
        row(f"{label} fp16", got["fp16"])


if __name__ == "__main__":
    mode, work = sys.argv[1], Path(sys.argv[2])
    {"host": lambda: host(work), "target": lambda: target(work, sys.argv[3]),
     "report": lambda: report(work, sys.argv[3:])}[mode]()
