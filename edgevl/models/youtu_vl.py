"""Youtu-VL: SigLIP-2 vision tower (window attention, 2-D RoPE) + VLPatchMerger + Youtu MLA LM.

The language half is ``youtu.py`` unchanged (text fields sit at the root of config.json). This
file holds the vision graph (hold it next to spec youtu_vl.md §4–§5) and its host-side driver.

One vision graph serves every image size. Tokens are laid out window by window, each window
padded to the size P of the largest one (``T = n_windows * P`` rows):
- window layers fold the windows into SDPA's head axis, (c=heads*nw, h=P), so each window
  attends only to itself and no N×N mask exists (memory stays linear in the patch count);
- padded keys are switched off by one extra q/k channel: q gets 1, k gets 0 (real) or -1e9
  (padding), so their scores vanish in the softmax without any mask;
- full-attention layers attend over all T rows with the same key bias.
The merger's groups of 4 stay contiguous in this layout; the host picks the real rows back out
in the processor's (row-major merged-grid) order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import ncnn_graph as G
from ..errors import EdgevlError
from ..processing import image as improc
from ..runtime import Net
from . import youtu
from .base import Ctx, GraphInfo, config_args, heads_first, heads_last

PAD_KEY_BIAS = -1e9  # added to q.k of padded keys (times the softmax scale): exp() underflows to 0


@dataclass
class VisionArgs:
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    spatial_merge_size: int = 2
    window_size: int = 256                        # pixels (spec §2.2)
    fullatt_block_indexes: list[int] = field(default_factory=lambda: [7, 15, 23, 26])
    out_hidden_size: int = 2560
    rope_theta: float = 10000.0                   # [I] vision RoPE base (spec §4.4)
    merger_rms_norm_eps: float = 1e-6             # [I] spec §5
    merger_act: str = "gelu"                      # [I] exact erf GELU in the merger (spec §5)

    @classmethod
    def from_config(cls, cfg: dict) -> "VisionArgs":
        v = config_args(cls, cfg.get("vision_config") or {}, where="config.json vision_config")
        if v.hidden_size % v.num_attention_heads or v.head_dim % 4:
            raise EdgevlError("vision_config: head size must divide hidden_size and be a multiple of 4 (2-D RoPE)")
        for act in (v.hidden_act, v.merger_act):
            if act not in _GELU:
                raise EdgevlError(f"vision activation {act!r} is not supported (expected gelu or gelu_pytorch_tanh)")
        return v

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.patch_size * self.patch_size


_GELU = {"gelu_pytorch_tanh": 1, "gelu_new": 1, "gelu": 0}  # GELU param 0: 1 = tanh form, 0 = erf


# ---------------------------------------------------------------------------------------------
# blocks


def emit_vision_attention(ctx: Ctx, x: str, p: str, v: VisionArgs, cos: str, sin: str, window: bool,
                          bias: dict) -> str:
    """Siglip2 attention with 2-D RoPE (rotate_half pairs, RotaryEmbed 0=0), per window or full."""
    g, D, nh, hd = ctx.g, v.hidden_size, v.num_attention_heads, v.head_dim
    q = heads_first(g, ctx.linear(x, f"{p}.q_proj", D, D, bias=True), hd, nh, f"{p}.q")
    k = heads_first(g, ctx.linear(x, f"{p}.k_proj", D, D, bias=True), hd, nh, f"{p}.k")
    val = heads_first(g, ctx.linear(x, f"{p}.v_proj", D, D, bias=True), hd, nh, f"{p}.v")
    q = g.layer("RotaryEmbed", [q, cos, sin], {0: 0}, name=f"{p}.q_rope")
    k = g.layer("RotaryEmbed", [k, cos, sin], {0: 0}, name=f"{p}.k_rope")
    if window:
        # (c=heads, h=nw*P) -> (c=heads*nw, h=P): shape read from the key-bias input at run time
        fold = lambda t, n: g.layer("Reshape", [t, bias["kbias"]], {6: f"{hd},1h,1c"}, name=f"{p}.{n}_windows")
        q, k, val = fold(q, "q"), fold(k, "k"), fold(val, "v")
        ones, kb = bias["ones"], bias["kbias"]
    else:
        ones, kb = bias["ones_full"], bias["kbias_full"]
    q = G.concat(g, [q, ones], axis=2, name=f"{p}.q_cat")
    k = G.concat(g, [k, kb], axis=2, name=f"{p}.k_cat")
    o = g.layer("SDPA", [q, k, val], {5: 0, 6: hd ** -0.5, 7: 0}, name=f"{p}.sdpa")
    if window:
        o = G.reshape(g, o, hd, -1, nh, name=f"{p}.unfold")
    o = heads_last(g, o, hd, nh, f"{p}.o")
    return ctx.linear(o, f"{p}.out_proj", D, D, bias=True)


def emit_vision_mlp(ctx: Ctx, x: str, p: str, v: VisionArgs) -> str:
    h = ctx.linear(x, f"{p}.fc1", v.intermediate_size, v.hidden_size, bias=True)
    h = ctx.g.layer("GELU", [h], {0: _GELU[v.hidden_act]}, name=f"{p}.act")
    return ctx.linear(h, f"{p}.fc2", v.hidden_size, v.intermediate_size, bias=True)


def emit_encoder_layer(ctx: Ctx, x: str, p: str, v: VisionArgs, i: int, cos: str, sin: str, bias: dict) -> str:
    g, D, eps = ctx.g, v.hidden_size, v.layer_norm_eps
    h = ctx.layer_norm(x, f"{p}.layer_norm1", D, eps)
    h = emit_vision_attention(ctx, h, f"{p}.self_attn", v, cos, sin, i not in v.fullatt_block_indexes, bias)
    x = G.binary(g, x, h, "add", name=f"{p}.attn_residual")
    h = ctx.layer_norm(x, f"{p}.layer_norm2", D, eps)
    h = emit_vision_mlp(ctx, h, f"{p}.mlp", v)
    return G.binary(g, x, h, "add", name=f"{p}.mlp_residual", out=f"vision.layer{i}.out")


def emit_merger(ctx: Ctx, x: str, v: VisionArgs) -> str:
    """VLPatchMerger: RMSNorm, concat each group of 4 tokens, Linear-GELU(erf)-Linear (spec §5)."""
    g, D, m2 = ctx.g, v.hidden_size, v.spatial_merge_size ** 2
    x = ctx.rms_norm(x, "merger.ln_q", D, v.merger_rms_norm_eps)
    x = G.reshape(g, x, D * m2, -1, name="merger.group")
    x = ctx.linear(x, "merger.mlp.0", D * m2, D * m2, bias=True)
    x = g.layer("GELU", [x], {0: _GELU[v.merger_act]}, name="merger.act")
    return ctx.linear(x, "merger.mlp.2", v.out_hidden_size, D * m2, bias=True, out="merged")


def vision_prefix(ckpt) -> str:
    # spec §8: ``siglip2.vision_model.*``; some exports drop ``vision_model``
    for pre in ("siglip2.vision_model", "siglip2"):
        if f"{pre}.embeddings.patch_embedding.weight" in ckpt:
            return pre
    raise EdgevlError("the checkpoint has no siglip2.vision_model.* tensors; it is not a Youtu-VL checkpoint")


def build_vision(ctx: Ctx, v: VisionArgs, prefix: str) -> GraphInfo:
    g = ctx.g
    pv = g.input("pixel_values")                          # (h=T, w=patch_dim), padded window order
    cos, sin = g.input("vision_cos"), g.input("vision_sin")
    kbias = g.input("kbias")                              # (c=heads*nw, h=P, w=1)
    zero = g.layer("BinaryOp", [kbias], {0: 2, 1: 1, 2: 0.0}, name="kbias_zero")
    ones = g.layer("BinaryOp", [zero], {0: 0, 1: 1, 2: 1.0}, name="q_one")
    nh = v.num_attention_heads
    bias = {"kbias": kbias, "ones": ones,
            "kbias_full": G.reshape(g, kbias, 1, -1, nh, name="kbias_full"),
            "ones_full": G.reshape(g, ones, 1, -1, nh, name="q_one_full")}
    g.section("embed")
    x = ctx.linear(pv, f"{prefix}.embeddings.patch_embedding", v.hidden_size, v.patch_dim, bias=True)
    for i in range(v.num_hidden_layers):
        g.section(f"layer{i}")
        x = emit_encoder_layer(ctx, x, f"{prefix}.encoder.layers.{i}", v, i, cos, sin, bias)
    g.section("merger")
    x = ctx.layer_norm(x, f"{prefix}.post_layernorm", v.hidden_size, v.layer_norm_eps, out="vision.post_ln")
    emit_merger(ctx, x, v)
    return GraphInfo(
        inputs={"pixel_values": "pixel_values", "cos": "vision_cos", "sin": "vision_sin", "kbias": "kbias"},
        outputs={"merged": "merged", "post_ln": "vision.post_ln",
                 "layers": [f"vision.layer{i}.out" for i in range(v.num_hidden_layers)]},
        extra={"vision_args": vars(v)},
    )


def convert(ckpt, out, dtype: str, kv_mode: str, on_tensor, write_language_model) -> dict:
    """Language model (root config) + vision graph into one package."""
    from ..convert import save_graph, storage_dtype

    cfg = ckpt.config
    if "vision_config" not in cfg:
        raise EdgevlError("config.json of a youtu_vl model needs a nested vision_config")
    v = VisionArgs.from_config(cfg)
    a = youtu.ModelArgs.from_config(cfg)
    if v.out_hidden_size != a.hidden_size:
        raise EdgevlError(f"vision_config.out_hidden_size {v.out_hidden_size} != hidden_size {a.hidden_size}")
    if cfg.get("image_token_id") is None:
        raise EdgevlError("config.json of a youtu_vl model needs image_token_id")
    parts = write_language_model(ckpt, out, a, dtype, kv_mode, "model", on_tensor)
    # The vision tower stays in float (bf16 for q8 packages): it is small next to the LM and
    # runs once per image with large M, where activation quantization costs accuracy.
    g = G.Graph(out / "vision.bin")
    info = build_vision(Ctx(ckpt, g, storage_dtype(dtype), None, on_tensor), v, vision_prefix(ckpt))
    parts["graphs"]["vision"] = save_graph(g, out / "vision.param", info)
    return parts


# ---------------------------------------------------------------------------------------------
# host side


@dataclass
class WindowLayout:
    """Where each processor-order patch sits in the padded window layout."""
    n_windows: int
    window_len: int          # P
    position: np.ndarray     # [N] row in the padded layout of processor-order patch n
    sizes: np.ndarray        # [n_windows] real patches per window

    @property
    def rows(self) -> int:
        return self.n_windows * self.window_len


def window_layout(gh: int, gw: int, v: VisionArgs) -> WindowLayout:
    window_index, cu = improc.window_partition(gh, gw, v.window_size, v.patch_size, v.spatial_merge_size)
    sizes = np.diff(cu)
    nw, P = len(sizes), int(sizes.max())
    m2 = v.spatial_merge_size ** 2
    win_order = (window_index[:, None] * m2 + np.arange(m2)).ravel()  # processor ids in window order
    window_of = np.repeat(np.arange(nw), sizes)
    offset_in = np.arange(gh * gw) - np.repeat(cu[:-1], sizes)
    position = np.empty(gh * gw, np.int64)
    position[win_order] = window_of * P + offset_in
    return WindowLayout(nw, P, position, sizes)


class VisionEncoder:
    """Runs the vision graph for one image: preprocessing, layout, RoPE tables, un-padding."""

    def __init__(self, net: Net, info: dict, manifest: dict,
                 default_max_patches: int = improc.DEFAULT_MAX_IMAGE_PATCHES):
        self.net, self.info = net, info
        # checked like a config: a damaged manifest must fail in one line, not divide by zero
        self.v = config_args(VisionArgs, info["extra"]["vision_args"], where="manifest.json vision_args")
        self.default_max_patches = default_max_patches

    def preprocess(self, image, max_image_patches=None) -> dict:
        n = self.default_max_patches if max_image_patches is None else int(max_image_patches)
        return improc.preprocess(image, n, patch_size=self.v.patch_size, merge_size=self.v.spatial_merge_size)

    def image_tokens(self, height: int, width: int, max_image_patches=None) -> int:
        """Tokens an image of this size will take, from its size alone (nothing decoded)."""
        n = self.default_max_patches if max_image_patches is None else max_image_patches
        m = self.v.spatial_merge_size
        th, tw = improc.target_size(height, width, n, self.v.patch_size, m)
        return (th // self.v.patch_size) * (tw // self.v.patch_size) // (m * m)

    def inputs(self, pre: dict) -> tuple[dict, WindowLayout]:
        v = self.v
        gh, gw = pre["spatial_shapes"]
        lay = window_layout(gh, gw, v)
        T = lay.rows
        pv = np.zeros((T, v.patch_dim), np.float32)
        pv[lay.position] = pre["pixel_values"]
        ang = np.zeros((T, v.head_dim // 2), np.float32)
        ang[lay.position] = improc.vision_rope_angles(gh, gw, v.head_dim, v.rope_theta, v.spatial_merge_size)
        real = np.arange(lay.window_len)[None, :] < lay.sizes[:, None]           # [nw, P]
        kb = np.where(real, 0.0, PAD_KEY_BIAS).astype(np.float32)
        kbias = np.broadcast_to(kb[None], (v.num_attention_heads,) + kb.shape)
        kbias = np.ascontiguousarray(kbias.reshape(-1, lay.window_len, 1))      # (c=heads*nw, h=P, w=1)
        names = self.info["inputs"]
        return {names["pixel_values"]: pv, names["cos"]: np.cos(ang), names["sin"]: np.sin(ang),
                names["kbias"]: kbias}, lay

    def __call__(self, image, max_image_patches=None, extract_layers: bool = False):
        """Merger rows [N/4, hidden] in processor order, and the processor info (plus layers)."""
        pre = self.preprocess(image, max_image_patches)
        feeds, lay = self.inputs(pre)
        outs = self.info["outputs"]
        names = (outs["layers"] + [outs["post_ln"]] if extract_layers else []) + [outs["merged"]]
        res = self.net.run(feeds, names)
        m2 = self.v.spatial_merge_size ** 2
        group_pos = lay.position[::m2] // m2
        rows = res[-1][group_pos]
        info = {k: pre[k] for k in ("spatial_shapes", "image_size", "resized_size", "num_image_tokens")}
        if extract_layers:
            info["layers"] = [r[lay.position] for r in res[:-1]]
            info["pixel_values"] = pre["pixel_values"]
        return rows, info
