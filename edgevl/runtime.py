"""Driving converted ncnn graphs from Python: nets, the KV cache, embeddings, the lm_head.

The ncnn facts this relies on are in ../shared/specs/ncnn_notes.md ("KV cache handles from
Python"): caches are extracted with type=1 into a Mat we own and fed back unchanged; numpy
inputs are cloned into ncnn before ``ex.input``; SDPA appends into the old cache in place, so a
cache is linear (branching from a prefix means re-prefilling).
"""

from __future__ import annotations

import os

import ncnn
import numpy as np

from .errors import EdgevlError
from .ncnn_graph import bf16_bits_to_f32


def default_threads() -> int:
    """EDGEVL_THREADS, else the physical core count (more threads than free cores stalls ncnn)."""
    env = os.environ.get("EDGEVL_THREADS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise EdgevlError(f"EDGEVL_THREADS must be an integer, got {env!r}") from None
    try:
        n = int(ncnn.get_physical_cpu_count())
    except Exception:  # pragma: no cover - very old wheels
        n = 0
    return max(1, n or (os.cpu_count() or 1))


def to_mat(a: np.ndarray) -> "ncnn.Mat":
    # ncnn.Mat(numpy) borrows the buffer without a reference: clone so ncnn owns its copy.
    return ncnn.Mat(np.ascontiguousarray(a, dtype=np.float32)).clone()


def from_mat(m: "ncnn.Mat") -> np.ndarray:
    return np.array(m, dtype=np.float32, copy=True)


class Net:
    """One ncnn network with the package's precision options."""

    def __init__(self, param: str, binfile: str, threads: int, dtype: str = "fp32", light_mode: bool = True):
        self.net = ncnn.Net()
        opt = self.net.opt
        opt.num_threads = int(threads)  # before load: Gemm keeps the load-time value
        opt.use_fp16_storage = False
        opt.use_fp16_packed = False
        opt.use_fp16_arithmetic = False
        # bf16 storage halves weight memory and bandwidth; fp32 packages stay exact. fp16
        # packages keep fp16 accuracy: on x86 ncnn widens them to fp32 in memory.
        opt.use_bf16_storage = dtype == "bf16"
        opt.use_bf16_packed = dtype == "bf16"
        self.light_mode = light_mode
        if self.net.load_param(param) != 0:
            raise EdgevlError(f"ncnn could not parse {param}; the package is corrupt — convert the model again")
        if self.net.load_model(binfile) != 0:
            raise EdgevlError(f"ncnn could not load {binfile}; the package is corrupt — convert the model again")

    def extractor(self) -> "ncnn.Extractor":
        ex = self.net.create_extractor()
        # Late extraction of intermediate blobs needs light mode off (ncnn_notes.md).
        ex.set_light_mode(self.light_mode)
        return ex

    def run(self, inputs: dict, outputs: list[str]) -> list[np.ndarray]:
        ex = self.extractor()
        for k, v in inputs.items():
            ex.input(k, v if isinstance(v, ncnn.Mat) else to_mat(v))
        res = []
        for name in outputs:
            m = ncnn.Mat()
            if ex.extract(name, m) != 0:
                raise RuntimeError(f"ncnn failed to compute blob {name}")
            res.append(from_mat(m))
        return res


class KVCache:
    """Per-layer (k, v) ncnn Mats plus the token count they hold."""

    def __init__(self, n_layers: int):
        self.mats: list[tuple] | None = None
        self.length = 0
        self.n_layers = n_layers

    def bytes(self) -> int:
        if not self.mats:
            return 0
        return int(sum(m.w * m.h * m.c * m.elemsize // max(1, m.elempack) for kv in self.mats for m in kv))

    def truncate(self, n: int) -> None:
        """Drop tokens after the first ``n`` (lowering .h; checked by tests/test_kv_cache.py)."""
        if n >= self.length:
            return
        if n == 0 or self.mats is None:
            self.mats, self.length = None, 0
            return
        for k, v in self.mats:
            k.h = n
            v.h = n
        self.length = n


class Embedding:
    """Row lookup in an on-disk [rows, dim] table via mmap: only touched rows enter memory.

    The table may be stored in row segments (the shards of a tied lm_head), each contiguous.
    """

    def __init__(self, path: str, segments: list, rows: int, dim: int, dtype: str):
        np_dtype = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16}[dtype]
        self.dtype, self.rows, self.dim = dtype, rows, dim
        self.starts = np.array([s["rows"][0] for s in segments], np.int64)
        self.tables = [np.memmap(path, dtype=np_dtype, mode="r", offset=s["offset"],
                                 shape=(s["rows"][1] - s["rows"][0], dim)) for s in segments]

    def __call__(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.rows):
            bad = int(ids[(ids < 0) | (ids >= self.rows)][0])
            raise EdgevlError(f"token id {bad} is outside the vocabulary (0..{self.rows - 1}); "
                              "the tokenizer does not match the model")
        seg = np.searchsorted(self.starts, ids, side="right") - 1
        raw = np.empty((ids.size, self.dim), self.tables[0].dtype)
        for k in np.unique(seg):
            sel = seg == k
            raw[sel] = self.tables[k][ids[sel] - self.starts[k]]
        if self.dtype == "bf16":
            return bf16_bits_to_f32(raw)
        return raw.astype(np.float32)


def causal_mask(past: int, seq: int) -> np.ndarray:
    """(h=seq, w=past+seq) additive mask: query i sees keys 0..past+i."""
    m = np.zeros((seq, past + seq), np.float32)
    if seq > 1:
        m[:, past:] = np.triu(np.full((seq, seq), -np.inf, np.float32), 1)
    return m


class Decoder:
    """A decoder graph with an SDPA KV cache (prefill and decode share it)."""

    def __init__(self, net: Net, info: dict, cos_sin):
        self.net, self.info = net, info
        self.cos_sin = cos_sin  # callable(positions) -> (cos, sin)
        self.n_layers = len(info["cache"])

    def new_cache(self) -> KVCache:
        return KVCache(self.n_layers)

    def forward(self, embeds: np.ndarray, cache: KVCache, extract: list[str] = ()) -> tuple[np.ndarray, dict]:
        """Run ``embeds`` [S, H] on top of ``cache`` (updated in place); returns hidden [S, H]."""
        seq, past = embeds.shape[0], cache.length
        cos, sin = self.cos_sin(np.arange(past, past + seq))
        names = self.info["inputs"]
        ex = self.net.extractor()
        ex.input(names["embeds"], to_mat(embeds))
        ex.input(names["mask"], to_mat(causal_mask(past, seq)))
        ex.input(names["cos"], to_mat(cos))
        ex.input(names["sin"], to_mat(sin))
        if cache.mats is not None:
            for (k_in, v_in, _, _), (k, v) in zip(self.info["cache"], cache.mats):
                ex.input(k_in, k)
                ex.input(v_in, v)
        extra = {}
        for name in extract:  # intermediate blobs first: they must be extracted before consumers free them
            m = ncnn.Mat()
            if ex.extract(name, m) != 0:
                raise RuntimeError(f"ncnn failed to compute blob {name}")
            extra[name] = from_mat(m)
        out = ncnn.Mat()
        if ex.extract(self.info["outputs"]["hidden"], out) != 0:
            raise RuntimeError("ncnn failed to run the decoder")
        mats = []
        for _, _, k_out, v_out in self.info["cache"]:
            k, v = ncnn.Mat(), ncnn.Mat()
            ex.extract(k_out, k, 1)  # type 1: the packed cache layout, fed back unchanged
            ex.extract(v_out, v, 1)
            mats.append((k, v))
        cache.mats = mats
        cache.length = past + seq
        return from_mat(out), extra


class LMHead:
    def __init__(self, net: Net, info: dict):
        self.net, self.info = net, info

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        (logits,) = self.net.run({self.info["inputs"]["hidden"]: np.atleast_2d(hidden)},
                                 [self.info["outputs"]["logits"]])
        return logits
