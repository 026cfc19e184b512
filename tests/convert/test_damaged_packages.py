"""Damaged packages: a manifest cannot point outside its folder or at unverified files, wrong
types give one line, a damaged graph names package and blob, ``edgevl check`` finds bit rot the
stamp cache hides, and a broken stamp cache (verified.json) never stops loading."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

import edgevl
from edgevl.package import MANIFEST
from support.cli import cli, one_line_error
from support.files import edit_json
from support.youtu import tiny_checkpoint


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-package")
    return edgevl.convert(tiny_checkpoint(root / "ck"), root / "pkg", dtype="fp32", progress=False)


def copy_pkg(pkg, tmp_path) -> Path:
    dst = tmp_path / "pkg"
    shutil.copytree(pkg, dst)
    return dst


def manifest(p):
    return p / MANIFEST


def reseal(p: Path, name: str) -> None:
    """Record a file's new hash and size in the manifest (a damaged but self-consistent package)."""
    data = (p / name).read_bytes()
    edit_json(manifest(p), lambda m: m["files"].__setitem__(name, {"sha256": hashlib.sha256(data).hexdigest(),
                                                                   "bytes": len(data)}))


def run(capsys, p, *extra):
    return cli(capsys, "run", p, "--prompt", "hi", "--max-new-tokens", "1", "--raw", *extra)


def _emb(**kv):
    return lambda p: edit_json(manifest(p), lambda m: m["embedding"].update(kv))


def _listed(name, meta=None):
    def edit(p):
        edit_json(manifest(p), lambda m: m["files"].__setitem__(name, meta or {"sha256": "0" * 64, "bytes": 0}))
    return edit


def _unlist(name):
    return lambda p: edit_json(manifest(p), lambda m: m["files"].pop(name) and None)


def _symlink_out(p):
    (p / "evil.bin").symlink_to("/dev/zero")
    _listed("evil.bin")(p)
    _emb(file="evil.bin")(p)


def _symlink_loop(p):
    (p / "loop.bin").symlink_to("loop.bin")
    _listed("loop.bin")(p)
    _emb(file="loop.bin")(p)


def _top(**kv):
    return lambda p: edit_json(manifest(p), lambda m: m.update(kv))


def _section_escape(p):
    def edit(m):
        m["graphs"]["decoder"]["extra"]["sections"][0]["param"] = "../../../etc/hostname"
    edit_json(manifest(p), edit)


def _rope_dim_string(p):
    edit_json(manifest(p), lambda m: m["graphs"]["decoder"]["extra"].update(rope_dim="16"))


def _shrink_embedding_file(p):
    e = json.loads(manifest(p).read_text())["embedding"]
    data = (p / e["file"]).read_bytes()
    (p / e["file"]).write_bytes(data[: len(data) // 2])
    reseal(p, e["file"])


PACKAGE_CASES = [  # (id, damage, extra CLI flags, words of the error)
    ("embedding-dev-zero", _emb(file="/dev/zero"), (), "points outside the package"),
    ("embedding-dotdot", _emb(file="../pkg/lm_head.bin"), (), "points outside the package"),
    ("embedding-symlink-out", _symlink_out, (), "symlink leading outside"),
    ("embedding-symlink-loop", _symlink_loop, (), "symlink loop"),
    ("embedding-unlisted-file", lambda p: (shutil.copy(p / "lm_head.bin", p / "extra.bin"), _emb(file="extra.bin")(p)),
     (), "extra.bin is not listed"),
    ("graph-dropped-from-files", _unlist("lm_head.bin"), (), "lm_head.bin is not listed"),
    ("tokenizer-config-dropped", _unlist("tokenizer_config.json"), (), "tokenizer_config.json is not listed"),
    ("files-absolute", _listed("/etc/hostname"), (), "points outside the package"),
    ("files-dotdot", _listed("../outside.bin"), (), "points outside the package"),
    ("section-escape", _section_escape, ("--low-memory",), "points outside the package"),
    ("graphs-a-string", _top(graphs="decoder"), (), "graphs must be an object"),
    ("format-version-string", _top(format_version="1"), (), "format_version must be a positive integer"),
    ("format-version-bool", _top(format_version=True), (), "format_version must be a positive integer"),
    ("files-bytes-string", lambda p: edit_json(manifest(p), lambda m: m["files"]["decoder.bin"].update(bytes="9")),
     (), "files['decoder.bin'] must be an object"),
    ("embedding-rows-string", _emb(rows="x"), (), "embedding.rows must be a positive integer"),
    ("embedding-dim-zero", _emb(dim=0), (), "embedding.dim must be a positive integer"),
    ("embedding-dtype", _emb(dtype="int4"), (), "embedding.dtype must be fp32, fp16 or bf16"),
    ("embedding-segments-gap", _emb(segments=[{"rows": [1, 404], "offset": 4}]), (), "embedding.segments[0]"),
    ("embedding-table-too-small", _emb(dim=64), (), "the embedding table"),
    ("embedding-file-truncated", _shrink_embedding_file, (), "lm_head.bin"),  # also the head's weights
    ("manifest-a-list", lambda p: manifest(p).write_text("[1]"), (), "is not an edgevl manifest"),
    ("manifest-not-utf8", lambda p: manifest(p).write_bytes(b"\xff\xfe\x00"), (), "is not valid JSON"),
    ("manifest-deep-nesting", lambda p: manifest(p).write_text("[" * 100000 + "]" * 100000), (), "is not valid JSON"),
    ("rope-dim-string", _rope_dim_string, (), "graphs.decoder.extra.rope_dim must be a positive number, got '16'"),
    ("state-entry-not-an-object", lambda p: edit_json(manifest(p), lambda m: m["graphs"]["decoder"].update(
        state=[7])), (), "graphs.decoder.state[0] must be an object with kind, inputs and outputs"),
    ("state-unknown-kind", lambda p: edit_json(manifest(p), lambda m: m["graphs"]["decoder"]["state"][0].update(
        kind="telepathy")), (), "unknown state kind 'telepathy'"),
    ("inputs-not-names", lambda p: edit_json(manifest(p), lambda m: m["graphs"]["lm_head"]["inputs"].update(
        hidden=5)), (), "graphs.lm_head.inputs.hidden must be a blob name"),
    ("config-eos-garbage", lambda p: edit_json(manifest(p), lambda m: m["config"].update(eos_token_id="abc")), (),
     "manifest.json has a malformed entry (ValueError"),
    ("missing-output-blob", lambda p: edit_json(manifest(p), lambda m: m["graphs"]["decoder"]["outputs"].update(
        hidden="no_such_blob")), (), "ncnn failed to compute blob 'no_such_blob' of decoder.param in package"),
]


@pytest.mark.parametrize("case", PACKAGE_CASES, ids=[c[0] for c in PACKAGE_CASES])
def test_hostile_manifest_gives_one_line(pkg, tmp_path, capsys, case):
    p = copy_pkg(pkg, tmp_path)
    case[1](p)
    one_line_error(*run(capsys, p, *case[2])[::2], case[3])


def test_damaged_graph_names_package_and_blob(pkg, tmp_path, capsys):
    """A graph that parses but cannot run (a Reshape to an impossible size), hashes re-sealed."""
    p = copy_pkg(pkg, tmp_path)
    text = (p / "decoder.param").read_text()
    assert "0=16 1=2 2=-1" in text
    (p / "decoder.param").write_text(text.replace("0=16 1=2 2=-1", "0=17 1=2 2=-1", 1))
    reseal(p, "decoder.param")
    one_line_error(*run(capsys, p)[::2], "ncnn failed to compute blob", "decoder.param", f"package {p}")


def test_vision_args_zero_heads_in_manifest(tmp_path, capsys):
    from edgevl.demo import demo_package

    p = tmp_path / "demo"
    shutil.copytree(demo_package(), p)
    edit_json(manifest(p), lambda m: m["graphs"]["vision"]["extra"]["vision_args"].update(num_attention_heads=0))
    one_line_error(*run(capsys, p)[::2], "manifest.json vision_args field num_attention_heads must be a positive")


def test_check_finds_bit_rot_that_keeps_the_mtime(pkg, tmp_path, capsys):
    p = copy_pkg(pkg, tmp_path)
    code, out, err = cli(capsys, "check", p)
    n = len(json.loads(manifest(p).read_text())["files"])
    assert code == 0 and out.startswith(f"ok: all {n} files of {p}"), (out, err)
    code, _, err = run(capsys, p)  # verified now: the stamp cache remembers size and mtime
    assert code == 0, err
    f = p / "decoder.bin"
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0x40  # one flipped bit
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    code, _, err = run(capsys, p)
    assert code == 0, err  # loading trusts the stamp (by design: no re-hash of gigabytes per load)
    one_line_error(*cli(capsys, "check", p)[::2], "decoder.bin does not match its sha256")


def test_check_takes_the_demo_as_every_model_command_does(capsys):
    from edgevl.demo import demo_package

    for args in ((), ("demo",)):
        code, out, err = cli(capsys, "check", *args)
        assert code == 0 and out.startswith("ok: all ") and str(demo_package()) in out, (out, err)


@pytest.mark.parametrize("edit", [
    lambda m: m["embedding"].update(dtype="fp16"),                      # read as another type: garbage
    lambda m: m["graphs"]["decoder"]["extra"].update(rope_theta=12345.0),  # other positions, same files
])
def test_an_edited_manifest_is_refused_by_load_and_check(pkg, tmp_path, capsys, edit):
    """The manifest says how to read every file: an edit to it after conversion is refused like a
    changed weight file, by every load (not only by `edgevl check`)."""
    p = copy_pkg(pkg, tmp_path)
    edit_json(manifest(p), edit, restamp=False)
    words = "manifest.json was changed after conversion"
    one_line_error(*run(capsys, p)[::2], words)
    one_line_error(*cli(capsys, "check", p)[::2], words)


def test_a_package_that_lost_its_manifest_is_not_called_a_checkpoint(pkg, tmp_path, capsys):
    p = copy_pkg(pkg, tmp_path)
    manifest(p).unlink()
    one_line_error(*run(capsys, p)[::2], "an edgevl package that lost its manifest; convert the model again")


def test_a_manifest_without_its_digest_still_loads(pkg, tmp_path, capsys):
    """Packages written before the manifest's own digest have none: they load as before."""
    p = copy_pkg(pkg, tmp_path)
    edit_json(manifest(p), lambda m: m.pop("manifest_sha256") and None, restamp=False)
    code, _, err = run(capsys, p)
    assert code == 0, err


def test_check_refuses_escapes_and_unlisted_files(pkg, tmp_path, capsys):
    p = copy_pkg(pkg, tmp_path)
    _unlist("chat_template.jinja")(p)
    one_line_error(*cli(capsys, "check", p)[::2], "chat_template.jinja is not listed")
    q = tmp_path / "q"
    shutil.copytree(pkg, q)
    _emb(file="/etc/passwd")(q)
    one_line_error(*cli(capsys, "check", q)[::2], "points outside the package")
    one_line_error(*cli(capsys, "check", tmp_path / "nothing")[::2], "does not exist")


STAMP_CASES = [
    ("list", b"[1, 2]"), ("string", b'"x"'), ("truncated", b'{"a": '), ("binary", b"\xff\xfe\x00\x01"),
    ("null", b"null"), ("deep", b"[" * 100000 + b"]" * 100000),
    ("entry-list", None), ("stamp-string", None),
]


@pytest.mark.parametrize("case", STAMP_CASES, ids=[c[0] for c in STAMP_CASES])
def test_corrupt_stamp_cache_is_ignored_and_rewritten(pkg, tmp_path, monkeypatch, case):
    monkeypatch.setenv("EDGEVL_CACHE", str(tmp_path / "cache"))
    stamps = tmp_path / "cache" / "verified.json"
    stamps.parent.mkdir()
    key = str(Path(pkg).resolve())
    if case[0] == "entry-list":
        stamps.write_text(json.dumps({key: [1, 2]}))
    elif case[0] == "stamp-string":
        stamps.write_text(json.dumps({key: {"decoder.bin": "x", "lm_head.bin": [1]}}))
    else:
        stamps.write_bytes(case[1])
    model = edgevl.load(pkg)
    assert model.vocab_size > 0
    fixed = json.loads(stamps.read_text())
    assert isinstance(fixed, dict) and set(fixed[key]) == set(model.manifest["files"])


def test_stamp_cache_that_is_a_folder_does_not_stop_loading(pkg, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEVL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "verified.json").mkdir(parents=True)
    assert edgevl.load(pkg).vocab_size > 0
    assert (tmp_path / "cache" / "verified.json").is_dir()


def test_a_file_made_unreadable_after_its_check_is_named_as_unreadable(pkg, tmp_path, capsys, monkeypatch):
    """chmod 000 keeps a file's size and time, so its checked stamp still holds: the load says the
    file cannot be read (ncnn's own read called the package corrupt)."""
    from edgevl import package

    p = copy_pkg(pkg, tmp_path)
    edgevl.load(p).close()                                    # checked once: stamped
    target = str(p / "lm_head.bin")
    real = os.access
    monkeypatch.setattr(package.os, "access", lambda f, mode: real(f, mode) and str(f) != target)
    line = one_line_error(*cli(capsys, "run", p, "--prompt", "hi", "--max-new-tokens", "1")[::2],
                          "lm_head.bin", "cannot be read", "permissions")
    assert "corrupt" not in line


def test_stamps_keep_the_last_loaded_packages_and_the_cache_path_expands_home(pkg, tmp_path, monkeypatch):
    """The stamp file keeps the packages loaded last (it grew with every package ever loaded),
    one on a disk not mounted now included; EDGEVL_CACHE=~/x is the home's folder."""
    from edgevl import package

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EDGEVL_CACHE", "~/cache")                 # quoted in a unit file: no shell expands it
    monkeypatch.setattr(package, "STAMPS_KEPT", 2)
    first = copy_pkg(pkg, tmp_path / "a")
    edgevl.load(first).close()
    stamps = tmp_path / "home" / "cache" / "verified.json"
    assert list(json.loads(stamps.read_text())) == [str(first.resolve())]
    first.rename(tmp_path / "a" / "unmounted")
    second = copy_pkg(pkg, tmp_path / "b")
    edgevl.load(second).close()
    assert list(json.loads(stamps.read_text())) == [str(first.resolve()), str(second.resolve())]
    (tmp_path / "a" / "unmounted").rename(first)
    third = copy_pkg(pkg, tmp_path / "c")
    edgevl.load(third).close()
    assert list(json.loads(stamps.read_text())) == [str(second.resolve()), str(third.resolve())]
