"""Time the host-side expert dispatch of edgevl/models/moe.py at real MoE widths.

    python benchmarks/moe_dispatch.py --hidden 3072 --inter 1024 --dtype q8 --threads 1

Writes a random expert package (``--resident`` experts of one layer), loads them all, then per
"token" routes 256 random router logits to the top 8 (the real softmax / quantile-balanced
routers), stands 8 distinct random resident experts in for the chosen ones and runs ``ExpertStore.compute`` (the
chosen experts' ncnn nets and the weighted sum) — what the host hook does per MoE layer and
token. With 32 resident experts of >= 5 MB each the chosen experts' weights come from RAM, not
the CPU cache, as in a real model. Also times a prefill chunk and loading one expert (a cache
miss). Prints one JSON line; numbers are the median over ``--repeats`` rounds, wall time and (for
decode) the process's CPU time (with 1 thread it excludes time other processes took the core).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgevl.blocks import moe  # noqa: E402


def random_experts(n, hidden, inter, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        yield ((rng.random((2 * inter, hidden), np.float32) - 0.5) * 0.05,
               (rng.random((hidden, inter), np.float32) - 0.5) * 0.05)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--dtype", default="q8", choices=["q8", "bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--resident", type=int, default=32)
    ap.add_argument("--experts", type=int, default=256, help="router width (logits per row)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=200, help="decode steps timed per round")
    ap.add_argument("--prefill", type=int, default=128, help="rows of the timed prefill chunk")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args(argv)

    folder = Path(a.dir or tempfile.mkdtemp(prefix="moe-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    saved = folder / "bench_spec.json"  # a --dir written before with the same shape is reused
    t0 = time.perf_counter()
    spec = json.loads(saved.read_text()) if saved.is_file() else None
    if not spec or (spec["hidden_size"], spec["intermediate_size"], spec["dtype"], spec["num_experts"]) != (
            a.hidden, a.inter, a.dtype, a.resident):
        w = moe.ExpertWriter(folder, a.hidden, a.inter, a.resident, a.dtype)
        w.add_layer(0, random_experts(a.resident, a.hidden, a.inter))
        spec = w.finish({"kind": "softmax", "top_k": a.top_k, "renormalize": True})
        saved.write_text(json.dumps(spec))
    write_s = time.perf_counter() - t0

    store = moe.ExpertStore(folder, spec, threads=a.threads)
    t0 = time.perf_counter()
    store.preload()
    load_ms = (time.perf_counter() - t0) / a.resident * 1e3
    rng = np.random.default_rng(1)
    bias = rng.standard_normal((2, a.experts)).astype(np.float32) * 0.4

    def route(logits, kind):
        if kind == "softmax":
            idx, wts = moe.softmax_topk(logits, a.top_k)
        else:
            idx, wts = moe.sigmoid_topk_biased(logits, a.top_k, bias, np.zeros(len(logits), np.int64), 2.83)
        # the resident experts stand in for all 256: distinct random ones per row
        picks = np.argsort(rng.random((len(idx), a.resident)), axis=1)[:, :a.top_k]
        return picks, wts

    def decode_round():
        xs = rng.standard_normal((a.tokens, 1, a.hidden)).astype(np.float32)
        logits = rng.standard_normal((a.tokens, 1, a.experts)).astype(np.float32)
        t, c = time.perf_counter(), time.process_time()
        for x, lg in zip(xs, logits):
            idx, wts = route(lg, "sigmoid_biased")
            store.compute(0, x, idx, wts)
        return (time.perf_counter() - t) / a.tokens * 1e3, (time.process_time() - c) / a.tokens * 1e3

    def prefill_round():
        x = rng.standard_normal((a.prefill, a.hidden)).astype(np.float32)
        lg = rng.standard_normal((a.prefill, a.experts)).astype(np.float32)
        t = time.perf_counter()
        idx, wts = route(lg, "softmax")
        store.compute(0, x, idx, wts)
        return (time.perf_counter() - t) * 1e3

    def routing_us(kind):
        lg = rng.standard_normal((1, a.experts)).astype(np.float32)
        zero = np.zeros(1, np.int64)
        fn = {"softmax": lambda: moe.softmax_topk(lg, a.top_k),
              "sigmoid_biased": lambda: moe.sigmoid_topk_biased(lg, a.top_k, bias, zero, 2.83)}[kind]
        t = time.perf_counter()
        for _ in range(2000):
            fn()
        return (time.perf_counter() - t) / 2000 * 1e6

    decode_round()  # warm-up
    decode, decode_cpu = zip(*[decode_round() for _ in range(a.repeats)])
    prefill = [prefill_round() for _ in range(a.repeats)]
    out = {"hidden": a.hidden, "inter": a.inter, "dtype": a.dtype, "threads": a.threads, "top_k": a.top_k,
           "expert_mb": round(spec["expert_bytes"] / 2**20, 2), "write_s": round(write_s, 1),
           "load_ms_per_expert": round(load_ms, 2),
           "decode_ms_per_layer_token": round(statistics.median(decode), 3),
           "decode_ms_all_rounds": [round(v, 3) for v in decode],
           # CPU time of the process: near the wall time on an idle machine, the work done on a busy one
           "decode_cpu_ms_per_layer_token": round(statistics.median(decode_cpu), 3),
           f"prefill{a.prefill}_ms_per_layer": round(statistics.median(prefill), 2),
           "routing_us": {k: round(routing_us(k), 1) for k in ("softmax", "sigmoid_biased")}}
    print(json.dumps(out))
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
