"""Youtu-LLM (transformers ``youtu``): DeepSeek-V3-style MLA + dense SwiGLU, as an ncnn graph.

Hold this file next to transformers' ``modeling_youtu.py``: each block below emits the layers
for the same block there. Also the language half of Youtu-VL (see ``youtu_vl.py``).

Decoder graph interface (one graph for prefill and decode):
  inputs  ``embeds`` (w=hidden, h=seq), ``mask`` (w=past+seq, h=seq), ``rope_cos``/``rope_sin``
          (w=rope_dim/2, h=seq), per layer ``cache_k{i}``/``cache_v{i}`` (omitted on prefill)
  outputs ``hidden`` (final-normed, w=hidden, h=seq), ``out_cache_k{i}``/``out_cache_v{i}``,
          and ``layer{i}.out`` after every decoder layer (for verification).
The embedding lookup and the lm_head run beside this graph (runtime), so the 100k+-row
tables never enter the per-token graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ncnn_graph as G
from ..errors import EdgevlError
from .base import Ctx, GraphInfo, config_args, heads_first, heads_last, rope_theta_of, swiglu_mlp


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    rope_interleave: bool = True
    attention_bias: bool = False
    rope_theta: float = 10000.0

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        a = config_args(cls, cfg, rope_theta=rope_theta_of(cfg))
        if a.hidden_act != "silu":
            raise EdgevlError(f"hidden_act {a.hidden_act!r} is not supported for Youtu models (expected silu)")
        if a.num_key_value_heads not in (None, a.num_attention_heads):
            raise EdgevlError("MLA expands K/V per head: num_key_value_heads must equal num_attention_heads")
        return a

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.qk_head_dim ** -0.5  # no yarn mscale: only plain RoPE is accepted


# ---------------------------------------------------------------------------------------------
# blocks


def emit_mla_attention(ctx: Ctx, x: str, p: str, a: ModelArgs, i: int, cos: str, sin: str, mask: str,
                       absorbed: bool) -> str:
    """YoutuAttention: q path, kv_a_proj_with_mqa -> [latent | rope], kv_b_proj, RoPE, SDPA, o_proj."""
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
    # same layout so scores are identical (ncnn_notes.md, RotaryEmbed).
    interleaved = 1 if a.rope_interleave else 0
    q_rot = g.layer("RotaryEmbed", [q_rot, cos, sin], {0: interleaved}, name=f"{p}.q_rope")
    k_rot = g.layer("RotaryEmbed", [k_rot, cos, sin], {0: interleaved}, name=f"{p}.k_rope")
    cache_in = [f"cache_k{i}", f"cache_v{i}"]
    cache_out = [f"{p}.attn_out", f"out_cache_k{i}", f"out_cache_v{i}"]

    if not absorbed:
        kv = ctx.linear(kv_lat, f"{p}.kv_b_proj", nh * (nope + vd), lat)
        kv = heads_first(g, kv, nope + vd, nh, f"{p}.kv")                   # (c=heads, h=seq, w=256)
        k_nope, v = G.slice_(g, kv, [nope, vd], axis=2, name=f"{p}.kv_b_split")
        k_rot = g.layer("Tile", [k_rot], {2: [nh, 1, 1]}, name=f"{p}.k_rot_tile")  # one shared head
        qf = G.concat(g, [q_nope, q_rot], axis=2, name=f"{p}.q_cat")
        kf = G.concat(g, [k_nope, k_rot], axis=2, name=f"{p}.k_cat")
        o, _, _ = g.layer("SDPA", [qf, kf, v, mask] + cache_in, {5: 1, 6: a.scale, 7: 1},
                          outputs=cache_out, name=f"{p}.sdpa")
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
        o, _, _ = g.layer("SDPA", [qf, kf, vf, mask] + cache_in, {5: 1, 6: a.scale, 7: 1},
                          outputs=cache_out, name=f"{p}.sdpa")                # (c=heads, h=seq, w=lat)
        o = per_head_gemm(ctx, o, [w_kv[h, nope:] for h in range(nh)], f"{p}.v_absorb", concat_axis=1)
    return ctx.linear(o, f"{p}.o_proj", H, nh * vd, bias=a.attention_bias)


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
    outs = [G.gemm(g, part, np.ascontiguousarray(w), ctx.dtype, quant=ctx.quant, name=f"{name}.{h}")
            for h, (part, w) in enumerate(zip(parts, weights))]
    return G.concat(g, outs, axis=concat_axis, name=f"{name}.cat")


def emit_decoder_layer(ctx: Ctx, x: str, prefix: str, a: ModelArgs, i: int, cos: str, sin: str,
                       mask: str, absorbed: bool) -> str:
    g, p = ctx.g, f"{prefix}.layers.{i}"
    h = ctx.rms_norm(x, f"{p}.input_layernorm", a.hidden_size, a.rms_norm_eps)
    h = emit_mla_attention(ctx, h, f"{p}.self_attn", a, i, cos, sin, mask, absorbed)
    h = G.binary(g, x, h, "add", name=f"{p}.attn_residual")
    m = ctx.rms_norm(h, f"{p}.post_attention_layernorm", a.hidden_size, a.rms_norm_eps)
    m = swiglu_mlp(ctx, m, f"{p}.mlp", a.hidden_size, a.intermediate_size)
    return G.binary(g, h, m, "add", name=f"{p}.mlp_residual", out=f"layer{i}.out")


def build_decoder(ctx: Ctx, a: ModelArgs, prefix: str = "model", absorbed: bool = False) -> GraphInfo:
    g = ctx.g
    x = g.input("embeds")
    mask = g.input("mask")
    cos, sin = g.input("rope_cos"), g.input("rope_sin")
    for i in range(a.num_hidden_layers):
        g.input(f"cache_k{i}")
        g.input(f"cache_v{i}")
    for i in range(a.num_hidden_layers):
        g.section(f"layer{i}")  # low-memory mode loads one decoder layer at a time
        x = emit_decoder_layer(ctx, x, prefix, a, i, cos, sin, mask, absorbed)
    g.section("norm")
    ctx.rms_norm(x, f"{prefix}.norm", a.hidden_size, a.rms_norm_eps, out="hidden")
    lat, rope = a.kv_lora_rank, a.qk_rope_head_dim
    per_token = (lat + rope + lat) if absorbed else a.num_attention_heads * (a.qk_head_dim + a.v_head_dim)
    return GraphInfo(
        inputs={"embeds": "embeds", "mask": "mask", "cos": "rope_cos", "sin": "rope_sin"},
        outputs={"hidden": "hidden", "layers": [f"layer{i}.out" for i in range(a.num_hidden_layers)]},
        cache=[[f"cache_k{i}", f"cache_v{i}", f"out_cache_k{i}", f"out_cache_v{i}"]
               for i in range(a.num_hidden_layers)],
        extra={"rope_dim": rope, "rope_theta": a.rope_theta, "kv_mode": "absorbed" if absorbed else "expanded",
               "kv_floats_per_token_per_layer": per_token, "hidden_size": a.hidden_size,
               "num_layers": a.num_hidden_layers, "max_position_embeddings": a.max_position_embeddings},
    )


def lm_head_name(ckpt, a: ModelArgs, prefix: str = "model") -> str:
    """The tensor the head uses: ``lm_head.weight``, or the embedding when tied (or absent)."""
    if not a.tie_word_embeddings and "lm_head.weight" in ckpt:
        return "lm_head.weight"
    if not a.tie_word_embeddings:
        raise EdgevlError("config.json says tie_word_embeddings=false but lm_head.weight is missing "
                          "from the checkpoint; re-download it")
    return f"{prefix}.embed_tokens.weight"


# Rows per lm_head Gemm: ncnn widens a constant B to fp32 while packing it at load, so one
# 283k x 2560 Gemm would need ~3 GB of transient memory; shards keep that to ~100 MB.
HEAD_SHARD_ROWS = 16384


def build_lm_head(ctx: Ctx, a: ModelArgs, weight_name: str) -> GraphInfo:
    """Logits = hidden @ W^T, as row shards concatenated; returns each shard's rows and offset."""
    g = ctx.g
    x = g.input("hidden")
    w = ctx.tensor(weight_name, (a.vocab_size, a.hidden_size))
    outs, shards = [], []
    for r0 in range(0, a.vocab_size, HEAD_SHARD_ROWS):
        r1 = min(a.vocab_size, r0 + HEAD_SHARD_ROWS)
        name = f"lm_head.{len(outs)}"
        g.section(f"shard{len(outs)}")
        outs.append(G.gemm(g, x, w.row_slice(r0, r1), ctx.dtype, quant=ctx.quant, name=name,
                           out="logits" if r1 - r0 == a.vocab_size else None, fp32_output=True))
        shards.append({"rows": [r0, r1], "offset": g.weight_offsets[name][0]})
    if len(outs) > 1:
        g.section("concat")
        g.layer("Concat", outs, {0: 1}, outputs=["logits"], name="lm_head.concat")
    return GraphInfo(inputs={"hidden": "hidden"}, outputs={"logits": "logits"}, extra={"shards": shards})
