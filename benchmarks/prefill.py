"""Prefill time against prompt length on the same loaded model, in interleaved rounds, three ways:
"plain" with ncnn's own Gemm row tiles and every delta-rule chunk zero-padded to the package's
chunk net; "tiles" with the row tiles edgevl picks per forward (``runtime.gemm_row_tile``);
"edgevl" with those and a prompt's last chunk in a smaller net (``gated_delta.TAIL_ROWS``; Qwen3.5
packages).

    python benchmarks/prefill.py PKG [--lengths 16 24 ... 160] [--threads 2] [--rounds 3]
        [--json OUT.json] [--plot OUT.png]

Each length is one decoder forward over that many random token ids on a fresh cache (a prompt's
prefill, without embedding lookup or lm_head); the minimum over rounds is kept. The outputs are
compared too: all three must give the same bits.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import edgevl
from edgevl import runtime
from edgevl.blocks import gated_delta as gd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("package")
    ap.add_argument("--lengths", type=int, nargs="+", default=list(range(16, 161, 8)))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    a = ap.parse_args()
    model = edgevl.load(a.package, threads=a.threads, speculative="none")
    fitted, tail_nets = runtime.gemm_row_tile, gd.DeltaRuleCore._net_for

    def ncnn_own(rows, threads, granule=None):
        return 0

    def padded(core, r):
        return core.chunk_net, core.chunk_info

    modes = {"plain": (ncnn_own, padded), "tiles": (fitted, padded), "edgevl": (fitted, tail_nets)}

    vocab = model.embedding.rows

    def work():
        dec, rng, rows = model.decoder, np.random.default_rng(0), []
        for n in a.lengths:
            ids = rng.integers(min(100, vocab // 2), min(1000, vocab), n).tolist()   # tiny vocabularies too
            emb, times, first = model.embedding(ids), {m: [] for m in modes}, None
            for _ in range(a.rounds):
                for mode, (rule, tails) in modes.items():
                    runtime.gemm_row_tile, gd.DeltaRuleCore._net_for = rule, tails
                    t = time.perf_counter()
                    h = dec.forward(emb, dec.new_cache(), np.arange(n)[None], ids=ids)[0]
                    times[mode].append((time.perf_counter() - t) * 1000)
                    if first is None:
                        first = h
                    elif not np.array_equal(h, first):
                        raise SystemExit(f"{n} rows: {mode} gave different outputs")
            runtime.gemm_row_tile, gd.DeltaRuleCore._net_for = fitted, tail_nets
            row = {"rows": n, "tile": fitted(n, a.threads), **{f"{m}_ms": min(t) for m, t in times.items()}}
            row["speedup"] = row["plain_ms"] / row["edgevl_ms"]
            print(f"{n:4d} rows  tile {row['tile']:>3}  " + "  ".join(f"{m} {row[m + '_ms']:7.1f} ms" for m in modes)
                  + f"  {row['speedup']:.2f}x", flush=True)
            rows.append(row)
        return rows

    rows = model._owner.call(work)
    model.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"package": a.package, "threads": a.threads, "rounds": a.rounds, "rows": rows}, f, indent=1)
    if a.plot:
        plot(rows, a.plot, f"{a.package.rstrip('/').split('/')[-1]}, {a.threads} threads: prefill ms")


def plot(rows: list, path: str, title: str) -> None:
    """Prefill ms against prompt rows, one line per way."""
    from lineplot import line_plot

    labels = {"plain": "ncnn's row tiles, padded chunk", "tiles": "row tiles per forward",
              "edgevl": "+ last chunk in a small net"}
    series = {label: [r[f"{m}_ms"] for r in rows] for m, label in labels.items()}
    line_plot(path, title, [r["rows"] for r in rows], series, "prompt tokens (rows)", every=2,
              colors=["#e6194b", "#f58231", "#4363d8"])

if __name__ == "__main__":
    main()
