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
          rule's output, fed by the driver after it ran the core on the layer's extracted inputs)
  outputs ``hidden`` (final-normed), ``layer{i}.out``, ``out_cache_k{i}``/``out_cache_v{i}``,
          per recurrent layer ``out_conv_state{i}`` and the core's inputs (conv output ``qkv`` and
          gate logits ``ba``; names in ``extra["state"]``).
A decode step or a prefill is one extractor over this graph: for each recurrent layer in turn the
driver extracts qkv/ba (ncnn computes everything up to there), runs the core net, and feeds
``core_out{i}``; attention layers run inside the graph with SDPA's own KV cache.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

import numpy as np

from .. import ncnn_graph as G
from ..errors import EdgevlError
from . import gated_delta as gd
from .base import (Ctx, GraphInfo, RowStack, config_args, heads_first, heads_last, rope_theta_of, swiglu_mlp,
                   write_embedding)

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

    @classmethod
    def from_config(cls, cfg: dict) -> "TextArgs":
        tc = dict(cfg.get("text_config") or {})
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
    the causal conv with its window, then (core output fed in) the gated RMSNorm and out_proj."""
    g, H, d = ctx.g, a.hidden_size, a.delta
    parts = [ctx.tensor(f"{p}.in_proj_qkv.weight", (d.conv_channels, H)),
             ctx.tensor(f"{p}.in_proj_z.weight", (d.values, H)),
             ctx.tensor(f"{p}.in_proj_b.weight", (d.value_heads, H)),
             ctx.tensor(f"{p}.in_proj_a.weight", (d.value_heads, H))]
    proj = G.gemm(g, x, RowStack(parts, f"{p}.in_proj"), ctx.dtype, quant=ctx.quant, name=f"{p}.in_proj")
    qkv, z, ba = G.slice_(g, proj, [d.conv_channels, d.values, 2 * d.value_heads], axis=1, name=f"{p}.in_split")
    conv = ctx.array(f"{p}.conv1d.weight", (d.conv_channels, 1, d.conv_kernel)).reshape(d.conv_channels, -1)
    qkv = gd.emit_causal_conv(g, qkv, conv, f"conv_state{i}", f"out_conv_state{i}", f"{p}.conv")
    core = g.input(f"core_out{i}")                                         # the delta rule's output
    y = gd.emit_gated_norm(g, core, z, ctx.array(f"{p}.norm.weight", (d.value_dim,)), d.value_heads,
                           a.rms_norm_eps, f"{p}.norm")
    a_log = ctx.array(f"{p}.A_log", (d.value_heads,)).astype(np.float32)
    state = {"layer": i, "kind": "recurrent", "inputs": [f"conv_state{i}"], "outputs": [f"out_conv_state{i}"],
             "shapes": {"conv": list(d.conv_state_shape), "matrix": list(d.state_shape)},
             "core": {"qkv": qkv, "ba": ba, "out": f"core_out{i}",
                      "neg_a": [float(v) for v in -np.exp(a_log)],
                      "dt_bias": [float(v) for v in ctx.array(f"{p}.dt_bias", (d.value_heads,))]}}
    return ctx.linear(y, f"{p}.out_proj", H, d.values), state


def emit_decoder_layer(ctx: Ctx, x: str, a: TextArgs, i: int, cos: str, sin: str, mask: str,
                       prefix: str) -> tuple[str, dict]:
    g, p = ctx.g, f"{prefix}.layers.{i}"
    h = rms_norm(ctx, x, f"{p}.input_layernorm", a.hidden_size, a.rms_norm_eps)
    if a.is_recurrent(i):
        h, state = emit_gated_delta_net(ctx, h, f"{p}.linear_attn", a, i)
    else:
        h = emit_attention(ctx, h, f"{p}.self_attn", a, i, cos, sin, mask)
        state = {"layer": i, "kind": "attention", "inputs": [f"cache_k{i}", f"cache_v{i}"],
                 "outputs": [f"out_cache_k{i}", f"out_cache_v{i}"],
                 "floats_per_token": 2 * a.num_key_value_heads * a.head_dim}
    h = G.binary(g, x, h, "add", name=f"{p}.attn_residual")
    m = rms_norm(ctx, h, f"{p}.post_attention_layernorm", a.hidden_size, a.rms_norm_eps)
    m = swiglu_mlp(ctx, m, f"{p}.mlp", a.hidden_size, a.intermediate_size)
    return G.binary(g, h, m, "add", name=f"{p}.mlp_residual", out=f"layer{i}.out"), state


def build_decoder(ctx: Ctx, a: TextArgs, prefix: str = PREFIX) -> GraphInfo:
    g = ctx.g
    x = g.input("embeds")
    mask = g.input("mask")
    cos, sin = g.input("rope_cos"), g.input("rope_sin")
    for i in range(a.num_hidden_layers):
        for name in ([f"conv_state{i}"] if a.is_recurrent(i) else [f"cache_k{i}", f"cache_v{i}"]):
            g.input(name)
    states = []
    for i in range(a.num_hidden_layers):
        g.section(f"layer{i}")
        x, st = emit_decoder_layer(ctx, x, a, i, cos, sin, mask, prefix)
        states.append(st)
    g.section("norm")
    rms_norm(ctx, x, f"{prefix}.norm", a.hidden_size, a.rms_norm_eps, out="hidden")
    rec = [s for s in states if s["kind"] == "recurrent"]
    return GraphInfo(
        inputs={"embeds": "embeds", "mask": "mask", "cos": "rope_cos", "sin": "rope_sin"},
        outputs={"hidden": "hidden", "layers": [f"layer{i}.out" for i in range(a.num_hidden_layers)],
                 "recurrent": [n for s in rec for n in (s["core"]["qkv"], s["core"]["ba"], s["outputs"][0])]},
        cache=[s["inputs"] + s["outputs"] for s in states if s["kind"] == "attention"],
        extra={"state": states, "delta": a.delta.to_dict(), "rope": {
                   "dim": a.rotary_dim, "theta": a.rope_theta, "mrope_section": a.mrope_section},
               "hidden_size": a.hidden_size, "num_layers": a.num_hidden_layers,
               "max_position_embeddings": a.max_position_embeddings},
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


def convert(ckpt, out, dtype: str, on_tensor) -> dict:
    """Decoder, lm_head, the two delta-rule core nets, the vision tower and the embedding table.

    Returns the manifest parts: ``graphs`` (decoder, lm_head, gdn_step, gdn_chunk, vision),
    ``embedding``, and ``mtp`` (the multi-token-prediction weights, kept out of the decoder)."""
    from ..convert import Q8_BLOCK, save_graph, storage_dtype
    from .youtu import build_lm_head, lm_head_name  # the sharded head is family-neutral

    cfg = ckpt.config
    a = TextArgs.from_config(cfg)
    sd = storage_dtype(dtype)
    quant = (8, Q8_BLOCK) if dtype == "q8" else None
    parts = {"graphs": {}}

    g = G.Graph(out / "decoder.bin")
    parts["graphs"]["decoder"] = save_graph(g, out / "decoder.param", build_decoder(Ctx(ckpt, g, sd, quant, on_tensor), a))
    for name, rows in (("gdn_step", 1), ("gdn_chunk", gd.CHUNK)):
        parts["graphs"][name] = gd.build_core_net(out / f"{name}.param", out / f"{name}.bin", a.delta, rows)

    embed_name = f"{PREFIX}.embed_tokens.weight"
    head_name = lm_head_name(ckpt, a, PREFIX)
    g = G.Graph(out / "lm_head.bin")
    head = save_graph(g, out / "lm_head.param", build_lm_head(Ctx(ckpt, g, sd, quant, on_tensor), a, head_name))
    parts["graphs"]["lm_head"] = head
    parts["embedding"] = write_embedding(ckpt, out, embed_name, a.vocab_size, a.hidden_size, sd, on_tensor,
                                         head if head_name == embed_name and quant is None else None)

    if cfg.get("vision_config"):
        v = VisionArgs.from_config(cfg)
        if v.out_hidden_size != a.hidden_size:
            raise EdgevlError(f"vision_config.out_hidden_size {v.out_hidden_size} != text hidden_size {a.hidden_size}")
        # float tower (bf16 for q8 packages): small next to the LM, large M per image
        g = G.Graph(out / "vision.bin")
        info = build_vision(Ctx(ckpt, g, sd, None, on_tensor), v)
        side = int(round(v.num_position_embeddings ** 0.5))
        table = ckpt.get(f"{VISION_PREFIX}.pos_embed.weight", (v.num_position_embeddings, v.hidden_size))
        on_tensor(table)
        table.numpy().astype("<f4").tofile(out / "vision_pos_embed.bin")
        info.extra["pos_embed"] = {"file": "vision_pos_embed.bin", "side": side, "dim": v.hidden_size}
        parts["graphs"]["vision"] = save_graph(g, out / "vision.param", info)
    mtp = sorted(k for k in ckpt.keys() if k.startswith("mtp."))
    if mtp:
        parts["mtp"] = {"tensors": len(mtp), "note": "multi-token-prediction head, not converted"}
    for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        if cfg.get(k) is not None:
            parts[k] = int(cfg[k])
    return parts


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


# ---------------------------------------------------------------------------------------------
# host side: the decoder driver and its state


@dataclass
class Snapshot:
    """The recurrent part of a cache at ``length`` tokens (attention KV is truncated instead)."""
    length: int
    next_position: int
    conv: dict
    matrix: dict

    def bytes(self) -> int:
        return int(sum(a.nbytes for d in (self.conv, self.matrix) for a in d.values()))


class HybridCache:
    """Per-layer decoder state: SDPA K/V Mats for attention layers (truncatable by lowering h,
    checked in tests), conv window + delta-rule matrix for recurrent layers (not truncatable:
    :meth:`restore` a :class:`Snapshot` taken at the prefix instead)."""

    def __init__(self, attention: list[int], recurrent: list[int], conv_shape, matrix_shape):
        self.attention, self.recurrent = list(attention), list(recurrent)
        self._conv_shape, self._matrix_shape = tuple(conv_shape), tuple(matrix_shape)
        self.reset()

    def reset(self) -> None:
        """Empty: no K/V, zero conv windows and matrices."""
        from ..runtime import to_mat

        self.kv = {i: None for i in self.attention}
        self.conv = {i: to_mat(np.zeros(self._conv_shape, np.float32)) for i in self.recurrent}
        self.matrix = {i: to_mat(np.zeros(self._matrix_shape, np.float32)) for i in self.recurrent}
        self.length = 0
        self.next_position = 0     # M-RoPE: decoding continues at max(positions) + 1

    def bytes(self) -> int:
        kv = sum(m.w * m.h * m.d * m.c * m.elemsize for pair in self.kv.values() if pair for m in pair)
        fixed = len(self.recurrent) * 4 * (int(np.prod(self._conv_shape)) + int(np.prod(self._matrix_shape)))
        return int(kv + fixed)

    def snapshot(self) -> Snapshot:
        from ..runtime import from_mat

        return Snapshot(self.length, self.next_position, {i: from_mat(m) for i, m in self.conv.items()},
                        {i: from_mat(m) for i, m in self.matrix.items()})

    def restore(self, snap: Snapshot) -> None:
        """Back to ``snap``: recurrent state copied in, K/V cut to its length. Valid only when the
        tokens before snap.length are unchanged since the snapshot was taken."""
        from ..runtime import to_mat

        if snap.length > self.length or set(snap.conv) != set(self.recurrent):
            raise EdgevlError(f"cannot restore a snapshot at {snap.length} tokens into a cache holding "
                              f"{self.length}; the snapshot belongs to another conversation or model")
        self._truncate_kv(snap.length)
        self.conv = {i: to_mat(a) for i, a in snap.conv.items()}
        self.matrix = {i: to_mat(a) for i, a in snap.matrix.items()}
        self.length, self.next_position = snap.length, snap.next_position

    def truncate(self, n: int) -> None:
        """Only to the current length or to 0: the recurrent state cannot be rolled back."""
        if n >= self.length:
            return
        if n != 0 and self.recurrent:
            raise EdgevlError("a recurrent cache cannot be truncated; restore a snapshot taken at the prefix")
        self.reset()

    def _truncate_kv(self, n: int) -> None:
        for i, pair in self.kv.items():
            if pair is None:
                continue
            if n == 0:
                self.kv[i] = None
                continue
            for m in pair:
                m.h = n


class Decoder:
    """Runs the decoder graph with the delta-rule core between its recurrent layers.

    ``forward(embeds [S, H], cache, positions [3, S], extract=())`` -> (hidden [S, H], extras):
    one extractor per call; for each recurrent layer in order it extracts the conv output and the
    gate logits, runs the fp32 core (step net for S = 1, chunk net otherwise) and feeds the core
    output back by name, then extracts the final hidden state, the new K/V and conv windows."""

    def __init__(self, net, info: dict, core: gd.DeltaRuleCore):
        self.net, self.info, self.core = net, info, core
        ex = info["extra"]
        self.rope = ex["rope"]
        self.states = {s["layer"]: s for s in ex["state"]}
        self.n_layers = int(ex["num_layers"])
        self.gates = {i: self.core.gate_params(s["core"]["neg_a"], s["core"]["dt_bias"])
                      for i, s in self.states.items() if s["kind"] == "recurrent"}

    def new_cache(self) -> HybridCache:
        d = self.core.d
        return HybridCache([i for i, s in self.states.items() if s["kind"] == "attention"],
                           list(self.gates), d.conv_state_shape, d.state_shape)

    def rope_tables(self, positions):
        r = self.rope
        return mrope_tables(positions, r["dim"], r["theta"], r["mrope_section"])

    def forward(self, embeds: np.ndarray, cache: HybridCache, positions, extract=()) -> tuple[np.ndarray, dict]:
        import ncnn

        from ..runtime import _extract, causal_mask, from_mat, to_mat

        seq, past = int(embeds.shape[0]), cache.length
        positions = np.asarray(positions, np.int64).reshape(-1, seq)
        if positions.shape[0] == 1:
            positions = np.repeat(positions, 3, 0)
        cos, sin = self.rope_tables(positions)
        names = self.info["inputs"]
        ex = self.net.extractor()
        for k, v in {names["embeds"]: embeds, names["mask"]: causal_mask(past, seq), names["cos"]: cos,
                     names["sin"]: sin}.items():
            ex.input(k, to_mat(v))
        for i in cache.attention:
            if cache.kv[i] is not None:
                for name, m in zip(self.states[i]["inputs"], cache.kv[i]):
                    ex.input(name, m)
        for i in cache.recurrent:
            ex.input(self.states[i]["inputs"][0], cache.conv[i])
        layer_names = self.info["outputs"]["layers"]
        wanted_layers = {n for n in extract if n in layer_names}
        extras, conv, matrix = {}, {}, {}
        for i in range(self.n_layers):
            st = self.states[i]
            if st["kind"] == "recurrent":
                c = st["core"]
                # the conv window first: its producer's input is freed once consumed (light mode)
                got = _extract(ex, [(c["qkv"], 0), (st["outputs"][0], 0), (c["ba"], 0)])
                conv[i] = got[st["outputs"][0]]
                o, matrix[i] = self.core(got[c["qkv"]], got[c["ba"]], self.gates[i], cache.matrix[i])
                ex.input(c["out"], o)
            if layer_names[i] in wanted_layers:
                extras[layer_names[i]] = from_mat(_extract(ex, [(layer_names[i], 0)])[layer_names[i]])
        hidden = self.info["outputs"]["hidden"]
        rest = [n for n in extract if n not in wanted_layers]
        got = _extract(ex, [(hidden, 0)] + [(n, 0) for n in rest]
                       + [(n, 1) for i in cache.attention for n in self.states[i]["outputs"]])
        extras.update({n: from_mat(got[n]) for n in rest})
        for i in cache.attention:
            cache.kv[i] = tuple(got[n] for n in self.states[i]["outputs"])
        cache.conv.update(conv)
        cache.matrix.update(matrix)
        cache.length = past + seq
        cache.next_position = int(positions.max()) + 1 if seq else cache.next_position
        del ex
        return from_mat(got[hidden]), extras


def decode_positions(cache: HybridCache, n: int = 1) -> np.ndarray:
    """Positions of the next ``n`` text tokens: all three axes continue from the cache."""
    return np.broadcast_to(np.arange(cache.next_position, cache.next_position + n), (3, n)).copy()


class VisionEncoder:
    """One image -> merger rows [N/4, hidden] in prompt order, plus its processor info (with
    ``grid_thw`` for M-RoPE)."""

    def __init__(self, net, info: dict, folder, processor_config=None):
        from ..processing import qwen_vl

        self.net, self.info = net, info
        self.v = VisionArgs(**info["extra"]["vision_args"])
        pe = info["extra"]["pos_embed"]
        self.pos_table = np.fromfile(str(folder / pe["file"]), dtype="<f4").reshape(-1, pe["dim"])
        self.cfg = processor_config or qwen_vl.ProcessorConfig.from_folder(folder)
        if (self.cfg.patch_size, self.cfg.merge_size, self.cfg.temporal_patch_size) != (
                self.v.patch_size, self.v.spatial_merge_size, self.v.temporal_patch_size):
            raise EdgevlError("preprocessor_config.json's patch/merge/temporal sizes differ from the vision "
                              "tower's; the checkpoint files do not belong together")

    def preprocess(self, image, max_image_patches: int | None = None) -> dict:
        """``max_image_patches`` caps the patch count below the checkpoint's max_pixels."""
        from dataclasses import replace

        from ..processing import qwen_vl

        cfg = self.cfg
        if max_image_patches is not None:
            cap = int(max_image_patches) * cfg.patch_size ** 2
            if cap < cfg.factor ** 2:
                raise EdgevlError(f"max_image_patches must be at least {cfg.merge_size ** 2} (one merged token), "
                                  f"got {max_image_patches}")
            cfg = replace(cfg, max_pixels=min(cfg.max_pixels, cap), min_pixels=min(cfg.min_pixels, cap))
        return qwen_vl.preprocess(image, cfg)

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
        info = {k: pre[k] for k in ("grid_thw", "image_size", "resized_size", "num_image_tokens")}
        if extract_layers:
            info["layers"] = res[:-1]
            info["pixel_values"] = pre["pixel_values"]
        return res[-1], info
