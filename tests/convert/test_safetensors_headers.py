"""Safetensors headers are never trusted: a bad header or file framing gives one line naming the
file (and the tensor), and a seeded fuzz of a real header converts to the very same package or
fails in one line."""

import json
import random
import shutil
import struct
from pathlib import Path

import pytest

import edgevl
from edgevl.errors import EdgevlError
from support.cli import cli, one_line_error
from support.convert import copy_ck, left_over
from support.files import package_digest


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
