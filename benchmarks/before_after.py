"""Time one task under several edgevl source trees, interleaved, each run in its own process.

    python benchmarks/before_after.py load PACKAGE --tree before=/path/to/old --tree after=. [--repeats 3]
    python benchmarks/before_after.py vision PACKAGE --tree before=OLD:OLD_PACKAGE --tree after=. \
        --images 640x480,1024x768,2048x1536

``load``: ``edgevl.load`` (warm page cache: the files are read once first), then the first token
of a 128-token prompt; ``vision``: one image encode per size after a 256x256 warm-up (the bench's
synthetic images). ``--tree NAME=PATH[:PACKAGE]`` runs with PATH first on PYTHONPATH and, if
given, its own package (an older tree may need a package in its own format). Prints a markdown
table: median (min-max) per figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD_LOAD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import edgevl
r0 = resource.getrusage(resource.RUSAGE_SELF)
t1 = time.perf_counter()
m = edgevl.load(sys.argv[1], threads=int(sys.argv[2]))
t2 = time.perf_counter()
r1 = resource.getrusage(resource.RUSAGE_SELF)
ids = list(range(100, 228))
m.prefill(ids, reuse_cache=False)
t3 = time.perf_counter()
print(json.dumps({"load_s": t2 - t1, "load_user_s": r1.ru_utime - r0.ru_utime, "load_sys_s": r1.ru_stime - r0.ru_stime,
                  "load_faults": r1.ru_minflt - r0.ru_minflt, "first_token_s": t3 - t1, "prefill_s": t3 - t2}))
"""

CHILD_VISION = r"""
import json, sys, time
import numpy as np
from PIL import Image
import edgevl

def image(w, h, seed=0):  # the same synthetic image as edgevl.bench.bench_image
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 255, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8))
    return small.resize((w, h), Image.BICUBIC)

m = edgevl.load(sys.argv[1], threads=int(sys.argv[2]))
m.encode_image(image(256, 256, 1))
out = {}
for size in sys.argv[3].split(","):
    w, h = (int(x) for x in size.split("x"))
    img = image(w, h)
    c0, t0 = time.process_time(), time.perf_counter()
    rows, _ = m.encode_image(img)
    out[size] = {"encode_s": time.perf_counter() - t0, "encode_cpu_s": time.process_time() - c0,
                 "tokens": int(rows.shape[0])}
print(json.dumps(out))
"""


def run(child: str, tree: str, args: list) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, "-c", child, *args], capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"{tree}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def cell(vals: list, fmt: str) -> str:
    med = fmt % statistics.median(vals)
    lo, hi = fmt % min(vals), fmt % max(vals)
    return med if lo == hi else f"{med} ({lo}–{hi})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("task", choices=["load", "vision"])
    ap.add_argument("package")
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH[:PACKAGE]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--images", default="640x480,1024x768,2048x1536")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    trees = {}
    for t in a.tree:
        name, _, rest = t.partition("=")
        path, _, pkg = rest.partition(":")
        trees[name] = (str(Path(path).resolve()), pkg or a.package)
    for _, pkg in trees.values():  # warm page cache
        for f in Path(pkg).glob("*.bin"):
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass
    runs = {name: [] for name in trees}
    names = list(trees)
    for r in range(a.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            path, pkg = trees[name]
            if a.task == "load":
                runs[name].append(run(CHILD_LOAD, path, [pkg, str(a.threads)]))
            else:
                runs[name].append(run(CHILD_VISION, path, [pkg, str(a.threads), a.images]))
            print(f"  {name} run {r + 1}: {json.dumps(runs[name][-1])}", file=sys.stderr, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": runs, "threads": a.threads, "repeats": a.repeats}, indent=1))
    if a.task == "load":
        print("| tree | load s | load CPU s (user + sys) | page faults | first token s (load + 128-token prefill) |")
        print("|---|---|---|---|---|")
        for name, rs in runs.items():
            print(f"| {name} | {cell([x['load_s'] for x in rs], '%.2f')} | "
                  f"{cell([x['load_user_s'] + x['load_sys_s'] for x in rs], '%.1f')} | "
                  f"{cell([x['load_faults'] / 1e6 for x in rs], '%.2fM')} | {cell([x['first_token_s'] for x in rs], '%.2f')} |")
    else:
        sizes = a.images.split(",")
        print("| tree | " + " | ".join(f"{s} s (CPU-s)" for s in sizes) + " |")
        print("|---" * (len(sizes) + 1) + "|")
        for name, rs in runs.items():
            cells = [f"{cell([x[s]['encode_s'] for x in rs], '%.2f')} ({cell([x[s]['encode_cpu_s'] for x in rs], '%.1f')})"
                     for s in sizes]
            print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\n{a.threads} thread(s), median (min–max) of {a.repeats} interleaved runs.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
