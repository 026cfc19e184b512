"""The Youtu MoE hybrid (``YoutuVLMoEForConditionalGeneration``): KDA linear attention + gated
MLA, a quantile-balanced mixture of experts, and a Qwen3-VL vision tower — as ncnn graphs plus the
host driver that runs them.

No modeling code or checkpoint of this model is public (spec qwen3_5_and_youtu_moe.md §2). The
PyTorch reference is ``edgevl/reference/youtu_moe.py`` (transformers' ``kimi_linear``, ``youtu``
and ``qwen3_vl`` blocks with the changes the llama.cpp patch describes); hold this file next to
it. The checkpoint layout is ASSUMED and lives in one table (``youtu_moe_layout.py``).

Per decoder layer (``layer_types`` / ``mlp_layer_types``):

- **KDA** (``KDAttention``): q/k/v, the forget gate's ``f_a``, ``b_proj`` and the output gate's
  ``g_a`` as one Gemm; the causal depthwise conv over q|k|v with its window (``gated_delta``'s
  emitter); then a host pass runs the delta rule with a *per-channel* decay in fp32 numpy
  (:class:`KdaCore`), one token at a time with the state updates deferred in a window, as
  ``gated_delta`` decodes GDN — the chunked form needs [C, C, Dk] pairwise decays and is not
  practical in ncnn (spec §3.1), so prefill is token by token too; then ``o_norm`` (RMSNorm x
  sigmoid(g_b(g_a x))) and ``o_proj`` back in the graph.
- **Gated MLA** (``GatedMLA``): youtu's MLA (``youtu.emit_mla_core``), interleaved M-RoPE on the
  rope dims (host cos/sin, ``qwen3_5.mrope_tables``), the attention output times
  sigmoid(``g_proj`` x) per head (or per channel) before ``o_proj``.
- **MLP**: layer 0 a dense SwiGLU; the others ``moe.emit_sparse_moe`` (router logits + the
  shared expert in the graph) with quantile-balanced routing on the host: experts = top-k of
  logits - qb_beta[modality], modality 1 for rows holding an image embedding (the decoder hands
  the rows' token ids to the pass), weights = normalised sigmoid(logits) x routed_scaling_factor.

Vision: transformers' ``Qwen3VLVisionModel`` is Qwen3.5's tower plus deepstack, so without
deepstack layers it is ``qwen3_5.build_vision`` (tensors under ``visual.``); a config naming
deepstack layers is refused. The base model emits ``</think>`` as its first token: the reasoning
markers make it a thinking-block close, never text.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import ncnn_graph as G
from ..errors import EdgevlError
from . import gated_delta as gd
from . import moe, qwen3_5, youtu
from .base import (Ctx, GraphInfo, RowStack, config_args, head_weight_name, kv_state,
                   rope_theta_of, save_graph, storage_dtype, swiglu_mlp, weight_ctx, write_head_and_embedding)
from .protocol import torch_dtype
from .youtu import YOUTU_VL_TEMPLATE
from .youtu_moe_layout import CHECKPOINT_LAYOUT, CheckpointLayout

PREFIX = "model"
VISION_PREFIX = "visual"
LAYER_KINDS = ("linear_attention", "full_attention")
MLP_KINDS = ("dense", "sparse")
LAYOUT_NOTE = ("the Youtu MoE checkpoint layout is an assumption (no checkpoint is public yet): tensor names "
               "follow edgevl/models/youtu_moe_layout.py")


@dataclass
class TextArgs:
    vocab_size: int
    hidden_size: int = 3072
    intermediate_size: int = 12288             # layer 0's dense MLP
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    q_lora_rank: int | None = 1024
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    mla_output_gate: str | None = "headwise"
    linear_num_heads: int = 32
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    kda_gate_lower_bound: object = -5.0        # negative: checked in from_config
    num_experts: int = 256
    num_experts_per_token: int = 8
    moe_intermediate_size: int = 1024
    num_shared_experts: int = 1
    routed_scaling_factor: float = 2.83
    num_modalities: int = 2
    layer_types: list | None = None
    mlp_layer_types: list | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_theta: float = 10000.0
    mrope_section: list | None = None

    @classmethod
    def from_config(cls, cfg: dict) -> "TextArgs":
        rp = cfg.get("rope_parameters") or {}
        a = config_args(cls, cfg, rope_theta=rope_theta_of(cfg),
                        mrope_section=rp.get("mrope_section") if isinstance(rp, dict) else None)
        n = a.num_hidden_layers
        if a.layer_types is None:   # the real model's [KDA, KDA, KDA, MLA] groups
            a.layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
        if a.mlp_layer_types is None:
            a.mlp_layer_types = ["dense" if i == 0 else "sparse" for i in range(n)]
        for key, kinds in (("layer_types", LAYER_KINDS), ("mlp_layer_types", MLP_KINDS)):
            v = getattr(a, key)
            if len(v) != n or any(t not in kinds for t in v):
                raise EdgevlError(f"config.json field {key} must list {n} entries of {' / '.join(kinds)}")
        if a.hidden_act != "silu":
            raise EdgevlError(f"hidden_act {a.hidden_act!r} is not supported for Youtu MoE models (expected silu)")
        if a.num_key_value_heads not in (None, a.num_attention_heads):
            raise EdgevlError("MLA expands K/V per head: num_key_value_heads must equal num_attention_heads")
        if a.mla_output_gate not in (None, "headwise", "elementwise"):
            raise EdgevlError(f"mla_output_gate must be headwise, elementwise or null, got {a.mla_output_gate!r:.40}")
        lb = a.kda_gate_lower_bound
        if isinstance(lb, bool) or not isinstance(lb, (int, float)) or not math.isfinite(lb) or lb >= 0:
            raise EdgevlError(f"kda_gate_lower_bound must be a negative number (the real model's is -5), got {lb!r:.40}")
        if a.qk_rope_head_dim % 2:
            raise EdgevlError(f"qk_rope_head_dim must be even, got {a.qk_rope_head_dim}")
        if a.mrope_section is None:
            a.mrope_section = [a.qk_rope_head_dim // 2, 0, 0]
        if (not isinstance(a.mrope_section, list) or len(a.mrope_section) != 3
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in a.mrope_section)
                or sum(a.mrope_section) * 2 != a.qk_rope_head_dim):
            raise EdgevlError(f"rope_parameters.mrope_section {a.mrope_section!r:.60} must be three integers summing "
                              f"to qk_rope_head_dim/2 = {a.qk_rope_head_dim // 2}")
        if isinstance(rp, dict) and rp.get("mrope_interleaved") is False:
            raise EdgevlError("only interleaved M-RoPE is described for Youtu MoE (rope_parameters.mrope_interleaved)")
        if a.num_experts_per_token > a.num_experts:
            raise EdgevlError(f"num_experts_per_token {a.num_experts_per_token} exceeds num_experts {a.num_experts}")
        return a

    @property
    def mla(self) -> youtu.ModelArgs:
        """The MLA blocks' arguments, as youtu's builder reads them."""
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim",
                "rms_norm_eps", "rope_interleave", "attention_bias", "rope_theta")
        return youtu.ModelArgs(**{k: getattr(self, k) for k in keys})

    @property
    def kda(self) -> gd.DeltaDims:
        h, d = self.linear_num_heads, self.linear_head_dim
        return gd.DeltaDims(h, h, d, d, self.linear_conv_kernel_dim)

    def is_recurrent(self, i: int) -> bool:
        return self.layer_types[i] == "linear_attention"

    def is_sparse(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "sparse"


class LayoutView:
    """The checkpoint seen by its internal tensor names: every read goes through the assumed
    layout's renames (``youtu_moe_layout.py``), so the builders below use one set of names."""

    def __init__(self, ckpt, layout: CheckpointLayout = CHECKPOINT_LAYOUT):
        self.ckpt, self.layout = ckpt, layout
        self.config, self.folder = ckpt.config, ckpt.folder

    def get(self, name: str, shape=None):
        return self.ckpt.get(self.layout.name(name), shape)

    def numpy(self, name: str, shape=None):
        return self.ckpt.numpy(self.layout.name(name), shape)

    def __contains__(self, name: str) -> bool:
        return self.layout.name(name) in self.ckpt

    def keys(self):
        return self.ckpt.keys()


# ---------------------------------------------------------------------------------------------
# decoder blocks


def emit_kda(ctx: Ctx, x: str, p: str, a: TextArgs, i: int) -> tuple[str, dict]:
    """KDAttention up to and after its core: the six input projections as one Gemm, the causal
    conv with its window, the forget-gate logits f_b(f_a x) | b_proj x (the host pass reads
    them with the conv output and feeds ``core_out{i}``), then o_norm x sigmoid(g_b(g_a x)) and
    o_proj. Returns the output and the host pass's args."""
    g, H, d = ctx.g, a.hidden_size, a.kda
    hd, heads, dk = d.keys, d.key_heads, d.key_dim
    parts = [ctx.tensor(f"{p}.{n}.weight", (rows, H)) for n, rows in
             (("q_proj", hd), ("k_proj", hd), ("v_proj", hd), ("forget_gate.f_a_proj", dk), ("b_proj", heads),
              ("g_a_proj", dk))]
    proj = G.gemm(g, x, RowStack(parts, f"{p}.in_proj"), ctx.dtype, quant=ctx.quant_for(f"{p}.in_proj"),
                  name=f"{p}.in_proj")
    qkv, fa, b, ga = G.slice_(g, proj, [3 * hd, dk, heads, dk], axis=1, name=f"{p}.in_split")
    conv = ctx.array(f"{p}.conv1d.weight", (3 * hd, 1, d.conv_kernel)).reshape(3 * hd, -1)
    qkv = gd.emit_causal_conv(g, qkv, conv, f"conv_state{i}", f"out_conv_state{i}", f"{p}.conv")
    f = ctx.linear(fa, f"{p}.forget_gate.f_b_proj", hd, dk)
    fb = G.concat(g, [f, b], axis=1, name=f"{p}.gate_logits")               # (h=seq, w=HD+H)
    core = g.input(f"core_out{i}")                                         # the delta rule's output
    gate = ctx.linear(ga, f"{p}.g_b_proj", hd, dk)
    y = gd.emit_gated_norm(g, core, gate, ctx.array(f"{p}.o_norm.weight", (dk,)), heads, a.rms_norm_eps,
                           f"{p}.o_norm", gate_act="sigmoid")
    a_log = ctx.array(f"{p}.forget_gate.A_log").astype(np.float32).reshape(-1)
    if a_log.size != heads:
        raise EdgevlError(f"{p}.forget_gate.A_log has {a_log.size} values; expected one per head ({heads})")
    core_args = {"layer": i, "qkv": qkv, "fb": fb, "out": f"core_out{i}",
                 "rate": [float(v) for v in np.repeat(np.exp(a_log), dk)],   # exp(A_log) per channel
                 "dt_bias": [float(v) for v in ctx.array(f"{p}.forget_gate.dt_bias", (hd,))]}
    return ctx.linear(y, f"{p}.o_proj", H, hd), core_args


def emit_gated_mla(ctx: Ctx, x: str, p: str, a: TextArgs, i: int, cos: str, sin: str, mask: str) -> str:
    """GatedMLA: youtu's MLA, its output times sigmoid(g_proj x) (one scalar per head, or per
    channel) before o_proj."""
    g, m = ctx.g, a.mla
    nh, vd = m.num_attention_heads, m.v_head_dim
    o = youtu.emit_mla_core(ctx, x, p, m, i, cos, sin, mask, absorbed=False)  # (h=seq, w=nh*vd)
    if a.mla_output_gate is not None:
        per = 1 if a.mla_output_gate == "headwise" else vd
        gate = G.sigmoid(g, ctx.linear(x, f"{p}.g_proj", nh * per, a.hidden_size), name=f"{p}.g_sigmoid")
        gate = G.reshape(g, gate, per, nh, -1, name=f"{p}.g_heads")        # (c=seq, h=heads, w=1|vd)
        o = G.reshape(g, o, vd, nh, -1, name=f"{p}.o_heads")
        o = G.binary(g, o, gate, "mul", name=f"{p}.gated")
        o = G.reshape(g, o, nh * vd, -1, name=f"{p}.o_flat")
    return ctx.linear(o, f"{p}.o_proj", a.hidden_size, nh * vd, bias=a.attention_bias)


def emit_decoder_layer(ctx: Ctx, x: str, a: TextArgs, i: int, cos: str, sin: str, mask: str,
                       prefix: str = PREFIX) -> tuple[str, dict | None, dict | None]:
    """h = x + mixer(norm(x)); out = h + mlp(norm(h)). Returns (output, the KDA core's pass args
    or None, the MoE pass or None)."""
    g, p = ctx.g, f"{prefix}.layers.{i}"
    h = ctx.rms_norm(x, f"{p}.input_layernorm", a.hidden_size, a.rms_norm_eps)
    core = None
    if a.is_recurrent(i):
        h, core = emit_kda(ctx, h, f"{p}.self_attn", a, i)
    else:
        h = emit_gated_mla(ctx, h, f"{p}.self_attn", a, i, cos, sin, mask)
    h = G.binary(g, x, h, "add", name=f"{p}.attn_residual")
    # a stable name: the MoE block's host pass extracts it
    m = ctx.rms_norm(h, f"{p}.post_attention_layernorm", a.hidden_size, a.rms_norm_eps, out=f"layer{i}.mlp_in")
    mlp_pass = None
    if a.is_sparse(i):
        shared = {"prefix": f"{p}.mlp.shared_experts", "inter": a.moe_intermediate_size * a.num_shared_experts,
                  "gate": None} if a.num_shared_experts else None
        m, mlp_pass = moe.emit_sparse_moe(ctx, m, i, f"{p}.mlp", a.hidden_size, a.num_experts, shared=shared)
        mlp_pass["ids"] = True   # the rows' token ids give their modality (qb_beta row)
    else:
        m = swiglu_mlp(ctx, m, f"{p}.mlp", a.hidden_size, a.intermediate_size)
    return G.binary(g, h, m, "add", name=f"{p}.mlp_residual", out=f"layer{i}.out"), core, mlp_pass


def build_decoder(ctx: Ctx, a: TextArgs, prefix: str = PREFIX) -> GraphInfo:
    """Per layer state: MLA layers an SDPA KV cache; KDA layers the conv window (graph in/out)
    and, on the host, the delta-rule matrix S [H, Dk, Dv] with a window of deferred updates,
    updated by the layer's host pass."""
    g = ctx.g
    x = g.input("embeds")
    mask = g.input("mask")
    cos, sin = g.input("rope_cos"), g.input("rope_sin")
    for i in range(a.num_hidden_layers):
        for name in ([f"conv_state{i}"] if a.is_recurrent(i) else [f"cache_k{i}", f"cache_v{i}"]):
            g.input(name)
    states, passes, gates = [], [], {}
    d, m = a.kda, a.mla
    for i in range(a.num_hidden_layers):
        g.section(f"layer{i}")
        x, core, mlp_pass = emit_decoder_layer(ctx, x, a, i, cos, sin, mask, prefix)
        if core is None:
            states.append(dict(kv_state(i, m.num_attention_heads * (m.qk_head_dim + m.v_head_dim)), layer=i))
        else:
            gates[str(i)] = {"rate": core.pop("rate"), "dt_bias": core.pop("dt_bias")}
            # the delta-rule matrix and a window of deferred updates (KdaCore)
            passes.append(gd.declare_recurrent_layer(states, i, d.conv_state_shape, kda_state_shapes(d), "kda",
                                                     core, [core["qkv"], core["fb"]]))
        passes += [mlp_pass] if mlp_pass else []
    g.section("norm")
    ctx.rms_norm(x, f"{prefix}.norm", a.hidden_size, a.rms_norm_eps, out="hidden")
    return GraphInfo(
        inputs={"embeds": "embeds", "mask": "mask", "cos": "rope_cos", "sin": "rope_sin"},
        outputs={"hidden": "hidden", "layers": [f"layer{i}.out" for i in range(a.num_hidden_layers)]},
        state=states, passes=passes,
        extra={"kda": d.to_dict(), "gates": gates, "lower_bound": float(a.kda_gate_lower_bound),
               "rope": {"dim": a.qk_rope_head_dim, "theta": a.rope_theta, "mrope_section": a.mrope_section},
               "hidden_size": a.hidden_size, "num_layers": a.num_hidden_layers},
    )


# ---------------------------------------------------------------------------------------------
# the KDA delta rule (host, fp32 numpy)

KDA_WINDOW = 16     # decoded tokens whose state updates are deferred (folded into S0 together)


def kda_state_shapes(d: gd.DeltaDims, window: int = KDA_WINDOW) -> list:
    """A KDA layer's host state: S0 [H, Dk, Dv]; the pending keys, deltas and per-channel
    cumulative log-decays of up to ``window`` tokens; the log-decay since S0; the number pending."""
    h, dk, dv = d.value_heads, d.key_dim, d.value_dim
    return [[h, dk, dv], [h, window, dk], [h, window, dv], [h, window, dk], [h, 1, dk], [1]]


class KdaCore(gd.WindowedCore):
    """A KDA layer's delta rule (``recurrent_kimi_delta_attention`` with the lower-bounded gate)
    in fp32 numpy, one token at a time, prefill too (no practical chunked form; see the module).

    g = lb * sigmoid(exp(A_log) * (f + dt_bias)) per channel; S <- diag(e^g) S (rows along Dk);
    delta = beta (v - k^T S); S <- S + k delta^T; o = q^T S; q and k l2-normalised (q also
    scaled by Dk^-1/2). As in ``gated_delta.DeltaRuleCore``, S is not rewritten every token: with
    per-channel cumulative log-decays c_j since S0, S_t = diag(e^c_t) S0 + sum_j
    diag(e^(c_t - c_j)) k_j delta_j^T, so a token reads S0 once (2 MiB per layer at the real
    shape) plus a small window, and the window folds into S0 every ``KDA_WINDOW`` tokens and at
    the end of a prompt (S0 is then the exact state, as the reference's cache holds it). At the
    real shape (1 thread, caches cold, ``benchmarks/kda_core.py``) a token and layer costs 0.40 ms
    decoding and 0.19 ms in a prompt; the ncnn step net this replaced, which rewrote S every
    token, 0.91 and 0.72 ms."""

    def __init__(self, d: gd.DeltaDims, lower_bound: float, window: int = KDA_WINDOW):
        self.d, self.lower_bound, self.window = d, float(lower_bound), int(window)
        self.shapes = kda_state_shapes(d, self.window)

    def consts(self, rate, dt_bias) -> tuple:
        """A layer's exp(A_log) per channel and dt_bias, as float32 vectors made once at load."""
        return (np.ascontiguousarray(rate, np.float32).reshape(-1),
                np.ascontiguousarray(dt_bias, np.float32).reshape(-1))

    def fold(self, state) -> tuple:
        """S0 <- diag(e^c_n) S0 + sum_j diag(e^(c_n - c_j)) k_j delta_j^T, in place; empties the window."""
        s0, wk, wd, wc, c, n = state
        m = int(n[0])
        if m == 0:
            return state
        s0 *= np.exp(c).transpose(0, 2, 1)                           # (H, Dk, 1): rows along Dk
        kd = wk[:, :m] * np.exp(c - wc[:, :m])                        # (H, m, Dk)
        s0 += np.matmul(kd.transpose(0, 2, 1), wd[:, :m])
        for a in (wk, wd, wc, c):
            a[...] = 0
        n[0] = 0
        return state

    def __call__(self, qkv, fb, consts: tuple, state: tuple):
        """qkv [seq, 3HD] and fb [seq, HD+H] (arrays or Mats); returns (o [seq, HD], the state)."""
        x = np.asarray(qkv, np.float32).reshape(-1, 3 * self.d.keys)
        f = np.asarray(fb, np.float32).reshape(len(x), -1)
        o = np.empty((len(x), self.d.values), np.float32)
        for t in range(len(x)):
            o[t] = self._step(x[t], f[t], consts, state)
        if len(x) > 1:
            self.fold(state)
        return o, state

    def _step(self, x, fb, consts, state) -> np.ndarray:
        d = self.d
        h, dk, hd = d.key_heads, d.key_dim, d.keys
        s0, wk, wd, wc, c, n = state
        q, k, v = (x[j * hd:(j + 1) * hd].reshape(h, dk) for j in range(3))
        q = q * (dk ** -0.5 / np.sqrt(np.einsum("hd,hd->h", q, q) + gd.L2NORM_EPS))[:, None]
        k = k * (1.0 / np.sqrt(np.einsum("hd,hd->h", k, k) + gd.L2NORM_EPS))[:, None]
        rate, dt = consts
        g = self.lower_bound / (1.0 + np.exp(-(rate * (fb[:hd] + dt))))       # lb * sigmoid, (HD,)
        beta = 1.0 / (1.0 + np.exp(-fb[hd:hd + h]))
        ct = c[:, 0] + g.reshape(h, dk)                                       # (H, Dk)
        qk = np.stack((q, k), axis=1)                                         # (H, 2, Dk)
        i = int(n[0])
        base = np.matmul(qk * np.exp(ct)[:, None, :], s0)                     # (H, 2, Dv)
        if i:
            kw = wk[:, :i] * np.exp(ct[:, None, :] - wc[:, :i])               # (H, i, Dk)
            base += np.matmul(np.matmul(qk, kw.transpose(0, 2, 1)), wd[:, :i])
        delta = (v - base[:, 1]) * beta[:, None]
        o = base[:, 0] + delta * np.einsum("hd,hd->h", q, k)[:, None]
        wk[:, i] = k
        wd[:, i] = delta
        wc[:, i] = ct
        c[:, 0] = ct
        n[0] = i + 1
        if i + 1 == self.window:
            self.fold(state)
        return o.reshape(-1)


def kda_hook(core: KdaCore, consts: dict):
    """The decoder's host pass for a KDA layer: conv output and gate logits in, the delta rule
    run on the layer's ``host`` state, the core output fed back by name."""
    def hook(blobs, seq, state, layer, qkv, fb, out):
        o, st = core(blobs[qkv], blobs[fb], consts[layer], core.as_state(state.get()))
        state.set(st)
        return {out: o}
    return hook


# ---------------------------------------------------------------------------------------------
# conversion


def layer_experts(ckpt: LayoutView, prefix: str, a: TextArgs, on_tensor):
    """(gate_up, down) lazy sources of each expert of one layer, ``prefix`` = ``...layers.{i}.mlp.experts``,
    stored as the layout says (fused [E, 2I, H] / [E, H, I], or per expert)."""
    H, I, E, lay = a.hidden_size, a.moe_intermediate_size, a.num_experts, ckpt.layout
    if lay.experts == "fused":
        return [moe.fused_expert(ckpt.ckpt, lay.name(f"{prefix}.gate_up_proj"), lay.name(f"{prefix}.down_proj"),
                                 e, H, I, E, on_tensor) for e in range(E)]
    return [moe.split_expert(ckpt.ckpt, lay.name(f"{prefix}.{e}"), H, I, on_tensor, names=lay.expert_names)
            for e in range(E)]


def convert(ckpt, out, dtype: str, options: dict, on_tensor, layout: CheckpointLayout = CHECKPOINT_LAYOUT) -> dict:
    """experts.bin/.param (with each layer's qb_beta), the decoder, lm_head,
    the vision tower and the embedding table; the manifest parts."""
    cfg = ckpt.config
    dense = moe.dense_float_layers(dtype, options.get("dense", "auto"))   # checked before any file is written
    a = TextArgs.from_config(cfg)
    view = LayoutView(ckpt, layout)
    print(f"note: {LAYOUT_NOTE}", file=sys.stderr)
    v = qwen3_5.checked_vision_args(view, a.hidden_size, VISION_PREFIX, "Youtu MoE")   # before anything is written
    if v is not None and (cfg["vision_config"].get("deepstack_visual_indexes") or []) != []:
        raise EdgevlError("vision_config.deepstack_visual_indexes is not empty: deepstack vision features are "
                          "not supported for Youtu MoE yet")
    parts = {"graphs": {}, "context": int(a.max_position_embeddings),
             "checkpoint_layout": {"assumed": True, "note": LAYOUT_NOTE}}
    # the experts first: a checkpoint that lacks some fails before the long decoder pass
    w = moe.ExpertWriter(out, a.hidden_size, a.moe_intermediate_size, a.num_experts,
                         moe.expert_dtype(dtype, options.get("experts", "auto")))
    for i in range(a.num_hidden_layers):
        if a.is_sparse(i):
            p = f"{PREFIX}.layers.{i}.mlp"
            bias = view.get(f"{p}.gate.qb_beta", (a.num_modalities, a.num_experts))
            on_tensor(bias)
            w.add_layer(i, layer_experts(view, f"{p}.experts", a, on_tensor), bias=bias.numpy())
    modality_ids = [int(cfg[k]) for k in ("image_token_id", "video_token_id") if cfg.get(k) is not None]
    parts["experts"] = w.finish({"kind": "sigmoid_biased", "top_k": a.num_experts_per_token,
                                 "scale": a.routed_scaling_factor, "eps": 1e-20,
                                 "modality_token_ids": modality_ids})

    g = G.Graph(out / "decoder.bin")
    # q8: the routed experts (most of the weights) and the head in int8, the dense path as
    # ``dense`` says (moe.dense_float_layers; bf16 by default)
    ctx = weight_ctx(view, g, dtype, on_tensor, float_layers=dense)
    parts["graphs"]["decoder"] = save_graph(g, out / "decoder.param", build_decoder(ctx, a))
    embed_name = f"{PREFIX}.embed_tokens.weight"
    head, parts["embedding"] = write_head_and_embedding(
        view, out, dtype, on_tensor, a.vocab_size, a.hidden_size, embed_name,
        head_weight_name(view, a.tie_word_embeddings, embed_name))
    parts["graphs"]["lm_head"] = head

    if v is not None:
        # float tower (bf16 for q8 packages): small next to the LM, large M per image
        g = G.Graph(out / "vision.bin")
        info = qwen3_5.build_vision(Ctx(view, g, storage_dtype(dtype), None, on_tensor), v, VISION_PREFIX)
        side = int(round(v.num_position_embeddings ** 0.5))
        table = view.get(f"{VISION_PREFIX}.pos_embed.weight", (v.num_position_embeddings, v.hidden_size))
        on_tensor(table)
        table.numpy().astype("<f4").tofile(out / "vision_pos_embed.bin")
        info.extra["pos_embed"] = {"file": "vision_pos_embed.bin", "side": side, "dim": v.hidden_size}
        parts["graphs"]["vision"] = save_graph(g, out / "vision.param", info)
        parts["image_token_id"] = int(cfg["image_token_id"])
    for k in ("video_token_id", "vision_start_token_id", "vision_end_token_id"):
        if cfg.get(k) is not None:
            parts[k] = int(cfg[k])
    return parts


# ---------------------------------------------------------------------------------------------
# the PyTorch reference (edgevl/reference/youtu_moe.py) behind the protocol's Reference


class YoutuMoeReference(qwen3_5.Qwen3_5Reference):
    """The project's reference model; images through transformers' Qwen2-VL PIL processor with
    the checkpoint's preprocessor_config.json and the package's patch budget (Qwen3.5's)."""

    def __init__(self, model, folder):
        self.model, self.folder = model, Path(folder)
        self.vl = self.has_vision = True

    @staticmethod
    def _cat(images):
        import torch

        if not images:
            return None, None
        return torch.cat([pv for pv, _ in images]), torch.cat([g for _, g in images])

    def vision_states(self, images):
        import torch

        visual = self.model.visual
        out = []
        for pv, grid in images:
            outs = []
            hooks = [b.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o))
                     for b in visual.blocks]
            try:
                with torch.no_grad():
                    merged, _ = self.model.vision_features(pv, grid)
            finally:
                for h in hooks:
                    h.remove()
            out.append((merged.float().numpy(), [o.float().numpy().reshape(-1, o.shape[-1]) for o in outs]))
        return out

    def text_states(self, ids, images=None):
        states, logits = self.model.text_states(list(ids), *self._cat(images))
        return [s.float().numpy() for s in states], logits.float().numpy()

    def start(self, ids, images=None):
        logits, state = self.model.start(list(ids), *self._cat(images))
        return logits.numpy(), state

    def step(self, token, state):
        logits, state = self.model.step(int(token), state)
        return logits.numpy(), state

    def state_bytes(self, state) -> int:
        return super().state_bytes(state.cache)

    def state_arrays(self, state):
        """Per KDA layer: the conv window's last K-1 columns and the delta-rule matrix."""
        out = {}
        k = self.model.tc.kimi.linear_conv_kernel_dim
        for i, layer in enumerate(state.cache.layers):
            conv, rec = getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)
            if not conv or not rec:
                continue
            conv = conv[0] if isinstance(conv, (list, tuple, dict)) else conv
            rec = rec[0] if isinstance(rec, (list, tuple, dict)) else rec
            out[(i, "conv")] = conv[0, :, -(k - 1):].float().numpy()
            out[(i, "recurrent")] = rec[0].float().numpy()
        return out


# ---------------------------------------------------------------------------------------------
# the architecture

ANSWER_HEADER = "<|begin_of_text|>assistant\n"


class YoutuMoe(moe.MoeArchitecture, qwen3_5.Qwen3_5):
    """Qwen3.5's positions (M-RoPE), rope tables and vision encoder; everything else its own."""
    name = "youtu_moe"
    has_vision = True
    # no public chat template: Youtu-VL's (the llama.cpp prompt also wraps images in
    # <|vision_start|>...<|vision_end|>); a checkpoint's own template wins
    chat_template = YOUTU_VL_TEMPLATE
    reasoning_tokens = ("<think>", "</think>")
    llamacpp_convert_args = ()
    # bf16/q8 rounding of the router's input flips near-tied expert choices (top-4 of 16 on the
    # tiny models, one flip replaces a quarter of the routed output): teacher-forced on three
    # trained tiny models (seeds 11-13), 6-14 of 192 rows fell below 0.99 logit cosine in bf16
    # (5-13 in q8, 1-4 below 0.97), each a routing flip — with the fp32 package's routing forced,
    # every bf16 row is >= 0.9986
    precision_outlier_rows = 0.1
    tiny_variants = {
        # 8 layers (L L L F x 2), q_lora, 4 KDA heads of 16, 4 MLA heads, headwise gate, 16 experts top-4
        "qlora-h4": dict(),
        # no q_lora, 2 KDA heads of 32, 3 MLA heads with wider rope, per-channel gate, 20 experts top-3,
        # 6 layers (L F L L L F), untied head, deeper vision
        "noqlora-h2": dict(num_hidden_layers=6, q_lora_rank=None, linear_num_heads=2, linear_head_dim=32,
                           num_attention_heads=3, num_key_value_heads=3, qk_nope_head_dim=8, qk_rope_head_dim=24,
                           v_head_dim=20, kv_lora_rank=16, mla_output_gate="elementwise", num_experts=20,
                           num_experts_per_token=3, moe_intermediate_size=24,
                           layer_types=["linear_attention", "full_attention", "linear_attention",
                                        "linear_attention", "linear_attention", "full_attention"],
                           rope_parameters={"mrope_section": [4, 4, 4]},
                           vision_config={"depth": 3, "hidden_size": 48, "num_heads": 3, "intermediate_size": 80}),
    }

    def convert(self, ckpt, out, dtype, options, on_tensor) -> dict:
        return convert(ckpt, out, dtype, options, on_tensor)

    def hooks(self, model) -> dict:
        gr = model.manifest["graphs"]
        try:
            extra = gr["decoder"]["extra"]
            core = KdaCore(gd.DeltaDims(**extra["kda"]), float(extra["lower_bound"]))
            consts = {int(i): core.consts(c["rate"], c["dt_bias"]) for i, c in extra["gates"].items()}
            hosts = [st["shapes"] for st in gr["decoder"]["state"] if st.get("kind") == "host"]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise EdgevlError(f"manifest.json graphs.decoder is malformed ({e!r:.60}); convert the model again") from None
        if any(sh != core.shapes for sh in hosts):
            raise EdgevlError("this package keeps the KDA state in an older layout; convert the model again")
        return {"kda": kda_hook(core, consts), "moe": moe.moe_hook(self.open_experts(model))}

    def snapshot_points(self, model, input_ids):
        """After each ``<|begin_of_text|>assistant\\n``: where a conversation's next turn may first
        differ from the tokens generated (e.g. an answer re-rendered without its reasoning)."""
        tok = model.tokenizer
        if tok not in self._headers:
            self._headers[tok] = tok.encode(ANSWER_HEADER)
        head = self._headers[tok]
        ids, n = list(input_ids), len(head)
        if not n:
            return []
        return [i + n for i, t in enumerate(ids) if t == head[0] and ids[i:i + n] == head]

    def reference(self, ref_dir, dtype="fp32"):
        from ..reference.youtu_moe import YoutuVLMoEForConditionalGeneration

        model = YoutuVLMoEForConditionalGeneration.from_pretrained(ref_dir, dtype=torch_dtype(dtype))
        return YoutuMoeReference(model, ref_dir)

    def make_tiny(self, folder, variant="qlora-h4", seed=0, dtype="fp32", train_steps=0, **overrides):
        """A random (or briefly trained) checkpoint in the assumed layout, written by the reference,
        with a small Youtu-style tokenizer (plus <think>/</think>) and Youtu-VL's chat template;
        overrides are ``reference.youtu_moe.make_config`` keys."""
        return make_tiny(folder, seed, dtype, train_steps, **{**self.tiny_variants.get(variant, {}), **overrides})


def make_tiny(folder, seed: int = 0, dtype: str = "fp32", train_steps: int = 0, **overrides) -> Path:
    import torch
    from tokenizers import AddedToken

    from ..demo.tokenizer import save_tokenizer
    from ..reference.youtu_moe import make_config, make_preprocessor_config, make_random
    from ..testing import tiny_tokenizer

    folder = Path(folder)
    tok = tiny_tokenizer(400, True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    ids = save_tokenizer(tok, folder, chat_template=YOUTU_VL_TEMPLATE)
    ids.pop("pad_token_id")
    cfg = make_config(vocab_size=tok.get_vocab_size(), pad_token_id=None, **ids, **overrides)
    model = make_random(cfg, seed=seed)
    if train_steps:
        model = train_chat(model, tok, train_steps, seed)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["eos_token_id"]}))
    model.save_pretrained(folder, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
                          preprocessor=make_preprocessor_config(cfg))
    return folder


def train_chat(model, tok, steps: int, seed: int = 0, window: int = 32, lr: float = 1e-2):
    """Brief training of the language model on chat-formatted CORPUS turns (text positions,
    modality 0): peaked logits on the prompts the tests render. Windows of 32 tokens and KDA
    chunks of 16 keep it ~4x faster than 64/64 (transformers' chunked KDA loops over every
    row of a chunk): 0.16 s a step. One torch thread: the same weights on every machine (and on
    a busy 2-core one, 2 threads were several times slower)."""
    import functools

    import torch
    import torch.nn.functional as F
    import transformers.models.kimi_linear.modeling_kimi_linear as kimi

    from ..testing import CORPUS

    sents = CORPUS[: len(CORPUS) // 4]
    ids = []
    for i, s in enumerate(sents):
        ids += tok.encode(f"<|begin_of_text|>user\n{s}<|end_of_text|>\n<|begin_of_text|>assistant\n</think>"
                          f"{sents[(i + 1) % len(sents)]}<|end_of_text|>\n").ids
    data = torch.tensor(ids)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    pos = torch.arange(window)[None].expand(3, window)
    chunked = kimi.chunk_kimi_delta_attention
    kimi.chunk_kimi_delta_attention = functools.partial(chunked, chunk_size=16)   # same math, fewer loop rows
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model.train()
    try:
        for _ in range(steps):
            starts = torch.randint(0, len(data) - window - 1, (8,), generator=g)
            x = torch.stack([data[s:s + window + 1] for s in starts])
            h = model.model(model.model.embed_tokens(x[:, :-1]), pos, modality=torch.zeros_like(x[:, :-1]))
            loss = F.cross_entropy(model.lm_head(h).reshape(-1, model.lm_head.out_features), x[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        kimi.chunk_kimi_delta_attention = chunked
        torch.set_num_threads(threads)
    return model.eval()


ARCH = YoutuMoe()
