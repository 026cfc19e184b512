"""Loading graphs: ncnn's load reuses freed memory (runtime.load_arena) and gives it back."""

import json
import subprocess
import sys

import numpy as np
import pytest

from edgevl import ncnn_graph as G

CHILD = r"""
import json, os, resource, sys, numpy as np
from edgevl.runtime import load_arena
try:  # numpy asks for huge pages on large arrays unless told not to (the test runs both ways)
    np._core.multiarray._set_madvise_hugepage(sys.argv[1] == "huge")
except AttributeError:
    np.core.multiarray._set_madvise_hugepage(sys.argv[1] == "huge")

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def churn(n=6):  # what ncnn does per layer: large temporaries (above glibc's 32 MiB mmap limit), freed
    f0 = faults()
    for _ in range(n):
        a = np.ones(48 << 18, np.float32)  # 48 MiB
        del a
    return faults() - f0

out = {"one": churn(1), "plain": churn()}
with load_arena():
    out["arena_first"] = churn(1)  # the heap grows: fresh pages, of the heap's own fault size
    out["arena_rest"] = churn(5)
    kept = np.ones(16 << 18, np.float32)  # a weight that stays, allocated among the temporaries
r0 = rss()
out["churn_after"] = churn()
a = np.ones(100 << 18, np.float32)
r1 = rss()
del a
out.update(grew=r1 - r0, kept=rss() - r0)
print(json.dumps(out))
"""


@pytest.mark.parametrize("pages", ["base", "huge"])
def test_load_arena_reuses_temporaries_and_returns_memory(pages):
    """Inside the arena, large blocks freed and allocated again reuse their pages (a bf16 Gemm
    weight passes through read, fp32 and bf16 copies before the packed copy ncnn keeps: fresh
    pages for each were most of a large model's load time, docs/benchmarks.md section 7); afterwards freed memory
    goes back to the OS as before.

    How many bytes one page fault maps is the kernel's choice (4 KiB pages; multi-size
    transparent huge pages of 16 KiB and up; 2 MiB huge pages where numpy asks for them, the
    "huge" case), and it can differ between mmapped blocks and the heap (a heap's unaligned end
    gets small pages). So faults are never turned into bytes: each count is compared with one
    fresh temporary's faults in the same kind of memory, measured in the same process (mmapped
    blocks: ``one``; the arena's heap: its first temporary). Fresh pages for each temporary cost
    about one unit each; reused pages cost next to none."""
    r = subprocess.run([sys.executable, "-c", CHILD, pages], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    one = res["one"]
    assert one > 0 and res["arena_first"] > 0, res
    assert res["plain"] > 5 * one, res              # every temporary faulted in afresh
    assert res["arena_rest"] < res["arena_first"] / 2, res   # five more reuse the first one's pages
    assert res["churn_after"] > 5 * one, res        # mmap again for large blocks
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
