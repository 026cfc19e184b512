"""Shared pieces for architecture builders: the weight context and emitters every model uses.

A builder asks ``Ctx`` for tensors by their checkpoint names and emits ncnn layers with them;
the context applies the package's storage dtype / quantization in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from .. import ncnn_graph as G
from ..errors import EdgevlError
from ..weights import Checkpoint


@dataclass
class Ctx:
    ckpt: Checkpoint
    g: G.Graph
    dtype: str = "fp32"                      # storage of large matrices: fp32 | fp16 | bf16
    quant: object = None                     # Gemm weights: a ncnn_graph quant spec, or name -> spec
    progress: object = None                  # callable(LazyTensor), called as tensors are read

    def quant_for(self, name: str):
        """The quantization of the Gemm named ``name`` (a policy may choose per layer)."""
        return self.quant(name) if callable(self.quant) else self.quant

    def tensor(self, name: str, shape=None):
        t = self.ckpt.get(name, shape)
        if self.progress is not None:
            self.progress(t)
        return t

    def array(self, name: str, shape=None) -> np.ndarray:
        return self.tensor(name, shape).numpy()

    # -- emitters that read their weights from the checkpoint ---------------------------------
    def linear(self, x: str, name: str, out_features: int, in_features: int, bias: bool = False,
               out: str | None = None, quantize: bool = True, fp32_output: bool = False) -> str:
        w = self.tensor(f"{name}.weight", (out_features, in_features))
        b = self.array(f"{name}.bias", (out_features,)) if bias else None
        q = self.quant_for(name) if quantize else None
        return G.gemm(self.g, x, w, self.dtype, bias=b, quant=q, name=name, out=out, fp32_output=fp32_output)

    def rms_norm(self, x: str, name: str, size: int, eps: float, out: str | None = None) -> str:
        return G.rms_norm(self.g, x, self.array(f"{name}.weight", (size,)), eps, name=name, out=out)

    def layer_norm(self, x: str, name: str, size: int, eps: float, out: str | None = None) -> str:
        return G.layer_norm(self.g, x, self.array(f"{name}.weight", (size,)),
                            self.array(f"{name}.bias", (size,)), eps, name=name, out=out)


def swiglu_mlp(ctx: Ctx, x: str, prefix: str, hidden: int, inter: int, out: str | None = None) -> str:
    """down(silu(gate(x)) * up(x)) — the dense MLP of Youtu, Qwen and Llama-style models."""
    g = ctx.g
    gate = ctx.linear(x, f"{prefix}.gate_proj", inter, hidden)
    gate = G.swish(g, gate, name=f"{prefix}.silu")
    up = ctx.linear(x, f"{prefix}.up_proj", inter, hidden)
    h = G.binary(g, gate, up, "mul", name=f"{prefix}.mul")
    return ctx.linear(h, f"{prefix}.down_proj", hidden, inter, out=out)


def heads_first(g: G.Graph, x: str, head_dim: int, heads: int, name: str) -> str:
    """(h=seq, w=heads*d) -> (c=heads, h=seq, w=d)."""
    x = G.reshape(g, x, head_dim, heads, -1, name=f"{name}.reshape")  # (c=seq, h=heads, w=d)
    return G.permute(g, x, 2, name=f"{name}.permute")                 # swap h and c


def heads_last(g: G.Graph, x: str, head_dim: int, heads: int, name: str) -> str:
    """(c=heads, h=seq, w=d) -> (h=seq, w=heads*d)."""
    x = G.permute(g, x, 2, name=f"{name}.permute")
    return G.reshape(g, x, head_dim * heads, -1, name=f"{name}.reshape")


def config_args(cls, cfg: dict, where: str = "config.json", **extra):
    """Build a dataclass from config.json keys, ignoring keys it does not declare.

    Values are checked against the field annotations first, so every architecture refuses a
    bad config in one line: ``int`` fields must be integers >= 1 (``field(metadata={"min": 0})``
    lowers the bound), ``float`` fields finite and > 0, ``bool``/``str`` of that type,
    ``list[int]`` lists of integers >= 0; ``X | None`` also takes null."""
    if not isinstance(cfg, dict):
        raise EdgevlError(f"{where} must be a JSON object, got {type(cfg).__name__}; fix the checkpoint's config")
    declared = {f.name: f for f in fields(cls)}
    kw = {k: v for k, v in cfg.items() if k in declared}
    kw.update(extra)
    for k, v in kw.items():
        _check_field(declared[k], v, where)
    try:
        return cls(**kw)
    except TypeError as e:
        raise EdgevlError(f"{where} is missing a field the model needs ({e}); check the checkpoint") from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_field(f, v, where: str) -> None:
    ann = (f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")).replace(" ", "")
    optional = ann.endswith("|None")
    kind = ann[:-len("|None")] if optional else ann
    if v is None and optional:
        return
    lo = f.metadata.get("min", 1)
    if kind == "int":
        ok, need = _is_int(v) and v >= lo, "a positive integer" if lo == 1 else f"an integer >= {lo}"
    elif kind == "float":
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
        need = "a positive number"
    elif kind == "bool":
        ok, need = isinstance(v, bool), "true or false"
    elif kind == "str":
        ok, need = isinstance(v, str), "a string"
    elif kind == "list[int]":
        ok, need = isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v), "a list of integers >= 0"
    elif kind == "list":
        ok, need = isinstance(v, list), "a list"
    else:
        return  # other annotations: the architecture checks them
    if not ok:
        r = repr(v)
        raise EdgevlError(f"{where} field {f.name} must be {need}{' or null' if optional else ''}, got "
                          f"{r if len(r) <= 60 else r[:60] + '...'}; fix the checkpoint's config")


@dataclass
class GraphInfo:
    """What the runtime needs to drive a converted graph (stored in the manifest)."""
    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    # decoder graphs: per layer {"kind": "kv" | "recurrent", "inputs": [...], "outputs": [...],
    # "floats_per_token" (kv) | "shapes" (recurrent, numpy (c, h, w) order)} — see runtime.Cache
    state: list = field(default_factory=list)
    passes: list = field(default_factory=list)      # host hooks between graph passes (runtime.Decoder)
    extra: dict = field(default_factory=dict)


def kv_state(i: int, floats_per_token: int) -> dict:
    """The SDPA KV cache of decoder layer ``i`` (blob names as the emitters write them)."""
    return {"kind": "kv", "inputs": [f"cache_k{i}", f"cache_v{i}"],
            "outputs": [f"out_cache_k{i}", f"out_cache_v{i}"], "floats_per_token": int(floats_per_token)}


# ---------------------------------------------------------------------------------------------
# writing a package's language-model files (any decoder-only LM)

# q8 packages: ncnn's classic int8 Gemm (int8 weights with one scale per output row, activations
# quantized per row at run time, VNNI kernels). Measured on a chain of 2B-shaped decoder layers
# (1 thread, CPU time per layer): bf16 5.7 ms, int8 3.1 ms, block-quantized q8 (8, 32) 9.6 ms at
# one row; 79 / 54 / 71 ms at 128 rows. Int8 everywhere lost too much on the tiny test models
# (top-1 176-187 of 192 teacher-forced tokens, mean KL 2.6-4.2e-3), the attention projections
# being the sensitive part, so an architecture may keep some Gemms in bf16 (``weight_ctx``,
# ``float_layers``): Youtu keeps most attention projections, which measured more accurate than
# the all-block q8 it replaces (youtu.py: q8_keeps_bf16).
Q8_QUANT = G.INT8


def storage_dtype(dtype: str) -> str:
    """The float format of weights that are not quantized."""
    return "bf16" if dtype == "q8" else dtype


def weight_ctx(ckpt: Checkpoint, g: G.Graph, dtype: str, on_tensor, quantize: bool = True,
               float_layers=None) -> Ctx:
    """A Ctx writing the package dtype (q8: int8 Gemm weights, bf16 for the rest, and for the
    Gemms whose checkpoint name ``float_layers(name)`` accepts)."""
    quant = Q8_QUANT if dtype == "q8" and quantize else None
    if quant is not None and float_layers is not None:
        quant = lambda name: None if float_layers(name) else Q8_QUANT  # noqa: E731
    return Ctx(ckpt, g, storage_dtype(dtype), quant, on_tensor)


def save_graph(g: G.Graph, param_path, info: GraphInfo) -> dict:
    """Write the graph (and its per-section params for low-memory mode); returns the manifest entry."""
    outs = [v for v in info.outputs.values() for v in (v if isinstance(v, list) else [v])]
    keep = outs + [n for s in info.state for n in s["outputs"]]
    info.extra["sections"] = g.save(param_path, keep=keep)
    return vars(info)


# Rows per lm_head Gemm: ncnn widens a constant B to fp32 while packing it at load, so one
# 283k x 2560 Gemm would need ~3 GB of transient memory; shards keep that to ~100 MB.
HEAD_SHARD_ROWS = 16384


def build_lm_head(ctx: Ctx, vocab: int, hidden: int, weight_name: str, rows: int | None = None) -> GraphInfo:
    """Logits = hidden @ W^T, as row shards concatenated; returns each shard's rows and offset.
    ``rows``: only the first rows of the head (a draft head)."""
    g = ctx.g
    x = g.input("hidden")
    w = ctx.tensor(weight_name, (vocab, hidden))
    rows = vocab if rows is None else min(int(rows), vocab)
    outs, shards = [], []
    for r0 in range(0, rows, HEAD_SHARD_ROWS):
        r1 = min(rows, r0 + HEAD_SHARD_ROWS)
        name = f"lm_head.{len(outs)}"
        g.section(f"shard{len(outs)}")
        outs.append(G.gemm(g, x, w.row_slice(r0, r1), ctx.dtype, quant=ctx.quant_for(name), name=name,
                           out="logits" if r1 - r0 == rows else None, fp32_output=True))
        shards.append({"rows": [r0, r1], "offset": g.weight_offsets[name][0]})
    if len(outs) > 1:
        g.section("concat")
        G.concat(g, outs, axis=1, name="lm_head.concat", out="logits")
    return GraphInfo(inputs={"hidden": "hidden"}, outputs={"logits": "logits"}, extra={"shards": shards})


def head_weight_name(ckpt: Checkpoint, tied: bool, embed_name: str, head_name: str = "lm_head.weight") -> str:
    """The tensor the head uses: ``lm_head.weight``, or the embedding when tied (or absent). A
    checkpoint that stores its own head uses it even where the config says tied, as transformers
    does (it leaves a stored head of other values untied): a composite config's flags may disagree."""
    if head_name in ckpt:
        return head_name
    if not tied:
        raise EdgevlError(f"config.json says tie_word_embeddings=false but {head_name} is missing "
                          "from the checkpoint; re-download it")
    return embed_name


# Rows of the int8 draft head that float packages with a multi-token-prediction block carry
# (BPE vocabularies put frequent tokens first; docs/speculative.md, "The draft head").
DRAFT_HEAD_ROWS = 65536


def write_draft_head(ckpt: Checkpoint, out, vocab: int, hidden: int, embed_name: str, tied: bool,
                     rows: int = DRAFT_HEAD_ROWS) -> dict:
    """draft_head.param/.bin: the head's first ``rows`` rows as int8 Gemms (one scale per row),
    for speculative decoding's drafts, which then read half the bytes of bf16 rows; the verifier
    keeps the package's own head, so the output does not change."""
    g = G.Graph(out / "draft_head.bin")
    ctx = weight_ctx(ckpt, g, "q8", lambda t: None)     # a second read of a tensor already counted
    return save_graph(g, out / "draft_head.param",
                      build_lm_head(ctx, vocab, hidden, head_weight_name(ckpt, tied, embed_name), rows))


def write_head_and_embedding(ckpt: Checkpoint, out, dtype: str, on_tensor, vocab: int, hidden: int,
                             embed_name: str, tied: bool) -> tuple[dict, dict]:
    """lm_head.param/.bin and the host-side embedding table ``embed_name`` (``tied``: the head is
    the embedding); returns (head graph entry, embedding)."""
    head_name = head_weight_name(ckpt, tied, embed_name)
    g = G.Graph(out / "lm_head.bin")
    ctx = weight_ctx(ckpt, g, dtype, on_tensor)
    head = save_graph(g, out / "lm_head.param", build_lm_head(ctx, vocab, hidden, head_name))
    sd = storage_dtype(dtype)
    if head_name == embed_name and ctx.quant_for("lm_head") is None:
        # Tied float head: its Gemm shards *are* the embedding table; read rows from lm_head.bin
        # (each shard's data follows its 4-byte type tag) instead of storing the table twice.
        embedding = {"file": "lm_head.bin", "dtype": sd,
                     "segments": [{"rows": s["rows"], "offset": s["offset"] + 4} for s in head["extra"]["shards"]]}
    else:
        t = ckpt.get(embed_name, (vocab, hidden))
        on_tensor(t)
        with open(out / "embed.bin", "wb") as f:
            for chunk in G.iter_row_chunks(t):
                f.write(G.encode(chunk, sd).tobytes())
        embedding = {"file": "embed.bin", "dtype": sd, "segments": [{"rows": [0, vocab], "offset": 0}]}
    embedding.update(rows=vocab, dim=hidden)
    return head, embedding
class RowStack:
    """Several [N_i, K...] tensors as one lazy [sum N_i, prod K...] matrix: Linear layers that read
    the same input written as one Gemm (one weight pass instead of several small ones), or a
    convolution kernel flattened to a Gemm weight."""

    def __init__(self, parts, name: str = "stack"):
        self.parts = list(parts)
        k = {int(np.prod(p.shape[1:])) for p in self.parts}
        if len(k) != 1:
            raise EdgevlError(f"{name}: the tensors stacked into one Gemm have different widths {sorted(k)}; the "
                              "checkpoint is inconsistent")
        self.starts = np.cumsum([0] + [int(p.shape[0]) for p in self.parts])
        self.shape = (int(self.starts[-1]), k.pop())
        self.name = name

    def read_rows(self, a: int, b: int) -> np.ndarray:
        out = []
        for p, s0, s1 in zip(self.parts, self.starts[:-1], self.starts[1:]):
            lo, hi = max(a, s0), min(b, s1)
            if lo < hi:
                rows = (p.read_rows(lo - s0, hi - s0) if hasattr(p, "read_rows")
                        else np.asarray(p[lo - s0:hi - s0], np.float32))
                out.append(rows.reshape(hi - lo, -1))
        return np.concatenate(out, 0)
