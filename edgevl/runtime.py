"""Driving converted ncnn graphs from Python: nets, the KV cache, embeddings, the lm_head.

The ncnn facts this relies on are in ../shared/specs/ncnn_notes.md ("KV cache handles from
Python"): caches are extracted with type=1 into a Mat we own and fed back unchanged; numpy
inputs are cloned into ncnn before ``ex.input``; SDPA appends into the old cache in place, so a
cache is linear (branching from a prefix means re-prefilling).
"""

from __future__ import annotations

import os
import platform

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
    """A Mat that owns a float32 copy of ``a`` (any dtype, layout or view).

    ncnn.Mat(numpy) borrows the buffer without keeping a reference, so the contiguous array must
    stay alive until ``clone()`` has copied it: when ``ascontiguousarray`` has to copy (a view,
    a transpose, fp64), a temporary freed before the clone would be read after free."""
    buf = np.ascontiguousarray(a, dtype=np.float32)
    mat = ncnn.Mat(buf).clone()
    del buf  # only now may the buffer go
    return mat


def from_mat(m: "ncnn.Mat") -> np.ndarray:
    return np.array(m, dtype=np.float32, copy=True)


def _options(opt, threads: int, dtype: str) -> None:
    opt.num_threads = int(threads)  # before load: Gemm keeps the load-time value
    # fp16 packages on 64-bit ARM keep weights and activations in fp16 (half the memory and
    # bandwidth; the conversion is base ARMv8), and compute in fp16 where the CPU can (ARMv8.2
    # asimdhp: Cortex-A55/A76, RK3568/RK3588, Pi 5) — accuracy measured in README "ARM boards".
    # On x86 ncnn widens them to fp32. Everything else stays off: ncnn's own defaults would run
    # fp32 packages in fp16 on ARM.
    fp16 = dtype == "fp16" and platform.machine().lower() in ("aarch64", "arm64")
    opt.use_fp16_storage = fp16
    opt.use_fp16_packed = fp16
    opt.use_fp16_arithmetic = fp16 and bool(getattr(ncnn, "cpu_support_arm_asimdhp", lambda: 0)())
    # bf16 storage halves weight memory and bandwidth; fp32 packages stay exact.
    opt.use_bf16_storage = dtype == "bf16"
    opt.use_bf16_packed = dtype == "bf16"


class Net:
    """One ncnn network with the package's precision options."""

    def __init__(self, param: str, binfile: str, threads: int, dtype: str = "fp32", light_mode: bool = True):
        self.net = ncnn.Net()
        _options(self.net.opt, threads, dtype)
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

    def execute(self, feeds: dict, wanted: list[tuple[str, int]]) -> dict:
        """Feed Mats/arrays by blob name; extract ``(name, type)`` pairs in order (type 1: caches)."""
        ex = self.extractor()
        for k, v in feeds.items():
            ex.input(k, v if isinstance(v, ncnn.Mat) else to_mat(v))
        return _extract(ex, wanted)

    def run(self, inputs: dict, outputs: list[str]) -> list[np.ndarray]:
        res = self.execute(inputs, [(n, 0) for n in outputs])
        return [from_mat(res[n]) for n in outputs]


def _extract(ex, wanted) -> dict:
    out = {}
    for name, typ in wanted:
        m = ncnn.Mat()
        if ex.extract(name, m, typ) != 0:
            raise RuntimeError(f"ncnn failed to compute blob {name}")
        out[name] = m
    return out


class SectionedNet(Net):
    """Low-memory mode: runs a graph section by section (a decoder layer, an lm_head shard),
    loading each section's weights only while it runs. Peak memory is about one section's
    weights instead of the model's, at the cost of re-reading the weights on every call."""

    def __init__(self, folder: str, binfile: str, sections: list, threads: int, dtype: str = "fp32"):
        self.folder, self.binfile, self.sections = folder, binfile, sections
        self.threads, self.dtype, self.light_mode = threads, dtype, True

    def _load(self, sec) -> Net:
        net = Net.__new__(Net)
        net.net, net.light_mode = ncnn.Net(), True
        _options(net.net.opt, self.threads, self.dtype)
        with open(self.binfile, "rb") as f:
            f.seek(sec["bin"][0])
            data = f.read(sec["bin"][1] - sec["bin"][0])
        if net.net.load_param(os.path.join(self.folder, sec["param"])) != 0 or (
                data and net.net.load_model_mem(data) not in (0, None)):  # this binding returns None
            raise EdgevlError(f"ncnn could not load section {sec['name']} of {self.binfile}; convert the model again")
        return net

    def execute(self, feeds: dict, wanted: list[tuple[str, int]]) -> dict:
        blobs = dict(feeds)
        types = dict(wanted)
        for sec in self.sections:
            net = self._load(sec)
            ex = net.extractor()
            for name in sec["inputs"]:
                if name in blobs:  # absent cache inputs stay empty (first prefill)
                    v = blobs[name]
                    ex.input(name, v if isinstance(v, ncnn.Mat) else to_mat(v))
            blobs.update(_extract(ex, [(n, types.get(n, 0)) for n in sec["outputs"]]))
            del ex, net
        return {n: blobs[n] for n, _ in wanted}


class KVCache:
    """Per-layer (k, v) ncnn Mats plus the token count they hold."""

    def __init__(self, n_layers: int):
        self.mats: list[tuple] | None = None
        self.length = 0
        self.n_layers = n_layers

    def bytes(self) -> int:
        if not self.mats:
            return 0
        # w*h*d*c counts packs and elemsize is bytes per pack: their product is the data size
        return int(sum(m.w * m.h * m.d * m.c * m.elemsize for kv in self.mats for m in kv))

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
        feeds = {names["embeds"]: embeds, names["mask"]: causal_mask(past, seq), names["cos"]: cos,
                 names["sin"]: sin}
        if cache.mats is not None:
            for (k_in, v_in, _, _), (k, v) in zip(self.info["cache"], cache.mats):
                feeds[k_in], feeds[v_in] = k, v
        # intermediate blobs first (they must be extracted before consumers free them); caches
        # with type 1: the packed cache layout, fed back unchanged
        hidden = self.info["outputs"]["hidden"]
        wanted = [(n, 0) for n in extract] + [(hidden, 0)]
        wanted += [(n, 1) for _, _, k_out, v_out in self.info["cache"] for n in (k_out, v_out)]
        res = self.net.execute(feeds, wanted)
        extra = {n: from_mat(res[n]) for n in extract}
        mats = [(res[k_out], res[v_out]) for _, _, k_out, v_out in self.info["cache"]]
        cache.mats = mats
        cache.length = past + seq
        return from_mat(res[hidden]), extra


class LMHead:
    def __init__(self, net: Net, info: dict):
        self.net, self.info = net, info

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        (logits,) = self.net.run({self.info["inputs"]["hidden"]: np.atleast_2d(hidden)},
                                 [self.info["outputs"]["logits"]])
        return logits
