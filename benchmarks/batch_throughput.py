"""Throughput and memory of `edgevl batch` on the shipped demo model: rows decoding together in one
process (``--parallel``), local workers and Ray actors.

    python benchmarks/batch_throughput.py [--n 300] [--repeats 3] [--markdown OUT.md] [--json OUT.json]

Every run is a fresh `edgevl batch` process writing a new JSONL file, over N generated demo scenes
(128x128, "Describe the image.", greedy); configurations are interleaved. Two rates per run:
end-to-end (N / the process's wall time: imports, model load, worker spawn or Ray start included)
and steady (rows 10 %..90 % of N over the time between them, read by polling the output file).
Memory: the peak of the summed resident memory of the batch process and its children (workers),
polled. The cells are medians over the repeats; the load average is recorded because the machine is
shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {
    "1 process, 1 row at a time x 2 threads": ["--workers", "1", "--parallel", "1", "--threads", "2"],
    "1 process, 4 rows together x 2 threads": ["--workers", "1", "--parallel", "4", "--threads", "2"],
    "1 process, 8 rows together x 2 threads": ["--workers", "1", "--parallel", "8", "--threads", "2"],
    "2 workers x 1 thread": ["--workers", "2", "--threads", "1"],
    "2 Ray actors x 1 thread (local Ray)": ["--workers", "2", "--threads", "1", "--ray"],
}


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (Linux /proc)."""
    kids: dict = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += kids.get(p, [])
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def one_run(folder: Path, out: Path, n: int, extra: list[str], model: list[str] = ()) -> dict:
    marks = {int(n * 0.1): None, int(n * 0.9): None}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "edgevl", "batch", *model, "--input", str(folder), "--prompt",
                             "Describe the image.", "--output", str(out), "--quiet", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak, polls = 0, 0
    while proc.poll() is None:
        if polls % 10 == 0:
            peak = max(peak, tree_rss(proc.pid))
        polls += 1
        lines = out.read_bytes().count(b"\n") if out.exists() else 0
        for k in marks:
            if marks[k] is None and lines >= k:
                marks[k] = time.monotonic()
        time.sleep(0.01)
    wall = time.monotonic() - t0
    err = proc.stderr.read()
    rows = out.read_text().splitlines()
    if proc.returncode != 0 or len(rows) != n:
        raise SystemExit(f"run failed ({proc.returncode}, {len(rows)} rows): {err}")
    (a, ta), (b, tb) = sorted(marks.items())
    return {"end_to_end": n / wall, "steady": (b - a) / (tb - ta), "wall_s": wall, "load": os.getloadavg()[0],
            "peak_mb": peak / 2 ** 20}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--markdown")
    ap.add_argument("--json")
    ap.add_argument("--only", default="", help="run only the configurations whose name contains this")
    ap.add_argument("--skip", default=None, help="leave out the configurations whose name contains this")
    ap.add_argument("--package", default=None, help="another package than the demo model's")
    ap.add_argument("--max-new-tokens", default=None, help="passed to edgevl batch")
    a = ap.parse_args(argv)
    if a.n < 20:   # the steady rate is read between rows 10 % and 90 % of N: fewer rows come in bursts
        ap.error(f"--n must be at least 20 (rows per run), got {a.n}")
    configs = {k: v for k, v in CONFIGS.items() if a.only in k and not (a.skip and a.skip in k)}

    from edgevl.demo import demo_package
    from edgevl.demo.scenes import make_scene

    demo_package()  # converted once, before any timing
    tmp = Path(tempfile.mkdtemp(prefix="edgevl-batch-bench-"))
    folder = tmp / "scenes"
    folder.mkdir()
    for i in range(a.n):
        make_scene(70000 + i).image.save(folder / f"scene_{i:04d}.png")
    results = {name: [] for name in configs}
    for r in range(a.repeats):
        for ci, (name, extra) in enumerate(configs.items()):
            out = tmp / f"out-{r}-{ci}.jsonl"
            model = [a.package] if a.package else []
            if a.max_new_tokens:
                extra = [*extra, "--max-new-tokens", a.max_new_tokens]
            res = one_run(folder, out, a.n, extra, model)
            results[name].append(res)
            print(f"{name}: {res['end_to_end']:.2f} img/s end-to-end, {res['steady']:.2f} steady, "
                  f"load {res['load']:.1f}", file=sys.stderr)
    what = f"`{Path(a.package).name}`" if a.package else "the demo model"
    lines = [f"`edgevl batch` on {what}, {a.n} scenes (128x128), \"Describe the image.\", greedy; "
             f"median of {a.repeats} interleaved runs; {os.cpu_count()} logical CPUs, shared machine.", "",
             "| configuration | images/s end-to-end | images/s steady | wall s | peak memory MB "
             "| load avg during runs |",
             "|---|---|---|---|---|---|"]
    for name, rs in results.items():
        med = {k: statistics.median(x[k] for x in rs) for k in ("end_to_end", "steady", "wall_s", "peak_mb")}
        loads = [x["load"] for x in rs]
        lines.append(f"| {name} | {med['end_to_end']:.1f} | {med['steady']:.1f} | {med['wall_s']:.1f} | "
                     f"{med['peak_mb']:.0f} | "
                     f"{min(loads):.1f}–{max(loads):.1f} |")
    shutil.rmtree(tmp, ignore_errors=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.markdown:
        Path(a.markdown).write_text(text)
    if a.json:
        Path(a.json).write_text(json.dumps({"n": a.n, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
