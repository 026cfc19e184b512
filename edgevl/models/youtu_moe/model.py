"""The Youtu MoE hybrid (``YoutuVLMoEForConditionalGeneration``): KDA linear attention + gated
MLA, a quantile-balanced mixture of experts, and a Qwen3-VL vision tower — as ncnn graphs plus the
host driver that runs them.

No modeling code or checkpoint of this model is public (docs/models/youtu_moe.md). The PyTorch
reference is ``edgevl/verification/references/youtu_moe.py`` (transformers' ``kimi_linear``,
``youtu`` and ``qwen3_vl`` blocks with the changes the llama.cpp patch describes); hold this file
next to it. The checkpoint layout is ASSUMED and lives in one table (``layout.py``).

Per decoder layer (``layer_types`` / ``mlp_layer_types``):

- **KDA** (``KDAttention``): q/k/v, the forget gate's ``f_a``, ``b_proj`` and the output gate's
  ``g_a`` as one Gemm; the causal depthwise conv over q|k|v with its window (``gated_delta``'s
  emitter); then a host pass runs the delta rule with a *per-channel* decay in fp32 numpy
  (``gated_delta.KdaCore``), one token at a time with the state updates deferred in a window, as
  GDN decodes — the chunked form needs [C, C, Dk] pairwise decays and is not practical in ncnn,
  so prefill is token by token too; then ``o_norm`` (RMSNorm x sigmoid(g_b(g_a x))) and
  ``o_proj`` back in the graph.
- **Gated MLA** (``GatedMLA``): MLA (``blocks/mla.py``), interleaved M-RoPE on the rope dims
  (host cos/sin, ``blocks/rope.py``), the attention output times sigmoid(``g_proj`` x) per head
  (or per channel) before ``o_proj``.
- **MLP**: layer 0 a dense SwiGLU; the others ``moe.emit_sparse_moe`` (router logits + the
  shared expert in the graph) with quantile-balanced routing on the host: experts = top-k of
  logits - qb_beta[modality], modality 1 for rows holding an image embedding (the decoder hands
  the rows' token ids to the pass), weights = normalised sigmoid(logits) x routed_scaling_factor.

Vision: transformers' ``Qwen3VLVisionModel`` is Qwen3.5's tower plus deepstack, so without
deepstack layers it is ``blocks/qwen_vision.py`` (tensors under ``visual.``); a config naming
deepstack layers is refused. The base model emits ``</think>`` as its first token: the reasoning
markers make it a thinking-block close, never text.
"""

from __future__ import annotations

import math
import sys
import weakref
from dataclasses import dataclass

import numpy as np

from ... import ncnn_graph as G
from ...blocks import gated_delta as gd
from ...blocks import moe, qwen_vision
from ...blocks.base import (
    Ctx,
    GraphInfo,
    RowStack,
    config_args,
    kv_state,
    save_graph,
    swiglu_mlp,
    weight_ctx,
    write_head_and_embedding,
)
from ...blocks.mla import MlaArgs, emit_mla_core
from ...blocks.rope import mrope, mrope_positions_of, rope_parameters_of, rope_theta_of
from ...errors import EdgevlError
from ..protocol import VISION_OPTION, Architecture, turn_points, vision_quantized
from ..youtu_vl.model import CHAT_TEMPLATE as YOUTU_VL_TEMPLATE
from .layout import CHECKPOINT_LAYOUT, CheckpointLayout

PREFIX = "model"
VISION_PREFIX = "visual"
LAYER_KINDS = ("linear_attention", "full_attention")
MLP_KINDS = ("dense", "sparse")
LAYOUT_NOTE = ("the Youtu MoE checkpoint layout is an assumption (no checkpoint is public yet): tensor names "
               "follow edgevl/models/youtu_moe/layout.py")


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
    def from_config(cls, cfg: dict) -> TextArgs:
        rp, _ = rope_parameters_of(cfg)
        a = config_args(cls, cfg, rope_theta=rope_theta_of(cfg), mrope_section=rp.get("mrope_section"))
        n = a.num_hidden_layers
        if a.layer_types is None:   # the real model's [KDA, KDA, KDA, MLA] groups
            a.layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
        if a.mlp_layer_types is None:
            a.mlp_layer_types = ["dense" if i == 0 else "sparse" for i in range(n)]
        for key, kinds in (("layer_types", LAYER_KINDS), ("mlp_layer_types", MLP_KINDS)):
            v = getattr(a, key)
            if len(v) != n or any(t not in kinds for t in v):
                raise EdgevlError(f"config.json field {key} must list {n} entries of {' / '.join(kinds)}")
        if "sparse" not in a.mlp_layer_types:   # the package's expert store would be empty
            raise EdgevlError("config.json field mlp_layer_types has no sparse layer: a Youtu MoE model routes "
                              "experts in at least one layer; mark its MoE layers sparse")
        if a.hidden_act != "silu":
            raise EdgevlError(f"hidden_act {a.hidden_act!r} is not supported for Youtu MoE models (expected silu)")
        if a.num_key_value_heads not in (None, a.num_attention_heads):
            raise EdgevlError("MLA expands K/V per head: num_key_value_heads must equal num_attention_heads")
        if a.mla_output_gate not in (None, "headwise", "elementwise"):
            raise EdgevlError(f"mla_output_gate must be headwise, elementwise or null, got {a.mla_output_gate!r:.40}")
        lb = a.kda_gate_lower_bound
        if isinstance(lb, bool) or not isinstance(lb, (int, float)) or not math.isfinite(lb) or lb >= 0:
            raise EdgevlError(f"kda_gate_lower_bound must be a negative number (the real model's is -5), "
                              f"got {lb!r:.40}")
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
    def mla(self) -> MlaArgs:
        return MlaArgs.of(self)

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
    layout's renames (``layout.py``), so the builders below use one set of names."""

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
    """GatedMLA: MLA, its output times sigmoid(g_proj x) (one scalar per head, or per channel)
    before o_proj."""
    g, m = ctx.g, a.mla
    nh, vd = m.num_attention_heads, m.v_head_dim
    o = emit_mla_core(ctx, x, p, m, i, cos, sin, mask, absorbed=False)  # (h=seq, w=nh*vd)
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
            states.append(dict(kv_state(i, m.kv_floats_per_token(absorbed=False)), layer=i))
        else:
            gates[str(i)] = {"rate": core.pop("rate"), "dt_bias": core.pop("dt_bias")}
            # the delta-rule matrix and a window of deferred updates (gated_delta.KdaCore)
            passes.append(gd.declare_recurrent_layer(states, i, d.conv_state_shape, gd.kda_state_shapes(d), "kda",
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
    v = qwen_vision.checked_vision_args(view, a.hidden_size, VISION_PREFIX, "Youtu MoE")   # before anything is written
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
    head, parts["embedding"] = write_head_and_embedding(view, out, dtype, on_tensor, a.vocab_size, a.hidden_size,
                                                        embed_name, a.tie_word_embeddings)
    parts["graphs"]["lm_head"] = head

    if v is not None:
        parts["graphs"]["vision"] = qwen_vision.write_vision(view, out, dtype, on_tensor, v, VISION_PREFIX,
                                                             vision_quantized(dtype, options.get("vision", "auto")))
    parts.update(qwen_vision.vision_token_ids(cfg, tower=v is not None))
    return parts


# ---------------------------------------------------------------------------------------------
# the architecture

USER_HEADER = "<|begin_of_text|>user"
ANSWER_HEADER = "<|begin_of_text|>assistant\n"


class YoutuMoe(Architecture):
    """The delta rule (KDA), MLA, M-RoPE, the MoE block and Qwen3-VL's vision tower, composed."""
    name = "youtu_moe"
    has_vision = True
    # no public chat template: Youtu-VL's (the llama.cpp prompt also wraps images in
    # <|vision_start|>...<|vision_end|>); a checkpoint's own template wins
    chat_template = YOUTU_VL_TEMPLATE
    reasoning_tokens = ("<think>", "</think>")
    options = {**moe.OPTIONS, "vision": VISION_OPTION}
    runtime_options = moe.RUNTIME_OPTIONS
    bench = moe.bench_profile()

    def __init__(self):
        self._headers = weakref.WeakKeyDictionary()   # tokenizer -> {marker: its ids}

    def convert(self, ckpt, out, dtype, options, on_tensor) -> dict:
        return convert(ckpt, out, dtype, options, on_tensor)

    def hooks(self, pkg) -> dict:
        gr = pkg.manifest["graphs"]
        try:
            extra = gr["decoder"]["extra"]
            core = gd.KdaCore(gd.DeltaDims(**extra["kda"]), float(extra["lower_bound"]))
            consts = {int(i): core.consts(c["rate"], c["dt_bias"]) for i, c in extra["gates"].items()}
            hosts = [st["shapes"] for st in gr["decoder"]["state"] if st.get("kind") == "host"]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise EdgevlError(f"manifest.json graphs.decoder is malformed ({e!r:.60}); convert the model "
                              "again") from None
        if any(sh != core.shapes for sh in hosts):
            raise EdgevlError("this package keeps the KDA state in an older layout; convert the model again")
        return {"kda": gd.kda_hook(core, consts), "moe": moe.moe_hook(moe.open_experts(pkg))}

    def rope(self, info):
        return mrope(info)

    def positions(self, input_ids, images, image_token_id):
        return mrope_positions_of(input_ids, images, image_token_id)

    def snapshot_points(self, tokenizer, input_ids):
        return turn_points(tokenizer, input_ids, self._headers, USER_HEADER, ANSWER_HEADER)

    def make_vision(self, pkg, net):
        return qwen_vision.open_vision(pkg, net)

    def runtime_stats(self, pkg) -> dict:
        return moe.runtime_stats(pkg)

    def preload(self, pkg, progress: bool = False) -> None:
        moe.preload(pkg, progress)


ARCH = YoutuMoe()
