"""Hostile conversions: ``--force`` never destroys anything but an old package, killed
conversions are cleaned up, safetensors headers and configs are never trusted (a seeded fuzz of
the header included), and the tokenizer is checked before anything is written."""

import json
import math
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import edgevl
from edgevl.errors import EdgevlError
from edgevl.package import MANIFEST, check_package
from hostile import TINY, cli, edit_json, one_line_error, package_digest, tiny_checkpoint, tree_digest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-convert")
    ck = tiny_checkpoint(root / "ck")
    ref = edgevl.convert(ck, root / "ref", dtype="fp32", progress=False)
    return ck, ref


def copy_ck(ck, dest) -> Path:
    shutil.copytree(ck, dest)
    return dest


def left_over(parent, name):
    """Hidden work folders of conversions into parent/name."""
    return sorted(p.name for p in Path(parent).iterdir() if p.name.startswith(f".{name}."))


# -- item 2: --force ----------------------------------------------------------------------------

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
    assert left_over(tmp_path, "a") == [f".a.partial-{pid}"] and not (tmp_path / "a").exists()
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


def test_sigkilled_replacement_keeps_the_new_package_and_drops_the_old(tiny, tmp_path):
    pkg = tmp_path / "pkg"
    edgevl.convert(tiny[0], pkg, dtype="fp16", progress=False)
    pid = killed_conversion(tiny[0], pkg, "swapped")
    assert left_over(tmp_path, "pkg") == [f".pkg.old-{pid}"]
    assert json.loads((pkg / MANIFEST).read_text())["dtype"] == "fp32"  # the new one is in place
    edgevl.convert(tiny[0], tmp_path / "other", dtype="fp32", progress=False)
    assert left_over(tmp_path, "pkg") == []
    check_package(pkg)  # complete: every file matches its manifest
    assert edgevl.generate(edgevl.load(pkg), "hi", max_new_tokens=4, raw=True) == \
        edgevl.generate(edgevl.load(tiny[1]), "hi", max_new_tokens=4, raw=True)


def test_old_package_of_an_interrupted_swap_is_restored(tiny, tmp_path):
    """Killed between the two renames of the fallback swap: the old package is put back."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    shutil.copytree(tiny[1], tmp_path / f".pkg.old-{dead.pid}")
    before = tree_digest(tmp_path / f".pkg.old-{dead.pid}")
    edgevl.convert(tiny[0], tmp_path / "other", dtype="fp32", progress=False)
    assert tree_digest(tmp_path / "pkg") == before and left_over(tmp_path, "pkg") == []


# -- item 3: safetensors headers -------------------------------------------------------------

def write_header(path: Path, meta, n: int | None = None) -> None:
    """Replace the header of a safetensors file, keeping its data section."""
    data = path.read_bytes()
    (old_n,) = struct.unpack("<Q", data[:8])
    body = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    path.write_bytes(struct.pack("<Q", len(body) if n is None else n) + body + data[8 + old_n:])


def header_of(path: Path) -> dict:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n])


def first_tensor(meta) -> str:
    return min((k for k in meta if k != "__metadata__"), key=lambda k: meta[k]["data_offsets"][0])


def _set(field, value):
    def edit(meta):
        meta[first_tensor(meta)][field] = value
        return meta
    return edit


def _overlap(meta):
    last = max((k for k in meta if k != "__metadata__"), key=lambda k: meta[k]["data_offsets"][0])
    a, b = meta[last]["data_offsets"]
    meta[last]["data_offsets"] = [0, b - a]  # on top of the first tensor
    return meta


def _drop_first(meta):
    meta.pop(first_tensor(meta))
    return meta


HEADER_CASES = [  # (id, header -> new header, words of the error, names the first tensor)
    ("header-is-a-list", lambda m: [m], "header is a JSON list", False),
    ("header-is-a-string", lambda m: "x", "header is a JSON str", False),
    ("entry-not-an-object", lambda m: {**m, first_tensor(m): [1, 2]}, "header entry is a list", True),
    ("string-offsets", _set("data_offsets", ["0", "4"]), "data_offsets must be two integers", True),
    ("offset-2**70", _set("data_offsets", [0, 2 ** 70]), "outside the data section", True),
    ("negative-offsets", _set("data_offsets", [-8, 0]), "data_offsets must be two integers >= 0", True),
    ("end-before-start", _set("data_offsets", [8, 4]), "outside the data section", True),
    ("three-offsets", _set("data_offsets", [0, 4, 8]), "data_offsets must be two integers", True),
    ("float-offsets", _set("data_offsets", [0.0, 4.0]), "data_offsets must be two integers", True),
    ("bool-shape", _set("shape", [True, 1]), "shape must be a list of integers", True),
    ("shape-2**70-with-zero", _set("shape", [0, 2 ** 70]), "needs 0", True),
    ("shape-too-big-for-range", _set("shape", [2 ** 40]), "needs 4398046511104", True),
    ("dtype-not-a-string", _set("dtype", 32), "dtype must be a string", True),
    ("overlap", _overlap, "must not overlap", False),
    ("missing-tensor-leaves-a-gap", _drop_first, "must not overlap or leave gaps", False),
]


@pytest.mark.parametrize("case", HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_bad_header_gives_one_line_naming_file_and_tensor(tiny, tmp_path, capsys, case):
    _, edit, words, names_tensor = case
    ck = copy_ck(tiny[0], tmp_path / "ck")
    f = ck / "model.safetensors"
    meta = header_of(f)
    first = first_tensor(meta)
    write_header(f, edit(meta))
    line = one_line_error(*cli(capsys, "convert", ck, tmp_path / "out", "--quiet")[::2], words)
    assert "model.safetensors" in line
    if names_tensor:
        assert f"tensor {first} in model.safetensors" in line
    assert not (tmp_path / "out").exists() and left_over(tmp_path, "out") == []


@pytest.mark.parametrize("case", [
    ("length-past-the-file", lambda raw: struct.pack("<Q", len(raw)) + raw[8:], "exceeds the file"),
    ("length-2**63", lambda raw: struct.pack("<Q", 2 ** 63) + raw[8:], "exceeds the 100 MB limit"),
    ("short-file", lambda raw: raw[:5], "shorter than 8 bytes"),
    ("trailing-bytes", lambda raw: raw + b"\0" * 16, "16 bytes after the last tensor"),
    ("truncated-data", lambda raw: raw[:-100], "outside the data section"),
    ("not-utf8", lambda raw: raw[:8] + b"\xff" * (len(raw[8:8 + struct.unpack('<Q', raw[:8])[0]]))
     + raw[8 + struct.unpack('<Q', raw[:8])[0]:], "not a valid safetensors file"),
], ids=lambda c: c[0])
def test_bad_file_framing(tiny, tmp_path, capsys, case):
    ck = copy_ck(tiny[0], tmp_path / "ck")
    f = ck / "model.safetensors"
    f.write_bytes(case[1](f.read_bytes()))
    one_line_error(*cli(capsys, "convert", ck, tmp_path / "out", "--quiet")[::2], case[2])
    assert not (tmp_path / "out").exists()


HOSTILE_VALUES = [[], {}, None, True, False, "713", "F32", "BF16", 4.5, -1, -8, 0, 1, 2 ** 70, -2 ** 70, 1e308,
                  [1], [0, 2 ** 70], [-8, 0], [2 ** 64, 2 ** 64 + 4], [[0], [4]], "0", {"a": 1}, "\ud800",
                  [0.0, 4.0], [4, 0], [0, 0], [True, False], [None], "x" * 300]


def mutate(raw: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One random mutation of a safetensors file's header (the data bytes stay as they are)."""
    (n,) = struct.unpack("<Q", raw[:8])
    head, data = bytearray(raw[8:8 + n]), raw[8 + n:]
    kind = rng.choice(["flip", "flip", "insert", "delete", "value", "value", "value", "element", "structure",
                       "length"])
    if kind == "flip":
        for _ in range(rng.randint(1, 3)):
            head[rng.randrange(n)] = rng.randrange(256)
        return kind, raw[:8] + bytes(head) + data
    if kind in ("insert", "delete"):
        i = rng.randrange(n)
        head = head[:i] + bytes([rng.randrange(32, 127)]) + head[i:] if kind == "insert" else head[:i] + head[i + 1:]
        fix = rng.random() < 0.5  # with or without a consistent length field
        return kind, struct.pack("<Q", len(head) if fix else n) + bytes(head) + data
    meta = json.loads(bytes(head))
    names = sorted(k for k in meta if k != "__metadata__")
    name = rng.choice(names)
    if kind == "value":
        field = rng.choice(["dtype", "shape", "data_offsets", None, "__metadata__"])
        value = rng.choice(HOSTILE_VALUES)
        if field == "__metadata__":
            meta["__metadata__"] = value
        elif field is None:
            meta[name] = value
        else:
            meta[name][field] = value
    elif kind == "element":
        field = rng.choice(["shape", "data_offsets"])
        lst = meta[name][field]
        if lst:
            lst[rng.randrange(len(lst))] = rng.choice(HOSTILE_VALUES + [lst[0] + 1, lst[-1] - 1, 2 ** 31, 2 ** 63])
        else:
            lst.append(rng.choice(HOSTILE_VALUES))
    elif kind == "structure":
        op = rng.choice(["list", "drop", "extra", "rename", "metadata-only"])
        if op == "list":
            meta = list(meta.items())
        elif op == "drop":
            meta.pop(name)
        elif op == "extra":
            meta[f"{name}.extra"] = dict(meta[name])
        elif op == "rename":
            meta[name[:-1] + "X"] = meta.pop(name)
        else:
            meta["__metadata__"] = {"format": "pt", "note": rng.choice(["", "x" * 1000, "é"])}
    else:  # the length field
        n2 = rng.choice([0, 1, n - 1, n + 1, n + 8, len(raw), 2 ** 32, 2 ** 63 + 5])
        return kind, struct.pack("<Q", n2) + bytes(head) + data
    body = json.dumps(meta).encode()
    return kind, struct.pack("<Q", len(body)) + body + data


def test_header_fuzz_converts_the_same_package_or_gives_one_line(tiny, tmp_path):
    """240 seeded mutations of a real header: each converts to the very same package or raises
    EdgevlError with one line; nothing else (no traceback, no leftover folder)."""
    ck, ref = tiny
    want = package_digest(ref)
    src = (ck / "model.safetensors").read_bytes()
    work = tmp_path / "ck"
    work.mkdir()
    for f in ck.iterdir():
        if f.name != "model.safetensors":
            (work / f.name).symlink_to(f)
    rng = random.Random(2026)
    outcomes = {"same": 0, "error": 0}
    kinds = set()
    for i in range(240):
        kind, raw = mutate(src, rng)
        kinds.add(kind)
        (work / "model.safetensors").write_bytes(raw)
        out = tmp_path / f"out{i}"
        try:
            edgevl.convert(work, out, dtype="fp32", progress=False)
        except EdgevlError as e:
            assert "\n" not in str(e) and str(e), (i, kind, str(e))
            assert not out.exists(), (i, kind)
            outcomes["error"] += 1
            continue
        assert package_digest(out) == want, (i, kind)
        shutil.rmtree(out)
        outcomes["same"] += 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    print(f"\nheader fuzz: 240 mutations, {outcomes}")
    assert outcomes["error"] >= 150 and outcomes["same"] >= 5, outcomes  # both outcomes are exercised
    assert len(kinds) == 7


# -- item 4: config.json and the tokenizer, checked before anything is written ---------------

def _cfg(fn):
    return lambda ck: edit_json(ck / "config.json", fn)


def _put(**kv):
    return _cfg(lambda c: c.update(kv))


CONFIG_CASES = [  # (id, edit of the checkpoint folder, words of the error)
    ("config-is-a-list", _cfg(lambda c: [c]), "config.json must be a JSON object"),
    ("layers-4.5", _put(num_hidden_layers=4.5), "num_hidden_layers must be a positive integer, got 4.5"),
    ("vocab-string", _put(vocab_size="713"), "vocab_size must be a positive integer, got '713'"),
    ("zero-layers", _put(num_hidden_layers=0), "num_hidden_layers must be a positive integer, got 0"),
    ("negative-heads", _put(num_attention_heads=-2), "num_attention_heads must be a positive integer"),
    ("bool-hidden", _put(hidden_size=True), "hidden_size must be a positive integer, got True"),
    ("q-lora-string", _put(q_lora_rank="none"), "q_lora_rank must be a positive integer or null"),
    ("eps-negative", _put(rms_norm_eps=-1e-6), "rms_norm_eps must be a positive number"),
    ("eps-nan", lambda ck: (ck / "config.json").write_text(
        (ck / "config.json").read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN')),
     "rms_norm_eps must be a positive number, got nan"),
    ("tie-string", _put(tie_word_embeddings="yes"), "tie_word_embeddings must be true or false"),
    ("act-number", _put(hidden_act=7), "hidden_act must be a string"),
    ("rope-theta-string", _cfg(lambda c: c["rope_parameters"].update(rope_theta="abc")),
     "rope_theta must be a positive number"),
    ("rope-parameters-list", _put(rope_parameters=[1]), "rope_parameters must be an object"),
    ("eos-string", _put(eos_token_id="x"), "eos_token_id must be a token id"),
    ("eos-negative-in-list", _put(eos_token_id=[1, -1]), "eos_token_id must be a token id"),
    ("model-type-list", _put(model_type=["youtu"], architectures=5), "is not supported"),
    ("config-not-utf8", lambda ck: (ck / "config.json").write_bytes(b"\xff\xfe{}"), "is not valid JSON"),
    ("generation-config-eos", lambda ck: edit_json(ck / "generation_config.json",
                                                   lambda g: g.update(eos_token_id={"a": 1})),
     "generation_config.json field eos_token_id"),
    ("no-tokenizer", lambda ck: (ck / "tokenizer.json").unlink(), "has no tokenizer.json"),
    ("garbage-tokenizer", lambda ck: (ck / "tokenizer.json").write_text("{not json"), "could not be read"),
    ("tokenizer-config-garbage", lambda ck: (ck / "tokenizer_config.json").write_text("[1, 2"),
     "tokenizer_config.json is not valid JSON"),
    ("tokenizer-config-list", lambda ck: (ck / "tokenizer_config.json").write_text("[1, 2]"),
     "tokenizer_config.json must be a JSON object"),
    ("template-syntax", lambda ck: (ck / "chat_template.jinja").write_text("{% for m in messages %}{{ m"),
     "chat template"),
    ("index-escapes", lambda ck: (ck / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "../../etc/passwd"}})), "not a file name"),
    ("index-list", lambda ck: (ck / "model.safetensors.index.json").write_text("[1]"),
     "not a valid safetensors index"),
]


@pytest.mark.parametrize("case", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_or_tokenizer_fails_before_writing(tiny, tmp_path, capsys, case):
    ck = copy_ck(tiny[0], tmp_path / "ck")
    case[1](ck)
    one_line_error(*cli(capsys, "convert", ck, tmp_path / "out", "--quiet")[::2], case[2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # not even a work folder


@pytest.mark.parametrize("case", [
    ("vision-heads-0", lambda v: v.update(num_attention_heads=0), "vision_config field num_attention_heads"),
    ("vision-fullatt-strings", lambda v: v.update(fullatt_block_indexes=["1"]), "fullatt_block_indexes"),
    ("vision-config-list", None, "vision_config must be a JSON object"),
], ids=lambda c: c[0])
def test_bad_vision_config(tmp_path, capsys, case):
    from edgevl.demo import demo_checkpoint

    ck = tmp_path / "vl"
    ck.mkdir()
    for f in demo_checkpoint().iterdir():
        if f.name == "config.json":
            shutil.copy(f, ck / f.name)
        else:
            (ck / f.name).symlink_to(f)
    edit = case[1]
    edit_json(ck / "config.json", lambda c: edit(c["vision_config"]) if edit else c.update(vision_config=[1]))
    one_line_error(*cli(capsys, "convert", ck, tmp_path / "out", "--quiet")[::2], case[2])
    assert not (tmp_path / "out").exists()


def test_good_config_values_of_every_type_still_convert(tiny, tmp_path):
    """The checks accept what real configs hold: ints for floats, null optionals, big thetas."""
    ck = copy_ck(tiny[0], tmp_path / "ck")
    edit_json(ck / "config.json", lambda c: c["rope_parameters"].update(rope_theta=500000))
    assert isinstance(json.loads((ck / "config.json").read_text())["rope_parameters"]["rope_theta"], int)
    out = edgevl.convert(ck, tmp_path / "out", dtype="fp32", progress=False)
    assert package_digest(out)["decoder.bin"] == package_digest(tiny[1])["decoder.bin"]
    assert math.isclose(edgevl.load(out).manifest["graphs"]["decoder"]["extra"]["rope_theta"], 500000.0)


# -- a package that converts must take images (or know it has none) and hold finite weights ----

def demo_copy(folder) -> Path:
    """The demo checkpoint (a Youtu-VL) with its small files copied and its weights linked."""
    from edgevl.demo import demo_checkpoint

    folder.mkdir()
    for f in demo_checkpoint().iterdir():
        if f.name == "model.safetensors":
            (folder / f.name).symlink_to(f)
        else:
            shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    """A tiny Qwen3.5 VL checkpoint (vision tower, preprocessor_config.json)."""
    from edgevl.verification.families.qwen3_5 import VERIFY as ARCH

    return ARCH.make_tiny(tmp_path_factory.mktemp("hostile-qwen") / "ck", seed=1)


def refused_before_writing(capsys, ck, tmp_path, *needles):
    one_line_error(*cli(capsys, "convert", ck, tmp_path / "out", "--quiet")[::2], *needles)
    assert not (tmp_path / "out").exists() and left_over(tmp_path, "out") == []


def test_vl_checkpoint_without_a_fitting_preprocessor_config_is_refused(qwen_vl, tmp_path, capsys):
    """Converted anyway, the package failed to load with "sizes differ from the vision tower's"
    (the fallback processor settings are Qwen2-VL's patch 14, not the tower's 16)."""
    ck = copy_ck(qwen_vl, tmp_path / "ck")
    (ck / "preprocessor_config.json").unlink()
    refused_before_writing(capsys, ck, tmp_path, "has no preprocessor_config.json",
                           "copy it from the model's original files")
    shutil.copy(qwen_vl / "preprocessor_config.json", ck)
    edit_json(ck / "preprocessor_config.json", lambda p: p.update(patch_size=14))
    refused_before_writing(capsys, ck, tmp_path, "patch/merge/temporal sizes 14/2/2 differ from vision_config's 16/2/2")
    (ck / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16, "size": [1]}))
    refused_before_writing(capsys, ck, tmp_path, "preprocessor_config.json holds a value of the wrong type")


def test_youtu_vl_without_preprocessor_config_takes_images_with_its_processor_defaults(tmp_path):
    """Youtu-VL's processor settings come from the tower (patch, merge) and the HF processor's
    defaults (mean/std 0.5, 36864 patches), so its package works without the file."""
    from PIL import Image

    ck = demo_copy(tmp_path / "ck")
    (ck / "preprocessor_config.json").unlink()
    model = edgevl.load(edgevl.convert(ck, tmp_path / "pk", dtype="fp32", progress=False))
    assert model.vision.default_max_patches == 36864
    rows, info = model.vision(Image.new("RGB", (128, 128), "white"))
    assert info["spatial_shapes"] == (8, 8) and len(rows) == 16


@pytest.mark.parametrize("value", [713, 10 ** 6, 2 ** 40])
def test_image_token_id_outside_the_tokenizer_is_refused(tmp_path, capsys, value):
    """Was converted; every image prompt then had "0 image placeholders" at run time."""
    ck = demo_copy(tmp_path / "ck")
    edit_json(ck / "config.json", lambda c: c.update(image_token_id=value))
    refused_before_writing(capsys, ck, tmp_path, f"image_token_id {value} is not a token of tokenizer.json (713 tokens)")


def test_image_token_id_list_is_refused(tmp_path, capsys):
    ck = demo_copy(tmp_path / "ck")
    edit_json(ck / "config.json", lambda c: c.update(image_token_id=[4]))
    refused_before_writing(capsys, ck, tmp_path, "image_token_id must be one token id")


def test_vision_weights_without_vision_config_are_refused(qwen_vl, tmp_path, capsys):
    """Qwen3.5 became a text-only package without a word; Youtu-VL named only the config."""
    words = "the checkpoint has vision weights but config.json has no vision_config"
    ck = copy_ck(qwen_vl, tmp_path / "qwen")
    edit_json(ck / "config.json", lambda c: {k: v for k, v in c.items() if k != "vision_config"})
    refused_before_writing(capsys, ck, tmp_path, words)
    ck = demo_copy(tmp_path / "youtu")
    edit_json(ck / "config.json", lambda c: c.update(vision_config=None))
    refused_before_writing(capsys, ck, tmp_path, words)


def poison(ck, name_part: str, value: float, row: int = 1) -> str:
    """Put ``value`` into one element of the first tensor whose name contains ``name_part``."""
    from safetensors.torch import load_file, save_file

    path = ck / "model.safetensors"
    t = load_file(str(path))
    name = next(k for k in sorted(t) if name_part in k)
    t[name] = t[name].clone()
    t[name].view(t[name].shape[0], -1)[row, -1] = value
    path.unlink()  # it may be a link to the shipped weights
    save_file(t, str(path), metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("source", ["fp32", "bf16"])
def test_nan_or_inf_weights_are_refused_naming_the_tensor(tmp_path, capsys, value, source):
    """Were converted: the demo then answered '' (every logit NaN)."""
    if source == "fp32":
        ck = demo_copy(tmp_path / "ck")
    else:
        from helpers import make_youtu

        ck = make_youtu(tmp_path / "ck", seed=1, dtype="bf16", **TINY)
    name = poison(ck, "mlp.down_proj", value, row=3)
    refused_before_writing(capsys, ck, tmp_path, f"tensor {name} in model.safetensors holds NaN or infinite values "
                                                 "(row 3)", "re-download it")


def test_nan_in_a_fused_expert_is_refused_naming_the_expert(tmp_path, capsys):
    """Routed experts are read through their own slices of the fused [E, 2I, H] tensor."""
    from safetensors.torch import load_file, save_file

    from edgevl.verification.families.youtu_moe import VERIFY as ARCH

    ck = ARCH.make_tiny(tmp_path / "ck", seed=1)

    t = load_file(str(ck / "model.safetensors"))
    name = next(k for k in sorted(t) if k.endswith("experts.gate_up_proj"))
    t[name] = t[name].clone()
    t[name][5, 7, 0] = float("nan")
    save_file(t, str(ck / "model.safetensors"), metadata={"format": "pt"})
    refused_before_writing(capsys, ck, tmp_path, f"tensor {name} (expert 5) in model.safetensors holds NaN or "
                                                 "infinite values (row 7)")


def test_finite_weights_of_any_size_still_convert(tiny, tmp_path):
    """Huge finite values (the sum of squares overflows) are not mistaken for infinity."""
    ck = copy_ck(tiny[0], tmp_path / "ck")
    name = poison(ck, "mlp.down_proj", 3e38, row=0)
    out = edgevl.convert(ck, tmp_path / "out", dtype="fp32", progress=False)
    assert (out / "manifest.json").is_file(), name
