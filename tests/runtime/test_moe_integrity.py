"""A mixture-of-experts package whose ``experts.bin`` changes under a running model, and manifests
whose ``experts`` section lies (edgevl/blocks/moe.py: ExpertStore, edgevl/package.py:
check_experts). Experts are read from disk for the life of the process, long after loading
verified the files: every expert block read is checked against its checksum from conversion, a
file cut short or replaced is noticed before ncnn reads from it, and each fault is one line
(``PackageError``: the package's fault, not the request's) with ncnn printing nothing raw."""

import json
import os
import shutil

import numpy as np
import pytest

import edgevl
from edgevl.blocks import moe
from edgevl.errors import EdgevlError, PackageError
from edgevl.package import MANIFEST, check_experts
from edgevl.verification.families.qwen3_5_moe import VERIFY as ARCH
from support.cli import cli, one_line_error
from support.files import edit_json
from support.moe import random_experts, write_random_package

PROMPT = [10, 11, 12, 13, 14]
N_NEW = 6


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-integrity")
    ck = ARCH.make_tiny(root / "ck", seed=3)
    # fp32 experts: plain floats; q8: int8 weights behind ncnn's per-weight type tags
    return {dtype: edgevl.convert(ck, root / dtype, dtype=dtype, progress=False) for dtype in ("fp32", "q8")}


def copy_pkg(packages, tmp_path, dtype="fp32"):
    dst = tmp_path / f"pkg-{dtype}"
    shutil.copytree(packages[dtype], dst)
    return dst


def generate(model):
    return list(model.generate_tokens(PROMPT, N_NEW, ignore_eos=True, reuse_cache=False))


def first_expert_read(model, monkeypatch):
    """Generates once (no expert cache: every expert is read from disk each time it is chosen)
    and returns (tokens, the (layer, expert) read first, its byte offset in experts.bin)."""
    seen = []
    read = moe.ExpertStore._read

    def spy(store, layer, e):
        seen.append((layer, e))
        return read(store, layer, e)

    monkeypatch.setattr(moe.ExpertStore, "_read", spy)
    tokens = generate(model)
    monkeypatch.setattr(moe.ExpertStore, "_read", read)
    layer, e = seen[0]
    spec = model.manifest["experts"]
    entry = next(x for x in spec["layers"] if x["layer"] == layer)
    return tokens, (layer, e), entry["offset"] + e * spec["expert_bytes"]


def package_error(fn) -> str:
    """The message of the PackageError ``fn()`` raises. Only the message is kept: a traceback
    kept past the test holds the decoder's frames (runtime.Net.execute), whose Mats from the
    decoder net's pools may then be collected after those pools, with the model (ncnn: "pool
    allocator destroyed too early", a segfault)."""
    with pytest.raises(PackageError) as info:
        fn()
    msg = str(info.value)
    del info
    assert "\n" not in msg
    return msg


def no_raw_ncnn_output(capfd):
    err = capfd.readouterr().err
    assert "ModelBin" not in err and "load_model" not in err, err


def nan_fill(data: bytes) -> bytes:
    return np.full(len(data) // 4, np.nan, np.float32).tobytes() + data[len(data) // 4 * 4:]


def flip_bits(data: bytes) -> bytes:
    b = bytearray(data)
    for i in range(0, len(b), 97):
        b[i] ^= 0x10
    return bytes(b)


DAMAGE = {  # (what the bytes become, where in the expert block)
    "flipped-bits": (flip_bits, "weights"),
    "nan-weights": (nan_fill, "weights"),
    "nan-type-tags": (nan_fill, "start"),   # ncnn's per-weight tags: it then wants other byte counts
}


@pytest.mark.parametrize("dtype", ["fp32", "q8"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_expert_bytes_changed_after_load_are_one_line(packages, tmp_path, monkeypatch, capfd, dtype, damage):
    p = copy_pkg(packages, tmp_path, dtype)
    model = edgevl.load(p, expert_cache_mb=0)
    want, (layer, e), off = first_expert_read(model, monkeypatch)
    size = model.manifest["experts"]["expert_bytes"]
    fn, where = DAMAGE[damage]
    start = off if where == "start" else off + size // 4
    n = 64 if where == "start" else size // 2
    with open(p / "experts.bin", "r+b") as f:       # in place: same file, same size
        original = os.pread(f.fileno(), n, start)
        os.pwrite(f.fileno(), fn(original), start)
    capfd.readouterr()
    msg = package_error(lambda: generate(model))
    assert msg == (f"{p / 'experts.bin'}: expert {e} of layer {layer} does not match its checksum (the file "
                   "changed after conversion); convert the model again or restore the file")
    no_raw_ncnn_output(capfd)
    with open(p / "experts.bin", "r+b") as f:       # restored: the same answer again
        os.pwrite(f.fileno(), original, start)
    assert generate(model) == want


def test_a_damaged_expert_is_refused_before_the_cache_changes(tmp_path):
    """An expert whose bytes fail their check is refused before ncnn parses them and before
    anything is evicted for it: the cache keeps what it had, never holds the damaged expert, and
    answers right once the bytes are back."""
    E, H, I = 6, 64, 48
    spec = write_random_package(tmp_path, [0], E, H, I, "q8", 2)
    x = np.random.default_rng(2).standard_normal((2, H)).astype(np.float32)
    full = moe.ExpertStore(tmp_path, spec)
    want = [full.run(0, e, x) for e in range(E)]
    full.close()
    store = moe.ExpertStore(tmp_path, spec, cache_mb=1.5 * spec["expert_bytes"] / (1 << 20))  # one expert
    assert np.array_equal(store.run(0, 1, x), want[1]) and store.cached(0, 1)
    kept, resident = store._nets[0][1], store.resident
    off = spec["layers"][0]["offset"] + 4 * spec["expert_bytes"]
    with open(tmp_path / "experts.bin", "r+b") as f:
        original = os.pread(f.fileno(), 8, off)
        os.pwrite(f.fileno(), b"\xff" * 8, off)          # expert 4's first type tag
    for _ in range(2):                                  # still refused: nothing remembered the bad load
        assert "expert 4 of layer 0 does not match its checksum" in package_error(lambda: store.run(0, 4, x))
        assert not store.cached(0, 4) and store._nets[0][1] is kept and store.resident == resident
    assert np.array_equal(store.run(0, 1, x), want[1]) and store.stats()["evictions"] == 0
    with open(tmp_path / "experts.bin", "r+b") as f:
        os.pwrite(f.fileno(), original, off)
    assert np.array_equal(store.run(0, 4, x), want[4]) and np.array_equal(store.run(0, 1, x), want[1])
    store.close()


def test_without_checksums_an_expert_ncnn_cannot_load_is_dropped(tmp_path):
    """A package converted before the checksums: bytes whose type tags make ncnn's load fail
    are one line, and the evicted net they were loaded into is not cached under either expert."""
    E, H, I = 6, 64, 48
    spec = write_random_package(tmp_path, [0], E, H, I, "q8", 2)
    spec.pop("checksum")
    x = np.random.default_rng(2).standard_normal((2, H)).astype(np.float32)
    store = moe.ExpertStore(tmp_path, spec, cache_mb=1.5 * spec["expert_bytes"] / (1 << 20))
    store.run(0, 1, x)
    off = spec["layers"][0]["offset"] + 4 * spec["expert_bytes"]
    with open(tmp_path / "experts.bin", "r+b") as f:
        os.pwrite(f.fileno(), np.full(4, np.nan, np.float32).tobytes(), off)
    assert package_error(lambda: store.run(0, 4, x)) == (
        f"{tmp_path / 'experts.bin'}: expert 4 of layer 0 does not load as experts.param says (the file changed "
        "after conversion); convert the model again or restore the file")
    assert not store.cached(0, 4) and not store.cached(0, 1)
    store.close()


def test_a_package_without_expert_checksums_still_runs(packages, tmp_path):
    """Packages converted before the checksums have none: they load and run unchecked."""
    p = copy_pkg(packages, tmp_path)
    want = generate(edgevl.load(p, expert_cache_mb=0))

    def strip(m):
        m["experts"].pop("checksum")
        for entry in m["experts"]["layers"]:
            entry.pop("hashes")
    edit_json(p / MANIFEST, strip)
    assert generate(edgevl.load(p, expert_cache_mb=0)) == want


def test_experts_file_cut_short_while_running(packages, tmp_path, monkeypatch, capfd):
    p = copy_pkg(packages, tmp_path)
    model = edgevl.load(p, expert_cache_mb=0)
    want, _, off = first_expert_read(model, monkeypatch)
    f = p / "experts.bin"
    data = f.read_bytes()
    os.truncate(f, off + 10)                 # inside the first expert the prompt reads
    capfd.readouterr()
    assert package_error(lambda: generate(model)) == (
        f"{f} is {off + 10} bytes, not the {len(data)} it had when the model loaded (cut "
        "short or rewritten while the model runs); restore the file or convert the model "
        "again")
    no_raw_ncnn_output(capfd)
    f.write_bytes(data)                      # restored in place
    assert generate(model) == want


def replace(path, data: bytes) -> None:
    """An atomic replace: a new file renamed over the old one (the model's descriptor still
    reads the old one)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_experts_file_replaced_while_running(packages, tmp_path, monkeypatch, capfd):
    p = copy_pkg(packages, tmp_path)
    model = edgevl.load(p, expert_cache_mb=0)
    want, (layer, e), off = first_expert_read(model, monkeypatch)
    f = p / "experts.bin"
    data = f.read_bytes()
    # an identical file: read from now on (a later change to it is seen), same answers
    replace(f, data)
    assert generate(model) == want
    damaged = bytearray(data)
    damaged[off + 200: off + 208] = b"\xff" * 8
    with open(f, "r+b") as h:
        os.pwrite(h.fileno(), bytes(damaged[off + 200: off + 208]), off + 200)
    assert f"expert {e} of layer {layer} does not match its checksum" in package_error(lambda: generate(model))
    # a different file of the same size
    replace(f, bytes(damaged))
    capfd.readouterr()
    assert package_error(lambda: generate(model)) == (
        f"{f}: expert {e} of layer {layer} does not match its checksum (the file was "
        "replaced while the model runs); convert the model again or restore the file")
    no_raw_ncnn_output(capfd)
    # a file of another size
    replace(f, data + b"\0" * 16)
    assert package_error(lambda: generate(model)) == (
        f"{f} was replaced while the model runs by a file of {len(data) + 16} bytes, not "
        f"the package's {len(data)}; restore the package's file or convert the model again")
    replace(f, data)                         # the package's own file back
    assert generate(model) == want


# -- manifests whose experts section lies ----------------------------------------------------------


def _experts(**kv):
    return lambda m: m["experts"].update(kv)


def _routing(**kv):
    return lambda m: m["experts"]["routing"].update(kv)


def _layer(i, **kv):
    return lambda m: m["experts"]["layers"][i].update(kv)


def _overlap(m):
    x = m["experts"]
    x["layers"][1]["offset"] = x["layers"][0]["offset"] + x["expert_bytes"]


def _past_end(m):
    x = m["experts"]
    x["layers"][-1]["offset"] = m["files"]["experts.bin"]["bytes"] - x["expert_bytes"]


def _drop_hash(m):
    m["experts"]["layers"][2]["hashes"].pop()


def _drop_last_layer(m):
    m["experts"]["layers"].pop()


def _pop(*keys):
    def edit(m):
        d = m
        for k in keys[:-1]:
            d = d[k]
        d.pop(keys[-1])
    return edit


LIES = [  # (id, edit of the manifest, words of the one-line error)
    ("experts-a-list", lambda m: m.update(experts=[1]), "experts must be an object"),
    ("offset-string", _layer(0, offset="abc"), "experts.layers[0].offset must be an integer >= 0, got 'abc'"),
    ("offset-negative", _layer(1, offset=-8), "experts.layers[1].offset must be an integer >= 0, got -8"),
    ("offset-float", _layer(1, offset=8.0), "experts.layers[1].offset must be an integer >= 0, got 8.0"),
    ("offsets-overlap", _overlap, "overlap in experts.bin"),
    ("offset-past-the-end", _past_end, "lie past the end of experts.bin"),
    ("layer-twice", _layer(1, layer=0), "experts.layers[1].layer must be a layer number >= 0 that no other"),
    ("layer-missing", _drop_last_layer, "routes layer 3 to experts that experts.layers does not list"),
    ("layers-empty", _experts(layers=[]), "experts.layers must be a non-empty list"),
    ("layer-not-an-object", _experts(layers=[5]), "experts.layers[0] must be an object"),
    ("hidden-size-wrong", _experts(hidden_size=48), "experts.hidden_size must be the model's hidden size 64"),
    ("hidden-size-string", _experts(hidden_size="64"), "experts.hidden_size must be a positive integer, got '64'"),
    ("num-experts-zero", _experts(num_experts=0), "experts.num_experts must be a positive integer, got 0"),
    ("expert-bytes-negative", _experts(expert_bytes=-1), "experts.expert_bytes must be a positive integer"),
    ("expert-bytes-doubled", lambda m: m["experts"].update(expert_bytes=2 * m["experts"]["expert_bytes"]),
     "overlap in experts.bin"),
    ("dtype-unknown", _experts(dtype="int4"), "experts.dtype must be q8, bf16, fp16 or fp32, got 'int4'"),
    ("file-not-a-name", _experts(file=7), "experts.file must be a file name, got 7"),
    ("file-unlisted", _experts(file="other.bin"), "package file other.bin is not listed in manifest.json"),
    ("param-outside", _experts(param="../experts.param"), "points outside the package (experts graph"),
    ("routing-unknown", _routing(kind="hash"), "unknown expert routing 'hash'; upgrade edgevl"),
    ("routing-a-string", _experts(routing="softmax"), "experts.routing must be an object"),
    ("top-k-zero", _routing(top_k=0), "experts.routing.top_k must be an integer from 1 to num_experts (8), got 0"),
    ("top-k-negative", _routing(top_k=-2), "experts.routing.top_k must be an integer from 1 to num_experts"),
    ("top-k-above-experts", _routing(top_k=9), "experts.routing.top_k must be an integer from 1 to num_experts"),
    ("top-k-string", _routing(top_k="2"), "experts.routing.top_k must be an integer from 1 to num_experts"),
    ("top-k-bool", _routing(top_k=True), "experts.routing.top_k must be an integer from 1 to num_experts"),
    ("top-k-missing", _pop("experts", "routing", "top_k"), "experts.routing.top_k must be given for softmax"),
    ("renormalize-string", _routing(renormalize="yes"), "experts.routing.renormalize must be true or false"),
    ("sigmoid-without-scale", _routing(kind="sigmoid_biased"),
     "experts.routing.scale must be given for sigmoid_biased routing"),
    ("sigmoid-without-bias", _routing(kind="sigmoid_biased", scale=2.5),
     "experts.layers[0].bias must be an object with offset >= 0 and shape [modalities >= 1, 8]"),
    ("scale-nan", _routing(kind="sigmoid_biased", scale=float("nan")), "experts.routing.scale must be a finite"),
    ("modality-ids-string", _routing(modality_token_ids="4"), "experts.routing.modality_token_ids must be a list"),
    ("checksum-unknown", _experts(checksum="md5"), "unknown expert checksum 'md5'; upgrade edgevl"),
    ("hashes-short", _drop_hash, "experts.layers[2].hashes must be a list of 8 hex digests of 32 digits"),
    ("hashes-not-hex", _layer(0, hashes=["zz" * 16] * 8), "experts.layers[0].hashes must be a list of 8 hex"),
    ("hashes-without-checksum", _pop("experts", "checksum"), "experts.checksum must be named when the layers"),
]


@pytest.mark.parametrize("case", LIES, ids=[c[0] for c in LIES])
def test_lying_experts_section_gives_one_line(packages, tmp_path, capsys, case):
    p = copy_pkg(packages, tmp_path)
    edit_json(p / MANIFEST, case[1])
    one_line_error(*cli(capsys, "run", p, "--prompt", "hi", "--max-new-tokens", "1", "--raw")[::2], case[2])
    one_line_error(*cli(capsys, "check", p)[::2], case[2])     # edgevl check reads the same checks


def biased_section(tmp_path, E=4, H=16, I=8):
    """The manifest parts check_experts reads, of a package with biased (per-modality) routing."""
    w = moe.ExpertWriter(tmp_path, H, I, E, "fp32")
    for i, layer in enumerate((1, 2)):
        w.add_layer(layer, random_experts(E, H, I, seed=i), bias=np.zeros((2, E), np.float32))
    spec = w.finish({"kind": "sigmoid_biased", "top_k": 2, "scale": 2.5, "eps": 1e-20, "modality_token_ids": [7]})
    return {"experts": spec, "embedding": {"dim": H},
            "files": {"experts.bin": {"bytes": (tmp_path / "experts.bin").stat().st_size}}}


BIAS_LIES = [
    ("bias-one-row-for-two-modalities", lambda m: m["experts"]["layers"][0]["bias"].update(shape=[1, 4]),
     "experts.layers[0].bias must be an object with offset >= 0 and shape [modalities >= 2, 4]"),
    ("bias-wrong-width", lambda m: m["experts"]["layers"][1]["bias"].update(shape=[2, 5]),
     "experts.layers[1].bias must be an object"),
    ("bias-offset-string", lambda m: m["experts"]["layers"][1]["bias"].update(offset="0"),
     "experts.layers[1].bias must be an object"),
    ("bias-inside-experts", lambda m: m["experts"]["layers"][0]["bias"].update(offset=8),
     "and experts.layers[0].bias (bytes 8..40) overlap in experts.bin"),
    ("bias-past-the-end", lambda m: m["experts"]["layers"][1]["bias"].update(
        offset=m["files"]["experts.bin"]["bytes"] - 16), "experts.layers[1].bias (bytes"),
]


@pytest.mark.parametrize("case", BIAS_LIES, ids=[c[0] for c in BIAS_LIES])
def test_lying_expert_bias_gives_one_line(tmp_path, case):
    m = biased_section(tmp_path)
    check_experts(m, tmp_path)      # as written: consistent
    case[1](m)
    with pytest.raises(EdgevlError) as info:
        check_experts(json.loads(json.dumps(m)), tmp_path)
    assert case[2] in str(info.value) and "\n" not in str(info.value)
