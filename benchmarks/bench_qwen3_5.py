"""Decode and prefill speed of a converted Qwen3.5 package through the public API, with the decode
time split into the delta-rule recurrence (the host passes running the fp32 core nets), the rest
of the decoder graph (Gemms, attention, conv, norms) and the lm_head.

    python benchmarks/bench_qwen3_5.py PACKAGE [--threads 1] [--prompt 128] [--decode 32] [--repeat 3]

Random token ids, as ``edgevl bench``; prints one JSON line with the median of the repeats
(min and max beside each median).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("package")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)

    import edgevl

    t0 = time.perf_counter()
    model = edgevl.load(a.package, threads=a.threads, verify=False)
    load_s = time.perf_counter() - t0
    spent = {"gdn": 0.0, "head": 0.0}
    dec = model.decoder
    for name, fn in list(dec.hooks.items()):
        def timed(blobs, _fn=fn, **kw):
            t = time.perf_counter()
            out = _fn(blobs, **kw)
            spent["gdn"] += time.perf_counter() - t
            return out
        dec.hooks[name] = timed
    head = model.logits

    def timed_head(hidden):
        t = time.perf_counter()
        out = head(hidden)
        spent["head"] += time.perf_counter() - t
        return out
    model.logits = timed_head

    ids = np.random.default_rng(0).integers(100, 30000, a.prompt).tolist()
    model.prefill(ids[:4], reuse_cache=False)   # warm-up
    runs = []
    for _ in range(a.repeat):
        t = time.perf_counter()
        tok = int(np.argmax(model.prefill(ids, reuse_cache=False)))
        prefill = time.perf_counter() - t
        spent.update(gdn=0.0, head=0.0)
        t = time.perf_counter()
        for _ in range(a.decode):
            tok = int(np.argmax(model.step(tok)))
        total = time.perf_counter() - t
        n = a.decode
        runs.append({"prefill_tok_s": a.prompt / prefill, "decode_tok_s": n / total,
                     "decode_ms": total / n * 1e3, "gdn_ms": spent["gdn"] / n * 1e3,
                     "lm_head_ms": spent["head"] / n * 1e3,
                     "graph_ms": (total - spent["gdn"] - spent["head"]) / n * 1e3})
    res = {"package": a.package, "dtype": model.dtype, "threads": a.threads, "load_s": round(load_s, 2),
           "prompt": a.prompt, "decode": a.decode, "load_avg": round(os.getloadavg()[0], 1)}
    for k in runs[0]:
        vals = [r[k] for r in runs]
        res[k] = [round(statistics.median(vals), 2), round(min(vals), 2), round(max(vals), 2)]
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
