"""The demo package from the command line: 'demo' (or no model) names it in every command, where
it lives is said once, and `edgevl cache` lists and clears only edgevl's own files; the cache is
named when it cannot be written and is keyed by the edgevl version."""

from pathlib import Path

import pytest

import edgevl
from edgevl import cli
from edgevl.demo import demo_package, demo_package_path
from edgevl.errors import EdgevlError


def test_demo_path_is_printed_and_demo_names_it_everywhere(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EDGEVL_CACHE", str(tmp_path / "cache"))
    first = cli.resolve_model(None)
    assert f"[converting the demo model into {first} (once)]" in capsys.readouterr().err
    assert cli.resolve_model("demo") == cli.resolve_model(None) == first
    assert capsys.readouterr().err == ""  # said once, when converting
    (tmp_path / "mine").mkdir()
    assert cli.resolve_model(str(tmp_path / "mine")) == str(tmp_path / "mine")
    for cmd in ("run", "verify", "chat", "serve", "bench"):
        a = cli.build_parser().parse_args([cmd] + (["--prompt", "x"] if cmd == "run" else []))
        assert a.model is None, cmd  # the model is optional everywhere


def test_cache_lists_and_clears_only_its_own_files(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("EDGEVL_CACHE", str(cache))
    pkg = demo_package()
    (cache / "notes.txt").write_text("mine, not edgevl's")
    assert cli.main(["cache"]) == 0
    out = capsys.readouterr().out
    size = sum(p.stat().st_size for p in pkg.iterdir())
    assert str(cache) in out and pkg.name in out and f"{size / 2**20:.1f} MB" in out and "notes.txt" not in out
    assert cli.main(["cache", "clear"]) == 0
    assert "removed" in capsys.readouterr().out
    assert not pkg.exists() and (cache / "notes.txt").is_file()


def test_unwritable_cache_folder_is_named_as_the_cache(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("EDGEVL_CACHE", str(tmp_path / "file" / "cache"))
    with pytest.raises(EdgevlError, match=r"edgevl cache folder .*file/cache.*set EDGEVL_CACHE"):
        demo_package()


def test_bench_and_verify_take_demo(tmp_path, capsys):
    assert cli.main(["verify", "demo", "--max-new-tokens", "4"]) == 0  # --reference: the package's source
    out = capsys.readouterr()
    assert "PASS" in out.out
    # a fresh cache converts the demo first, and says so
    lines = [line for line in out.err.splitlines() if not line.startswith("[converting the demo model into ")]
    assert lines[0].startswith("[1/4] loading the package")
    assert "prompt 'Describe the image in one sentence.'" in out.err and "(fp32)" in out.err
    assert "greedy tokens must be identical" in out.err and "[4/4] 4 greedy tokens" in out.err
    assert cli.main(["bench", "--repeats", "1", "--prompt-tokens", "8", "--gen-tokens", "2"]) == 0
    assert "| edgevl fp32 expanded-kv |" in capsys.readouterr().out


def test_demo_cache_is_keyed_by_the_edgevl_version(monkeypatch, tmp_path):
    """An upgrade converts the demo again instead of loading (or refusing) an older release's copy."""
    monkeypatch.setenv("EDGEVL_CACHE", str(tmp_path))
    now = demo_package_path()
    assert now.parent == tmp_path and now.name.endswith(f"-{edgevl.__version__}")
    monkeypatch.setattr(edgevl, "__version__", "9.9.9")
    assert demo_package_path() != now


def test_the_api_loads_the_demo_as_the_cli_does(tmp_path, monkeypatch):
    """``edgevl.load()`` and ``edgevl.load("demo")`` are the commands' default model; a package
    folder named demo in the working folder wins, as on the command line."""
    import shutil

    from edgevl.demo.scenes import make_scene

    monkeypatch.setenv("EDGEVL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    make_scene(3).image.save("scene.png")
    for model in (edgevl.load(), edgevl.load("demo")):
        assert model.path == demo_package_path() == Path(cli.resolve_model(None))
        assert edgevl.generate(model, "How many shapes are there?", image="scene.png", max_new_tokens=3)
    shutil.copytree(demo_package_path(), "demo")
    assert edgevl.load("demo").path == Path("demo")


def test_first_loads_at_once_convert_the_demo_once(tmp_path, monkeypatch):
    """An app's first requests (threads) and its workers (processes) all load the demo into an
    empty cache at once: one converts, the others wait for it and load what it wrote (they used
    to convert together, failed with misleading errors and left a corrupt package behind)."""
    import importlib
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from edgevl.package import check_package
    from support.common import smooth_image

    monkeypatch.setenv("EDGEVL_CACHE", str(tmp_path / "cache"))
    convert_mod = importlib.import_module("edgevl.convert")   # the package exports a function of that name
    calls = []
    real = convert_mod.convert
    monkeypatch.setattr(convert_mod, "convert", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    # a second process converting at the same time, waiting on the same cache folder
    other = subprocess.Popen([sys.executable, "-c", "import edgevl.demo as d; print(d.demo_package())"],
                             stdout=subprocess.PIPE, text=True)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: demo_package(), range(4)))
    assert other.communicate(timeout=300)[0].strip() == str(got[0]) and other.returncode == 0
    assert got == [demo_package_path()] * 4 and len(calls) <= 1
    check_package(got[0])
    left = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert [n for n in left if n.startswith(("demo-", "."))] == [got[0].name], left   # no work folders left
    assert edgevl.generate(edgevl.load(), "Describe the image.", image=smooth_image(64, 64), max_new_tokens=4)


def test_a_cache_folder_under_an_unwritable_home_is_named_as_the_cache(tmp_path, monkeypatch):
    """A container user whose HOME is / or missing: the folder that fails is above the cache;
    that is the cache's place, not the installed edgevl, at fault."""
    import edgevl.demo as demo

    monkeypatch.setenv("EDGEVL_CACHE", str(tmp_path / "home" / ".cache" / "edgevl"))

    def refused(folder):
        raise PermissionError(13, "Permission denied", str(tmp_path / "home"))

    monkeypatch.setattr(demo, "_folder_lock", refused)
    with pytest.raises(EdgevlError, match=r"edgevl cache folder .*home/.cache/edgevl.*set EDGEVL_CACHE") as e:
        demo_package()
    assert "reinstall" not in str(e.value)


def test_a_damaged_demo_in_the_cache_is_converted_again_or_named_for_cache_clear(tmp_path, monkeypatch):
    """What stands at the demo's cache path without a manifest (a clear cut short, a file) is
    replaced at the next use; a cached demo with a damaged file says to clear the cache (the
    user cannot convert the demo by hand)."""
    import shutil

    monkeypatch.setenv("EDGEVL_CACHE", str(tmp_path / "cache"))
    out = demo_package()
    (out / "manifest.json").unlink()
    assert demo_package() == out and (out / "manifest.json").is_file()
    shutil.rmtree(out)
    out.write_text("not a package")
    assert demo_package() == out and (out / "manifest.json").is_file()
    with open(out / "decoder.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(EdgevlError, match=r"decoder.bin.*edgevl cache clear"):
        edgevl.load("demo")
