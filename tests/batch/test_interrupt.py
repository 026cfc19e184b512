"""Ctrl-C in `edgevl batch` (a real SIGINT to the job): exit 130 with one line saying how to resume,
and the rerun it names finishes the job."""

import os
import signal
import subprocess
import sys
import time

from edgevl.demo.scenes import make_scene
from support.common import ROOT
from support.files import read_jsonl

N = 12


def _job(pkg, folder, out, *extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "edgevl", "batch", str(pkg), "--input", str(folder), "--prompt",
                             "Describe the image.", "--output", str(out), "--threads", "1", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _interrupt_after_a_row(proc, out, sig=signal.SIGINT):
    t0 = time.monotonic()
    while not (out.exists() and out.read_bytes().count(b"\n") >= 1):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() - t0 < 120, "no row written"
        time.sleep(0.005)
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, [line for line in err.splitlines() if line.strip()]


def _scenes(tmp_path, seed: int):
    """A folder of N demo scenes (the job's images)."""
    folder = tmp_path / "scenes"
    folder.mkdir()
    for i in range(N):
        make_scene(seed + i).image.save(folder / f"s{i:02d}.png")
    return folder


def test_ctrl_c_says_how_to_resume_and_the_rerun_finishes(pkg, tmp_path):
    folder = _scenes(tmp_path, 500)
    out = tmp_path / "out.jsonl"
    code, err = _interrupt_after_a_row(_job(pkg, folder, out), out)
    assert code == 130, err
    assert "Traceback" not in "\n".join(err), err
    assert err[-1] == (f"interrupted; rerun the same command to resume (the rows already in {out} are kept)"), err
    done = len(read_jsonl(out))
    assert 1 <= done < N

    again = _job(pkg, folder, out)
    _, err2 = again.communicate(timeout=300)
    assert again.returncode == 0, err2
    assert f"{done} already done" in err2 and len(read_jsonl(out)) == N


def test_after_overwrite_the_hint_says_to_leave_it_out(pkg, tmp_path):
    """Rerunning a command with --overwrite would start over, not resume."""
    folder = _scenes(tmp_path, 700)
    out = tmp_path / "out.jsonl"
    code, err = _interrupt_after_a_row(_job(pkg, folder, out, "--overwrite"), out)
    assert code == 130, err
    assert err[-1] == ("interrupted; rerun the same command without --overwrite to resume (the rows already in "
                       f"{out} are kept)"), err


def test_sigterm_stops_the_job_as_ctrl_c_does(pkg, tmp_path):
    """`timeout` and schedulers send SIGTERM: the same line, the Parquet output assembled from the
    rows done, no lock left; exit 143."""
    folder = _scenes(tmp_path, 900)
    out = tmp_path / "out.parquet"
    partial = tmp_path / "out.parquet.partial.jsonl"
    code, err = _interrupt_after_a_row(_job(pkg, folder, out), partial, signal.SIGTERM)
    assert code == 143, err
    assert err[-1] == f"stopped (SIGTERM); rerun the same command to resume (the rows already in {out} are kept)", err
    assert out.exists() and not partial.exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".lock")]


SLOW_FINISH = """
import importlib, sys, time
batch = importlib.import_module("edgevl.batch")   # the package exports a function of that name
write = batch._write_atomic
def slow(path, fn):   # the Parquet file is written when the job stops: a second Ctrl-C comes meanwhile
    print("writing", flush=True)
    time.sleep(1.5)
    return write(path, fn)
batch._write_atomic = slow
from edgevl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_second_ctrl_c_while_the_output_is_written_waits_for_it(pkg, tmp_path):
    """A second Ctrl-C during the writing of the Parquet output stopped it: only the journal was
    left, while the last line said the rows were in the Parquet file."""
    folder = _scenes(tmp_path, 1100)
    out = tmp_path / "out.parquet"
    partial = tmp_path / "out.parquet.partial.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", SLOW_FINISH, "batch", str(pkg), "--input", str(folder), "--prompt",
                             "Describe the image.", "--output", str(out), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    t0 = time.monotonic()
    while not (partial.exists() and partial.read_bytes().count(b"\n") >= 1):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() - t0 < 120, "no row written"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGINT)
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert lines[-1] == f"interrupted; rerun the same command to resume (the rows already in {out} are kept)", err
    assert out.exists() and not partial.exists()
