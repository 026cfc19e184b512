"""How far reduced-precision packages move from their fp32 reference, over seeds and CPUs: the
measurement behind the bounds of the precision tests (tests/support/precision.py).

    python scripts/precision_spread.py build OUT [--seeds 11 21 31 41 51]
        trains each precision test's tiny checkpoints with these seeds (its own seed is always
        added), converts them, and stores the reference's teacher-forcing rows (needs torch)
    python scripts/precision_spread.py measure OUT --cpu NAME [--json FILE]
        runs the stored packages on this CPU (ncnn and numpy only) and prints the spread

The measure step can run under emulation to see another CPU's ncnn kernels, e.g. AVX2 without
AVX-512 on an AVX-512 machine:

    qemu-x86_64 -cpu EPYC-Rome .venv/bin/python scripts/precision_spread.py measure OUT --cpu avx2
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("EDGEVL_THREADS", "1")


def cases():
    """(suite, config, dtypes, default seed, build(folder, seed) -> checkpoint, prompts(model) -> ids lists)."""
    from conformance import test_all_families as conf
    from precision import test_qwen3_5 as qp
    from precision import test_qwen3_5_moe as qm
    from precision import test_youtu as yp

    from edgevl import models
    from edgevl.generate import prepare
    from support.youtu import chat_ids

    for name in models.names():
        yield ("conformance", name, ["bf16", "q8"], 11, lambda f, s, n=name: conf.trained_checkpoint(n, f, s),
               lambda m: [prepare(m, p).input_ids for p in conf.PROMPTS])
    for name in ("q_lora", "untied"):
        for half in (False, True):
            dtypes = ["fp16"] if half else ["bf16", "q8"]
            yield ("youtu", f"{name}-{'fp16' if half else 'bf16'}", dtypes, 12 if half else 11,
                   lambda f, s, n=name, d=dtypes[0]: yp.trained_checkpoint(n, f, d, s),
                   lambda m: [chat_ids(m, p) for p in yp.PROMPTS])
    for i, name in enumerate(qp.CONFIGS):
        yield ("qwen3_5", name, ["bf16", "q8"], 60 + i, lambda f, s, n=name: qp.trained_checkpoint(n, f, s),
               qp.prompt_ids)
    yield ("qwen3_5_moe_q8", qm.CONFIGS[0], ["q8", "q8-dense"], 11, qm.q8_checkpoint, None)


def build(out: Path, seeds: list[int]) -> None:
    import edgevl
    from edgevl import verification
    from edgevl.progress import Progress
    from support import precision

    todo = [(c, s) for c in cases() for s in sorted({c[3], *seeds})]
    bar = Progress(len(todo), "checkpoints", unit="", enabled=True)
    for (suite, config, dtypes, _, make, prompts), seed in todo:
        root = out / suite / config / f"s{seed}"
        if (root / "rows.pkl").is_file():
            bar.update(1)
            continue
        ck = make(root / "ck", seed)
        for dtype in dtypes:
            kw = {"dtype": "q8", "dense": "q8"} if dtype == "q8-dense" else {"dtype": dtype}
            edgevl.convert(ck, root / dtype, progress=False, **kw)
        if prompts is None:    # the MoE q8 test replays the fp32 package's expert choices
            edgevl.convert(ck, root / "fp32", dtype="fp32", progress=False)
        model = edgevl.load(root / dtypes[0])
        ref = verification.get(model.arch.name).reference(ck)
        ids = prompts(model) if prompts else None
        rows = [precision.reference_rows(ref, i) for i in ids] if ids else None
        with open(root / "rows.pkl", "wb") as f:
            pickle.dump({"ids": ids, "rows": rows, "ref": None if rows else ref_rows_moe(model, ref)}, f)
        bar.update(1, note=f"{suite}/{config}/s{seed}")
    bar.close()


def ref_rows_moe(model, ref):
    from edgevl.generate import prepare
    from support import precision
    from support.common import CORPUS

    out = []
    for prompt in (CORPUS[0], CORPUS[4], CORPUS[8]):
        ids = prepare(model, prompt).input_ids
        out.append((ids, *precision.reference_rows(ref, ids, 32)))
    return out


def measure(out: Path, cpu: str) -> list[dict]:
    import edgevl
    from edgevl import verification
    from support import precision

    results = []
    for rows_file in sorted(out.glob("*/*/s*/rows.pkl")):
        root = rows_file.parent
        suite, config, seed = root.parts[-3], root.parts[-2], int(root.name[1:])
        data = pickle.loads(rows_file.read_bytes())
        for pk in sorted(p for p in root.iterdir() if (p / "manifest.json").is_file() and p.name != "fp32"):
            model = edgevl.load(pk)
            if data["rows"] is not None:
                got = precision.Agreement()
                for ids, (seq, want) in zip(data["ids"], data["rows"]):
                    got.add(precision.teacher_forced(model, seq, len(ids)), want)
                stats = {"outliers": int(verification.get(model.arch.name).precision_outlier_rows * got.total)}
            else:
                got, forced = moe_q8(model, edgevl.load(root / "fp32"), data["ref"])
                stats = {"forced_min_cosine": forced.low()}
            skip = stats.get("outliers", 0)
            stats.update(suite=suite, config=config, seed=seed, dtype=pk.name, cpu=cpu, agree=got.agree,
                         total=got.total, far=got.far, gap=got.gap(skip), low=got.low(skip),
                         min_cosine=min(got.cosines), cosines=[round(c, 6) for c in got.cosines],
                         gaps=[round(g, 4) for g in got.gaps])
            if data["rows"] is None:
                stats["forced_cosines"] = [round(c, 6) for c in forced.cosines]
            results.append(stats)
            print(json.dumps(stats), flush=True)
    return results


def moe_q8(q8, f32, ref_rows):
    """tests/precision/test_qwen3_5_moe.py's q8_agreement on stored reference rows."""
    from precision import test_qwen3_5_moe as qm

    class Stored:        # the reference's rows, looked up by prompt
        def __init__(self):
            self.by_ids = {tuple(ids): (seq, want) for ids, seq, want in ref_rows}

        def greedy(self, ids, n):
            return self.by_ids[tuple(ids)][0][len(ids):]

        def text_states(self, seq):
            for s, want in self.by_ids.values():
                if list(s) == list(seq):
                    import numpy as np

                    full = np.zeros((len(seq), want.shape[1]), want.dtype)
                    full[len(seq) - len(want) - 1:-1] = want
                    return None, full
            raise KeyError("no stored reference for this sequence")

    return qm.q8_agreement(q8, f32, Stored(), setattr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    b.add_argument("--seeds", type=int, nargs="*", default=[21, 31, 41, 51])
    m = sub.add_parser("measure")
    m.add_argument("out", type=Path)
    m.add_argument("--cpu", required=True, help="a name for this CPU in the results (e.g. avx512, avx2)")
    m.add_argument("--json", type=Path, help="append the results to this file (JSON lines)")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        build(a.out, a.seeds)
        return 0
    results = measure(a.out, a.cpu)
    if a.json:
        with open(a.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
