"""Decode and prefill speed of a converted Qwen3.5 (or Qwen3.5-MoE) package through the public API,
with the decode time split into the delta-rule recurrence (``gdn_ms``: the host passes running
it), the routed experts of an MoE package (``experts_ms``), the rest of the decoder graph
(``graph_ms``: Gemms, attention, conv, norms) and the lm_head.

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
from pathlib import Path

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
    dec = model.decoder
    # host passes by kind: the delta rule ("gdn") and, in MoE packages, the routed experts
    kinds = {name: "experts" if name == "moe" else "gdn" for name in dec.hooks}
    spent = dict.fromkeys(["head", *sorted(set(kinds.values()))], 0.0)
    for name, fn in list(dec.hooks.items()):
        def timed(blobs, _fn=fn, _kind=kinds[name], **kw):
            t = time.perf_counter()
            out = _fn(blobs, **kw)
            spent[_kind] += time.perf_counter() - t
            return out
        dec.hooks[name] = timed
    head = model.logits

    def timed_head(hidden):
        t = time.perf_counter()
        out = head(hidden)
        spent["head"] += time.perf_counter() - t
        return out
    model.logits = timed_head

    from edgevl.bench import _prompt_ids

    ids = _prompt_ids(a.prompt, model.vocab_size)   # as edgevl bench (within a small test vocabulary too)
    model.prefill(ids[:4], reuse_cache=False)   # warm-up
    runs = []
    for _ in range(a.repeat):
        t = time.perf_counter()
        tok = int(np.argmax(model.prefill(ids, reuse_cache=False)))
        prefill = time.perf_counter() - t
        spent.update(dict.fromkeys(spent, 0.0))
        t = time.perf_counter()
        for _ in range(a.decode):
            tok = int(np.argmax(model.step(tok)))
        total = time.perf_counter() - t
        n = a.decode
        runs.append({"prefill_tok_s": a.prompt / prefill, "decode_tok_s": n / total,
                     "decode_ms": total / n * 1e3,
                     **{f"{k}_ms": v / n * 1e3 for k, v in spent.items() if k != "head"},
                     "lm_head_ms": spent["head"] / n * 1e3,
                     "graph_ms": (total - sum(spent.values())) / n * 1e3})
    res = {"package": Path(a.package).name, "dtype": model.dtype, "threads": a.threads, "load_s": round(load_s, 2),
           "prompt": a.prompt, "decode": a.decode, "load_avg": round(os.getloadavg()[0], 1)}
    for k in runs[0]:
        vals = [r[k] for r in runs]
        res[k] = [round(statistics.median(vals), 2), round(min(vals), 2), round(max(vals), 2)]
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
