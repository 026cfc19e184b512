"""Qwen3.5 (transformers ``qwen3_5``): Gated DeltaNet + gated full attention, M-RoPE, Qwen3-VL-style
vision tower — as ncnn graphs plus the host driver that runs them.

Hold this file next to transformers' ``modeling_qwen3_5.py``: each block emits the layers of the
block of the same name there (spec qwen3_5_and_youtu_moe.md §1, §3). The delta rule itself is in
``gated_delta.py`` (fp32 core nets shared by every recurrent layer).

Decoder graph interface (one graph, weights loaded once, prefill and decode):
  inputs  ``embeds`` (w=hidden, h=seq), ``mask`` (w=past+seq, h=seq), ``rope_cos``/``rope_sin``
          (w=rotary_dim/2, h=seq; interleaved M-RoPE from 3-axis positions), per attention layer
          ``cache_k{i}``/``cache_v{i}`` (omitted on the first prefill), per recurrent layer
          ``conv_state{i}`` (h=conv channels, w=K-1) and ``core_out{i}`` (h=seq, w=Vd: the delta
          rule's output, fed by a host pass)
  outputs ``hidden`` (final-normed), ``layer{i}.out``, ``out_cache_k{i}``/``out_cache_v{i}``,
          per recurrent layer ``out_conv_state{i}`` and the core's inputs (conv output and gate
          logits, named in the manifest's ``passes``).
The generic ``runtime.Decoder`` drives it with one extractor per call: for each recurrent layer
in turn a host pass extracts the core's inputs (ncnn computes everything up to there), runs the
fp32 core net on the layer's ``host`` state (the delta-rule matrix) and feeds ``core_out{i}``;
attention layers run inside the graph with SDPA's own KV cache.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from .. import ncnn_graph as G
from ..errors import EdgevlError
from . import gated_delta as gd
from .base import (Ctx, GraphInfo, RowStack, config_args, head_weight_name, heads_first, heads_last, kv_state,
                   rope_theta_of, save_graph, storage_dtype, swiglu_mlp, weight_ctx, write_head_and_embedding)
from .protocol import Architecture, Reference, torch_dtype

PREFIX = "model.language_model"
VISION_PREFIX = "model.visual"
LAYER_KINDS = ("linear_attention", "full_attention")


@dataclass
class TextArgs:
    vocab_size: int
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list | None = None
    full_attention_interval: int = 4
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    mrope_section: list = field(default_factory=lambda: [11, 11, 10])

    # a text-only checkpoint (e.g. Qwen3_5ForCausalLM, model_type qwen3_5_text) has it at the root
    text_model_types: ClassVar[tuple] = ("qwen3_5_text",)

    @classmethod
    def from_config(cls, cfg: dict) -> "TextArgs":
        tc = dict(cfg.get("text_config") or (cfg if cfg.get("model_type") in cls.text_model_types else {}))
        if not tc:
            raise EdgevlError("config.json of a qwen3_5 model needs a text_config")
        if "tie_word_embeddings" not in tc and "tie_word_embeddings" in cfg:
            tc["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        rp = tc.get("rope_parameters") or {}
        a = config_args(cls, tc, rope_theta=rope_theta_of(tc),
                        partial_rotary_factor=float(rp.get("partial_rotary_factor", tc.get("partial_rotary_factor", 0.25))),
                        mrope_section=list(rp.get("mrope_section", [11, 11, 10])))
        if a.layer_types is None:   # transformers' rule; the saved config normally lists them
            a.layer_types = ["linear_attention" if (i + 1) % a.full_attention_interval else "full_attention"
                             for i in range(a.num_hidden_layers)]
        bad = [t for t in a.layer_types if t not in LAYER_KINDS]
        if bad or len(a.layer_types) != a.num_hidden_layers:
            raise EdgevlError(f"text_config.layer_types must list {a.num_hidden_layers} entries of "
                              f"{' / '.join(LAYER_KINDS)} (got {bad[:1] or len(a.layer_types)})")
        if a.hidden_act != "silu":
            raise EdgevlError(f"hidden_act {a.hidden_act!r} is not supported for Qwen3.5 (expected silu)")
        if a.linear_num_value_heads % a.linear_num_key_heads or a.num_attention_heads % a.num_key_value_heads:
            raise EdgevlError("text_config: value heads must be a multiple of key heads (linear and full attention)")
        if sum(a.mrope_section) * 2 != a.rotary_dim:
            raise EdgevlError(f"rope_parameters.mrope_section {a.mrope_section} must sum to half the rotary "
                              f"dim ({a.rotary_dim} = head_dim x partial_rotary_factor)")
        return a

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def delta(self) -> gd.DeltaDims:
        return gd.DeltaDims(self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                            self.linear_value_head_dim, self.linear_conv_kernel_dim)

    def is_recurrent(self, i: int) -> bool:
        return self.layer_types[i] == "linear_attention"


@dataclass
class VisionArgs:
    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0

    @classmethod
    def from_config(cls, cfg: dict) -> "VisionArgs":
        vc = cfg.get("vision_config") or {}
        rp = vc.get("rope_parameters") or {}
        v = config_args(cls, vc, rope_theta=float(rp.get("rope_theta", 10000.0)))
        if v.hidden_act not in _GELU_TANH:
            raise EdgevlError(f"vision hidden_act {v.hidden_act!r} is not supported (expected gelu or gelu_pytorch_tanh)")
        if v.hidden_size % v.num_heads or v.head_dim % 4:
            raise EdgevlError("vision_config: num_heads must divide hidden_size into heads of a multiple of 4 (2-D RoPE)")
        side = int(round(v.num_position_embeddings ** 0.5))
        if side * side != v.num_position_embeddings:
            raise EdgevlError(f"vision_config.num_position_embeddings {v.num_position_embeddings} is not a square")
        return v

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size


_GELU_TANH = {"gelu_pytorch_tanh": True, "gelu_new": True, "gelu": False}


# ---------------------------------------------------------------------------------------------
# decoder blocks


def rms_norm(ctx: Ctx, x: str, name: str, size: int, eps: float, out: str | None = None) -> str:
    """Qwen3_5RMSNorm: x * rsqrt(mean x^2 + eps) * (1 + w) — gamma = 1 + w at export."""
    return G.rms_norm(ctx.g, x, 1.0 + ctx.array(f"{name}.weight", (size,)), eps, name=name, out=out)


def partial_rope(g: G.Graph, x: str, cos: str, sin: str, rot: int, dim: int, name: str) -> str:
    """NEOX rotate_half on the first ``rot`` dims of each head; the rest pass through."""
    if rot == dim:
        return G.rotary(g, x, cos, sin, interleaved=False, name=name)
    r, rest = G.slice_(g, x, [rot, dim - rot], axis=2, name=f"{name}.split")
    r = G.rotary(g, r, cos, sin, interleaved=False, name=name)
    return G.concat(g, [r, rest], axis=2, name=f"{name}.cat")


def emit_attention(ctx: Ctx, x: str, p: str, a: TextArgs, i: int, cos: str, sin: str, mask: str) -> str:
    """Qwen3_5Attention: q_proj gives per head [query | gate]; q/k RMSNorm (1+w); partial RoPE;
    GQA SDPA with the KV cache; output * sigmoid(gate); o_proj."""
    g, H, nh, nkv, hd = ctx.g, a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim
    q = ctx.linear(x, f"{p}.q_proj", nh * 2 * hd, H, bias=a.attention_bias)
    q = heads_first(g, q, 2 * hd, nh, f"{p}.q")                             # (c=heads, h=seq, w=2hd)
    q, gate = G.slice_(g, q, [hd, hd], axis=2, name=f"{p}.q_gate")         # interleaved per head
    q = rms_norm(ctx, q, f"{p}.q_norm", hd, a.rms_norm_eps)
    k = heads_first(g, ctx.linear(x, f"{p}.k_proj", nkv * hd, H, bias=a.attention_bias), hd, nkv, f"{p}.k")
    k = rms_norm(ctx, k, f"{p}.k_norm", hd, a.rms_norm_eps)
    v = heads_first(g, ctx.linear(x, f"{p}.v_proj", nkv * hd, H, bias=a.attention_bias), hd, nkv, f"{p}.v")
    q = partial_rope(g, q, cos, sin, a.rotary_dim, hd, f"{p}.q_rope")
    k = partial_rope(g, k, cos, sin, a.rotary_dim, hd, f"{p}.k_rope")
    o, _, _ = G.sdpa(g, q, k, v, mask, scale=hd ** -0.5, cache=[f"cache_k{i}", f"cache_v{i}"],
                     cache_out=[f"out_cache_k{i}", f"out_cache_v{i}"], name=f"{p}.sdpa")
    o = G.binary(g, o, G.sigmoid(g, gate, name=f"{p}.gate"), "mul", name=f"{p}.gated")
    o = heads_last(g, o, hd, nh, f"{p}.o")
    return ctx.linear(o, f"{p}.o_proj", H, nh * hd, bias=a.attention_bias)


def emit_gated_delta_net(ctx: Ctx, x: str, p: str, a: TextArgs, i: int) -> tuple[str, dict]:
    """Qwen3_5GatedDeltaNet up to and after its core: the four input projections as one Gemm,
    the causal conv with its window, then (core output fed in by the host hook) the gated
    RMSNorm and out_proj. Returns the output and the host pass's blob names."""
    g, H, d = ctx.g, a.hidden_size, a.delta
    parts = [ctx.tensor(f"{p}.in_proj_qkv.weight", (d.conv_channels, H)),
             ctx.tensor(f"{p}.in_proj_z.weight", (d.values, H)),
             ctx.tensor(f"{p}.in_proj_b.weight", (d.value_heads, H)),
             ctx.tensor(f"{p}.in_proj_a.weight", (d.value_heads, H))]
    proj = G.gemm(g, x, RowStack(parts, f"{p}.in_proj"), ctx.dtype, quant=ctx.quant_for(f"{p}.in_proj"),
                  name=f"{p}.in_proj")
    qkv, z, ba = G.slice_(g, proj, [d.conv_channels, d.values, 2 * d.value_heads], axis=1, name=f"{p}.in_split")
    conv = ctx.array(f"{p}.conv1d.weight", (d.conv_channels, 1, d.conv_kernel)).reshape(d.conv_channels, -1)
    qkv = gd.emit_causal_conv(g, qkv, conv, f"conv_state{i}", f"out_conv_state{i}", f"{p}.conv")
    core = g.input(f"core_out{i}")                                         # the delta rule's output
    y = gd.emit_gated_norm(g, core, z, ctx.array(f"{p}.norm.weight", (d.value_dim,)), d.value_heads,
                           a.rms_norm_eps, f"{p}.norm")
    a_log = ctx.array(f"{p}.A_log", (d.value_heads,)).astype(np.float32)
    core_args = {"layer": i, "qkv": qkv, "ba": ba, "out": f"core_out{i}",
                 "neg_a": [float(v) for v in -np.exp(a_log)],
                 "dt_bias": [float(v) for v in ctx.array(f"{p}.dt_bias", (d.value_heads,))]}
    return ctx.linear(y, f"{p}.out_proj", H, d.values), core_args


def emit_dense_mlp(ctx: Ctx, x: str, p: str, a: TextArgs, i: int) -> tuple[str, None]:
    """Qwen3_5MLP (SwiGLU); no host pass."""
    return swiglu_mlp(ctx, x, p, a.hidden_size, a.intermediate_size), None


def emit_decoder_layer(ctx: Ctx, x: str, a: TextArgs, i: int, cos: str, sin: str, mask: str,
                       prefix: str, mlp=emit_dense_mlp) -> tuple[str, dict | None, dict | None]:
    """``mlp(ctx, normed blob, prefix, args, layer) -> (blob, host pass or None)``: the dense
    SwiGLU here, a sparse MoE block in Qwen3.5-MoE. Returns (output, the core's pass args, the
    MLP's pass)."""
    g, p = ctx.g, f"{prefix}.layers.{i}"
    h = rms_norm(ctx, x, f"{p}.input_layernorm", a.hidden_size, a.rms_norm_eps)
    core = None
    if a.is_recurrent(i):
        h, core = emit_gated_delta_net(ctx, h, f"{p}.linear_attn", a, i)
    else:
        h = emit_attention(ctx, h, f"{p}.self_attn", a, i, cos, sin, mask)
    h = G.binary(g, x, h, "add", name=f"{p}.attn_residual")
    # a stable name: an MoE block's host pass extracts it
    m = rms_norm(ctx, h, f"{p}.post_attention_layernorm", a.hidden_size, a.rms_norm_eps, out=f"layer{i}.mlp_in")
    m, mlp_pass = mlp(ctx, m, f"{p}.mlp", a, i)
    return G.binary(g, h, m, "add", name=f"{p}.mlp_residual", out=f"layer{i}.out"), core, mlp_pass


def build_decoder(ctx: Ctx, a: TextArgs, prefix: str = PREFIX, mlp=emit_dense_mlp) -> GraphInfo:
    """Per layer state: attention layers an SDPA KV cache (``kv``); recurrent layers the conv
    window as a graph input/output (``recurrent``) and the delta-rule matrix on the host
    (``host``), which one host pass per layer updates: it extracts the layer's conv output and
    gate logits, runs the fp32 core net and feeds ``core_out{i}``."""
    g = ctx.g
    x = g.input("embeds")
    mask = g.input("mask")
    cos, sin = g.input("rope_cos"), g.input("rope_sin")
    for i in range(a.num_hidden_layers):
        for name in ([f"conv_state{i}"] if a.is_recurrent(i) else [f"cache_k{i}", f"cache_v{i}"]):
            g.input(name)
    states, passes, gates = [], [], {}
    d = a.delta
    for i in range(a.num_hidden_layers):
        g.section(f"layer{i}")
        x, core, mlp_pass = emit_decoder_layer(ctx, x, a, i, cos, sin, mask, prefix, mlp)
        if core is None:
            states.append(dict(kv_state(i, 2 * a.num_key_value_heads * a.head_dim), layer=i))
            passes += [mlp_pass] if mlp_pass else []
            continue
        gates[str(i)] = {"neg_a": core.pop("neg_a"), "dt_bias": core.pop("dt_bias")}
        # the delta-rule matrix and a window of deferred decode updates (gated_delta.DeltaRuleCore)
        passes.append(gd.declare_recurrent_layer(states, i, d.conv_state_shape, d.host_state_shapes(gd.WINDOW),
                                                 "gated_delta", core, [core["qkv"], core["ba"]]))
        passes += [mlp_pass] if mlp_pass else []
    g.section("norm")
    rms_norm(ctx, x, f"{prefix}.norm", a.hidden_size, a.rms_norm_eps, out="hidden")
    return GraphInfo(
        inputs={"embeds": "embeds", "mask": "mask", "cos": "rope_cos", "sin": "rope_sin"},
        outputs={"hidden": "hidden", "layers": [f"layer{i}.out" for i in range(a.num_hidden_layers)]},
        state=states, passes=passes,
        extra={"delta": a.delta.to_dict(), "gates": gates,
               "rope": {"dim": a.rotary_dim, "theta": a.rope_theta, "mrope_section": a.mrope_section},
               "hidden_size": a.hidden_size, "num_layers": a.num_hidden_layers},
    )


# ---------------------------------------------------------------------------------------------
# vision blocks


def emit_vision_attention(ctx: Ctx, x: str, p: str, v: VisionArgs, cos: str, sin: str) -> str:
    """Qwen3_5VisionAttention: fused qkv, 2-D RoPE over the whole head, full attention (one image)."""
    g, D, nh, hd = ctx.g, v.hidden_size, v.num_heads, v.head_dim
    qkv = ctx.linear(x, f"{p}.qkv", 3 * D, D, bias=True)
    q, k, val = (heads_first(g, t, hd, nh, f"{p}.{n}") for t, n in
                 zip(G.slice_(g, qkv, [D, D, D], axis=1, name=f"{p}.split"), "qkv"))
    q = G.rotary(g, q, cos, sin, interleaved=False, name=f"{p}.q_rope")
    k = G.rotary(g, k, cos, sin, interleaved=False, name=f"{p}.k_rope")
    o = heads_last(g, G.sdpa(g, q, k, val, scale=hd ** -0.5, name=f"{p}.sdpa"), hd, nh, f"{p}.o")
    return ctx.linear(o, f"{p}.proj", D, D, bias=True)


def emit_vision_block(ctx: Ctx, x: str, p: str, v: VisionArgs, i: int, cos: str, sin: str) -> str:
    g, D = ctx.g, v.hidden_size
    h = ctx.layer_norm(x, f"{p}.norm1", D, 1e-6)
    x = G.binary(g, x, emit_vision_attention(ctx, h, f"{p}.attn", v, cos, sin), "add", name=f"{p}.attn_residual")
    h = ctx.layer_norm(x, f"{p}.norm2", D, 1e-6)
    h = ctx.linear(h, f"{p}.mlp.linear_fc1", v.intermediate_size, D, bias=True)
    h = G.gelu(g, h, tanh=_GELU_TANH[v.hidden_act], name=f"{p}.mlp.act")
    h = ctx.linear(h, f"{p}.mlp.linear_fc2", D, v.intermediate_size, bias=True)
    return G.binary(g, x, h, "add", name=f"{p}.mlp_residual", out=f"vision.layer{i}.out")


def emit_merger(ctx: Ctx, x: str, p: str, v: VisionArgs) -> str:
    """Qwen3_5VisionPatchMerger: LayerNorm per patch, 2x2 patches as one row, fc1, erf GELU, fc2."""
    g, D, m2 = ctx.g, v.hidden_size, v.spatial_merge_size ** 2
    x = ctx.layer_norm(x, f"{p}.norm", D, 1e-6)
    x = G.reshape(g, x, D * m2, -1, name=f"{p}.group")
    x = ctx.linear(x, f"{p}.linear_fc1", D * m2, D * m2, bias=True)
    x = G.gelu(g, x, tanh=False, name=f"{p}.act")
    return ctx.linear(x, f"{p}.linear_fc2", v.out_hidden_size, D * m2, bias=True, out="merged")


def build_vision(ctx: Ctx, v: VisionArgs, prefix: str = VISION_PREFIX) -> GraphInfo:
    """Patch embedding (the Conv3d with kernel = stride as one Gemm) + the host-resampled learned
    position table, the blocks, the merger. Inputs (h=patches): ``pixel_values`` (w=C*T*p*p),
    ``vision_pos`` (w=hidden), ``vision_cos``/``vision_sin`` (w=head_dim/2)."""
    g = ctx.g
    pv, pos = g.input("pixel_values"), g.input("vision_pos")
    cos, sin = g.input("vision_cos"), g.input("vision_sin")
    g.section("embed")
    w = ctx.tensor(f"{prefix}.patch_embed.proj.weight",
                   (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size))
    x = G.gemm(g, pv, RowStack([w], "patch_embed"), ctx.dtype, bias=ctx.array(f"{prefix}.patch_embed.proj.bias", (v.hidden_size,)),
               name=f"{prefix}.patch_embed")
    x = G.binary(g, x, pos, "add", name=f"{prefix}.pos_add")
    for i in range(v.depth):
        g.section(f"layer{i}")
        x = emit_vision_block(ctx, x, f"{prefix}.blocks.{i}", v, i, cos, sin)
    g.section("merger")
    emit_merger(ctx, x, f"{prefix}.merger", v)
    return GraphInfo(
        inputs={"pixel_values": "pixel_values", "pos": "vision_pos", "cos": "vision_cos", "sin": "vision_sin"},
        outputs={"merged": "merged", "layers": [f"vision.layer{i}.out" for i in range(v.depth)]},
        extra={"vision_args": asdict(v)},
    )


# ---------------------------------------------------------------------------------------------
# conversion


def convert(ckpt, out, dtype: str, on_tensor, a: TextArgs | None = None, mlp=emit_dense_mlp,
            float_layers=None) -> dict:
    """Decoder, lm_head, the two delta-rule core nets, the vision tower and the embedding table.

    Returns the manifest parts: ``graphs`` (decoder, lm_head, gdn_chunk, vision),
    ``embedding``, ``context``, and ``mtp`` (the multi-token-prediction weights, kept out of the
    decoder: the base for speculative decoding later). ``a`` and ``mlp``: the text arguments and
    MLP emitter of a derived architecture (Qwen3.5-MoE); ``float_layers(name)``: the decoder Gemms
    a q8 package keeps in bf16."""
    cfg = ckpt.config
    a = a or TextArgs.from_config(cfg)
    v = checked_vision_args(ckpt, a.hidden_size)
    prefix = text_prefix(ckpt)
    parts = {"graphs": {}, "context": int(a.max_position_embeddings)}

    g = G.Graph(out / "decoder.bin")
    parts["graphs"]["decoder"] = save_graph(g, out / "decoder.param", build_decoder(weight_ctx(ckpt, g, dtype, on_tensor, float_layers=float_layers), a,
                                                                                    prefix, mlp))
    parts["graphs"]["gdn_chunk"] = gd.build_core_net(out / "gdn_chunk.param", out / "gdn_chunk.bin", a.delta)

    embed_name = f"{prefix}.embed_tokens.weight"
    head, parts["embedding"] = write_head_and_embedding(
        ckpt, out, dtype, on_tensor, a.vocab_size, a.hidden_size, embed_name,
        head_weight_name(ckpt, a.tie_word_embeddings, embed_name))
    parts["graphs"]["lm_head"] = head

    if v is not None:
        # float tower (bf16 for q8 packages): small next to the LM, large M per image
        g = G.Graph(out / "vision.bin")
        info = build_vision(Ctx(ckpt, g, storage_dtype(dtype), None, on_tensor), v)
        side = int(round(v.num_position_embeddings ** 0.5))
        table = ckpt.get(f"{VISION_PREFIX}.pos_embed.weight", (v.num_position_embeddings, v.hidden_size))
        on_tensor(table)
        table.numpy().astype("<f4").tofile(out / "vision_pos_embed.bin")
        info.extra["pos_embed"] = {"file": "vision_pos_embed.bin", "side": side, "dim": v.hidden_size}
        parts["graphs"]["vision"] = save_graph(g, out / "vision.param", info)
        parts["image_token_id"] = int(cfg["image_token_id"])
    mtp = sorted(k for k in ckpt.keys() if k.startswith("mtp."))
    if mtp:
        parts["mtp"] = {"tensors": len(mtp), "note": "multi-token-prediction head, not converted"}
    for k in ("video_token_id", "vision_start_token_id", "vision_end_token_id"):
        if cfg.get(k) is not None:
            parts[k] = int(cfg[k])
    return parts


def checked_vision_args(ckpt, hidden_size: int, prefix: str = VISION_PREFIX, what: str = "qwen3_5"):
    """The vision tower's arguments (None: a text-only checkpoint), with everything a package
    needs to take images checked before a file is written: a package that converts but refuses
    every image (or silently has no tower) is worse than a refusal now."""
    cfg = ckpt.config
    if not cfg.get("vision_config"):
        if f"{prefix}.patch_embed.proj.weight" in ckpt:
            raise EdgevlError("the checkpoint has vision weights but config.json has no vision_config; restore "
                              "config.json's vision_config from the model's original files")
        return None
    v = VisionArgs.from_config(cfg)
    if v.out_hidden_size != hidden_size:
        raise EdgevlError(f"vision_config.out_hidden_size {v.out_hidden_size} != text hidden_size {hidden_size}")
    if cfg.get("image_token_id") is None:
        raise EdgevlError(f"config.json of a {what} model with a vision_config needs image_token_id")
    check_processor_config(ckpt.folder, v)
    return v


def check_processor_config(folder, v: VisionArgs) -> None:
    """preprocessor_config.json must be there and fit the tower: the built-in defaults are
    Qwen2-VL's (patch 14, CLIP mean and std), not this family's, so they are no fallback."""
    from ..processing import qwen_vl
    from ..tokenizer import read_json_object

    p = Path(folder) / "preprocessor_config.json"
    if not p.is_file():
        raise EdgevlError(f"{folder} has no preprocessor_config.json (the image processor's sizes, mean and std), "
                          "which a model with a vision_config needs; copy it from the model's original files")
    try:
        c = qwen_vl.ProcessorConfig.from_dict(read_json_object(p))
    except (TypeError, ValueError, AttributeError) as e:
        raise EdgevlError(f"{p} holds a value of the wrong type ({' '.join(str(e).split())[:80]}); fix or "
                          "re-download it") from None
    if (c.patch_size, c.merge_size, c.temporal_patch_size) != (v.patch_size, v.spatial_merge_size,
                                                               v.temporal_patch_size):
        raise EdgevlError(f"preprocessor_config.json's patch/merge/temporal sizes {c.patch_size}/{c.merge_size}/"
                          f"{c.temporal_patch_size} differ from vision_config's {v.patch_size}/"
                          f"{v.spatial_merge_size}/{v.temporal_patch_size}; the checkpoint files do not belong "
                          "together")


def text_prefix(ckpt) -> str:
    """Where the language model's tensors live: ``model.language_model`` (the VLM checkpoint),
    or ``model`` (a text-only ``Qwen3_5ForCausalLM`` checkpoint)."""
    return PREFIX if f"{PREFIX}.embed_tokens.weight" in ckpt else "model"


# ---------------------------------------------------------------------------------------------
# host side: positions and rotary tables


def rope_positions(input_ids, grids, image_token_id: int, merge: int) -> np.ndarray:
    """M-RoPE positions [3, len(input_ids)] as transformers' ``get_rope_index``: text advances all
    three axes together; the k-th run of image tokens takes the k-th grid (t, h, w in patches) and
    gets T = s, H = s + row, W = s + col on the merged grid; text after it resumes at
    s + max(h, w) / merge. Decoding continues at max(positions) + 1."""
    ids = np.asarray(input_ids, np.int64).reshape(-1)
    out, pos, k = [], 0, 0
    grids = list(grids or [])
    for is_image, run in itertools.groupby(ids == image_token_id):
        n = len(list(run))
        if not is_image:
            out.append(np.broadcast_to(np.arange(pos, pos + n), (3, n)))
            pos += n
            continue
        if k >= len(grids):
            raise EdgevlError(f"the prompt has more image-token runs than images ({len(grids)}); give one "
                              "image per <|vision_start|><|image_pad|>...<|vision_end|> block")
        t, h, w = (int(x) for x in grids[k])
        gh, gw = h // merge, w // merge
        if n != t * gh * gw:
            raise EdgevlError(f"image {k + 1}: the prompt has {n} image tokens but the image gives {t * gh * gw}; "
                              "expand each <|image_pad|> to the image's token count")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out.append(np.stack([tt.ravel() + pos, hh.ravel() + pos, ww.ravel() + pos]))
        pos += max(gh, gw)
        k += 1
    if k != len(grids):
        raise EdgevlError(f"{len(grids)} images were given but the prompt has {k} image-token runs")
    return np.concatenate(out, 1) if out else np.zeros((3, 0), np.int64)


def mrope_tables(positions: np.ndarray, rot_dim: int, theta: float, section) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [seq, rot_dim/2] of interleaved M-RoPE (``Qwen3_5TextRotaryEmbedding``): frequency j
    takes the H position at j = 1, 4, ... < 3*section[1], W at j = 2, 5, ... < 3*section[2], T
    elsewhere; float32 as transformers computes them."""
    inv = (1.0 / (theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim))).astype(np.float32)
    p = np.broadcast_to(np.asarray(positions), (3, np.shape(positions)[-1])).astype(np.float32)
    freqs = p[:, :, None] * inv[None, None, :]
    f = freqs[0].copy()
    for axis in (1, 2):
        idx = slice(axis, 3 * section[axis], 3)
        f[:, idx] = freqs[axis][:, idx]
    return np.cos(f).astype(np.float32), np.sin(f).astype(np.float32)


def vision_rope_tables(gh: int, gw: int, head_dim: int, theta: float, merge: int):
    """cos/sin [gh*gw, head_dim/2] of the vision tower's 2-D RoPE in merge-block patch order:
    [h * f, w * f] with f over head_dim/4 frequencies (``Qwen3_5VisionRotaryEmbedding``)."""
    half = head_dim // 2
    inv = (1.0 / (theta ** (np.arange(0, half, 2, dtype=np.float64) / half))).astype(np.float32)
    rows, cols = _merge_order(gh, gw, merge)
    f = np.concatenate([rows[:, None].astype(np.float32) * inv, cols[:, None].astype(np.float32) * inv], 1)
    return np.cos(f).astype(np.float32), np.sin(f).astype(np.float32)


def _merge_order(gh: int, gw: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch in the processor's order: merge blocks in raster order, raster inside."""
    r = np.arange(gh).reshape(gh // merge, 1, merge, 1)
    c = np.arange(gw).reshape(1, gw // merge, 1, merge)
    rows = np.broadcast_to(r, (gh // merge, gw // merge, merge, merge)).ravel()
    cols = np.broadcast_to(c, (gh // merge, gw // merge, merge, merge)).ravel()
    return rows, cols


def vision_pos_embed(table: np.ndarray, gh: int, gw: int, merge: int) -> np.ndarray:
    """The learned square position table resampled to (gh, gw): bilinear, align_corners, edge
    taps clamped, 4 weighted rows per patch, in merge-block order (transformers'
    ``get_vision_interpolation_indices_and_weights`` + weighted sum)."""
    side = int(round(table.shape[0] ** 0.5))
    rows, cols = _merge_order(gh, gw, merge)

    def taps(index, size):
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        lo = np.floor(src)
        t = lo.astype(np.int64)[:, None] + np.arange(2)
        w = np.clip(1 - np.abs(src[:, None] - lo[:, None] - np.arange(2, dtype=np.float32)), 0, None)
        return np.clip(t, 0, side - 1), w.astype(np.float32)

    ht, hw = taps(rows, gh)
    wt, ww = taps(cols, gw)
    idx = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
    wts = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
    return (table[idx] * wts[:, :, None]).sum(1, dtype=np.float32)


# The default per-image patch budget: the checkpoint's max_pixels, but at most this many patches
# (a 1024x1024 image at patch 16). The tower attends over all of an image's patches at once, so
# memory grows with the square of the patch count; real checkpoints allow 16.7 M pixels (65536
# patches, tens of GB of attention scores). ``--max-image-patches`` raises or lowers it.
DEFAULT_MAX_PATCHES = 4096


class VisionEncoder:
    """One image -> merger rows [N/4, hidden] in prompt order, plus its processor info (with
    ``grid_thw`` and ``merge_size`` for M-RoPE)."""

    def __init__(self, net, info: dict, pos_table_path, processor_config=None):
        from ..processing import qwen_vl

        self.net, self.info = net, info
        self.v = config_args(VisionArgs, info["extra"]["vision_args"], where="manifest.json vision_args")
        pe = info["extra"]["pos_embed"]
        table = np.fromfile(str(pos_table_path), dtype="<f4")
        if table.size != self.v.num_position_embeddings * self.v.hidden_size or pe.get("dim") != self.v.hidden_size:
            raise EdgevlError(f"{pos_table_path} does not hold the vision position table the manifest describes; "
                              "convert the model again")
        self.pos_table = table.reshape(-1, self.v.hidden_size)
        self.cfg = processor_config or qwen_vl.ProcessorConfig()
        if (self.cfg.patch_size, self.cfg.merge_size, self.cfg.temporal_patch_size) != (
                self.v.patch_size, self.v.spatial_merge_size, self.v.temporal_patch_size):
            raise EdgevlError("preprocessor_config.json's patch/merge/temporal sizes differ from the vision "
                              "tower's; the checkpoint files do not belong together")
        self.default_max_patches = max(self.cfg.merge_size ** 2,
                                       min(DEFAULT_MAX_PATCHES, self.cfg.max_pixels // self.cfg.patch_size ** 2))

    def config_for(self, max_image_patches: int | None = None):
        """The processor settings with the patch budget applied (None: the default budget)."""
        from dataclasses import replace

        cfg = self.cfg
        n = self.default_max_patches if max_image_patches is None else int(max_image_patches)
        cap = n * cfg.patch_size ** 2
        if cap < cfg.factor ** 2:
            raise EdgevlError(f"max_image_patches must be at least {cfg.merge_size ** 2} (one merged token), "
                              f"got {max_image_patches}")
        return replace(cfg, max_pixels=min(cfg.max_pixels, cap), min_pixels=min(cfg.min_pixels, cap))

    def preprocess(self, image, max_image_patches: int | None = None) -> dict:
        from ..processing import qwen_vl

        pre = qwen_vl.preprocess(image, self.config_for(max_image_patches))
        pre["max_image_patches"] = self.default_max_patches if max_image_patches is None else int(max_image_patches)
        return pre

    def image_tokens(self, height: int, width: int, max_image_patches=None) -> int:
        """Tokens an image of this size will take, from its size alone (nothing decoded)."""
        from ..processing import qwen_vl

        cfg = self.config_for(max_image_patches)
        th, tw = qwen_vl.smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
        return (th // cfg.patch_size) * (tw // cfg.patch_size) // cfg.merge_size ** 2

    def inputs(self, pre: dict) -> dict:
        v = self.v
        _, gh, gw = pre["grid_thw"]
        cos, sin = vision_rope_tables(gh, gw, v.head_dim, v.rope_theta, v.spatial_merge_size)
        names = self.info["inputs"]
        return {names["pixel_values"]: pre["pixel_values"], names["pos"]: vision_pos_embed(
                    self.pos_table, gh, gw, v.spatial_merge_size), names["cos"]: cos, names["sin"]: sin}

    def __call__(self, image, max_image_patches: int | None = None, extract_layers: bool = False):
        pre = self.preprocess(image, max_image_patches)
        outs = self.info["outputs"]
        names = (outs["layers"] if extract_layers else []) + [outs["merged"]]
        res = self.net.run(self.inputs(pre), names)
        info = {k: pre[k] for k in ("grid_thw", "image_size", "resized_size", "num_image_tokens",
                                    "max_image_patches")}
        info["merge_size"] = self.v.spatial_merge_size
        if extract_layers:
            info["layers"] = res[:-1]
            info["layer_names"] = [f"layer {i}" for i in range(len(res) - 1)]
            info["pixel_values"] = pre["pixel_values"]
        return res[-1], info


# ---------------------------------------------------------------------------------------------
# the PyTorch reference: transformers' own Qwen3_5ForConditionalGeneration (or ForCausalLM)


class Qwen3_5Reference(Reference):
    """transformers' model; images through transformers' own image processor (PIL backend) with
    the checkpoint's preprocessor_config.json and the package's patch budget."""

    def __init__(self, model, folder):
        self.model, self.folder = model, Path(folder)
        self.vl = hasattr(model.model, "visual")
        self.has_vision = self.vl

    def _lm(self):
        return self.model.model.language_model if self.vl else self.model.model

    def _processor(self, max_image_patches: int):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from ..processing import qwen_vl

        p = self.folder / "preprocessor_config.json"
        raw = json.loads(p.read_text()) if p.is_file() else {}
        cfg = qwen_vl.ProcessorConfig.from_dict(raw)
        cap = max_image_patches * cfg.patch_size ** 2
        kw = {k: v for k, v in raw.items() if k not in ("image_processor_type", "processor_class", "min_pixels",
                                                        "max_pixels", "size")}
        kw["size"] = {"shortest_edge": min(cfg.min_pixels, cap), "longest_edge": min(cfg.max_pixels, cap)}
        return Qwen2VLImageProcessorPil(**kw)

    def prepare_images(self, images, infos):
        """[(pixel_values, image_grid_thw)] from transformers' processor (not ours)."""
        from ..processing.image import load_image

        out = []
        for im, info in zip(images, infos):
            enc = self._processor(int(info["max_image_patches"]))(images=[load_image(im)], return_tensors="pt")
            out.append((enc["pixel_values"], enc["image_grid_thw"]))
        return out

    def processor_diff(self, images, infos):
        return max(float(np.abs(pv.numpy() - info["pixel_values"]).max())
                   for (pv, _), info in zip(self.prepare_images(images, infos), infos) if "pixel_values" in info)

    def vision_states(self, images):
        import torch

        visual = self.model.model.visual
        out = []
        for pv, grid in images:
            outs = []
            hooks = [b.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o))
                     for b in visual.blocks]
            try:
                with torch.no_grad():
                    merged = self.model.model.get_image_features(pv, grid, return_dict=True).pooler_output
            finally:
                for h in hooks:
                    h.remove()
            merged = merged[0] if isinstance(merged, (list, tuple)) else merged
            out.append((merged.float().numpy(), [o.float().numpy().reshape(-1, o.shape[-1]) for o in outs]))
        return out

    def _inputs(self, ids, images):
        import torch

        t = torch.tensor([list(ids)])
        kw = {"input_ids": t}
        if images:
            cfg = self.model.config
            kw["pixel_values"] = torch.cat([pv for pv, _ in images])
            kw["image_grid_thw"] = torch.cat([g for _, g in images])
            kw["mm_token_type_ids"] = (t == cfg.image_token_id).int() + 2 * (t == cfg.video_token_id).int()
        if self.vl:
            self.model.model.rope_deltas = None     # positions of a new prompt, not the last one's
        return kw

    def text_states(self, ids, images=None):
        import torch

        outs = []
        hooks = [layer.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o))
                 for layer in self._lm().layers]
        try:
            with torch.no_grad():
                r = self.model(**self._inputs(ids, images), output_hidden_states=True)
                final = self._lm().norm(outs[-1])
        finally:
            for h in hooks:
                h.remove()
        states = [r.hidden_states[0][0].float().numpy()] + [o[0].float().numpy() for o in outs] + [final[0].float().numpy()]
        return states, r.logits[0].float().numpy()

    def start(self, ids, images=None):
        import torch

        with torch.no_grad():
            r = self.model(**self._inputs(ids, images), use_cache=True)
        return r.logits[0, -1].float().numpy(), r.cache if hasattr(r, "cache") else r.past_key_values

    def step(self, token, state):
        import torch

        with torch.no_grad():
            r = self.model(input_ids=torch.tensor([[int(token)]]), cache=state, use_cache=True)
        return r.logits[0, -1].float().numpy(), r.cache if hasattr(r, "cache") else r.past_key_values

    def state_arrays(self, state):
        """Per linear-attention layer: the conv window's last K-1 columns (the ones the conv
        reads; transformers keeps K) and the delta-rule matrix."""
        out = {}
        for i, layer in enumerate(state.layers):
            conv, rec = getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)
            if conv is None or rec is None:
                continue
            conv = conv[0] if isinstance(conv, (list, tuple, dict)) else conv   # one state per layer
            rec = rec[0] if isinstance(rec, (list, tuple, dict)) else rec
            k = self._lm().config.linear_conv_kernel_dim
            out[(i, "conv")] = conv[0, :, -(k - 1):].float().numpy()
            out[(i, "recurrent")] = rec[0].float().numpy()
        return out


# ---------------------------------------------------------------------------------------------
# the architecture

CHAT_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_5_chat_template.jinja").read_text()
ANSWER_HEADER = "<|im_start|>assistant\n"


class Qwen3_5(Architecture):
    name = "qwen3_5"
    has_vision = True
    chat_template = CHAT_TEMPLATE
    reasoning_tokens = ("<think>", "</think>")
    # the MTP head is not converted (nor run) by edgevl; llama.cpp's converter otherwise wants it
    llamacpp_convert_args = ("--no-mtp",)
    tiny_variants = {
        # Hv = 2 Hk, tied, L L L F, attention head 64, GQA 2:1
        "hv2hk-tied-i4-hd64": dict(),
        # Hv = Hk, untied, L F L F, head 128, Dk = Dv, deeper vision
        "hvhk-untied-i2-hd128": dict(linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
                                     head_dim=128, num_attention_heads=4, num_key_value_heads=2,
                                     full_attention_interval=2, tie_word_embeddings=False,
                                     vision=dict(depth=3, hidden_size=48, num_heads=3, intermediate_size=80)),
        # head 256, L L F, Dk > Dv, no GQA, wider hidden
        "hd256-i3": dict(head_dim=256, num_hidden_layers=3, full_attention_interval=3, hidden_size=96,
                         intermediate_size=128, num_key_value_heads=2, linear_key_head_dim=32,
                         linear_value_head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2),
    }

    # transformers' classes of the family (the reference and the tiny checkpoints)
    hf_classes = {"vlm": "Qwen3_5ForConditionalGeneration", "causal_lm": "Qwen3_5ForCausalLM",
                  "config": "Qwen3_5Config", "text_config": "Qwen3_5TextConfig"}
    text_args = TextArgs

    def __init__(self):
        import weakref

        self._headers = weakref.WeakKeyDictionary()   # tokenizer -> the answer header's ids

    def convert(self, ckpt, out, dtype, options, on_tensor) -> dict:
        return convert(ckpt, out, dtype, on_tensor)

    def make_decoder(self, model, net):
        from ..runtime import Decoder

        info = model.manifest["graphs"]["decoder"]
        return Decoder(net, info, self.rope(info), self.hooks(model))

    def hooks(self, model) -> dict:
        """The delta rule of every recurrent layer: decoding in numpy, prefill in the fp32 chunk
        net (packing off: the state stays in the plain layout from run to run, no repacking
        copies). Packages converted before the step moved to numpy also hold a ``gdn_step``
        graph; it is not loaded."""
        gr = model.manifest["graphs"]
        if "gdn_chunk" not in gr:
            raise EdgevlError("manifest.json lacks graphs.gdn_chunk; convert the model again")
        core = gd.DeltaRuleCore(model.open_net("gdn_chunk", dtype="fp32", packing=False), gr["gdn_chunk"])
        gates = {int(i): core.gate_params(g["neg_a"], g["dt_bias"])
                 for i, g in gr["decoder"]["extra"]["gates"].items()}
        return {"gated_delta": gd.core_hook(core, gates)}

    def rope(self, info):
        r = info["extra"].get("rope") or {}
        dim, theta, section = r.get("dim"), r.get("theta"), r.get("mrope_section")
        if not (isinstance(dim, int) and dim > 0 and isinstance(theta, (int, float)) and theta > 0
                and isinstance(section, list) and len(section) == 3 and sum(section) * 2 == dim):
            raise EdgevlError(f"manifest.json graphs.decoder.extra.rope is malformed ({r!r:.80}); convert the model again")
        return lambda positions: mrope_tables(positions, dim, theta, section)

    def positions(self, input_ids, images, image_token_id):
        grids, merge = [], 2
        for k, info in enumerate(images):
            if not isinstance(info, dict) or "grid_thw" not in info:
                raise EdgevlError(f"image {k + 1}: M-RoPE needs the image's grid; pass images as paths/PIL images, "
                                  "or as the (rows, info) pairs Model.encode_image returns")
            grids.append(info["grid_thw"])
            merge = int(info.get("merge_size", merge))
        return rope_positions(input_ids, grids, -1 if image_token_id is None else image_token_id, merge)

    def snapshot_points(self, model, input_ids):
        """After each ``<|im_start|>assistant\\n``: the template re-renders an earlier answer
        without its reasoning, so a conversation's next turn first differs right there."""
        tok = model.tokenizer
        if tok not in self._headers:
            self._headers[tok] = tok.encode(ANSWER_HEADER)
        head = self._headers[tok]
        ids, n = list(input_ids), len(head)
        if not n:
            return []
        return [i + n for i, t in enumerate(ids) if t == head[0] and ids[i:i + n] == head]

    def make_vision(self, model, net):
        from ..package import package_path
        from ..processing import qwen_vl

        info = model.manifest["graphs"]["vision"]
        table = package_path(model.path, info["extra"]["pos_embed"]["file"], model.manifest, "vision table")
        return VisionEncoder(net, info, table, qwen_vl.ProcessorConfig.from_folder(model.path))

    def reference(self, ref_dir, dtype="fp32"):
        import transformers

        cfg = json.loads((Path(ref_dir) / "config.json").read_text())
        text_only = cfg.get("model_type") in self.text_args.text_model_types
        cls = getattr(transformers, self.hf_classes["causal_lm" if text_only else "vlm"])
        return Qwen3_5Reference(cls.from_pretrained(ref_dir, dtype=torch_dtype(dtype)).eval(), ref_dir)

    def make_tiny(self, folder, variant="hv2hk-tied-i4-hd64", seed=0, dtype="fp32", train_steps=0, **overrides):
        """A random (or briefly trained) Qwen3_5ForConditionalGeneration with the real chat template;
        overrides are text_config kwargs (plus ``full_attention_interval``, ``vision`` for the
        vision_config, ``text_only`` for a Qwen3_5ForCausalLM checkpoint)."""
        return make_tiny(folder, seed, dtype, train_steps=train_steps, classes=self.hf_classes,
                         **{**self.tiny_variants.get(variant, {}), **overrides})


# ---------------------------------------------------------------------------------------------
# tiny checkpoints for the tests: transformers' own classes, a small byte-level BPE with Qwen's
# special tokens and pre-tokenizer, the real chat template, generation and preprocessor configs

TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]
TINY_NOT_SPECIAL = ["<think>", "</think>"]   # Qwen decodes these even with skip_special_tokens
# transformers' Qwen3_5Tokenizer pre-tokenizer pattern
PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# CLIP mean/std (not 0.5, so a processor that ignores the file shows), and a pixel budget that
# keeps the tiny vision towers fast
TINY_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    "resample": 3, "rescale_factor": 1 / 255,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "size": {"shortest_edge": 4096, "longest_edge": 131072},
}
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
                   spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                   hidden_act="gelu_pytorch_tanh")


def tiny_tokenizer(vocab_size: int = 400):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from ..testing import CORPUS

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=TINY_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TINY_NOT_SPECIAL])
    return tok


def save_tiny_tokenizer(tok, folder) -> dict:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>", "add_bos_token": False, "clean_up_tokenization_spaces": False,
           "model_max_length": 262144, "errors": "replace", "split_special_tokens": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    ids = {name: tok.token_to_id(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("im_end", "<|im_end|>"), ("endoftext", "<|endoftext|>"))}
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids["im_end"], ids["endoftext"]], "pad_token_id": ids["endoftext"]}))
    (folder / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=1))
    return ids


def _mrope_section(head_dim: int, partial: float = 0.25) -> list[int]:
    """Split the rotary frequencies over T/H/W like the real [11, 11, 10] (sum = rotary dim / 2)."""
    n = int(head_dim * partial) // 2
    h = w = n * 11 // 32 or 1
    return [n - h - w, h, w]


def tiny_text_config(vocab_size: int, **overrides) -> dict:
    hd = overrides.get("head_dim", 64)
    interval = overrides.pop("full_attention_interval", 4)
    cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=2, num_key_value_heads=1, head_dim=hd,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=24, linear_conv_kernel_dim=4, max_position_embeddings=4096,
               rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=None,
               rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                "mrope_section": _mrope_section(hd), "mrope_interleaved": True,
                                "partial_rotary_factor": 0.25})
    cfg.update(overrides)
    n = cfg["num_hidden_layers"]
    cfg.setdefault("layer_types", ["linear_attention" if (i + 1) % interval else "full_attention"
                                   for i in range(n)])
    return cfg


def _init_gdn(model, seed: int):
    """Decays from slow to fast (A in [0.05, 2], dt_bias around 0), as trained models have them;
    the generic init would give every head about the same decay."""
    import torch

    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 2.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


def train_chat(model, tok, steps: int, seed: int = 0):
    """Brief training on chat-formatted CORPUS turns (user: a sentence; assistant: the next one,
    after an empty think block): peaked logits on the prompts the tests render."""
    from ..testing import CORPUS, train_briefly

    sents = CORPUS[: len(CORPUS) // 4]
    ids = []
    for i, s in enumerate(sents):
        ids += tok.encode(f"<|im_start|>user\n{s}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
                          f"{sents[(i + 1) % len(sents)]}<|im_end|>\n").ids
    return train_briefly(model, tok, steps, seed, ids=ids, lr=1e-2)


def make_tiny(folder, seed: int = 0, dtype: str = "fp32", init_scale: float = 0.15, train_steps: int = 0,
              vision: dict | None = None, tie_word_embeddings: bool = True, text_only: bool = False,
              classes: dict | None = None, **text_overrides) -> Path:
    """``classes``: the transformers class names (``Qwen3_5.hf_classes``) of the model to build."""
    import torch
    import transformers

    from ..testing import init_random

    names = classes or Qwen3_5.hf_classes
    (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig) = (
        getattr(transformers, names[k]) for k in ("config", "causal_lm", "vlm", "text_config"))

    folder = Path(folder)
    tok = tiny_tokenizer()
    ids = save_tiny_tokenizer(tok, folder)
    tc = tiny_text_config(tok.get_vocab_size(), tie_word_embeddings=tie_word_embeddings, **text_overrides)
    tc["eos_token_id"] = ids["im_end"]
    torch.manual_seed(seed)
    if text_only:
        (folder / "preprocessor_config.json").unlink()
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**tc)).eval()
    else:
        vc = dict(TINY_VISION, out_hidden_size=tc["hidden_size"], **(vision or {}))
        cfg = Qwen3_5Config(text_config=tc, vision_config=vc, tie_word_embeddings=tie_word_embeddings,
                            **{k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                   "vision_end_token_id")})
        model = Qwen3_5ForConditionalGeneration(cfg).eval()
    model = init_random(model, seed, init_scale)
    _init_gdn(model, seed)
    if train_steps:
        model = train_chat(model, tok, train_steps, seed)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


ARCH = Qwen3_5()
