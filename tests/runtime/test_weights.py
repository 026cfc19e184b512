"""Streaming safetensors reader: dtypes, shards, row blocks, and clear errors."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from edgevl.errors import EdgevlError
from edgevl.weights import Checkpoint


def write(folder, tensors, shards=1):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "youtu"}))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return
    wm = {}
    for s in range(shards):
        part = {n: tensors[n] for n in names[s::shards]}
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(folder / fname))
        wm.update(dict.fromkeys(part, fname))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shards", [1, 3])
def test_reads_exact_values(tmp_path, dtype, shards):
    g = torch.Generator().manual_seed(0)
    ts = {f"t{i}": torch.randn(5 + i, 3, generator=g).to(dtype) for i in range(4)}
    ts["vec"] = torch.randn(7, generator=g).to(dtype)
    write(tmp_path / "m", ts, shards)
    ck = Checkpoint(tmp_path / "m")
    assert set(ck.keys()) == set(ts)
    for n, t in ts.items():
        got = ck.numpy(n)
        np.testing.assert_array_equal(got, t.float().numpy())
        assert got.dtype == np.float32
    t = ck.get("t3")
    np.testing.assert_array_equal(t.read_rows(2, 6), ts["t3"][2:6].float().numpy())


def test_missing_shard(tmp_path):
    write(tmp_path / "m", {"a": torch.zeros(2), "b": torch.zeros(3)}, shards=2)
    (tmp_path / "m" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(EdgevlError, match="model-00002-of-00002.safetensors .* is missing"):
        Checkpoint(tmp_path / "m")


def test_the_index_decides_which_shard_a_tensor_is_read_from(tmp_path):
    """A copy of a tensor in another shard than the index names is read from the index's shard
    when the two are the same bytes, and refused when they differ (transformers loads every shard
    whole, so its reference may hold the other copy); a tensor the index puts in a shard that does
    not hold it is named with that shard."""
    ts = {"a": torch.ones(2), "b": torch.full((3,), 2.0)}
    write(tmp_path / "m", ts, shards=2)
    same = {"b": ts["b"], "a": torch.ones(2)}   # shard 2 holds b and an equal copy of a
    save_file(same, str(tmp_path / "m" / "model-00002-of-00002.safetensors"))
    ck = Checkpoint(tmp_path / "m")
    np.testing.assert_array_equal(ck.numpy("a"), np.ones(2, np.float32))
    for stale in (torch.zeros(2), torch.ones(3), torch.ones(2, dtype=torch.float16)):   # values, shape, dtype
        save_file({"b": ts["b"], "a": stale}, str(tmp_path / "m" / "model-00002-of-00002.safetensors"))
        with pytest.raises(EdgevlError, match="tensor a is in model-00001-of-00002.safetensors, where "
                                              "model.safetensors.index.json puts it, and with other values in "
                                              "model-00002-of-00002.safetensors .*; remove the stray copy"):
            Checkpoint(tmp_path / "m")
    save_file({"b": ts["b"]}, str(tmp_path / "m" / "model-00002-of-00002.safetensors"))
    index = tmp_path / "m" / "model.safetensors.index.json"
    moved = json.loads(index.read_text())
    moved["weight_map"]["a"] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps(moved))
    save_file({"b": ts["b"]}, str(tmp_path / "m" / "model-00002-of-00002.safetensors"))
    ck = Checkpoint(tmp_path / "m")
    assert "a" in ck and "a" in ck.keys()   # there as far as a converter asks (an optional head, a block) ...
    with pytest.raises(EdgevlError, match="index.json puts tensor a in model-00002-of-00002.safetensors, which does "
                                          "not hold it; re-download"):
        ck.get("a")                          # ... so reading it says where the index is wrong


def test_which_files_hold_the_weights_when_a_folder_has_more_than_one_set(tmp_path):
    """model.safetensors beside an index and its shards is what transformers loads (the reference
    verify compares with), so it is what converts; files with no index that hold the same tensor
    are refused, never read last-file-wins."""
    ts = {"a": torch.ones(2), "b": torch.full((3,), 2.0)}
    write(tmp_path / "m", ts, shards=2)
    save_file({"a": torch.full((2,), 7.0), "b": torch.zeros(3)}, str(tmp_path / "m" / "model.safetensors"))
    ck = Checkpoint(tmp_path / "m")
    assert [f.name for f in ck.files] == ["model.safetensors"]
    np.testing.assert_array_equal(ck.numpy("a"), np.full(2, 7.0, np.float32))
    (tmp_path / "n").mkdir()
    (tmp_path / "n" / "config.json").write_text(json.dumps({"model_type": "youtu"}))
    save_file(ts, str(tmp_path / "n" / "model-00001-of-00001.safetensors"))
    save_file({"c": torch.ones(1)}, str(tmp_path / "n" / "extra.safetensors"))
    assert set(Checkpoint(tmp_path / "n").keys()) == {"a", "b", "c"}     # other tensors: read beside
    save_file({"b": torch.zeros(3)}, str(tmp_path / "n" / "zz-old-copy.safetensors"))
    with pytest.raises(EdgevlError, match="tensor b is in both model-00001-of-00001.safetensors and "
                                          "zz-old-copy.safetensors .* remove the stray copy"):
        Checkpoint(tmp_path / "n")
    # with an index, a tensor it does not list may sit in two of its shards (read as before)
    write(tmp_path / "i", ts, shards=2)
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        part = load_file(str(tmp_path / "i" / name))
        save_file({**part, "unlisted": torch.ones(1)}, str(tmp_path / "i" / name))
    assert "unlisted" in Checkpoint(tmp_path / "i").keys()


def test_wrong_shape_and_missing_tensor(tmp_path):
    write(tmp_path / "m", {"a": torch.zeros(2, 3)})
    ck = Checkpoint(tmp_path / "m")
    with pytest.raises(EdgevlError, match=r"tensor a has shape \[2, 3\] but config.json implies \[3, 2\]"):
        ck.get("a", (3, 2))
    with pytest.raises(EdgevlError, match="tensor b is missing"):
        ck.get("b")


def test_unsupported_dtype_is_reported_when_used(tmp_path):
    write(tmp_path / "m", {"a": torch.zeros(2, dtype=torch.int64), "b": torch.zeros(2)})
    ck = Checkpoint(tmp_path / "m")
    ck.numpy("b")
    with pytest.raises(EdgevlError, match="dtype I64"):
        ck.get("a")


@pytest.mark.parametrize("setup,msg", [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_text("x"), "is not a folder"),
    (lambda p: p.mkdir(), "has no config.json"),
])
def test_bad_folders(tmp_path, setup, msg):
    p = tmp_path / "x"
    setup(p)
    with pytest.raises(EdgevlError, match=msg):
        Checkpoint(p)


def test_corrupt_header_and_truncated_data(tmp_path):
    write(tmp_path / "m", {"a": torch.zeros(100, 10)})
    f = tmp_path / "m" / "model.safetensors"
    data = f.read_bytes()
    ck = Checkpoint(tmp_path / "m")
    f.write_bytes(data[:-200])  # truncated after opening: found when read
    with pytest.raises(EdgevlError, match="truncated"):
        ck.numpy("a")
    with pytest.raises(EdgevlError, match="lie outside the data section.*truncated"):  # and when opened
        Checkpoint(tmp_path / "m")
    f.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(EdgevlError, match="not a valid safetensors file"):
        Checkpoint(tmp_path / "m")
