"""A small writer for ncnn graphs: `.param` text plus `.bin` weights.

It knows ncnn's file formats and nothing about models. Layers are appended in execution order;
their weights are streamed into the `.bin` immediately (row chunks), so a graph of any size is
written with memory near one chunk. Blobs have names; a blob read by more than one layer gets
an automatic `Split` (ncnn requires it), and the original name stays extractable.

Weight encodings (docs/ncnn.md, section 3):
- ``Tagged``: 4-byte tag, data, zero padding to 4 bytes (Gemm A/B/C, Embed, MemoryData 21=0).
- ``Raw``: untagged fp32 (RMSNorm gamma, LayerNorm gamma/beta, MemoryData default).
- ``BlockQuant``: ncnn block-quantized Gemm B (no tag), packed values then fp32 scales.
- ``Int8Rows``: ncnn's classic int8 Gemm B (tagged int8), quantized per output row; the row
  scales are applied after the Gemm (see ``gemm``).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

MAGIC = 7767517

TAG_FP32 = 0x00000000
TAG_FP16 = 0x01306B47
TAG_BF16 = 0x01348B83
TAG_INT8 = 0x000D4B38

DTYPES = ("fp32", "fp16", "bf16")

# Rows converted per write: keeps memory near 16 MiB for any tensor (a 283k-row embedding too).
CHUNK_BYTES = 16 << 20


# ---------------------------------------------------------------------------------------------
# tensor sources and dtype conversion


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns (uint16), round to nearest even, NaN kept NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def bf16_bits_to_f32(u: np.ndarray) -> np.ndarray:
    return (np.asarray(u, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode(x: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 array -> the on-disk element array of ``dtype``."""
    if dtype == "fp32":
        return np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "fp16":
        return np.ascontiguousarray(x, dtype=np.float32).astype(np.float16)
    if dtype == "bf16":
        return f32_to_bf16_bits(x)
    raise ValueError(f"unknown dtype {dtype!r}")


def _rows(src) -> int:
    return int(src.shape[0]) if len(src.shape) else 1


def iter_row_chunks(src, row_bytes: int | None = None) -> Iterable[np.ndarray]:
    """Yield fp32 row blocks of ``src`` (a numpy array or a lazy tensor with ``read_rows``)."""
    shape = tuple(src.shape)
    n = _rows(src)
    per_row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    step = max(1, CHUNK_BYTES // max(1, (row_bytes or per_row * 4)))
    if isinstance(src, np.ndarray):
        flat = src.reshape(n, -1) if src.ndim else src.reshape(1, 1)
        for s in range(0, n, step):
            yield np.ascontiguousarray(flat[s:s + step], dtype=np.float32)
        return
    for s in range(0, n, step):
        yield np.asarray(src.read_rows(s, min(n, s + step)), dtype=np.float32).reshape(-1, per_row)


# ---------------------------------------------------------------------------------------------
# weight encodings


class Weight:
    def write(self, f) -> int:  # returns bytes written
        raise NotImplementedError


class Raw(Weight):
    """Untagged fp32 data."""

    def __init__(self, src):
        self.src = src

    def write(self, f) -> int:
        n = 0
        for chunk in iter_row_chunks(self.src):
            b = chunk.astype("<f4").tobytes()
            f.write(b)
            n += len(b)
        return n


class Tagged(Weight):
    """Type tag + data (+ padding to 4 bytes)."""

    def __init__(self, src, dtype: str = "fp32"):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported weight dtype {dtype!r}")
        self.src, self.dtype = src, dtype

    def write(self, f) -> int:
        tag = {"fp32": TAG_FP32, "fp16": TAG_FP16, "bf16": TAG_BF16}[self.dtype]
        f.write(np.uint32(tag).tobytes())
        n = 4
        for chunk in iter_row_chunks(self.src):
            b = encode(chunk, self.dtype).tobytes()
            f.write(b)
            n += len(b)
        pad = (-n) % 4
        f.write(b"\0" * pad)
        return n + pad


BLOCK_CODES = {32: 0, 64: 1, 128: 2}


def block_quantize(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-block quantization of rows of ``w`` [N, K].

    Returns (q int8 [N, K], scales fp32 [N, ceil(K/block)]) with scale = qmax/absmax, so that
    dequantized = q / scale (ncnn's convention for block-quantized Gemm).
    """
    n, k = w.shape
    nb = -(-k // block)
    qmax = float((1 << (bits - 1)) - 1)
    padded = np.zeros((n, nb * block), np.float32)
    padded[:, :k] = w
    blocks = padded.reshape(n, nb, block)
    absmax = np.abs(blocks).max(axis=2)
    scale = np.where(absmax > 0, qmax / np.maximum(absmax, 1e-30), 1.0).astype(np.float32)
    q = np.clip(np.rint(blocks * scale[:, :, None]), -qmax, qmax).astype(np.int8)
    return q.reshape(n, nb * block)[:, :k], scale


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack signed values LSB-first, one row of ceil(K*bits/8) bytes per output column."""
    if bits == 8:
        return q.astype(np.int8).view(np.uint8)
    n, k = q.shape
    mask = (1 << bits) - 1
    u = (q.astype(np.int16) & mask).astype(np.uint32)
    bitpos = np.arange(k, dtype=np.int64) * bits
    nbytes = -(-k * bits // 8)
    out = np.zeros((n, nbytes + 1), np.uint32)
    byte, off = bitpos // 8, (bitpos % 8).astype(np.uint32)
    for j in range(k):  # tiny helper for 4/6-bit (slow paths in ncnn anyway)
        v = u[:, j] << off[j]
        out[:, byte[j]] |= v & 0xFF
        out[:, byte[j] + 1] |= (v >> 8) & 0xFF
    return out[:, :nbytes].astype(np.uint8)


class BlockQuant(Weight):
    """Gemm constant B [N, K] block-quantized (param 18 = bits*100 + block_code)."""

    def __init__(self, src, bits: int = 8, block: int = 32):
        if bits not in (4, 6, 8) or block not in BLOCK_CODES:
            raise ValueError("block quantization needs bits in {4,6,8} and block in {32,64,128}")
        self.src, self.bits, self.block = src, bits, block

    @property
    def quantize_term(self) -> int:
        return self.bits * 100 + BLOCK_CODES[self.block]

    def write(self, f) -> int:
        # values for every row first, then every row's scales: stream values, buffer scales
        # (N * K/block floats: ~1/8 of the int8 data at block 32).
        scales = []
        n = 0
        for chunk in iter_row_chunks(self.src):
            q, s = block_quantize(chunk, self.bits, self.block)
            packed = pack_bits(q, self.bits)
            pad = (-packed.shape[1]) % 4
            if pad:
                packed = np.concatenate([packed, np.zeros((packed.shape[0], pad), np.uint8)], 1)
            b = packed.tobytes()
            f.write(b)
            n += len(b)
            scales.append(s)
        b = np.concatenate(scales, 0).astype("<f4").tobytes()
        f.write(b)
        return n + len(b)


class Int8Rows(Weight):
    """Gemm constant B [N, K] as int8 with one symmetric scale per output row (q = round(w*s),
    s = 127/absmax(row)). Streams rows; ``scales`` holds the rows' s once written."""

    def __init__(self, src):
        self.src, self.scales = src, None

    def write(self, f) -> int:
        f.write(np.uint32(TAG_INT8).tobytes())
        n, scales = 4, []
        for chunk in iter_row_chunks(self.src):
            absmax = np.abs(chunk).max(axis=1)
            s = np.where(absmax > 0, 127.0 / np.maximum(absmax, 1e-30), 1.0).astype(np.float32)
            q = np.clip(np.rint(chunk * s[:, None]), -127, 127).astype(np.int8)
            b = q.tobytes()
            f.write(b)
            n += len(b)
            scales.append(s)
        pad = (-n) % 4
        f.write(b"\0" * pad)
        self.scales = np.concatenate(scales)
        return n + pad


# ---------------------------------------------------------------------------------------------
# the graph


def _fmt_value(v) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.9e}"
    if isinstance(v, str):
        return f'"{v}"'
    raise TypeError(f"unsupported param value {v!r}")


def format_params(params: dict) -> str:
    out = []
    for k, v in params.items():
        if isinstance(v, (list, tuple)):
            if not v:
                continue
            out.append(f"{-23300 - int(k)}={len(v)},{','.join(_fmt_value(x) for x in v)}")
        else:
            out.append(f"{int(k)}={_fmt_value(v)}")
    return " ".join(out)


class Graph:
    """Build an ncnn graph layer by layer; weights go straight to ``bin_path``."""

    def __init__(self, bin_path: str | os.PathLike):
        self.bin_path = os.fspath(bin_path)
        self._bin = open(self.bin_path, "wb")
        self._layers: list[tuple[str, str, list[str], list[str], dict]] = []
        self._produced: set[str] = set()
        self._names: Counter = Counter()
        self._blob_id = 0
        self.weight_offsets: dict[str, tuple[int, int]] = {}  # layer name -> (offset, bytes)
        self._closed = False
        self._sections: list[tuple[str, int, int]] = []  # (name, first layer, bin offset)

    # -- naming -------------------------------------------------------------------------------
    def _layer_name(self, typ: str, name: str | None) -> str:
        base = name or typ.lower()
        self._names[base] += 1
        return base if self._names[base] == 1 and name else f"{base}_{self._names[base]}"

    def _new_blob(self) -> str:
        self._blob_id += 1
        return f"b{self._blob_id}"

    # -- layers -------------------------------------------------------------------------------
    def layer(self, typ: str, inputs: Sequence[str], params: dict | None = None,
              weights: Sequence[Weight] = (), outputs: int | Sequence[str] = 1,
              name: str | None = None):
        """Append a layer; returns its output blob name (or a tuple when several)."""
        for b in inputs:
            if b not in self._produced:
                raise ValueError(f"blob {b!r} is used before any layer produces it")
        outs = [self._new_blob() for _ in range(outputs)] if isinstance(outputs, int) else list(outputs)
        for b in outs:
            if b in self._produced:
                raise ValueError(f"blob {b!r} is produced twice")
            self._produced.add(b)
        lname = self._layer_name(typ, name)
        if weights:
            start = self._bin.tell()
            for w in weights:
                w.write(self._bin)
            self.weight_offsets[lname] = (start, self._bin.tell() - start)
        self._layers.append((typ, lname, list(inputs), outs, dict(params or {})))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def input(self, name: str) -> str:
        return self.layer("Input", [], outputs=[name], name=name)

    def section(self, name: str) -> None:
        """Start a section: later layers (until the next section) can be run as their own net."""
        self._sections.append((name, len(self._layers), self._bin.tell()))

    # -- output -------------------------------------------------------------------------------
    def save(self, param_path: str | os.PathLike, keep: Sequence[str] = ()) -> list[dict]:
        """Write the .param text (with Splits inserted) and close the .bin.

        With sections, also writes ``<param stem>.<section>.param`` per section: the section's
        layers plus an Input for every blob it reads from elsewhere. Returns, per section, its
        param file, its byte range in the .bin, and the blobs it reads and must hand on (read by
        a later section, or named in ``keep``).
        """
        self.close()
        end = os.path.getsize(self.bin_path)
        _write_param(param_path, self._layers)
        sections = []
        bounds = self._sections + [("", len(self._layers), end)]
        if self._sections and self._sections[0][1] > 0:
            bounds.insert(0, ("prologue", 0, 0))  # layers before the first section
        for (name, l0, off), (_, l1, off1) in zip(bounds, bounds[1:]):
            layers = [x for x in self._layers[l0:l1] if x[0] != "Input"]
            if not layers:
                continue
            produced = {b for x in layers for b in x[3]}
            needed = [b for x in layers for b in x[2] if b not in produced]
            inputs = list(dict.fromkeys(needed))
            later = {b for x in self._layers[l1:] for b in x[2]}
            outputs = [b for x in layers for b in x[3] if b in later or b in keep]
            path = Path(param_path).with_suffix(f".{name}.param")
            _write_param(path, [("Input", b, [], [b], {}) for b in inputs] + layers)
            sections.append({"name": name, "param": path.name, "bin": [off, off1],
                             "inputs": inputs, "outputs": outputs})
        return sections


    def close(self) -> None:
        if not self._closed:
            self._bin.close()
            self._closed = True

    @property
    def layer_count(self) -> int:
        return len(self._layers)


def _line(typ, lname, ins, outs, params) -> str:
    s = f"{typ:<24} {lname:<32} {len(ins)} {len(outs)} {' '.join(ins + outs)}"
    p = format_params(params)
    return s + (" " + p if p else "")


def _write_param(path, layers) -> None:
    """Layers -> .param text, inserting a Split after every blob read by more than one layer."""
    consumers = Counter(b for _, _, ins, _, _ in layers for b in ins)
    lines = []
    taken: dict[str, list[str]] = {}
    nblobs = 0
    for typ, lname, ins, outs, params in layers:
        ins = [taken[b].pop(0) if b in taken else b for b in ins]
        lines.append(_line(typ, lname, ins, outs, params))
        nblobs += len(outs)
        for b in outs:
            k = consumers.get(b, 0)
            if k > 1:
                parts = [f"{b}_s{i}" for i in range(k)]
                taken[b] = parts
                lines.append(_line("Split", f"split_{b}", [b], parts, {}))
                nblobs += k
    with open(path, "w") as f:
        f.write(f"{MAGIC}\n{len(lines)} {nblobs}\n")
        f.write("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------
# common layer emitters (thin wrappers that fix ncnn's parameter ids in one place)


INT8 = "int8"  # quant: ncnn's classic int8 Gemm with per-row weight scales


def gemm(g: Graph, x: str, w, dtype: str = "fp32", bias=None, quant=None,
         name: str | None = None, out: str | None = None, fp32_output: bool = False) -> str:
    """y = x @ W^T (+ b): a Linear layer. ``w`` is [N, K]; x is 2-D (h=rows, w=K) or 1-D.

    ``quant``: None (``dtype`` floats), ``(bits, block)`` for ncnn's block-quantized Gemm, or
    ``INT8``: ncnn's classic int8 Gemm (activations quantized per row at run time, VNNI kernels)
    with per-row weight scales folded out of the Gemm into a multiply after it — one scale per
    tensor (all ncnn keeps for a constant B) lost ~3x the accuracy on uneven rows (docs/ncnn.md, section 8).
    ``fp32_output`` keeps the result in fp32 inside a bf16-storage net (logits: a bf16 logit
    row would turn near-ties into wrong argmaxes)."""
    n, k = (int(s) for s in w.shape)
    if quant == INT8:
        return _gemm_int8_rows(g, x, w, n, k, bias, name, out, fp32_output)
    params = {10: 4 if bias is not None else -1, 2: 0, 3: 1, 4: 0, 5: 1, 6: 1 if bias is not None else 0,
              7: 0, 8: n, 9: k}
    if fp32_output:
        params[13] = 1
    if quant is not None:
        bq = BlockQuant(w, bits=quant[0], block=quant[1])
        params[18] = bq.quantize_term
        weights = [bq]
    else:
        weights = [Tagged(w, dtype)]
    if bias is not None:
        weights.append(Tagged(bias, "fp32"))
    return g.layer("Gemm", [x], params, weights, outputs=[out] if out else 1, name=name)


class _ScaledBias(Tagged):
    """A bias as the int8 Gemm's constant C, in the units of its output before the row scales are
    taken out (bias x row scale): written after the weight, whose scales it needs."""

    def __init__(self, bias, rows: Int8Rows):
        super().__init__(None, "fp32")
        self.bias, self.rows = np.asarray(bias, np.float32), rows

    def write(self, f) -> int:
        self.src = self.bias * self.rows.scales
        return super().write(f)


def _gemm_int8_rows(g: Graph, x: str, w, n: int, k: int, bias, name, out, fp32_output) -> str:
    # 18=2: int8, one B scale given (1.0); a bias rides along as C (10=4: one value per column),
    # which ncnn reads between B and the scale
    params = {10: -1 if bias is None else 4, 2: 0, 3: 1, 4: 0, 5: 1, 6: 0 if bias is None else 1, 7: 0, 8: n,
              9: k, 18: 2}
    if fp32_output:
        params[13] = 1
    q = Int8Rows(w)
    weights = [q] + ([] if bias is None else [_ScaledBias(bias, q)]) + [Raw(np.ones(1, np.float32))]
    y = g.layer("Gemm", [x], params, weights, name=name)                    # the row scales come next
    base = name or y
    inv = (1.0 / q.scales).astype(np.float32)[None, :]                       # (h=1, w=N): per column
    return binary(g, y, memory_data(g, inv, name=f"{base}.row_scales"), "mul", name=f"{base}.scale", out=out)


def rms_norm(g: Graph, x: str, gamma, eps: float, name: str | None = None, out: str | None = None) -> str:
    return g.layer("RMSNorm", [x], {0: int(gamma.shape[0]), 1: float(eps), 2: 1}, [Raw(gamma)],
                   outputs=[out] if out else 1, name=name)


def layer_norm(g: Graph, x: str, gamma, beta, eps: float, name: str | None = None,
               out: str | None = None) -> str:
    return g.layer("LayerNorm", [x], {0: int(gamma.shape[0]), 1: float(eps), 2: 1},
                   [Raw(gamma), Raw(beta)], outputs=[out] if out else 1, name=name)


def binary(g: Graph, a: str, b: str, op: str, name: str | None = None, out: str | None = None) -> str:
    code = {"add": 0, "sub": 1, "mul": 2, "div": 3}[op]
    return g.layer("BinaryOp", [a, b], {0: code}, outputs=[out] if out else 1, name=name)


def reshape(g: Graph, x: str, w: int, h: int | None = None, c: int | None = None,
            name: str | None = None) -> str:
    params = {0: w}
    if h is not None:
        params[1] = h
    if c is not None:
        params[2] = c
    return g.layer("Reshape", [x], params, name=name)


def permute(g: Graph, x: str, order_type: int, name: str | None = None) -> str:
    return g.layer("Permute", [x], {0: order_type}, name=name)


def slice_(g: Graph, x: str, sizes: Sequence[int], axis: int, name: str | None = None):
    return g.layer("Slice", [x], {0: list(sizes), 1: axis}, outputs=len(sizes), name=name)


def concat(g: Graph, xs: Sequence[str], axis: int, name: str | None = None, out: str | None = None) -> str:
    return g.layer("Concat", list(xs), {0: axis}, outputs=[out] if out else 1, name=name)


def memory_data(g: Graph, arr: np.ndarray, dtype: str = "fp32", name: str | None = None) -> str:
    """A constant blob; numpy shape (c, h, w) / (h, w) / (w,) maps to ncnn (w, h, c)."""
    shape = arr.shape[::-1]
    params = {0: int(shape[0])}
    if len(shape) > 1:
        params[1] = int(shape[1])
    if len(shape) > 2:
        params[2] = int(shape[2])
    params[21] = 0  # tagged: lets bf16/fp16 constants shrink on disk
    return g.layer("MemoryData", [], params, [Tagged(arr.reshape(arr.shape[0] if arr.ndim > 1 else 1, -1),
                                                     dtype)], name=name)


def binary_scalar(g: Graph, x: str, op: str, value: float, name: str | None = None,
                  out: str | None = None) -> str:
    """x (op) a constant scalar."""
    code = {"add": 0, "sub": 1, "mul": 2, "div": 3, "max": 4, "min": 5, "pow": 6, "rsub": 7}[op]
    return g.layer("BinaryOp", [x], {0: code, 1: 1, 2: float(value)}, outputs=[out] if out else 1, name=name)


UNARY_OPS = {"abs": 0, "neg": 1, "floor": 2, "ceil": 3, "square": 4, "sqrt": 5, "rsqrt": 6, "exp": 7,
             "log": 8, "sin": 9, "cos": 10, "tan": 11, "asin": 12, "acos": 13, "atan": 14,
             "reciprocal": 15, "tanh": 16, "log10": 17, "round": 18, "trunc": 19}


def unary(g: Graph, x: str, op: str, name: str | None = None, out: str | None = None) -> str:
    return g.layer("UnaryOp", [x], {0: UNARY_OPS[op]}, outputs=[out] if out else 1, name=name)


def swish(g: Graph, x: str, name: str | None = None, out: str | None = None) -> str:
    """SiLU: x * sigmoid(x)."""
    return g.layer("Swish", [x], outputs=[out] if out else 1, name=name)


def sigmoid(g: Graph, x: str, name: str | None = None, out: str | None = None) -> str:
    return g.layer("Sigmoid", [x], outputs=[out] if out else 1, name=name)


def gelu(g: Graph, x: str, tanh: bool, name: str | None = None, out: str | None = None) -> str:
    """GELU: exact erf form, or torch's tanh approximation (``gelu_pytorch_tanh``)."""
    return g.layer("GELU", [x], {0: 1 if tanh else 0}, outputs=[out] if out else 1, name=name)


def rotary(g: Graph, x: str, cos: str, sin: str, interleaved: bool, name: str | None = None) -> str:
    """RotaryEmbed over the whole last axis: x (c=heads, h=seq, w=dim), cos/sin (h=seq, w=dim/2).

    ``interleaved=False`` equals HF's rotate_half; ``True`` rotates adjacent pairs in place (HF's
    interleaved form writes the result as cat(even', odd') — same scores, other layout)."""
    return g.layer("RotaryEmbed", [x, cos, sin], {0: 1 if interleaved else 0}, name=name)


def crop_expr(g: Graph, x: str, refs: Sequence[str], starts: str, ends: str, axes: str,
              name: str | None = None, out: str | None = None) -> str:
    """Crop whose start/end are expressions over input shapes, read at run time (blob 0 is
    ``x``, 1.. are ``refs``; e.g. starts ``"-(2w,1)"``: the w of refs[1] minus one). Axes count
    ncnn's way for x's rank (3-D: 0=c, 1=h, 2=w)."""
    return g.layer("Crop", [x, *refs], {19: starts, 20: ends, 21: axes}, outputs=[out] if out else 1, name=name)


def tile(g: Graph, x: str, repeats: Sequence[int], name: str | None = None) -> str:
    """Repeat whole blocks along (c, h, w) — [h0, h1, h0, h1], not repeat_interleave."""
    return g.layer("Tile", [x], {2: [int(r) for r in repeats]}, name=name)


def reshape_like(g: Graph, x: str, ref: str, expr: str, name: str | None = None) -> str:
    """Reshape whose target shape is an expression over ``ref``'s shape (read at run time),
    e.g. ``"64,1h,1c"``: w=64, h=ref.h, c=ref.c.

    In this wheel (1.0.20261020) a two-input Reshape to a 3-D shape ran ~30x slower than a copy
    (450 ms for 3.5 M values) while 2-D and 4-D targets ran at copy speed: reshape to 4-D here
    and then to 3-D with fixed params (``reshape(g, x, w, 0, -1)`` keeps h, infers c)."""
    return g.layer("Reshape", [x, ref], {6: expr}, name=name)


def sdpa(g: Graph, q: str, k: str, v: str, mask: str | None = None, scale: float = 0.0,
         cache: Sequence[str] | None = None, cache_out: Sequence[str] | None = None,
         name: str | None = None, out: str | None = None):
    """Scaled dot-product attention: q (c=heads, h=seq, w=d), k/v (c=kv_heads, ...) — GQA native.

    ``mask`` is additive (w=past+seq, h=seq). With ``cache=(past_k, past_v)`` and
    ``cache_out=(k_all, v_all)`` SDPA appends to the KV cache itself and returns
    ``(o, k_all, v_all)``; otherwise ``o``. ``scale`` 0 means 1/sqrt(d)."""
    inputs = [q, k, v] + ([mask] if mask else [])
    params = {5: 1 if mask else 0, 6: float(scale), 7: 1 if cache else 0}
    if cache:
        outs = [out or g._new_blob(), *cache_out]
        return g.layer("SDPA", inputs + list(cache), params, outputs=outs, name=name)
    return g.layer("SDPA", inputs, params, outputs=[out] if out else 1, name=name)


def matmul(g: Graph, a: str, b: str, name: str | None = None, out: str | None = None) -> str:
    """Batched a @ b over the last two axes (3-D: per channel), both operands blobs."""
    return g.layer("MatMul", [a, b], outputs=[out] if out else 1, name=name)


def crop_last(g: Graph, x: str, n: int, axis: int, name: str | None = None, out: str | None = None) -> str:
    """The last ``n`` entries along ``axis`` (negative: from the last axis), whatever the size."""
    return g.layer("Crop", [x], {9: [-int(n)], 10: [2 ** 31 - 1], 11: [int(axis)]},
                   outputs=[out] if out else 1, name=name)


def crop_from(g: Graph, x: str, start: int, axis: int, name: str | None = None, out: str | None = None) -> str:
    """The entries from ``start`` on along ``axis`` (negative: from the last axis), whatever the size."""
    return g.layer("Crop", [x], {9: [int(start)], 10: [2 ** 31 - 1], 11: [int(axis)]},
                   outputs=[out] if out else 1, name=name)


def conv_dw1d(g: Graph, x: str, weight: np.ndarray, name: str | None = None, out: str | None = None) -> str:
    """Depthwise 1-D convolution, no padding or bias: x (h=channels, w=time), weight [channels, k]."""
    ch, k = (int(s) for s in weight.shape)
    return g.layer("ConvolutionDepthWise1D", [x], {0: ch, 1: k, 2: 1, 3: 1, 4: 0, 5: 0, 6: ch * k, 7: ch},
                   [Tagged(np.ascontiguousarray(weight, np.float32))], outputs=[out] if out else 1, name=name)


def bnll(g: Graph, x: str, name: str | None = None, out: str | None = None) -> str:
    """softplus log(1 + e^x) in the overflow-safe form (ncnn's Softplus overflows above ~88)."""
    return g.layer("BNLL", [x], outputs=[out] if out else 1, name=name)


def cumsum(g: Graph, x: str, axis: int, name: str | None = None, out: str | None = None) -> str:
    return g.layer("CumulativeSum", [x], {0: int(axis)}, outputs=[out] if out else 1, name=name)
