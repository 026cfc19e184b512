"""Youtu-VL: SigLIP-2 vision tower (window attention, 2-D RoPE) + VLPatchMerger + Youtu MLA LM.

The language half is Youtu-LLM's unchanged (``edgevl/models/youtu``; text fields sit at the root
of config.json). This file holds the vision graph and the converter (the tower's facts:
docs/models/youtu_vl.md, "Vision tower" and "Merger"); ``runtime.py`` drives the graph per image
and rewrites grounding coordinates; ``processing.py`` is the image processor.

One vision graph serves every image size, and it computes on real patches only. Tokens are laid
out window by window, the windows grouped by size (a raster tiling has at most four sizes: whole
windows, the right column, the bottom row, the corner), each size class in one of
``WINDOW_SLOTS`` slots:
- window layers cut each slot's rows out (Crop with run-time bounds from the slot's shape
  inputs) and fold its windows into SDPA's head axis, (c=heads*n, h=s), so each window attends
  only to itself and no N×N mask exists (memory stays linear in the patch count); the slots'
  outputs are concatenated back in row order;
- an unused slot holds one copy of the last row as a window of its own, cut off again after the
  concatenation (at most three such rows, in the window SDPAs only);
- full-attention layers attend over all N rows as they are.
The merger's groups of 4 stay contiguous in this layout; the host picks the real rows back out
in the processor's (row-major merged-grid) order.
"""

from __future__ import annotations

from pathlib import Path

from ... import ncnn_graph as G
from ...blocks.base import Q8_QUANT, Ctx, GraphInfo, heads_first, heads_last, save_graph, storage_dtype
from ...blocks.rope import rope_1d
from ...blocks.vision import GELU_TANH, emit_vit_mlp, rope_attention
from ...errors import EdgevlError
from ...processing import settings
from .. import youtu  # its language model: the converter and options (youtu.model)
from ..protocol import VISION_OPTION, Architecture, vision_quantized
from . import processing
from .config import WINDOW_SLOTS, VisionArgs
from .runtime import GroundingProcessor, VisionEncoder

# ---------------------------------------------------------------------------------------------
# blocks


def emit_vision_attention(ctx: Ctx, x: str, p: str, v: VisionArgs, cos: str, sin: str, window: bool,
                          slots: list) -> str:
    """Siglip2 attention with 2-D RoPE (rotate_half pairs, RotaryEmbed 0=0), per window or full."""
    g, D, nh, hd = ctx.g, v.hidden_size, v.num_attention_heads, v.head_dim
    q = heads_first(g, ctx.linear(x, f"{p}.q_proj", D, D, bias=True), hd, nh, f"{p}.q")
    k = heads_first(g, ctx.linear(x, f"{p}.k_proj", D, D, bias=True), hd, nh, f"{p}.k")
    val = heads_first(g, ctx.linear(x, f"{p}.v_proj", D, D, bias=True), hd, nh, f"{p}.v")
    if not window:
        o = rope_attention(g, q, k, val, cos, sin, hd, nh, p)
    else:
        q = G.rotary(g, q, cos, sin, interleaved=False, name=f"{p}.q_rope")
        k = G.rotary(g, k, cos, sin, interleaved=False, name=f"{p}.k_rope")
        outs = [window_sdpa(g, q, k, val, shape, start, hd, nh, f"{p}.slot{i}")
                for i, (shape, start) in enumerate(slots)]
        o = G.concat(g, outs, axis=1, name=f"{p}.slots")
        # drop the unused slots' stand-in rows (a no-op when every slot is used)
        o = G.crop_expr(g, o, [q], "0", "1h", "1", name=f"{p}.real_rows")
        o = heads_last(g, o, hd, nh, f"{p}.o")
    return ctx.linear(o, f"{p}.out_proj", D, D, bias=True)


def window_sdpa(g: G.Graph, q: str, k: str, v: str, shape: str, start: str, hd: int, nh: int, name: str) -> str:
    """Attention inside the n windows of s rows that one slot holds: rows [start, start + n*s) of
    q/k/v (c=heads, h=rows, w=hd), windows folded into heads. ``shape`` is a (h=n, w=s) input,
    ``start`` a 1-D input of width start + 1."""
    parts = []
    for t, tag in ((q, "q"), (k, "k"), (v, "v")):
        t = G.crop_expr(g, t, [shape, start], "-(2w,1)", "+(-(2w,1),*(1w,1h))", "1", name=f"{name}.{tag}_rows")
        t = G.reshape_like(g, t, shape, f"{hd},1w,1h,0c", name=f"{name}.{tag}_4d")  # (w=hd, h=s, d=n, c=heads)
        parts.append(G.reshape(g, t, hd, 0, -1, name=f"{name}.{tag}_windows"))    # (c=heads*n, h=s)
    o = G.sdpa(g, *parts, scale=hd ** -0.5, name=f"{name}.sdpa")
    return G.reshape(g, o, hd, -1, nh, name=f"{name}.unfold")                      # (c=heads, h=n*s)


def emit_encoder_layer(ctx: Ctx, x: str, p: str, v: VisionArgs, i: int, cos: str, sin: str, slots: list) -> str:
    g, D, eps = ctx.g, v.hidden_size, v.layer_norm_eps
    h = ctx.layer_norm(x, f"{p}.layer_norm1", D, eps)
    h = emit_vision_attention(ctx, h, f"{p}.self_attn", v, cos, sin, i not in v.fullatt_block_indexes, slots)
    x = G.binary(g, x, h, "add", name=f"{p}.attn_residual")
    h = ctx.layer_norm(x, f"{p}.layer_norm2", D, eps)
    h = emit_vit_mlp(ctx, h, f"{p}.mlp", D, v.intermediate_size, v.hidden_act)
    return G.binary(g, x, h, "add", name=f"{p}.mlp_residual", out=f"vision.layer{i}.out")


def emit_merger(ctx: Ctx, x: str, v: VisionArgs) -> str:
    """VLPatchMerger: RMSNorm, concat each group of 4 tokens, Linear-GELU(erf)-Linear."""
    g, D, m2 = ctx.g, v.hidden_size, v.spatial_merge_size ** 2
    x = ctx.rms_norm(x, "merger.ln_q", D, v.merger_rms_norm_eps)
    x = G.reshape(g, x, D * m2, -1, name="merger.group")
    x = ctx.linear(x, "merger.mlp.0", D * m2, D * m2, bias=True)
    x = G.gelu(g, x, tanh=GELU_TANH[v.merger_act], name="merger.act")
    return ctx.linear(x, "merger.mlp.2", v.out_hidden_size, D * m2, bias=True, out="merged")


def vision_prefix(ckpt) -> str:
    # ``siglip2.vision_model.*`` (docs/models/youtu_vl.md, "Checkpoint"); some exports drop ``vision_model``
    for pre in ("siglip2.vision_model", "siglip2"):
        if f"{pre}.embeddings.patch_embedding.weight" in ckpt:
            return pre
    raise EdgevlError("the checkpoint has no siglip2.vision_model.* tensors; it is not a Youtu-VL checkpoint")


def build_vision(ctx: Ctx, v: VisionArgs, prefix: str) -> GraphInfo:
    g = ctx.g
    pv = g.input("pixel_values")                          # (h=N, w=patch_dim), packed window order
    cos, sin = g.input("vision_cos"), g.input("vision_sin")
    slots = [(g.input(f"window_shape{i}"), g.input(f"window_start{i}")) for i in range(WINDOW_SLOTS)]
    g.section("embed")
    # the patch embedding stays float in an int8 tower: one Gemm over raw pixels
    x = ctx.linear(pv, f"{prefix}.embeddings.patch_embedding", v.hidden_size, v.patch_dim, bias=True,
                   quantize=False)
    for i in range(v.num_hidden_layers):
        g.section(f"layer{i}")
        x = emit_encoder_layer(ctx, x, f"{prefix}.encoder.layers.{i}", v, i, cos, sin, slots)
    g.section("merger")
    x = ctx.layer_norm(x, f"{prefix}.post_layernorm", v.hidden_size, v.layer_norm_eps, out="vision.post_ln")
    emit_merger(ctx, x, v)
    return GraphInfo(
        inputs={"pixel_values": "pixel_values", "cos": "vision_cos", "sin": "vision_sin",
                "window_shapes": [f"window_shape{i}" for i in range(WINDOW_SLOTS)],
                "window_starts": [f"window_start{i}" for i in range(WINDOW_SLOTS)]},
        outputs={"merged": "merged", "post_ln": "vision.post_ln",
                 "layers": [f"vision.layer{i}.out" for i in range(v.num_hidden_layers)]},
        extra={"vision_args": vars(v)},
    )


def convert(ckpt, out, dtype: str, options: dict, on_tensor) -> dict:
    """Language model (root config) + vision graph into one package."""
    cfg = ckpt.config
    if cfg.get("vision_config") is None:
        if any(f"{pre}.embeddings.patch_embedding.weight" in ckpt for pre in ("siglip2.vision_model", "siglip2")):
            raise EdgevlError("the checkpoint has vision weights but config.json has no vision_config; restore "
                              "config.json's vision_config from the model's original files")
        raise EdgevlError("config.json of a youtu_vl model needs a nested vision_config")
    v = VisionArgs.from_config(cfg)
    a = youtu.model.ModelArgs.from_config(cfg)
    if v.out_hidden_size != a.hidden_size:
        raise EdgevlError(f"vision_config.out_hidden_size {v.out_hidden_size} != hidden_size {a.hidden_size}")
    if cfg.get("image_token_id") is None:
        raise EdgevlError("config.json of a youtu_vl model needs image_token_id")
    parts = youtu.model.write_language_model(ckpt, out, a, dtype, options["kv_cache"], "model", on_tensor)
    g = G.Graph(out / "vision.bin")
    quant = Q8_QUANT if vision_quantized(dtype, options.get("vision", "auto")) else None
    info = build_vision(Ctx(ckpt, g, storage_dtype(dtype), quant, on_tensor), v, vision_prefix(ckpt))
    info.extra["quantized"] = quant is not None
    info.extra["max_image_patches"] = configured_max_patches(ckpt.folder)
    parts["graphs"]["vision"] = save_graph(g, out / "vision.param", info)
    parts["image_token_id"] = int(cfg["image_token_id"])
    return parts


def configured_max_patches(folder) -> int:
    """The per-image patch budget of a checkpoint: ``max_image_patches`` from its
    preprocessor_config.json if set, else 36864.

    Youtu-VL's own JSON has no such key (its ``max_num_patches`` 256 is overridden by the
    processor call's default 36864; docs/models/youtu_vl.md), so real checkpoints get 36864; the demo model,
    trained on 128x128 images, sets 64.
    """
    try:
        got = settings(folder, "preprocessor_config.json")
    except (OSError, EdgevlError):
        got = None
    v = got[0].get("max_image_patches") if got else None
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    return processing.DEFAULT_MAX_IMAGE_PATCHES


# ---------------------------------------------------------------------------------------------
# the architecture

# Youtu-VL's chat template (a built-in for checkpoints without one): default system prompt,
# content items joined without separators, one <|image_pad|> per image (expanded to the image's
# token count later), BOS in the template (docs/models/youtu_vl.md, "Chat template")
CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text().rstrip("\n")


class YoutuVL(Architecture):
    """Youtu-VL: Youtu-LLM's language model (its converter and rotary tables) plus the vision tower."""

    name = "youtu_vl"
    options = {"kv_cache": youtu.model.KV_CACHE, "vision": VISION_OPTION}
    chat_template = CHAT_TEMPLATE
    has_vision = True

    def convert(self, ckpt, out, dtype, options, on_tensor) -> dict:
        return convert(ckpt, out, dtype, options, on_tensor)

    def rope(self, info):
        return rope_1d(info)

    def make_vision(self, pkg, net):
        return VisionEncoder(net, pkg.manifest["graphs"]["vision"])

    def output_processor(self, images):
        if not images or any(i is None for i in images):  # text-only, or bare rows without sizes
            return None
        return GroundingProcessor(images)


ARCH = YoutuVL()
