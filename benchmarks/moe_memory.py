"""Peak memory of an MoE package run with an expert cache, against the bound "cache + the
non-expert weights + 15 %" (docs/moe.md, section 7).

Each setting runs in a fresh interpreter (its peak RSS is that run's alone): load with
``--expert-cache-mb``, prefill a prompt of deterministic token ids, decode greedily. The
non-expert weights are the package's graph weights and embedding table (every .bin but
experts.bin; the embedding is memory-mapped and only its used rows are read).

    python benchmarks/moe_memory.py PKG --cache-mb 300 [--cache-mb 0 ...] [--prompt-tokens 128]
        [--gen-tokens 64] [--threads 2] [--json out.json]
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time
sys.path.insert(0, {root!r})
import edgevl

def status():
    out = {{}}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0]) << 10
    return out

cache = {cache!r}
opts = {{}} if cache is None else {{"expert_cache_mb": cache}}
if {chunk!r}:
    opts["prefill_chunk"] = {chunk!r}
t0 = time.perf_counter()
m = edgevl.load({pkg!r}, threads={threads}, **opts)
m.preload()
loaded = status()
V = m.vocab_size
ids = [(7 * i + 3) % (V - 8) + 4 for i in range({prompt})]
t1 = time.perf_counter()
toks = list(m.generate_tokens(ids, {gen}, ignore_eos=True, reuse_cache=False))
t2 = time.perf_counter()
ex = m.runtime_stats().get("experts", {{}})
print(json.dumps({{"loaded_rss": loaded["VmRSS"], "load_peak": loaded["VmHWM"], "peak": status()["VmHWM"],
                  "tokens": toks, "seconds": t2 - t1, "load_seconds": t1 - t0,
                  "hit_rate": ex.get("hit_rate"), "resident_peak": ex.get("peak_resident_bytes")}}))
"""


def non_expert_bytes(pkg: Path) -> int:
    return sum(f.stat().st_size for f in pkg.glob("*.bin") if f.name != "experts.bin")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("package")
    ap.add_argument("--cache-mb", type=float, action="append", required=True,
                    help="expert cache sizes to run (MB; repeat the flag; -1: no cache, every expert resident)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=0, help="prefill_chunk load option (0: the default)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)

    pkg = Path(a.package).resolve()
    if not (pkg / "experts.bin").is_file():
        raise SystemExit(f"moe_memory: {pkg} is not an MoE package (no experts.bin); give a Qwen3.5-MoE or Youtu MoE "
                         "package")
    dense = non_expert_bytes(pkg)
    experts = (pkg / "experts.bin").stat().st_size
    mb = 1 << 20
    print(f"{pkg.name}: non-expert weights {dense / mb:.0f} MB, experts {experts / mb:.0f} MB", flush=True)
    print("| expert cache MB | share of experts | peak RSS MB | bound MB | peak / bound | hit rate | load peak MB "
          "| s |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for cache in a.cache_mb:
        c = None if cache < 0 else cache
        code = CHILD.format(root=str(Path(__file__).resolve().parents[1]), pkg=str(pkg), cache=c,
                            threads=a.threads, prompt=a.prompt_tokens, gen=a.gen_tokens, chunk=a.prefill_chunk)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"cache {cache}: the run failed:\n{r.stderr[-2000:]}")
        out = json.loads(r.stdout.strip().splitlines()[-1])
        bound = None if c is None else 1.15 * (c * mb + dense)
        row = dict(out, cache_mb=c, non_expert_bytes=dense, expert_bytes=experts, bound=bound)
        rows.append(row)
        share = "all" if c is None else f"{c * mb / experts:.0%}"
        ratio = "" if bound is None else f"{out['peak'] / bound:.2f}"
        hits = "" if out["hit_rate"] is None else f"{out['hit_rate']:.0%}"
        print(f"| {'none' if c is None else f'{c:g}'} | {share} | {out['peak'] / mb:.0f} | "
              f"{'' if bound is None else f'{bound / mb:.0f}'} | {ratio} | {hits} | {out['load_peak'] / mb:.0f} | "
              f"{out['seconds']:.1f} |", flush=True)
    same = len({tuple(r["tokens"]) for r in rows}) == 1
    print(f"tokens identical across settings: {same}")
    if a.json:
        # the package's folder name (benchmarks/run.sh puts packages in its work folder), not its
        # absolute path on the machine that ran it
        Path(a.json).write_text(json.dumps({"package": pkg.name, "prompt_tokens": a.prompt_tokens,
                                            "gen_tokens": a.gen_tokens, "threads": a.threads, "runs": rows,
                                            "tokens_identical": same}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
