"""Reduced-precision packages against their fp32 PyTorch reference, teacher-forced: the numbers the
precision tests assert on, and the recipes of the checkpoints they are measured on.

A bf16/fp16/q8 package is run over a prompt followed by the reference's own greedy answer (so both
see the same tokens at every position), and each position's logits are compared with the
reference's: top-1 agreement, logit cosine, and how far the reference ranks our choice.

Why the bounds are what they are: ncnn picks different kernels on AVX2, AVX-512 (with or without
VNNI/BF16) and ARM, which round differently, so these numbers move with the CPU. Random tiny nets
have nearly flat logits, where any rounding flips near-ties; the recipes train each checkpoint
briefly so that its logits are peaked like a real model's. Each bound comes from the worst value
measured over five seeds (the test's own and four more) on an AVX-512 (BF16/VNNI) CPU and on an
AVX2-only one (the same packages under ``qemu-x86_64 -cpu EPYC-Rome``), with a margin (``MARGIN``);
``scripts/precision_spread.py`` repeats that measurement and each test's comment quotes the range.

- top-1 agreement: a disagreement is a flipped near-tie, not an error, as long as the reference's
  gap between its choice and ours is small (``Agreement.gap``, in the row's logit standard
  deviations; a wrong kernel crosses gaps of several). Agreement counts swing by a few rows of
  192 from seed to seed and CPU to CPU; "our choice is among the reference's top 3" does not
  hold on AVX2 (4-5 candidates within 0.05 standard deviations happen).
- logit cosine: a trained tiny net has a few positions where its logits hang on any rounding:
  transformers itself in bf16 gives 0.71 against its fp32 run at one row of a Qwen3.5 model
  where the other 191 rows are >= 0.997. So the bound applies to the (k+1)-th lowest row, k =
  ``sensitive_rows`` (1 % of the rows, at least; more for mixture-of-experts models, whose
  near-tied expert choices flip), and the gap bound to the other rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

N_NEW = 48      # teacher-forced positions per prompt: the reference's greedy answer
# how a bound sits below the worst measured value: top-1 agreement 0.02 lower (4 rows of 192),
# the logit cosine's distance from 1 half again as large, a crossed gap half again as wide
MARGIN = {"top1": 0.02, "cosine": 1.5, "gap": 1.5}
SENSITIVE_SHARE = 0.01


def sensitive_rows(total: int, share: float = 0.0) -> int:
    """Rows left out of the cosine and gap bounds: 1 % (rounded up), or ``share`` of them for a
    family whose discrete choices flip (``FamilyVerification.precision_outlier_rows``)."""
    return max(math.ceil(SENSITIVE_SHARE * total), int(share * total))


@dataclass
class Agreement:
    """Per-position comparison of our logits with the reference's, accumulated over prompts."""
    agree: int = 0
    total: int = 0
    far: int = 0                    # our top-1 outside the reference's top 3
    cosines: list = field(default_factory=list)
    # per row: the reference's logit gap between its top-1 and ours, in row standard deviations
    # (0 where they agree): a flip on a near-tie crosses a small gap
    gaps: list = field(default_factory=list)

    def add(self, ours: np.ndarray, ref: np.ndarray) -> Agreement:
        ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
        top, want = ours.argmax(1), ref.argmax(1)
        self.agree += int((top == want).sum())
        self.total += len(ref)
        top3 = np.argsort(-ref, 1)[:, :3]
        self.far += int(sum(t not in row for t, row in zip(top, top3)))
        rows = np.arange(len(ref))
        self.gaps += ((ref[rows, want] - ref[rows, top]) / ref.std(1)).tolist()
        self.cosines += [float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30)) for a, b in zip(ours, ref)]
        return self

    @property
    def rate(self) -> float:
        return self.agree / self.total

    def low(self, skip: int = 0) -> float:
        """The (skip+1)-th lowest cosine: ``skip`` rows may be outliers (e.g. a near-tied expert
        choice that rounding flipped, which changes a whole row)."""
        return sorted(self.cosines)[skip]

    def gap(self, skip: int = 0) -> float:
        """The largest gap a disagreement crossed, leaving out the ``skip`` rows of lowest cosine."""
        keep = np.argsort(self.cosines, kind="stable")[skip:]
        return float(max((self.gaps[i] for i in keep), default=0.0))

    def line(self, skip: int = 0) -> str:
        return (f"top-1 {self.agree}/{self.total}, logit cosine {self.low(skip):.4f} at the {skip + 1}th lowest row "
                f"(min {min(self.cosines):.4f}), {self.far} outside the reference's top 3, largest gap crossed "
                f"{self.gap(skip):.3f} row stds")


def teacher_forced(model, seq: list[int], n_prompt: int) -> np.ndarray:
    """Our logits at the positions that predict ``seq[n_prompt:]``, from one fresh forward."""
    hidden, _ = model.decoder.forward(model.embed(seq), model.decoder.new_cache(), model.positions(seq))
    return model.logits(hidden[n_prompt - 1:-1])


def reference_rows(ref, ids: list[int], n: int = N_NEW) -> tuple[list[int], np.ndarray]:
    """(prompt + the reference's greedy answer, the reference's logits predicting the answer)."""
    seq = list(ids) + ref.greedy(ids, n)
    return seq, ref.text_states(seq)[1][len(ids) - 1:-1]


def compare(model, ref, prompts_ids, n: int = N_NEW) -> Agreement:
    """Teacher-forced agreement of ``model`` with ``ref`` over prompts given as token ids."""
    acc = Agreement()
    for ids in prompts_ids:
        seq, want = reference_rows(ref, ids, n)
        acc.add(teacher_forced(model, seq, len(ids)), want)
    return acc
