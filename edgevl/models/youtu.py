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
from .base import (Ctx, GraphInfo, config_args, head_weight_name, heads_first, heads_last, kv_state,
                   rope_tables, rope_theta_of, save_graph, swiglu_mlp, weight_ctx, write_head_and_embedding)
from .protocol import Architecture, Option, TransformersCausalLM, torch_dtype


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
    o = emit_mla_core(ctx, x, p, a, i, cos, sin, mask, absorbed)
    return ctx.linear(o, f"{p}.o_proj", a.hidden_size, a.num_attention_heads * a.v_head_dim, bias=a.attention_bias)


def emit_mla_core(ctx: Ctx, x: str, p: str, a: ModelArgs, i: int, cos: str, sin: str, mask: str,
                  absorbed: bool) -> str:
    """YoutuAttention up to o_proj: the attention output (h=seq, w=heads*v_head_dim)."""
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
        state=[kv_state(i, per_token) for i in range(a.num_hidden_layers)],
        extra={"rope_dim": rope, "rope_theta": a.rope_theta, "hidden_size": a.hidden_size,
               "num_layers": a.num_hidden_layers},
    )


def q8_keeps_bf16(name: str) -> bool:
    """q8 packages keep the attention projections except q_b_proj in bf16; q_b_proj, the MLP
    and the head are int8 (base.Q8_QUANT). Teacher-forced on the six tiny trained test models
    (two configs x three seeds): top-1 186-190 of 192, mean KL 1.4-2.0e-3; the block-quantized
    q8 of earlier packages 184-190 and 2.1-2.9e-3; int8 everywhere 176-187 and 2.6-4.2e-3, and
    int8 o_proj too already fell to 179. The bf16 part is 20 % of a 2B layer's weights."""
    return ".self_attn." in name and ".q_b_proj" not in name


def write_language_model(ckpt, out, a: ModelArgs, dtype: str, kv_cache: str, prefix: str, on_tensor) -> dict:
    """decoder.param/.bin, lm_head.param/.bin and the embedding table; the manifest parts."""
    g = G.Graph(out / "decoder.bin")
    ctx = weight_ctx(ckpt, g, dtype, on_tensor, float_layers=q8_keeps_bf16)
    info = build_decoder(ctx, a, prefix, absorbed=(kv_cache == "absorbed"))
    dec = save_graph(g, out / "decoder.param", info)
    embed_name = f"{prefix}.embed_tokens.weight"
    head, embedding = write_head_and_embedding(ckpt, out, dtype, on_tensor, a.vocab_size, a.hidden_size, embed_name,
                                               head_weight_name(ckpt, a.tie_word_embeddings, embed_name))
    return {"graphs": {"decoder": dec, "lm_head": head}, "embedding": embedding,
            "context": int(a.max_position_embeddings)}


# ---------------------------------------------------------------------------------------------
# the architecture

# Youtu-VL's chat template (spec youtu_vl.md §10.1; Youtu-LLM checkpoints ship their own): default
# system prompt, content items joined without separators, one <|image_pad|> per image (expanded
# to N/4 later), BOS in the template.
YOUTU_VL_TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "{{- '<|begin_of_text|>system\\nYou are a helpful assistant.<|end_of_text|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|begin_of_text|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ('video', 'video_url') -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|end_of_text|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|begin_of_text|>assistant\\n' -}}{%- endif -%}"
)


class Youtu(Architecture):
    name = "youtu"
    options = {"kv_cache": Option(
        ("expanded", "absorbed"), "expanded",
        # Expanded is the default because it measured faster on the 2-core machine in every case
        # we ran (2 threads: decode 8.3 vs 7.5 tok/s at a 128-token prompt, 6.2 vs 5.4 at 2048;
        # prefill 100 vs 86 and 75 vs 50): the absorbed step's per-head Gemms do not scale with
        # threads. Absorbed keeps a 4.7x smaller KV cache (very long contexts, little RAM).
        "MLA KV cache layout: expanded (per-head keys/values, faster here) or absorbed (the "
        "latent, 4.7x smaller, for very long contexts or little RAM)", label="{value}-kv")}
    tiny_variants = {
        "q_lora": dict(),
        "no_q_lora": dict(q_lora_rank=None, hidden_size=72, num_attention_heads=3),
        "rope32_v_ne_nope": dict(qk_rope_head_dim=32, qk_nope_head_dim=16, v_head_dim=40, num_hidden_layers=3),
        "untied": dict(tie_word_embeddings=False, kv_lora_rank=24),
        "theta10000": dict(rope_theta=10000.0, intermediate_size=80),
    }

    def convert(self, ckpt, out, dtype, options, on_tensor) -> dict:
        a = ModelArgs.from_config(ckpt.config)
        return write_language_model(ckpt, out, a, dtype, options["kv_cache"], "model", on_tensor)

    def rope(self, info):
        dim, theta = info["extra"]["rope_dim"], info["extra"]["rope_theta"]
        for what, v, kind in (("rope_dim", dim, int), ("rope_theta", theta, (int, float))):
            if isinstance(v, bool) or not isinstance(v, kind) or not v > 0:
                raise EdgevlError(f"manifest.json graphs.decoder.extra.{what} must be a positive number, got "
                                  f"{v!r:.40}; convert the model again")
        return lambda positions: rope_tables(positions[0], dim, theta)

    def reference(self, ref_dir, dtype="fp32"):
        from transformers import YoutuForCausalLM

        return TransformersCausalLM(YoutuForCausalLM.from_pretrained(ref_dir, dtype=torch_dtype(dtype)).eval())

    def make_tiny(self, folder, variant="q_lora", seed=0, dtype="fp32", train_steps=0, max_shard_size=None,
                  init_scale: float = 0.15, **overrides):
        """A random (or briefly trained) YoutuForCausalLM checkpoint; overrides are YoutuConfig kwargs."""
        import torch
        from transformers import YoutuConfig, YoutuForCausalLM

        from ..demo.tokenizer import save_tokenizer
        from ..testing import init_random, tiny_tokenizer, train_briefly

        overrides = {**self.tiny_variants.get(variant, {}), **overrides}
        tok = tiny_tokenizer()
        ids = save_tokenizer(tok, folder, chat_template=YOUTU_VL_TEMPLATE)
        theta = overrides.pop("rope_theta", 500000.0)
        cfg = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
                   qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=20, max_position_embeddings=512,
                   rope_parameters={"rope_type": "default", "rope_theta": float(theta)},
                   bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
                   # no pad id: transformers 5.24 zeroes the pad row of the embedding when loading,
                   # which would make the reference differ from the checkpoint it was saved from
                   pad_token_id=None, tie_word_embeddings=True)
        cfg.update(overrides)
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
        torch.manual_seed(seed)
        model = init_random(YoutuForCausalLM(YoutuConfig(**cfg)).eval(), seed, init_scale)
        if train_steps:
            model = train_briefly(model, tok, train_steps, seed)
        if dtype == "bf16":
            model = model.to(torch.bfloat16)
        model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
        return folder


ARCH = Youtu()
