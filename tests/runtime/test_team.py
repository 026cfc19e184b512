"""The OpenMP team's size, chosen from decode step times (edgevl.team): a team slowed by work
beside it gives way to the owner thread alone and comes back once it is faster again; shrinking
the team changes no bit of any result."""

import sys

import numpy as np
import pytest

import edgevl
from edgevl import team
from support.qwen import make_qwen3_5


class FakeOpenMP:
    def __init__(self):
        self.levels = 5
        self.sets = []

    def omp_get_max_active_levels(self):
        return self.levels

    def omp_set_max_active_levels(self, n):
        self.levels = n
        self.sets.append(n)


def run(t: team.Team, steps: int, full: float, alone: float, key="decode") -> None:
    """``steps`` decode steps that take ``full`` seconds on the whole team, ``alone`` on one thread."""
    for _ in range(steps):
        ran_alone = t.lib.levels == 0
        assert ran_alone == (t.look["alone"] if t.look else t.alone)
        t.note(key, alone if ran_alone else full)


def test_a_slowed_team_gives_way_to_one_thread_and_comes_back():
    lib = FakeOpenMP()
    t = team.Team(lib)
    # a quiet machine: the team keeps its threads; looks at one thread grow rarer
    run(t, 400, full=0.040, alone=0.065)
    assert not t.alone and t.changes == 0 and lib.levels == 5
    looks = lib.sets.count(0)
    assert 2 <= looks <= 6, lib.sets
    # a busy process beside it: every layer waits for the scheduler; within a few steps the
    # team is shrunk to the owner thread
    run(t, 6, full=0.500, alone=0.070)
    assert t.alone and lib.levels == 0 and t.changes == 1
    # while it stays busy, looks at the whole team are rare and cost little
    before = len(lib.sets)
    run(t, 300, full=0.500, alone=0.070)
    assert t.alone and (len(lib.sets) - before) // 2 <= 6
    # the busy process ends: the whole team comes back at the next look
    run(t, team.LONGEST + 2 * team.PROBE, full=0.040, alone=0.065)
    assert not t.alone and lib.levels == 5 and t.changes == 2


def test_steps_of_another_kind_do_not_decide_a_look():
    """A look compares steps of one kind (rows of a step, one model): steps of other kinds
    between them run on the team being tried but count for nothing."""
    lib = FakeOpenMP()
    t = team.Team(lib)
    run(t, team.START - 1, full=0.040, alone=0.065, key="one")
    run(t, 1, full=0.040, alone=0.065, key="one")     # the look starts
    assert t.look is not None and lib.levels == 0
    for _ in range(3):
        t.note("four", 0.001)                          # another kind, very fast
    assert t.look is not None
    run(t, team.PROBE, full=0.040, alone=0.065, key="one")
    assert t.look is None and not t.alone and lib.levels == 5


def test_the_choice_is_set_again_on_each_thread_that_runs_steps():
    """Newer libgomp keeps the setting per thread: a new owner thread (after every model was
    closed) gets the process's choice before its first step; the configured team is the one read
    before any change, whatever a later team reads."""
    import threading

    lib = FakeOpenMP()
    t = team.Team(lib, full=5)
    run(t, 30, full=0.040, alone=0.065)
    run(t, 6, full=0.500, alone=0.070)
    assert t.alone
    seen = []

    def step():
        lib.levels = 5                       # a fresh thread's own setting
        t.timed("decode", lambda: seen.append(lib.levels))
    th = threading.Thread(target=step)
    th.start()
    th.join()
    assert seen == [0]                       # the step ran on one thread there too
    assert team.Team(lib, full=5).full == 5 and lib.levels == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the OpenMP runtime is found through /proc")
def test_shrinking_the_team_changes_no_bit(tmp_path, monkeypatch):
    """ncnn keeps each layer's split as at load (its Gemm tiles follow the load-time thread
    count), so a decoder run by its owner thread alone computes exactly what the team does."""
    assert team.enabled()
    pkg = edgevl.convert(make_qwen3_5(tmp_path / "ck", seed=4, text_only=True), tmp_path / "pk", dtype="fp32",
                         progress=False)
    m = edgevl.load(pkg, threads=2, speculative="none")
    lib = team._openmp()
    full = team._full                   # as configured (a model before this one may have chosen one thread)
    now = m._owner.call(lib.omp_get_max_active_levels)
    monkeypatch.setattr(team, "_team", False)             # no choosing while the test sets the team
    ids = list(range(5, 45))

    def logits(levels):
        m._owner.call(lib.omp_set_max_active_levels, levels)
        try:
            rows = [m.prefill(ids[:30], reuse_cache=False).copy()]
            rows += [m.prefill(ids[:k], reuse_cache=True).copy() for k in range(31, 40)]   # decode steps
            return np.stack(rows)
        finally:
            m._owner.call(lib.omp_set_max_active_levels, now)

    whole, alone = logits(full), logits(0)
    assert full != 0 and np.isfinite(whole).all()
    assert np.array_equal(whole, alone)
    m.close()


def test_default_threads_fit_the_cpus_this_process_may_use(tmp_path, monkeypatch):
    from edgevl import runtime

    monkeypatch.delenv("EDGEVL_THREADS", raising=False)
    monkeypatch.setattr(runtime.ncnn, "get_physical_cpu_count", lambda: 8)
    monkeypatch.setattr(runtime, "cpu_quota", lambda: None)
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7}, raising=False)
    assert runtime.default_threads() == 8
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {3}, raising=False)     # taskset -c 3
    assert runtime.default_threads() == 1
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(runtime, "cpu_quota", lambda: 2)                                      # docker --cpus 1.5
    assert runtime.default_threads() == 2


@pytest.mark.parametrize("files, cpus", [
    ({"cpu.max": "150000 100000\n"}, 2),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu.max": "garbage"}, None),
    ({}, None),
])
def test_cpu_quota_of_cgroup_v2_and_v1(tmp_path, files, cpus):
    from edgevl import runtime

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert runtime.cpu_quota(str(tmp_path)) == cpus
