import atexit
import os
import shutil
import sys
import tempfile

# Tests never touch the user's cache (verified-stamps, demo package). The process that makes the
# directory removes it at exit: left behind, one per run filled CI's disk.
if "EDGEVL_CACHE" not in os.environ:
    os.environ["EDGEVL_CACHE"] = tempfile.mkdtemp(prefix="edgevl-test-cache-")
    atexit.register(shutil.rmtree, os.environ["EDGEVL_CACHE"], ignore_errors=True)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# tests/ on sys.path: test modules (imported by pytest's importlib mode, which adds nothing to
# sys.path) and the scripts that reuse them import the shared helpers as ``support.<subject>``.
sys.path.insert(0, os.path.dirname(__file__))

# Tiny test models gain nothing from threads, and two OpenMP pools (torch's and ncnn's) spinning
# on the same 2 cores slow each other down by orders of magnitude.
os.environ.setdefault("EDGEVL_THREADS", "1")

import torch

torch.set_num_threads(1)

# In-process conversions split the lm_head into several shards even for tiny vocabularies, so
# the sharded head and the segmented embedding are exercised everywhere (subprocess CLI tests
# keep the default: one shard).
import edgevl.blocks.base as _base  # noqa: E402

_base.HEAD_SHARD_ROWS = 128


# The suite runs on two pytest-xdist workers (README: `-n 2 --dist loadfile`), one core each. A test marked
# ``alone`` asserts a speed ratio or a time bound that another test's work beside it would skew:
# it takes an exclusive lock that every other test holds shared, from its fixtures' set-up to its
# teardown, so it starts once the other worker's test ends and none starts until it is done.
import contextlib  # noqa: E402
import fcntl  # noqa: E402

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: runs while no other test runs (a timing or speed assertion)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not hasattr(item.config, "workerinput"):   # one process: nothing runs beside a test
        yield
        return
    # xdist gives each worker a folder inside the run's own temporary folder, which pytest cleans
    with open(os.path.join(os.path.dirname(item.config.option.basetemp), "alone.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(f, fcntl.LOCK_UN)
