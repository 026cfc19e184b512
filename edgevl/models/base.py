"""Shared pieces for architecture builders: the weight context and emitters every model uses.

A builder asks ``Ctx`` for tensors by their checkpoint names and emits ncnn layers with them;
the context applies the package's storage dtype / quantization in one place.
"""

from __future__ import annotations

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
    quant: tuple[int, int] | None = None     # (bits, block) for Gemm weights, e.g. (8, 32)
    progress: object = None                  # callable(LazyTensor), called as tensors are read

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
        q = self.quant if quantize else None
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
    gate = g.layer("Swish", [gate], name=f"{prefix}.silu")
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


def config_args(cls, cfg: dict, **extra):
    """Build a dataclass from config.json keys, ignoring keys it does not declare."""
    names = {f.name for f in fields(cls)}
    kw = {k: v for k, v in cfg.items() if k in names}
    kw.update(extra)
    try:
        return cls(**kw)
    except TypeError as e:
        raise EdgevlError(f"config.json is missing a field the model needs ({e}); check the checkpoint") from None


def rope_theta_of(cfg: dict, default: float = 10000.0) -> float:
    """The checkpoint's own RoPE base: ``rope_parameters`` (transformers 5) or ``rope_theta``."""
    rp = cfg.get("rope_parameters") or {}
    rs = cfg.get("rope_scaling") or {}
    rtype = rp.get("rope_type") or rs.get("rope_type") or rs.get("type") or "default"
    if rtype != "default":
        raise EdgevlError(f"rope_type {rtype!r} in config.json is not supported yet (only plain RoPE); "
                          "please open an issue with the checkpoint name")
    theta = rp.get("rope_theta", cfg.get("rope_theta"))
    return float(theta if theta is not None else default)


def rope_tables(positions: np.ndarray, dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [len(positions), dim/2] for plain 1-D RoPE, float32 as transformers computes it."""
    inv = (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))).astype(np.float32)
    ang = np.asarray(positions, dtype=np.float32)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@dataclass
class GraphInfo:
    """What the runtime needs to drive a converted decoder graph (stored in the manifest)."""
    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    cache: list = field(default_factory=list)       # [[in_k, in_v, out_k, out_v], ...]
    extra: dict = field(default_factory=dict)


class RowStack:
    """Several [N_i, K...] tensors as one lazy [sum N_i, prod K...] matrix: Linear layers that read
    the same input written as one Gemm (one weight pass instead of several small ones), or a
    convolution kernel flattened to a Gemm weight."""

    def __init__(self, parts, name: str = "stack"):
        self.parts = list(parts)
        k = {int(np.prod(p.shape[1:])) for p in self.parts}
        if len(k) != 1:
            raise ValueError(f"{name}: stacked tensors need one input width, got {sorted(k)}")
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


def write_embedding(ckpt, out, embed_name: str, rows: int, dim: int, dtype: str, on_tensor,
                    tied_head: dict | None = None) -> dict:
    """The host-side embedding table's manifest entry. A tied float lm_head's row shards *are*
    the table (each shard's rows follow its 4-byte type tag), so nothing is stored twice;
    otherwise the table is written to ``embed.bin`` in ``dtype``."""
    if tied_head is not None:
        emb = {"file": "lm_head.bin", "dtype": dtype,
               "segments": [{"rows": s["rows"], "offset": s["offset"] + 4} for s in tied_head["extra"]["shards"]]}
    else:
        t = ckpt.get(embed_name, (rows, dim))
        on_tensor(t)
        with open(out / "embed.bin", "wb") as f:
            for chunk in G.iter_row_chunks(t):
                f.write(G.encode(chunk, dtype).tobytes())
        emb = {"file": "embed.bin", "dtype": dtype, "segments": [{"rows": [0, rows], "offset": 0}]}
    return dict(emb, rows=rows, dim=dim)
