"""Qwen3.5 (transformers ``qwen3_5``): Gated DeltaNet + gated full attention, M-RoPE, Qwen3-VL's
vision tower — as ncnn graphs plus the host driver that runs them.

Hold this file next to transformers' ``modeling_qwen3_5.py``: each block emits the layers of the
block of the same name there (docs/models/qwen3_5.md). Shared blocks: the delta rule
(``edgevl/blocks/gated_delta.py``: fp32 core nets shared by every recurrent layer), M-RoPE
(``blocks/rope.py``) and the vision tower (``blocks/qwen_vision.py``).

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

import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from ... import ncnn_graph as G
from ...blocks import gated_delta as gd
from ...blocks import qwen_vision
from ...blocks.base import (
    Ctx,
    GraphInfo,
    RowStack,
    config_args,
    heads_first,
    heads_last,
    kv_state,
    save_graph,
    swiglu_mlp,
    weight_ctx,
    write_draft_head,
    write_head_and_embedding,
)
from ...blocks.rope import mrope, mrope_positions_of, rope_parameters_of, rope_theta_of
from ...errors import EdgevlError
from ..protocol import VISION_OPTION, Architecture, BenchProfile, Option, turn_points, vision_quantized

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
    mtp_num_hidden_layers: int = field(default=0, metadata={"min": 0})

    # a text-only checkpoint (e.g. Qwen3_5ForCausalLM, model_type qwen3_5_text) has it at the root
    text_model_types: ClassVar[tuple] = ("qwen3_5_text",)

    @classmethod
    def from_config(cls, cfg: dict) -> TextArgs:
        tc = dict(cfg.get("text_config") or (cfg if cfg.get("model_type") in cls.text_model_types else {}))
        if not tc:
            raise EdgevlError("config.json of a qwen3_5 model needs a text_config")
        if "tie_word_embeddings" in cfg:    # the composite model's flag ties its head, as in transformers
            tc["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        rp, field_ = rope_parameters_of(tc)
        partial = rp.get("partial_rotary_factor", tc.get("partial_rotary_factor", 0.25))
        a = config_args(cls, tc, rope_theta=rope_theta_of(tc), partial_rotary_factor=float(partial),
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
            raise EdgevlError("text_config: value heads must be a multiple of key heads, got linear_num_value_heads "
                              f"{a.linear_num_value_heads} over linear_num_key_heads {a.linear_num_key_heads} and "
                              f"num_attention_heads {a.num_attention_heads} over num_key_value_heads "
                              f"{a.num_key_value_heads} (a key the config leaves out takes transformers' default)")
        if sum(a.mrope_section) * 2 != a.rotary_dim:
            raise EdgevlError(f"{field_}.mrope_section {a.mrope_section} must sum to half the rotary "
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
    qkv = gd.emit_causal_conv(g, qkv, conv, f"conv_state{i}", f"out_conv_state{i}", f"{p}.conv",
                              width=d.undo_conv_state_shape[1])
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
                       p: str, mlp=emit_dense_mlp, recurrent: bool = False) -> tuple[str, dict | None, dict | None]:
    """Layer ``i`` (its state and blob names) with the tensors named ``p``.*: Gated DeltaNet if
    ``recurrent``, else gated attention. ``mlp(ctx, normed blob, prefix, args, layer) -> (blob,
    host pass or None)``: the dense SwiGLU here, a sparse MoE block in Qwen3.5-MoE. Returns
    (output, the core's pass args, the MLP's pass)."""
    g = ctx.g
    h = rms_norm(ctx, x, f"{p}.input_layernorm", a.hidden_size, a.rms_norm_eps)
    core = None
    if recurrent:
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
        x, core, mlp_pass = emit_decoder_layer(ctx, x, a, i, cos, sin, mask, f"{prefix}.layers.{i}", mlp,
                                               a.is_recurrent(i))
        if core is None:
            states.append(dict(kv_state(i, 2 * a.num_key_value_heads * a.head_dim), layer=i))
            passes += [mlp_pass] if mlp_pass else []
            continue
        gates[str(i)] = {"neg_a": core.pop("neg_a"), "dt_bias": core.pop("dt_bias")}
        # the delta-rule matrix and a window of deferred decode updates (gated_delta.DeltaRuleCore)
        # the conv window keeps UNDO_ROWS columns so speculative decoding can verify several drafts
        passes.append(gd.declare_recurrent_layer(states, i, d.undo_conv_state_shape, d.host_state_shapes(gd.WINDOW),
                                                 "gated_delta", core, [core["qkv"], core["ba"]],
                                                 reads=d.conv_kernel - 1))
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


def build_mtp(ctx: Ctx, a: TextArgs, mlp=emit_dense_mlp) -> GraphInfo:
    """The multi-token-prediction block (docs/models/qwen3_5.md, "MTP"): row i takes
    ``embeds`` = [embed(t[i+1]) | h[i]] (w=2H; h[i] the decoder's final-normed hidden state at i)
    and gives the block's ``hidden`` after ``mtp.norm``, whose head argmax drafts t[i+2].

    x = fc([pre_fc_norm_embedding(e) | pre_fc_norm_hidden(h)]), then one full-attention layer
    (``mtp.layers.0``: the same parts as a decoder attention layer, the MoE block in
    Qwen3.5-MoE) with its own KV cache, at token i's rotary position. The layer takes index
    ``num_hidden_layers`` (its state and blob names, its experts in ``experts.bin``), after the
    decoder's layers."""
    g, H, eps, n = ctx.g, a.hidden_size, a.rms_norm_eps, a.num_hidden_layers
    x = g.input("embeds")
    mask = g.input("mask")
    cos, sin = g.input("rope_cos"), g.input("rope_sin")
    g.input(f"cache_k{n}")
    g.input(f"cache_v{n}")
    e, h = G.slice_(g, x, [H, H], axis=1, name="mtp.split")
    e = rms_norm(ctx, e, "mtp.pre_fc_norm_embedding", H, eps)
    h = rms_norm(ctx, h, "mtp.pre_fc_norm_hidden", H, eps)
    x = ctx.linear(G.concat(g, [e, h], axis=1, name="mtp.cat"), "mtp.fc", H, 2 * H)
    x, _, mlp_pass = emit_decoder_layer(ctx, x, a, n, cos, sin, mask, "mtp.layers.0", mlp)
    rms_norm(ctx, x, "mtp.norm", H, eps, out="hidden")
    return GraphInfo(
        inputs={"embeds": "embeds", "mask": "mask", "cos": "rope_cos", "sin": "rope_sin"},
        outputs={"hidden": "hidden"},
        state=[dict(kv_state(n, 2 * a.num_key_value_heads * a.head_dim), layer=n)],
        passes=[mlp_pass] if mlp_pass else [],
        extra={"layer": n, "hidden_size": H})


def mtp_layers(cfg: dict) -> int:
    """The MTP layers config.json declares (0: none)."""
    return int((cfg.get("text_config") or cfg).get("mtp_num_hidden_layers") or 0)


def mtp_present(ckpt, a: TextArgs, keep: bool = True) -> bool:
    """Whether the package gets the MTP block: the checkpoint has it (``mtp.*`` tensors) and
    ``keep``. One layer is supported (every released checkpoint has one)."""
    if not keep or "mtp.fc.weight" not in ckpt:
        return False
    layers = a.mtp_num_hidden_layers or 1
    if layers != 1 or "mtp.layers.1.input_layernorm.weight" in ckpt:
        raise EdgevlError(f"the checkpoint's multi-token-prediction block has {layers} layers; edgevl converts a "
                          "one-layer block — convert with --no-mtp to leave it out")
    p = "mtp.layers.0"
    for name in ("mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm", f"{p}.input_layernorm",
                 f"{p}.post_attention_layernorm", f"{p}.self_attn.q_proj", f"{p}.self_attn.o_proj"):
        if f"{name}.weight" not in ckpt:
            raise EdgevlError(f"the checkpoint's multi-token-prediction block lacks {name}.weight; re-download "
                              "the checkpoint, or convert with --no-mtp to leave the block out")
    return True


MTP_OPTION = Option(("keep", "drop"), "keep",
                    "the multi-token-prediction block of checkpoints that have one: keep converts it for "
                    "speculative decoding (a few percent more weights); drop (--no-mtp) leaves it out",
                    flag="no-mtp")


# ---------------------------------------------------------------------------------------------
# conversion


def convert(ckpt, out, dtype: str, on_tensor, a: TextArgs | None = None, mlp=emit_dense_mlp,
            float_layers=None, mtp: str = "keep", vision: str = "auto") -> dict:
    """Decoder, lm_head, the delta-rule chunk net, the vision tower, the embedding table and,
    when the checkpoint has one and ``mtp`` is "keep", the multi-token-prediction block.

    Returns the manifest parts: ``graphs`` (decoder, lm_head, gdn_chunk, vision, mtp),
    ``embedding``, ``context`` and ``mtp`` (whether the checkpoint had the block and the package
    has it). ``a`` and ``mlp``: the text arguments and MLP emitter of a derived architecture
    (Qwen3.5-MoE); ``float_layers(name)``: the Gemms a q8 package keeps in bf16."""
    cfg = ckpt.config
    a = a or TextArgs.from_config(cfg)
    with_mtp = mtp_present(ckpt, a, mtp == "keep")
    v = qwen_vision.checked_vision_args(ckpt, a.hidden_size, VISION_PREFIX, "qwen3_5")
    prefix = text_prefix(ckpt)
    parts = {"graphs": {}, "context": int(a.max_position_embeddings)}

    g = G.Graph(out / "decoder.bin")
    ctx = weight_ctx(ckpt, g, dtype, on_tensor, float_layers=float_layers)
    parts["graphs"]["decoder"] = save_graph(g, out / "decoder.param", build_decoder(ctx, a, prefix, mlp))
    parts["graphs"]["gdn_chunk"] = gd.build_core_net(out / "gdn_chunk.param", out / "gdn_chunk.bin", a.delta)

    embed_name = f"{prefix}.embed_tokens.weight"
    head, parts["embedding"] = write_head_and_embedding(ckpt, out, dtype, on_tensor, a.vocab_size, a.hidden_size,
                                                        embed_name, a.tie_word_embeddings)
    parts["graphs"]["lm_head"] = head

    if v is not None:
        parts["graphs"]["vision"] = qwen_vision.write_vision(ckpt, out, dtype, on_tensor, v, VISION_PREFIX,
                                                             vision_quantized(dtype, vision))
    parts.update(qwen_vision.vision_token_ids(cfg, tower=v is not None))
    if with_mtp:
        g = G.Graph(out / "mtp.bin")
        ctx = weight_ctx(ckpt, g, dtype, on_tensor, float_layers=float_layers)
        parts["graphs"]["mtp"] = save_graph(g, out / "mtp.param", build_mtp(ctx, a, mlp))
        if dtype in ("bf16", "fp16"):   # q8 heads are int8 already; fp32 packages draft exactly
            parts["graphs"]["draft_head"] = write_draft_head(ckpt, out, a.vocab_size, a.hidden_size, embed_name,
                                                             a.tie_word_embeddings)
    if "mtp.fc.weight" in ckpt:
        parts["mtp"] = {"converted": with_mtp}
    return parts


def text_prefix(ckpt) -> str:
    """Where the language model's tensors live: ``model.language_model`` (the VLM checkpoint),
    or ``model`` (a text-only ``Qwen3_5ForCausalLM`` checkpoint)."""
    return PREFIX if f"{PREFIX}.embed_tokens.weight" in ckpt else "model"


# ---------------------------------------------------------------------------------------------
# host side: positions and rotary tables


# ---------------------------------------------------------------------------------------------
# the architecture

CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text()
USER_HEADER = "<|im_start|>user"
ANSWER_HEADER = "<|im_start|>assistant\n"


def delta_rule_hooks(pkg) -> dict:
    """The delta rule of every recurrent layer: decoding in numpy, prefill in the fp32 chunk net
    (packing off: the state stays in the plain layout from run to run, no repacking copies).
    Packages converted before the step moved to numpy also hold a ``gdn_step`` graph; it is not
    loaded."""
    gr = pkg.manifest["graphs"]
    if "gdn_chunk" not in gr:
        raise EdgevlError("manifest.json lacks graphs.gdn_chunk; convert the model again")
    core = gd.DeltaRuleCore(pkg.open_net("gdn_chunk", dtype="fp32", packing=False), gr["gdn_chunk"])
    gates = {int(i): core.gate_params(g["neg_a"], g["dt_bias"])
             for i, g in gr["decoder"]["extra"]["gates"].items()}
    return {"gated_delta": gd.core_hook(core, gates)}


class Qwen3_5(Architecture):
    name = "qwen3_5"
    has_vision = True
    chat_template = CHAT_TEMPLATE
    reasoning_tokens = ("<think>", "</think>")
    template_switches = ("enable_thinking", "add_vision_id")
    options = {"mtp": MTP_OPTION, "vision": VISION_OPTION}
    # llama.cpp's converter expects the MTP block unless told it is not there
    bench = BenchProfile(convert_args_of=lambda cfg: () if mtp_layers(cfg) else ("--no-mtp",))

    def __init__(self):
        self._headers = weakref.WeakKeyDictionary()   # tokenizer -> {marker: its ids}

    def convert(self, ckpt, out, dtype, options, on_tensor) -> dict:
        return convert(ckpt, out, dtype, on_tensor, mtp=options.get("mtp", "keep"),
                       vision=options.get("vision", "auto"))

    def thinking_args(self, thinking):
        return {} if thinking is None else {"enable_thinking": bool(thinking)}

    def hooks(self, pkg) -> dict:
        return delta_rule_hooks(pkg)

    def rope(self, info):
        return mrope(info)

    def positions(self, input_ids, images, image_token_id):
        return mrope_positions_of(input_ids, images, image_token_id)

    def snapshot_points(self, tokenizer, input_ids):
        return turn_points(tokenizer, input_ids, self._headers, USER_HEADER, ANSWER_HEADER)

    def make_vision(self, pkg, net):
        return qwen_vision.open_vision(pkg, net)


ARCH = Qwen3_5()
