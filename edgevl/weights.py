"""Stream tensors from a Hugging Face checkpoint folder without loading the model.

safetensors is an 8-byte header length, a JSON header (name -> dtype, shape, byte range) and
raw little-endian data. We parse it ourselves and read each tensor (or a block of its rows)
with plain file reads, so peak memory is one tensor or one row block, and pages of a
multi-GB file never pile up in the process (an mmap would count them in RSS).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from .errors import EdgevlError

# safetensors dtype -> (numpy storage dtype, bytes per element)
_STORAGE = {"F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2)}
_KNOWN_UNSUPPORTED = {"F64", "F8_E4M3", "F8_E5M2", "I8", "U8", "I16", "I32", "I64", "BOOL"}
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "I16": 2,
             "I32": 4, "I64": 8, "BOOL": 1}
MAX_HEADER = 100 << 20


def _show(name) -> str:
    """A header string fit for a one-line message (names come from an untrusted file)."""
    r = repr(name)[1:-1] if isinstance(name, str) else repr(name)
    return r if len(r) <= 80 else r[:80] + "..."


def sha256_file(path, on_bytes=None, block=8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(block)
            if not b:
                break
            h.update(b)
            if on_bytes is not None:
                on_bytes(len(b))
    return h.hexdigest()


def _to_f32(raw: np.ndarray, dtype: str, name: str | None = None, path: str | None = None,
            first_row: int = 0) -> np.ndarray:
    """Checkpoint values as float32; with ``name`` (a converter read) NaN or infinity is refused:
    ncnn would carry it silently into every answer."""
    out = (raw.astype(np.uint32) << np.uint32(16)).view(np.float32) if dtype == "BF16" else \
        raw.astype(np.float32, copy=False)
    if name is None:
        return out
    # a sum of squares is NaN or inf if any value is; one BLAS pass costs a third of
    # np.isfinite's (5 ms per 100 MB of bf16); the exact test runs only after an overflow
    flat = out.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        squares = np.dot(flat, flat)
    if not np.isfinite(squares) and not np.isfinite(out).all():
        bad = np.flatnonzero(~np.isfinite(out.reshape(len(out), -1)).all(1))
        where = f" in {os.path.basename(path)}" if path else ""
        raise EdgevlError(f"tensor {_show(name)}{where} holds NaN or infinite values (row {first_row + int(bad[0])}); "
                          "the checkpoint is damaged — re-download it, or fix the run that saved it")
    return out


class LazyTensor:
    """One tensor in a safetensors file; reads on demand."""

    def __init__(self, name: str, path: str, dtype: str, shape, start: int, end: int):
        self.name, self.path, self.dtype = name, path, dtype
        self.shape = tuple(int(s) for s in shape)
        self.start, self.end = start, end
        if dtype not in _STORAGE:
            raise EdgevlError(
                f"tensor {_show(name)} in {os.path.basename(path)} has dtype {_show(dtype)}; edgevl converts "
                "bf16, fp16 and fp32 checkpoints — convert the checkpoint to one of those first")
        itemsize = _STORAGE[dtype][1]
        # Python ints: a hostile shape such as 2**70 must not wrap around in int64
        if min(self.shape, default=1) < 0 or start < 0 or (end - start) != math.prod(self.shape) * itemsize:
            raise EdgevlError(f"tensor {_show(name)} in {os.path.basename(path)} has a byte range that does "
                              f"not match its shape {list(self.shape)}; the file is corrupt — re-download it")

    @property
    def row_elems(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    def read_raw_rows(self, r0: int, r1: int, width: int | None = None) -> np.ndarray:
        """Rows [r0, r1) in the checkpoint's own dtype (bf16 as uint16); with ``width``, rows of
        the tensor seen as a [-1, width] matrix (e.g. one expert's rows of a fused [E, R, K] one)."""
        np_dtype, itemsize = _STORAGE[self.dtype]
        per_row = (self.row_elems if width is None else int(width)) * itemsize
        with open(self.path, "rb") as f:
            f.seek(self.start + r0 * per_row)
            buf = f.read((r1 - r0) * per_row)
        if len(buf) != (r1 - r0) * per_row:
            raise EdgevlError(f"{os.path.basename(self.path)} ends inside tensor {self.name}; "
                              "the file is truncated — re-download it")
        shape = (r1 - r0,) + (self.shape[1:] if width is None else (int(width),))
        return np.frombuffer(buf, dtype=np.dtype(np_dtype).newbyteorder("<")).reshape(shape)

    def read_rows(self, r0: int, r1: int, width: int | None = None, what: str | None = None,
                  shown_row: int | None = None) -> np.ndarray:
        """Rows [r0, r1) as float32 (``width``: as ``read_raw_rows``); NaN or infinity is a
        one-line error naming the tensor (``what``: the part of it that was read, whose first
        row is ``shown_row``)."""
        return _to_f32(self.read_raw_rows(r0, r1, width), self.dtype, what or self.name, self.path,
                       r0 if shown_row is None else shown_row)

    def numpy(self) -> np.ndarray:
        n = self.shape[0] if self.shape else 1
        return self.read_rows(0, n).reshape(self.shape)

    def row_slice(self, r0: int, r1: int) -> RowSlice:
        return RowSlice(self, r0, r1)

    def __repr__(self):
        return f"LazyTensor({self.name}, {self.dtype}, {list(self.shape)})"


class RowSlice:
    """Rows [r0, r1) of a lazy tensor, itself lazy (for sharding huge matrices)."""

    def __init__(self, t: LazyTensor, r0: int, r1: int):
        self.t, self.r0, self.r1 = t, r0, r1
        self.shape = (r1 - r0,) + t.shape[1:]
        self.name = f"{t.name}[{r0}:{r1}]"

    def read_rows(self, a: int, b: int) -> np.ndarray:
        return self.t.read_rows(self.r0 + a, self.r0 + b)


def _same_bytes(t: LazyTensor, path: str, dtype: str, shape, start: int, end: int, block: int = 64 << 20) -> bool:
    """Whether the tensor stored at ``path[start:end]`` is ``t`` (its dtype, shape and bytes;
    read in blocks, so a duplicated embedding costs no more memory than a block)."""
    if dtype != t.dtype or list(shape) != list(t.shape) or end - start != t.end - t.start:
        return False
    with open(t.path, "rb") as a, open(path, "rb") as b:
        a.seek(t.start)
        b.seek(start)
        left = end - start
        while left > 0:
            n = min(block, left)
            if a.read(n) != b.read(n):
                return False
            left -= n
    return True


def _read_header(path: str) -> dict:
    """name -> (dtype, shape, start, end) with absolute file offsets; nothing in the header is
    trusted: every entry must be well typed, lie inside the data section and match its shape,
    and the tensors must tile the data section as the safetensors format requires."""
    fname = os.path.basename(path)

    def bad(why):
        return EdgevlError(f"{path} is not a valid safetensors file ({why}); re-download it")

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise bad("shorter than 8 bytes")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or n > size - 8:
                raise bad(f"header length {n} exceeds {'the file' if n <= MAX_HEADER else 'the 100 MB limit'}")
            meta = json.loads(f.read(n))
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, nesting
        raise bad(_show(str(e))) from None
    if not isinstance(meta, dict):
        raise bad(f"the header is a JSON {type(meta).__name__}, not an object")
    base, data_len = 8 + n, size - 8 - n
    out, spans = {}, []
    for k, v in meta.items():
        if k == "__metadata__":
            continue
        where = f"tensor {_show(k)} in {fname}"
        if not isinstance(v, dict):
            raise EdgevlError(f"{where}: its header entry is a {type(v).__name__}, not an object; the file is "
                              "corrupt — re-download it")
        dtype, shape, offs = v.get("dtype"), v.get("shape"), v.get("data_offsets")
        if not isinstance(dtype, str):
            raise EdgevlError(f"{where}: dtype must be a string, got {_show(dtype)}; the file is corrupt — "
                              "re-download it")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise EdgevlError(f"{where}: shape must be a list of integers >= 0, got {_show(shape)}; the file is "
                              "corrupt — re-download it")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_count(o) for o in offs)):
            raise EdgevlError(f"{where}: data_offsets must be two integers >= 0, got {_show(offs)}; the file is "
                              "corrupt — re-download it")
        start, end = offs
        if not start <= end <= data_len:
            raise EdgevlError(f"{where}: data_offsets [{start}, {end}] lie outside the data section (0..{data_len}"
                              " bytes); the file is corrupt or truncated — re-download it")
        itemsize = _ITEMSIZE.get(dtype)
        if itemsize is not None and end - start != math.prod(shape) * itemsize:
            raise EdgevlError(f"{where}: data_offsets [{start}, {end}] hold {end - start} bytes but shape "
                              f"{_show(shape)} of {dtype} needs {math.prod(shape) * itemsize}; the file is corrupt "
                              "— re-download it")
        spans.append((start, end, k))
        out[k] = (dtype, shape, base + start, base + end)
    pos = 0
    for start, end, k in sorted(spans):
        if start != pos:
            raise EdgevlError(f"tensor {_show(k)} in {fname} starts at byte {start} of the data section, but the "
                              f"previous tensor ends at {pos} (tensors must not overlap or leave gaps); the file "
                              "is corrupt — re-download it")
        pos = end
    if pos != data_len:
        raise bad(f"{data_len - pos} bytes after the last tensor")
    return out


# the checkpoint's files beside its config and weights that edgevl reads when present (a package
# keeps them for its runtime: tokenizer, templates, generation and processor settings)
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.json",
              "chat_template.jinja", "generation_config.json", "preprocessor_config.json",
              "video_preprocessor_config.json")


def _check_link(f: Path) -> None:
    if f.is_symlink() and not f.exists():
        raise EdgevlError(f"{f} is a link to {os.readlink(f)}, which is gone (a download not finished, or a deleted "
                          "cache entry?); download the checkpoint again")


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class Checkpoint:
    """A Hugging Face model folder: config.json plus safetensors (single or sharded)."""

    def __init__(self, folder):
        self.folder = Path(folder)
        if not self.folder.exists():
            raise EdgevlError(f"{self.folder} does not exist; pass a Hugging Face checkpoint folder")
        if not self.folder.is_dir():
            raise EdgevlError(f"{self.folder} is not a folder; pass a Hugging Face checkpoint folder "
                              "(with config.json and *.safetensors)")
        # a Hugging Face cache snapshot links its files to blobs: a file not downloaded (yet) is a
        # dangling link, which would otherwise read as a file the checkpoint does not have
        for name in ("config.json", "model.safetensors.index.json", "processor_config.json", *SIDE_FILES):
            _check_link(self.folder / name)
        cfg = self.folder / "config.json"
        if not cfg.is_file():
            snapshots = self.folder / "snapshots" if (self.folder / "snapshots").is_dir() else (
                self.folder if self.folder.name == "snapshots" else None)
            found = sorted((p for p in snapshots.iterdir() if (p / "config.json").is_file()),
                           key=lambda p: p.stat().st_mtime) if snapshots is not None else []
            try:   # the revision the cache's main branch points at, where it says
                main = snapshots.parent / "snapshots" / (snapshots.parent / "refs" / "main").read_text().strip()
                found += [main] if (main / "config.json").is_file() else []
            except (OSError, AttributeError, ValueError):
                pass
            if found:   # huggingface_hub's cache: models--org--name/snapshots/<revision>/
                raise EdgevlError(f"{self.folder} is a Hugging Face cache folder; pass one of its snapshots, "
                                  f"such as {found[-1]}")
            raise EdgevlError(f"{self.folder} has no config.json; pass the folder of a Hugging Face "
                              "checkpoint (config.json + *.safetensors)")
        try:
            self.config = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise EdgevlError(f"{cfg} is not valid JSON ({e.msg} at line {e.lineno}); fix or re-download it") from None
        except (ValueError, RecursionError) as e:  # not UTF-8, absurd nesting
            raise EdgevlError(f"{cfg} is not valid JSON ({_show(str(e))}); fix or re-download it") from None
        if not isinstance(self.config, dict):
            raise EdgevlError(f"{cfg} must be a JSON object (the model's settings), got a "
                              f"{type(self.config).__name__}; fix or re-download it")
        self.weight_map: dict = {}   # the index's tensor -> shard file, when sharded
        self.files = self._shard_files()
        self._tensors: dict[str, LazyTensor] = {}
        strays = []
        for path in self.files:
            for name, (dt, shape, s, e) in _read_header(str(path)).items():
                if self.weight_map.get(name, path.name) != path.name:
                    strays.append((name, path, dt, shape, s, e))   # a copy in a shard the index does not name
                    continue
                if name in self._tensors and not self.weight_map:
                    # files with no index to say which copy holds: never the last one by name
                    raise EdgevlError(f"tensor {_show(name)} is in both {Path(self._tensors[name].path).name} and "
                                      f"{path.name} in {self.folder}, and no model.safetensors.index.json says "
                                      "which; remove the stray copy")
                if dt in _KNOWN_UNSUPPORTED or dt not in _STORAGE:
                    # defer the error until the tensor is actually needed
                    self._tensors[name] = _Unsupported(name, str(path), dt, shape)
                else:
                    self._tensors[name] = LazyTensor(name, str(path), dt, shape, s, e)
        for name, path, dt, shape, s, e in strays:
            named = self._tensors.get(name)
            if isinstance(named, LazyTensor) and not _same_bytes(named, str(path), dt, shape, s, e):
                # transformers loads every shard whole, so which copy it ends with is not the index's say
                raise EdgevlError(f"tensor {_show(name)} is in {Path(named.path).name}, where "
                                  f"model.safetensors.index.json puts it, and with other values in {path.name} "
                                  f"in {self.folder}; remove the stray copy or re-download the checkpoint")

    def _shard_files(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        # transformers loads model.safetensors when there is one, index or not: the same weights
        # as the reference (a folder may keep a consolidated copy beside its shards)
        if single.is_file():
            return [single]
        if index.is_file():
            try:
                wm = json.loads(index.read_text())["weight_map"]
                names = sorted(set(wm.values()))
            except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
                raise EdgevlError(f"{index} is not a valid safetensors index; re-download it") from None
            bad = [n for n in names if not isinstance(n, str) or not n or os.path.basename(n) != n or n in (".", "..")]
            if bad:
                raise EdgevlError(f"{index} names shard {_show(bad[0])}, which is not a file name in {self.folder}; "
                                  "re-download the index")
            missing = [n for n in names if not (self.folder / n).is_file()]
            if missing:
                raise EdgevlError(f"checkpoint shard {missing[0]} listed in model.safetensors.index.json "
                                  f"is missing from {self.folder}; download all {len(names)} shards")
            self.weight_map = wm
            return [self.folder / n for n in names]
        found = sorted(self.folder.glob("*.safetensors"))
        for f in found:
            _check_link(f)
        if found:
            return found
        blobs = self.folder.parent.parent / "blobs"
        if self.folder.parent.name == "snapshots" and blobs.is_dir():
            unfinished = sorted(blobs.glob("*.incomplete"))
            if unfinished:
                raise EdgevlError(f"{self.folder} has no *.safetensors weights yet: the Hugging Face cache holds an "
                                  f"unfinished download ({unfinished[0].name}); let the download finish, then "
                                  "convert")
        if (self.folder / "manifest.json").is_file():   # what convert writes beside the graphs
            raise EdgevlError(f"{self.folder} is an edgevl package already (converted); run it as it is, or "
                              "convert the checkpoint it came from")
        raise EdgevlError(f"{self.folder} has no *.safetensors weights; edgevl converts safetensors "
                          "checkpoints (save the model with save_pretrained(safe_serialization=True))")

    def __contains__(self, name: str) -> bool:
        # a tensor the index names is there as far as the model is concerned: get() says where it is not
        return name in self._tensors or name in self.weight_map

    def keys(self):
        return list(dict.fromkeys([*self._tensors, *self.weight_map]))   # in the files' order

    def get(self, name: str, shape=None) -> LazyTensor:
        t = self._tensors.get(name)
        if t is None and name in self.weight_map:
            raise EdgevlError(f"model.safetensors.index.json puts tensor {name} in {_show(self.weight_map[name])}, "
                              f"which does not hold it; re-download the checkpoint (its index and shards)")
        if t is None:
            raise EdgevlError(f"tensor {name} is missing from the checkpoint in {self.folder}; "
                              "the weights do not match config.json (or a shard is incomplete)")
        if isinstance(t, _Unsupported):
            t.fail()
        if shape is not None and tuple(t.shape) != tuple(int(s) for s in shape):
            raise EdgevlError(f"tensor {name} has shape {list(t.shape)} but config.json implies "
                              f"{[int(s) for s in shape]}; the checkpoint does not match its config")
        return t

    def numpy(self, name: str, shape=None) -> np.ndarray:
        return self.get(name, shape).numpy()

    def file_hashes(self) -> dict[str, str]:
        return {p.name: sha256_file(p) for p in self.files}


class _Unsupported:
    def __init__(self, name, path, dtype, shape):
        self.name, self.path, self.dtype, self.shape = name, path, dtype, tuple(shape)

    def fail(self):
        raise EdgevlError(f"tensor {_show(self.name)} in {os.path.basename(self.path)} has dtype {_show(self.dtype)}; "
                          "edgevl converts bf16, fp16 and fp32 checkpoints — convert it to one of those first")
