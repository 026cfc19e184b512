"""Loading graphs: ncnn's load reuses freed memory (runtime.load_arena) and gives it back."""

import json
import subprocess
import sys

import numpy as np

from edgevl import ncnn_graph as G

CHILD = r"""
import json, resource, numpy as np
from edgevl.runtime import load_arena
try:  # numpy asks for huge pages on large arrays; ncnn's buffers get none, so count 4 KiB pages
    np._core.multiarray._set_madvise_hugepage(False)
except AttributeError:
    np.core.multiarray._set_madvise_hugepage(False)

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

def churn():  # what ncnn does per layer: large temporaries (above glibc's 32 MiB mmap limit), freed
    f0 = faults()
    for _ in range(6):
        a = np.ones(48 << 18, np.float32)  # 48 MiB
        del a
    return faults() - f0

out = {"plain": churn()}
with load_arena():
    out["arena"] = churn()
    kept = np.ones(16 << 18, np.float32)  # a weight that stays, allocated among the temporaries
r0 = rss()
out["churn_after"] = churn()
a = np.ones(100 << 18, np.float32)
r1 = rss()
del a
out.update(grew=r1 - r0, kept=rss() - r0)
print(json.dumps(out))
"""


def test_load_arena_reuses_temporaries_and_returns_memory():
    """Inside the arena, large blocks freed and allocated again reuse their pages (a bf16 Gemm
    weight passes through read, fp32 and bf16 copies before the packed copy ncnn keeps: fresh
    pages for each were most of a large model's load time, docs/benchmarks.md section 7); afterwards freed memory
    goes back to the OS as before."""
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    pages = (48 << 20) // 4096
    assert res["plain"] > 5 * pages, res            # every temporary faulted in afresh
    assert res["arena"] < 1.5 * pages, res          # one temporary's pages, reused
    assert res["churn_after"] > 5 * pages, res      # mmap again for large blocks
    assert res["grew"] > 90 << 20 and res["kept"] < 8 << 20, res


def test_nets_load_inside_the_arena(tmp_path, monkeypatch):
    import contextlib

    import edgevl.runtime as R

    g = G.Graph(tmp_path / "g.bin")
    G.gemm(g, g.input("x"), np.ones((8, 8), np.float32), "bf16", out="y")
    g.save(tmp_path / "g.param")
    entered = []

    @contextlib.contextmanager
    def arena():
        entered.append(True)
        yield

    monkeypatch.setattr(R, "load_arena", arena)
    R.Net(str(tmp_path / "g.param"), str(tmp_path / "g.bin"), 1, "bf16")
    assert entered == [True]
