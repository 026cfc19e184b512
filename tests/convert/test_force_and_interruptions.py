"""``convert --force`` never destroys anything but an old package, and killed conversions are
cleaned up by the next one (a half-done replacement keeps the new package, an interrupted swap
restores the old one)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import edgevl
from edgevl.package import MANIFEST, check_package
from support.cli import cli, one_line_error
from support.convert import copy_ck, left_over
from support.files import package_digest, tree_digest


def test_force_into_the_checkpoints_parent_keeps_everything(tiny, tmp_path, capsys):
    ck = copy_ck(tiny[0], tmp_path / "models" / "ck")
    (tmp_path / "models" / "notes.txt").write_text("mine")
    before = tree_digest(tmp_path / "models")
    code, _, err = cli(capsys, "convert", ck, tmp_path / "models", "--force", "--quiet")
    one_line_error(code, err, "contains the checkpoint")
    assert tree_digest(tmp_path / "models") == before


def test_force_onto_the_checkpoint_itself_keeps_it(tiny, tmp_path, capsys):
    ck = copy_ck(tiny[0], tmp_path / "ck")
    before = tree_digest(ck)
    one_line_error(*cli(capsys, "convert", ck, ck, "--force", "--quiet")[::2], "contains the checkpoint")
    assert tree_digest(ck) == before


def test_force_onto_a_folder_that_is_not_a_package_keeps_it(tiny, tmp_path, capsys):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "thesis.tex").write_text("years of work")
    (docs / "sub" / "data.csv").write_text("1,2")
    (docs / MANIFEST).write_text(json.dumps({"name": "some other tool"}))  # a manifest, but not ours
    before = tree_digest(docs)
    one_line_error(*cli(capsys, "convert", tiny[0], docs, "--force", "--quiet")[::2], "not an edgevl package")
    assert tree_digest(docs) == before


def test_force_onto_a_file_or_a_symlinked_package_refuses(tiny, tmp_path, capsys):
    (tmp_path / "out.bin").write_bytes(b"data")
    one_line_error(*cli(capsys, "convert", tiny[0], tmp_path / "out.bin", "--force", "--quiet")[::2],
                   "not a package folder")
    assert (tmp_path / "out.bin").read_bytes() == b"data"
    shutil.copytree(tiny[1], tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    before = tree_digest(tmp_path / "real")
    one_line_error(*cli(capsys, "convert", tiny[0], tmp_path / "link", "--force", "--quiet")[::2], "symlink")
    assert tree_digest(tmp_path / "real") == before


def test_force_onto_a_package_inside_the_checkpoint_refuses(tiny, tmp_path, capsys):
    ck = copy_ck(tiny[0], tmp_path / "ck")
    shutil.copytree(tiny[1], ck / "pkg")
    before = tree_digest(ck)
    one_line_error(*cli(capsys, "convert", ck, ck / "pkg", "--force", "--quiet")[::2], "inside the checkpoint")
    assert tree_digest(ck) == before


def test_force_onto_a_package_holding_the_weights_refuses(tiny, tmp_path, capsys):
    """HF-cache style: the checkpoint's files are symlinks into the folder to be replaced."""
    pkg = tmp_path / "pkg"
    shutil.copytree(tiny[1], pkg)
    blobs = pkg  # the weights live inside the package folder
    ck = tmp_path / "ck"
    ck.mkdir()
    for f in Path(tiny[0]).iterdir():
        shutil.copy(f, blobs / f"blob-{f.name}")
        (ck / f.name).symlink_to(blobs / f"blob-{f.name}")
    before = tree_digest(pkg)
    one_line_error(*cli(capsys, "convert", ck, pkg, "--force", "--quiet")[::2], "contains the checkpoint")
    assert tree_digest(pkg) == before


def test_force_replaces_a_package_and_a_failed_conversion_keeps_the_old_one(tiny, tmp_path, capsys):
    pkg = tmp_path / "pkg"
    shutil.copytree(tiny[1], pkg)
    before = tree_digest(pkg)
    bad = copy_ck(tiny[0], tmp_path / "bad")
    from safetensors.numpy import load_file, save_file

    t = load_file(str(bad / "model.safetensors"))
    key = next(k for k in t if k.endswith("mlp.down_proj.weight"))
    t[key] = t[key][:, :-1].copy()
    save_file(t, str(bad / "model.safetensors"))
    one_line_error(*cli(capsys, "convert", bad, pkg, "--force", "--quiet")[::2], "down_proj", "shape")
    assert tree_digest(pkg) == before and left_over(tmp_path, "pkg") == []
    # a good conversion replaces it (here: another dtype), leaving no work folder behind
    code, out, err = cli(capsys, "convert", tiny[0], pkg, "--force", "--quiet", "--dtype", "fp16")
    assert code == 0, err
    assert json.loads((pkg / MANIFEST).read_text())["dtype"] == "fp16"
    assert left_over(tmp_path, "pkg") == []
    assert edgevl.generate(edgevl.load(pkg), "hi", max_new_tokens=2, raw=True) is not None


KILL_SCRIPT = textwrap.dedent("""
    import importlib, os, shutil, sys, time
    C = importlib.import_module("edgevl.convert")  # the package exports a function of that name
    src, out, stage = sys.argv[1:4]

    def hang():
        print("ready", flush=True)
        time.sleep(600)

    if stage == "writing":  # killed in the middle of writing graphs (after the first one)
        G = importlib.import_module("edgevl.ncnn_graph")
        save = G.Graph.save
        def save_graph(*a, **k):
            r = save(*a, **k)
            hang()
        G.Graph.save = save_graph
    else:  # killed after the new package was swapped in, before the old one was deleted
        rmtree = shutil.rmtree
        def slow_rmtree(path, *a, **k):
            if ".old-" in str(path):
                hang()
            return rmtree(path, *a, **k)
        shutil.rmtree = slow_rmtree
    C.convert(src, out, dtype="fp32", progress=False, overwrite=True)
""")


def killed_conversion(ck, out, stage) -> int:
    p = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(ck), str(out), stage], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait(30)
    assert p.returncode == -signal.SIGKILL
    return p.pid


def test_sigkilled_conversion_is_cleaned_up_by_the_next_one(tiny, tmp_path):
    pid = killed_conversion(tiny[0], tmp_path / "a", "writing")
    assert [re.sub(r"\.\d+$", "", n) for n in left_over(tmp_path, "a")] == [f".a.partial-{pid}"]
    assert not (tmp_path / "a").exists()
    # another tool's folder of the same name pattern (a dead PID, files a conversion never writes) stays
    foreign = tmp_path / f".notes.partial-{pid}"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("mine")
    # a conversion still running elsewhere keeps its folder: its PID is alive
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = tmp_path / f".c.partial-{sleeper.pid}"
        alive.mkdir()
        edgevl.convert(tiny[0], tmp_path / "b", dtype="fp32", progress=False)
        assert left_over(tmp_path, "a") == [] and alive.is_dir()
        assert (foreign / "thesis.tex").read_text() == "mine"
    finally:
        sleeper.kill()
        sleeper.wait()
    assert package_digest(tmp_path / "b") == package_digest(tiny[1])


TERM_SCRIPT = textwrap.dedent("""
    import importlib, sys, time
    G = importlib.import_module("edgevl.ncnn_graph")
    save = G.Graph.save
    def save_graph(*a, **k):   # SIGTERM in the middle of writing graphs (after the first one)
        r = save(*a, **k)
        print("ready", flush=True)
        time.sleep(600)
    G.Graph.save = save_graph
    from edgevl.cli import main
    sys.exit(main(["convert", sys.argv[1], sys.argv[2], "--dtype", "fp32", "--quiet"]))
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_conversion_stopped_by_sigterm_or_ctrl_c_cleans_up_and_says_so(tiny, tmp_path, sig):
    """`timeout`, `kill` and `docker stop` send SIGTERM, which ended convert on the spot and left
    its partial folder (gigabytes for a real model) until a later conversion beside it; Ctrl-C
    cleaned up without a word."""
    p = subprocess.Popen([sys.executable, "-c", TERM_SCRIPT, str(tiny[0]), str(tmp_path / "a")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        assert left_over(tmp_path, "a")          # what the stop must clean up
        os.kill(p.pid, sig)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 128 + sig, err
    assert f"{'stopped (SIGTERM)' if sig == signal.SIGTERM else 'interrupted'}; nothing was written to" in err
    assert left_over(tmp_path, "a") == [] and not (tmp_path / "a").exists()


def test_sigkilled_replacement_keeps_the_new_package_and_drops_the_old(tiny, tmp_path):
    pkg = tmp_path / "pkg"
    edgevl.convert(tiny[0], pkg, dtype="fp16", progress=False)
    pid = killed_conversion(tiny[0], pkg, "swapped")
    assert [re.sub(r"\.\d+$", "", n) for n in left_over(tmp_path, "pkg")] == [f".pkg.old-{pid}"]
    assert json.loads((pkg / MANIFEST).read_text())["dtype"] == "fp32"  # the new one is in place
    edgevl.convert(tiny[0], tmp_path / "other", dtype="fp32", progress=False)
    assert left_over(tmp_path, "pkg") == []
    check_package(pkg)  # complete: every file matches its manifest
    assert edgevl.generate(edgevl.load(pkg), "hi", max_new_tokens=4, raw=True) == \
        edgevl.generate(edgevl.load(tiny[1]), "hi", max_new_tokens=4, raw=True)


def test_old_package_of_an_interrupted_swap_is_restored(tiny, tmp_path):
    """Killed between the two renames of the fallback swap: the old package is put back (here
    in the work folders' older name, without the conversion's number)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    shutil.copytree(tiny[1], tmp_path / f".pkg.old-{dead.pid}")
    before = tree_digest(tmp_path / f".pkg.old-{dead.pid}")
    edgevl.convert(tiny[0], tmp_path / "other", dtype="fp32", progress=False)
    assert tree_digest(tmp_path / "pkg") == before and left_over(tmp_path, "pkg") == []


def test_threads_converting_into_one_folder_leave_a_whole_package(tiny, tmp_path):
    """Each conversion writes its own work folder, threads of one process too: they used to share
    one named by the process, and wrote a package whose files did not match its manifest."""
    from concurrent.futures import ThreadPoolExecutor

    out = tmp_path / "pkg"
    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda _: edgevl.convert(tiny[0], out, dtype="fp32", progress=False,
                                                      overwrite=True), range(4)))
    assert done == [out] * 4 and left_over(tmp_path, "pkg") == []
    check_package(out)
    assert package_digest(out) == package_digest(tiny[1])


LATE_TERM = textwrap.dedent("""
    import os, shutil, signal, sys
    real = shutil.rmtree
    def rmtree(p, *a, **k):   # SIGTERM while the replaced package is deleted (the new one is in place)
        if ".old-" in str(p):
            os.kill(os.getpid(), signal.SIGTERM)
        return real(p, *a, **k)
    shutil.rmtree = rmtree
    from edgevl.cli import main
    sys.exit(main(["convert", sys.argv[1], sys.argv[2], "--dtype", "fp16", "--force", "--quiet"]))
""")


def test_a_stop_while_the_new_package_is_swapped_in_waits_and_says_it_was_written(tiny, tmp_path):
    """Deleting a replaced multi-GB package takes seconds: a SIGTERM then left the old one half
    deleted beside the new one and said nothing was written."""
    out = tmp_path / "pkg"
    shutil.copytree(tiny[1], out)
    p = subprocess.run([sys.executable, "-c", LATE_TERM, str(tiny[0]), str(out)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, p.stderr
    assert p.stderr.strip().endswith(f"stopped (SIGTERM); {out} was written whole before the stop"), p.stderr
    assert json.loads((out / MANIFEST).read_text())["dtype"] == "fp16" and check_package(out)
    assert left_over(tmp_path, "pkg") == []
