"""How many of its threads ncnn's OpenMP team gets, decided by measuring decode steps.

ncnn splits each layer over a team of ``threads`` OpenMP threads and waits for all of them at the
layer's end. When another process keeps a core busy, one of the team's threads waits for the
scheduler at every layer, and a decode step of a thousand layers pays that each time: on a
2-core machine with one busy process beside it, a 0.8B decoder on 2 threads ran 12-17x slower than
on 1. So the thread that owns ncnn times its decode steps and, when the team looks slowed, tries a
few steps with the team shrunk to the calling thread alone, keeps whichever ran faster, and looks
again now and then (less often while the choice keeps holding).

The team is shrunk through OpenMP's max-active-levels (0: every parallel region runs on the thread
that meets it), which leaves every layer's work split as at load (ncnn's Gemm tiles follow the
load-time thread count, and its layers read no team size): the results are the same bits whichever
team ran them. The choice is the process's, as the machine's load is: the libgomp that ncnn's wheel
ships keeps the setting for the whole process, newer ones per thread, so it is set again on each
thread that runs timed steps (the owner thread; a new one after every model was closed), and the
configured value is read once, before any change. ``EDGEVL_ADAPT_THREADS=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import deque

START = 16          # steps before the first look (and after a change of team)
LONGEST = 1024      # the most steps between two looks while the choice keeps holding
SLOWED = 1.5        # a step this much slower than the best since the last look asks for a look now
BETTER = 0.85       # the other team must run a step in this fraction of the time to take over
PROBE = 2           # steps a look runs on the other team
STEPS_KEPT = 5

_lock = threading.Lock()
_team = None
_lib = None
_full = None        # max-active-levels as configured, read before any change


def _openmp():
    """The OpenMP runtime ncnn runs on (as loaded in this process), or None."""
    global _lib, _full
    if _lib is None:
        _lib = False
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "omp" in line and "/" in line}
        except OSError:
            paths = set()
        # ncnn's own first (its wheel ships one beside it: ncnn.libs/); torch may have loaded another
        for path in sorted(paths, key=lambda p: (not os.path.basename(os.path.dirname(p)).startswith("ncnn"), p)):
            name = os.path.basename(path)
            if not (name.startswith(("libgomp", "libomp", "libiomp")) and ".so" in name):
                continue
            try:
                lib = ctypes.CDLL(path)
                lib.omp_get_max_active_levels.restype = ctypes.c_int
                lib.omp_set_max_active_levels.argtypes = [ctypes.c_int]
            except (OSError, AttributeError):
                continue
            _full = lib.omp_get_max_active_levels()
            _lib = lib
            break
    return _lib or None


def enabled() -> bool:
    return os.environ.get("EDGEVL_ADAPT_THREADS", "1") != "0" and _openmp() is not None


class Team:
    """The process's team choice and the step times behind it."""

    def __init__(self, lib, full: int | None = None):
        self.lib = lib
        self.full = lib.omp_get_max_active_levels() if full is None else full    # the team as configured
        self.alone = False                              # the team shrunk to the calling thread
        self.set_on = None                              # the thread the setting was last made on
        self.times: dict = {}                           # key -> {alone: recent step times}
        self.best: dict = {}                            # key -> fastest full-team step since the last look
        self.steps, self.period = 0, START
        self.next_look = START
        self.look: dict | None = None
        self.changes = 0

    def _set(self, alone: bool) -> None:
        self.lib.omp_set_max_active_levels(0 if alone else self.full)
        self.set_on = threading.get_ident()

    def timed(self, key, fn):
        """``fn()``, timed as a step of kind ``key`` (steps compare only with their own kind)."""
        if self.set_on != threading.get_ident():    # a runtime that keeps the setting per thread
            self._set(self.look["alone"] if self.look else self.alone)
        t = time.perf_counter()
        out = fn()
        self.note(key, time.perf_counter() - t)
        return out

    def note(self, key, seconds: float) -> None:
        mine = self.times.setdefault(key, {False: deque(maxlen=STEPS_KEPT), True: deque(maxlen=STEPS_KEPT)})
        ran = self.look["alone"] if self.look else self.alone
        mine[ran].append(seconds)
        if self.look is not None:
            self._looking(key)
            return
        self.steps += 1
        due = self.steps >= self.next_look
        if not self.alone:
            best = self.best[key] = min(self.best.get(key, seconds), seconds)
            recent = list(mine[False])[-3:]
            due = due or (len(recent) == 3 and min(recent) > SLOWED * best)
        if due and len(mine[self.alone]) >= 3:
            self.look = {"alone": not self.alone, "key": key, "left": PROBE, "waited": 0}
            mine[not self.alone].clear()
            self._set(not self.alone)

    def _looking(self, key) -> None:
        look = self.look
        look["waited"] += 1
        if key == look["key"]:
            look["left"] -= 1
        if look["left"] > 0 and look["waited"] < 4 * PROBE:
            return
        self.look = None
        mine = self.times[look["key"]]
        tried, kept = list(mine[look["alone"]]), list(mine[self.alone])[-3:]
        if look["left"] <= 0 and kept and sorted(tried)[len(tried) // 2] < BETTER * sorted(kept)[len(kept) // 2]:
            self.alone, self.period = look["alone"], START
            self.changes += 1
        else:
            self.period = min(2 * self.period, LONGEST)
        self._set(self.alone)
        self.best.clear()
        self.next_look = self.steps + self.period


def team() -> Team | None:
    """The process's :class:`Team` (None where the OpenMP runtime cannot be reached or it is off)."""
    global _team
    if _team is None:
        with _lock:
            if _team is None:
                lib = _openmp() if enabled() else None
                _team = Team(lib, _full) if lib is not None else False
    return _team or None


def timed(key, fn, threads: int):
    """``fn()``, a decode step of kind ``key`` on nets of ``threads`` threads, timed for the choice."""
    t = team() if threads > 1 else None
    return t.timed(key, fn) if t is not None else fn()
