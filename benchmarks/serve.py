"""Concurrent streams through the engine that `edgevl serve` uses: aggregate tokens/s, time to first
token and time per token (p50/p95) at 1, 2, 4 and 8 streams, against one stream of the plain API.

    python benchmarks/serve.py PKG [--streams 1 2 4 8] [--tokens 64] [--prompt 40] [--threads 2]
                                   [--speculative none|mtp] [--json OUT.json] [--plot OUT.png]

Every stream gets its own random prompt of ``--prompt`` token ids and decodes ``--tokens`` tokens
(greedy, no early stop); streams start together. Rounds run interleaved (API, then each count of
streams) so that a machine's drift touches all of them alike.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np

import edgevl
from edgevl.engine import Engine


def one_round(model, engine, n: int, tokens: int, prompt: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(100, 5000, prompt)] for _ in range(n)]
    marks = [[] for _ in range(n)]
    t0 = time.perf_counter()

    def run(i):
        gen = (engine or model).generate_tokens(prompts[i], tokens, ignore_eos=True, reuse_cache=False)
        for _ in gen:
            marks[i].append(time.perf_counter())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [m[0] - t0 for m in marks]
    tpot = [(m[-1] - m[0]) / (len(m) - 1) for m in marks if len(m) > 1]
    return {"streams": n, "tokens": sum(len(m) for m in marks), "wall_s": wall,
            "aggregate_tps": sum(len(m) for m in marks) / wall,
            "ttft_s": ttft, "tpot_s": tpot}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("package")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--speculative", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args()
    opts = {} if a.speculative is None else {"speculative": a.speculative}
    model = edgevl.load(a.package, threads=a.threads, **opts)
    engine = Engine(model, parallel=max(a.streams))
    one_round(model, engine, 2, 8, a.prompt, 0)     # warm-up: first-use allocations
    rows: dict = {"api": []}
    rows.update({n: [] for n in a.streams})
    for r in range(a.rounds):
        rows["api"].append(one_round(model, None, 1, a.tokens, a.prompt, 100 + r))
        for n in a.streams:
            rows[n].append(one_round(model, engine, n, a.tokens, a.prompt, 200 + r))
    engine.close()

    def summary(runs):
        ttft = np.concatenate([x["ttft_s"] for x in runs])
        tpot = np.concatenate([x["tpot_s"] for x in runs])
        ms = {f"{k}_p{q}_ms": float(np.percentile(v, q) * 1e3) for k, v in (("ttft", ttft), ("tpot", tpot))
              for q in (50, 95)}
        return {"aggregate_tps": float(np.median([x["aggregate_tps"] for x in runs])), **ms}

    out = {"package": a.package, "threads": a.threads, "tokens": a.tokens, "prompt": a.prompt,
           "speculative": model.speculative, "rounds": a.rounds,
           "api_one_stream": summary(rows["api"]), "engine": {str(n): summary(rows[n]) for n in a.streams}}
    one = out["engine"][str(a.streams[0])]["aggregate_tps"]
    print(f"API, one stream: {out['api_one_stream']['aggregate_tps']:.1f} tok/s")
    print("streams  aggregate tok/s  x one stream  TTFT p50/p95 ms  TPOT p50/p95 ms")
    for n in a.streams:
        s = out["engine"][str(n)]
        print(f"{n:7d}  {s['aggregate_tps']:15.1f}  {s['aggregate_tps'] / one:12.2f}  "
              f"{s['ttft_p50_ms']:6.0f}/{s['ttft_p95_ms']:<6.0f}   {s['tpot_p50_ms']:6.1f}/{s['tpot_p95_ms']:.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot(a.streams, [out["engine"][str(n)]["aggregate_tps"] for n in a.streams], "o-", label="edgevl engine")
        ax.axhline(out["api_one_stream"]["aggregate_tps"], ls="--", c="gray", label="API, one stream")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_xticks(a.streams)
        ax.legend()
        ax.set_title(f"{a.package.rstrip('/').split('/')[-1]}, {a.threads} threads")
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)


if __name__ == "__main__":
    main()
