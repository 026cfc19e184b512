"""Multi-head latent attention (MLA, DeepSeek-V3's): the attention of Youtu-LLM, Youtu-VL's
language model and the Youtu MoE's full-attention layers, emitted as ncnn layers.

Hold it next to transformers' ``YoutuAttention`` (``modeling_youtu.py``): queries through an
optional low-rank path (q_lora), keys and values from one compressed latent plus a shared rotary
part, RoPE on the rotary dims only. The KV cache is either expanded (per-head keys and values) or
absorbed (the latent itself; docs/models/youtu.md, "MLA").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ncnn_graph as G
from .base import Ctx, heads_first, heads_last


@dataclass
class MlaArgs:
    hidden_size: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float = 1e-6
    rope_interleave: bool = True
    attention_bias: bool = False

    @classmethod
    def of(cls, args) -> MlaArgs:
        """The MLA fields of a model's config arguments (any dataclass that has them)."""
        return cls(**{k: getattr(args, k) for k in cls.__dataclass_fields__})

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.qk_head_dim ** -0.5  # no yarn mscale: only plain RoPE is accepted

    def kv_floats_per_token(self, absorbed: bool) -> int:
        """The KV cache's values per token and layer."""
        lat, rope = self.kv_lora_rank, self.qk_rope_head_dim
        return (lat + rope + lat) if absorbed else self.num_attention_heads * (self.qk_head_dim + self.v_head_dim)


def emit_mla_attention(ctx: Ctx, x: str, p: str, a: MlaArgs, i: int, cos: str, sin: str, mask: str,
                       absorbed: bool) -> str:
    """MLA (``YoutuAttention``, DeepSeek-V3's): q path, kv_a_proj_with_mqa -> [latent | rope],
    kv_b_proj, RoPE, SDPA, o_proj."""
    o = emit_mla_core(ctx, x, p, a, i, cos, sin, mask, absorbed)
    return ctx.linear(o, f"{p}.o_proj", a.hidden_size, a.num_attention_heads * a.v_head_dim, bias=a.attention_bias)


def emit_mla_core(ctx: Ctx, x: str, p: str, a: MlaArgs, i: int, cos: str, sin: str, mask: str,
                  absorbed: bool) -> str:
    """MLA up to o_proj: the attention output (h=seq, w=heads*v_head_dim). ``absorbed`` folds
    kv_b_proj into the query and the output so the cache holds the latent (see below)."""
    g, H, nh = ctx.g, a.hidden_size, a.num_attention_heads
    nope, rope, vd, lat = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank

    if a.q_lora_rank is None:
        q = ctx.linear(x, f"{p}.q_proj", nh * a.qk_head_dim, H)
    else:
        q = ctx.linear(x, f"{p}.q_a_proj", a.q_lora_rank, H, bias=a.attention_bias)
        q = ctx.rms_norm(q, f"{p}.q_a_layernorm", a.q_lora_rank, a.rms_norm_eps)
        q = ctx.linear(q, f"{p}.q_b_proj", nh * a.qk_head_dim, a.q_lora_rank)
    q = heads_first(g, q, a.qk_head_dim, nh, f"{p}.q")                    # (c=heads, h=seq, w=192)
    q_nope, q_rot = G.slice_(g, q, [nope, rope], axis=2, name=f"{p}.q_split")

    ckv = ctx.linear(x, f"{p}.kv_a_proj_with_mqa", lat + rope, H, bias=a.attention_bias)
    kv_lat, k_rot = G.slice_(g, ckv, [lat, rope], axis=1, name=f"{p}.kv_split")  # latent first
    kv_lat = ctx.rms_norm(kv_lat, f"{p}.kv_a_layernorm", lat, a.rms_norm_eps)

    # RotaryEmbed 0=1 rotates adjacent pairs in place (HF writes cat(even', odd')); q and k get the
    # same layout so scores are identical (docs/ncnn.md, RotaryEmbed).
    q_rot = G.rotary(g, q_rot, cos, sin, a.rope_interleave, name=f"{p}.q_rope")
    k_rot = G.rotary(g, k_rot, cos, sin, a.rope_interleave, name=f"{p}.k_rope")
    cache_in = [f"cache_k{i}", f"cache_v{i}"]
    cache_out = [f"out_cache_k{i}", f"out_cache_v{i}"]

    if not absorbed:
        kv = ctx.linear(kv_lat, f"{p}.kv_b_proj", nh * (nope + vd), lat)
        kv = heads_first(g, kv, nope + vd, nh, f"{p}.kv")                   # (c=heads, h=seq, w=256)
        k_nope, v = G.slice_(g, kv, [nope, vd], axis=2, name=f"{p}.kv_b_split")
        k_rot = G.tile(g, k_rot, [nh, 1, 1], name=f"{p}.k_rot_tile")  # one shared head
        qf = G.concat(g, [q_nope, q_rot], axis=2, name=f"{p}.q_cat")
        kf = G.concat(g, [k_nope, k_rot], axis=2, name=f"{p}.k_cat")
        o, _, _ = G.sdpa(g, qf, kf, v, mask, a.scale, cache_in, cache_out, name=f"{p}.sdpa", out=f"{p}.attn_out")
        o = heads_last(g, o, vd, nh, f"{p}.o")
    else:
        # Absorbed MLA: attend as ONE shared KV head over [latent | k_rot] keys and latent values,
        # folding kv_b_proj's k part into q and its v part after attention. The cache then holds
        # lat + rope (key) and lat (value) values per token instead of heads * (qk + v).
        w_kv = ctx.array(f"{p}.kv_b_proj.weight", (nh * (nope + vd), lat)).reshape(nh, nope + vd, lat)
        q_lat = per_head_gemm(ctx, q_nope, [w_kv[h, :nope].T for h in range(nh)], f"{p}.q_absorb")
        q_lat = G.reshape(g, q_lat, lat, -1, nh, name=f"{p}.q_absorb.heads")   # (c=heads, h=seq, w=lat)
        qf = G.concat(g, [q_lat, q_rot], axis=2, name=f"{p}.q_cat")
        kf = G.concat(g, [kv_lat, k_rot], axis=1, name=f"{p}.k_cat")        # (h=seq, w=lat+rope)
        kf = G.reshape(g, kf, lat + rope, -1, 1, name=f"{p}.k_1head")
        vf = G.reshape(g, kv_lat, lat, -1, 1, name=f"{p}.v_1head")
        o, _, _ = G.sdpa(g, qf, kf, vf, mask, a.scale, cache_in, cache_out, name=f"{p}.sdpa",
                         out=f"{p}.attn_out")                               # (c=heads, h=seq, w=lat)
        o = per_head_gemm(ctx, o, [w_kv[h, nope:] for h in range(nh)], f"{p}.v_absorb", concat_axis=1)
    return o


def per_head_gemm(ctx: Ctx, x: str, weights: list, name: str, concat_axis: int = 0) -> str:
    """x (c=heads, h=seq, w=K) times a different W_h [N, K] per head, as one Gemm per head.

    Gemm keeps its constant weights packed in the storage dtype (bf16/q8); a MatMul with a
    MemoryData constant would hold them in fp32 and copy them on every forward. Returns the
    per-head (h=seq, w=N) results concatenated along rows (axis 0: h=heads*seq) or columns
    (axis 1: w=heads*N, the layout o_proj wants).
    """
    g, heads, k = ctx.g, len(weights), int(weights[0].shape[1])
    rows = G.reshape(g, x, k, -1, name=f"{name}.rows")                      # (h=heads*seq, w=K)
    parts = G.slice_(g, rows, [-233] * heads, axis=0, name=f"{name}.split")  # equal parts: heads x (h=seq)
    parts = parts if heads > 1 else [parts]
    outs = [G.gemm(g, part, np.ascontiguousarray(w), ctx.dtype, quant=ctx.quant_for(f"{name}.{h}"),
                   name=f"{name}.{h}")
            for h, (part, w) in enumerate(zip(parts, weights))]
    return G.concat(g, outs, axis=concat_axis, name=f"{name}.cat")
