"""Youtu-VL: SigLIP-2 vision tower (window attention, 2-D RoPE) + VLPatchMerger + Youtu MLA LM.

The language half is ``youtu.py`` unchanged (text fields sit at the root of config.json). This
file holds the vision graph (hold it next to spec youtu_vl.md §4–§5) and its host-side driver.

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

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import ncnn_graph as G
from ..boxes import Box
from ..errors import EdgevlError
from ..processing import siglip2
from ..runtime import Net
from . import youtu
from .youtu import YOUTU_VL_TEMPLATE
from .base import Ctx, GraphInfo, config_args, heads_first, heads_last, save_graph, storage_dtype
from .protocol import OutputProcessor, Reference, torch_dtype

# Window size classes of a raster tiling: whole windows, right column, bottom row, corner.
WINDOW_SLOTS = 4



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
            if act not in _GELU_TANH:
                raise EdgevlError(f"vision activation {act!r} is not supported (expected gelu or gelu_pytorch_tanh)")
        return v

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.patch_size * self.patch_size


_GELU_TANH = {"gelu_pytorch_tanh": True, "gelu_new": True, "gelu": False}  # tanh form, or exact erf


# ---------------------------------------------------------------------------------------------
# blocks


def emit_vision_attention(ctx: Ctx, x: str, p: str, v: VisionArgs, cos: str, sin: str, window: bool,
                          slots: list) -> str:
    """Siglip2 attention with 2-D RoPE (rotate_half pairs, RotaryEmbed 0=0), per window or full."""
    g, D, nh, hd = ctx.g, v.hidden_size, v.num_attention_heads, v.head_dim
    q = heads_first(g, ctx.linear(x, f"{p}.q_proj", D, D, bias=True), hd, nh, f"{p}.q")
    k = heads_first(g, ctx.linear(x, f"{p}.k_proj", D, D, bias=True), hd, nh, f"{p}.k")
    val = heads_first(g, ctx.linear(x, f"{p}.v_proj", D, D, bias=True), hd, nh, f"{p}.v")
    q = G.rotary(g, q, cos, sin, interleaved=False, name=f"{p}.q_rope")
    k = G.rotary(g, k, cos, sin, interleaved=False, name=f"{p}.k_rope")
    if not window:
        o = G.sdpa(g, q, k, val, scale=hd ** -0.5, name=f"{p}.sdpa")
    else:
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


def emit_vision_mlp(ctx: Ctx, x: str, p: str, v: VisionArgs) -> str:
    h = ctx.linear(x, f"{p}.fc1", v.intermediate_size, v.hidden_size, bias=True)
    h = G.gelu(ctx.g, h, tanh=_GELU_TANH[v.hidden_act], name=f"{p}.act")
    return ctx.linear(h, f"{p}.fc2", v.hidden_size, v.intermediate_size, bias=True)


def emit_encoder_layer(ctx: Ctx, x: str, p: str, v: VisionArgs, i: int, cos: str, sin: str, slots: list) -> str:
    g, D, eps = ctx.g, v.hidden_size, v.layer_norm_eps
    h = ctx.layer_norm(x, f"{p}.layer_norm1", D, eps)
    h = emit_vision_attention(ctx, h, f"{p}.self_attn", v, cos, sin, i not in v.fullatt_block_indexes, slots)
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
    x = G.gelu(g, x, tanh=_GELU_TANH[v.merger_act], name="merger.act")
    return ctx.linear(x, "merger.mlp.2", v.out_hidden_size, D * m2, bias=True, out="merged")


def vision_prefix(ckpt) -> str:
    # spec §8: ``siglip2.vision_model.*``; some exports drop ``vision_model``
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
    x = ctx.linear(pv, f"{prefix}.embeddings.patch_embedding", v.hidden_size, v.patch_dim, bias=True)
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
    a = youtu.ModelArgs.from_config(cfg)
    if v.out_hidden_size != a.hidden_size:
        raise EdgevlError(f"vision_config.out_hidden_size {v.out_hidden_size} != hidden_size {a.hidden_size}")
    if cfg.get("image_token_id") is None:
        raise EdgevlError("config.json of a youtu_vl model needs image_token_id")
    parts = youtu.write_language_model(ckpt, out, a, dtype, options["kv_cache"], "model", on_tensor)
    # The vision tower stays in float (bf16 for q8 packages): it is small next to the LM and
    # runs once per image with large M, where activation quantization costs accuracy.
    g = G.Graph(out / "vision.bin")
    info = build_vision(Ctx(ckpt, g, storage_dtype(dtype), None, on_tensor), v, vision_prefix(ckpt))
    info.extra["max_image_patches"] = configured_max_patches(ckpt.folder)
    parts["graphs"]["vision"] = save_graph(g, out / "vision.param", info)
    parts["image_token_id"] = int(cfg["image_token_id"])
    return parts


def configured_max_patches(folder) -> int:
    """The per-image patch budget of a checkpoint: ``max_image_patches`` from its
    preprocessor_config.json if set, else 36864.

    Youtu-VL's own JSON has no such key (its ``max_num_patches`` 256 is overridden by the
    processor call's default 36864, spec §2.3), so real checkpoints get 36864; the demo model,
    trained on 128x128 images, sets 64.
    """
    p = Path(folder) / "preprocessor_config.json"
    if p.is_file():
        try:
            v = json.loads(p.read_text()).get("max_image_patches")
        except (OSError, ValueError):
            v = None
        if isinstance(v, int) and v > 0:
            return v
    return siglip2.DEFAULT_MAX_IMAGE_PATCHES


# ---------------------------------------------------------------------------------------------
# host side


@dataclass
class WindowLayout:
    """Where each processor-order patch sits in the packed window layout, and the slots."""
    position: np.ndarray     # [N] row in the packed layout of processor-order patch n
    slots: list              # per used slot: (windows n, rows per window s, first row)

    @property
    def rows(self) -> int:
        return len(self.position)


def window_layout(gh: int, gw: int, v: VisionArgs) -> WindowLayout:
    """Windows in processor window order, regrouped by size (largest first) into slots."""
    window_index, cu = siglip2.window_partition(gh, gw, v.window_size, v.patch_size, v.spatial_merge_size)
    sizes = np.diff(cu)
    classes = sorted(set(sizes.tolist()), reverse=True)
    if len(classes) > WINDOW_SLOTS:  # a raster tiling has at most 4
        raise EdgevlError(f"{len(classes)} window sizes in one image; at most {WINDOW_SLOTS} are supported")
    order = np.concatenate([np.flatnonzero(sizes == c) for c in classes])     # windows, packed order
    m2 = v.spatial_merge_size ** 2
    win_order = (window_index[:, None] * m2 + np.arange(m2)).ravel()        # processor ids in window order
    packed_start = np.empty(len(sizes), np.int64)
    packed_start[order] = np.concatenate([[0], np.cumsum(sizes[order])[:-1]])
    window_of = np.repeat(np.arange(len(sizes)), sizes)
    offset_in = np.arange(gh * gw) - np.repeat(cu[:-1], sizes)
    position = np.empty(gh * gw, np.int64)
    position[win_order] = packed_start[window_of] + offset_in
    slots, start = [], 0
    for c in classes:
        n = int((sizes == c).sum())
        slots.append((n, int(c), start))
        start += n * int(c)
    return WindowLayout(position, slots)


class VisionEncoder:
    """Runs the vision graph for one image: preprocessing, window layout, RoPE tables, row order."""

    def __init__(self, net: Net, info: dict):
        self.net, self.info = net, info
        shapes = info["inputs"].get("window_shapes")
        if not (isinstance(shapes, list) and len(shapes) == WINDOW_SLOTS):
            raise EdgevlError("the package's vision graph uses an older window layout; convert the model again")
        # checked like a config: a damaged manifest must fail in one line, not divide by zero
        self.v = config_args(VisionArgs, info["extra"]["vision_args"], where="manifest.json vision_args")
        n = info["extra"].get("max_image_patches")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise EdgevlError(f"manifest.json graphs.vision.extra.max_image_patches must be a positive integer, "
                              f"got {n!r:.40}; convert the model again")
        self.default_max_patches = n

    def preprocess(self, image, max_image_patches=None) -> dict:
        n = self.default_max_patches if max_image_patches is None else int(max_image_patches)
        pre = siglip2.preprocess(image, n, patch_size=self.v.patch_size, merge_size=self.v.spatial_merge_size)
        pre["max_image_patches"] = n
        return pre

    def image_tokens(self, height: int, width: int, max_image_patches=None) -> int:
        """Tokens an image of this size will take, from its size alone (nothing decoded)."""
        n = self.default_max_patches if max_image_patches is None else max_image_patches
        m = self.v.spatial_merge_size
        th, tw = siglip2.target_size(height, width, n, self.v.patch_size, m)
        return (th // self.v.patch_size) * (tw // self.v.patch_size) // (m * m)

    def inputs(self, pre: dict) -> tuple[dict, WindowLayout]:
        v = self.v
        gh, gw = pre["spatial_shapes"]
        lay = window_layout(gh, gw, v)
        N = lay.rows
        pv = np.empty((N, v.patch_dim), np.float32)
        pv[lay.position] = pre["pixel_values"]
        ang = np.empty((N, v.head_dim // 2), np.float32)
        ang[lay.position] = siglip2.vision_rope_angles(gh, gw, v.head_dim, v.rope_theta, v.spatial_merge_size)
        names = self.info["inputs"]
        feeds = {names["pixel_values"]: pv, names["cos"]: np.cos(ang), names["sin"]: np.sin(ang)}
        # only the shapes of these inputs are read (unused slots: the last row as a 1-row window)
        slots = lay.slots + [(1, 1, N - 1)] * (WINDOW_SLOTS - len(lay.slots))
        for (n, size, start), shape, first in zip(slots, names["window_shapes"], names["window_starts"]):
            feeds[shape] = np.zeros((n, size), np.float32)
            feeds[first] = np.zeros(start + 1, np.float32)
        return feeds, lay

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
        info = {k: pre[k] for k in ("spatial_shapes", "image_size", "resized_size", "num_image_tokens",
                                    "max_image_patches")}
        info["grid"] = tuple(int(x) // self.v.spatial_merge_size for x in pre["spatial_shapes"])
        if extract_layers:
            info["layers"] = [r[lay.position] for r in res[:-1]]
            info["pixel_values"] = pre["pixel_values"]
        return rows, info


# ---------------------------------------------------------------------------------------------
# output: grounding coordinates (spec §10.3)
#
# The model writes coordinates as tokens ``<x_i>``/``<y_i>`` in pixels of the *resized* image;
# the reference ``generate(..., img_input=...)`` rescales them to the original image. We rewrite
# them in the streamed text instead of mapping token ids: the numbers are pixels of the original
# image, clamped to that image (not to the 2048 coordinate tokens, nor to a small vocabulary's).
#
# Which image a coordinate refers to: the reference passes one image, the last one of the
# conversation (ADP demo ``process_input``), so by default every coordinate is in the prompt's
# last image. With several images the answer can say which it means: the last mention before a
# coordinate of "image 2" / "picture 2" / "photo #2" / "the second image" (1-based, prompt order)
# assigns it to that image; mentions of images the prompt does not have are ignored.

COORD_RE = re.compile(r"<([xy])_(\d+)>")
PARTIAL_COORD_RE = re.compile(r"<(?:[xy](?:_\d*)?)?$")           # text that may grow into one
BOX_RE = re.compile(r"<box>\s*<x_(\d+)>\s*<y_(\d+)>\s*<x_(\d+)>\s*<y_(\d+)>\s*</box>")
LABEL_RE = re.compile(r"<(ref|label)>(.*?)</\1>", re.S)          # as the ADP demo's vis.py
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")
MENTION_RE = re.compile(r"\b(?:image|picture|photo|img)\s*#?\s*(\d+)\b|\b(" + "|".join(ORDINALS) +
                        r")\s+(?:image|picture|photo)\b", re.I)
MENTION_LOOKBACK = 32  # characters re-scanned for a mention split across streamed pieces


class GroundingProcessor(OutputProcessor):
    """Rescales ``<x_i>``/``<y_i>`` in the answer to original-image pixels and collects
    ``<box>`` answers (label: the last ``<ref>``/``<label>`` before the box) as Box tuples."""

    def __init__(self, images: list[dict]):
        # (original (h, w), resized (h, w)) per image
        self.sizes = [(tuple(i["image_size"]), tuple(i["resized_size"])) for i in images]
        self.text = ""          # rewritten text returned so far
        self.pending = ""       # held back: may be the start of a coordinate token
        self.mentions: list[tuple[int, int]] = []   # (end offset in text, image index)
        self._mention_scan = 0
        self._found: list[tuple[int, Box]] = []      # (end offset, box)
        self._box_scan = 0

    def image_at(self, offset: int) -> int:
        """The image a coordinate at ``offset`` of the text refers to (module comment)."""
        for end, k in reversed(self.mentions):
            if end <= offset:
                return k
        return len(self.sizes) - 1

    def _scan_mentions(self, upto: int) -> None:
        if len(self.sizes) < 2:
            return
        start = max(self._mention_scan, upto - MENTION_LOOKBACK, 0)
        for m in MENTION_RE.finditer(self.text, start, upto):
            k = int(m.group(1)) - 1 if m.group(1) else ORDINALS.index(m.group(2).lower())
            if 0 <= k < len(self.sizes) and (not self.mentions or self.mentions[-1][0] < m.end()):
                self.mentions.append((m.end(), k))
        self._mention_scan = max(self._mention_scan, upto - MENTION_LOOKBACK)

    def rescale(self, axis: str, value: int, image: int) -> int:
        (oh, ow), (rh, rw) = self.sizes[image]
        orig, resized = (ow, rw) if axis == "x" else (oh, rh)
        return min(max(round(value * orig / resized), 0), orig - 1)  # round half to even, as torch

    def feed(self, text: str) -> str:
        s = self.pending + text
        m = PARTIAL_COORD_RE.search(s)
        cut = m.start() if m else len(s)
        s, self.pending = s[:cut], s[cut:]
        return self._release(s)

    def flush(self) -> str:
        s, self.pending = self.pending, ""
        return self._release(s)

    def _append(self, s: str) -> None:
        self.text += s
        self._scan_mentions(len(self.text))

    def _release(self, s: str) -> str:
        base, last = len(self.text), 0
        for m in COORD_RE.finditer(s):
            self._append(s[last:m.start()])
            axis, k = m.group(1), self.image_at(len(self.text))
            self._append(f"<{axis}_{self.rescale(axis, int(m.group(2)), k)}>")
            last = m.end()
        self._append(s[last:])
        for b in BOX_RE.finditer(self.text, self._box_scan):
            labels = [lm.group(2).strip() for lm in LABEL_RE.finditer(self.text, 0, b.start())]
            x1, y1, x2, y2 = (int(v) for v in b.groups())
            self._found.append((b.end(), Box.of(labels[-1] if labels else None, x1, y1, x2, y2,
                                                self.image_at(b.start()))))
            self._box_scan = b.end()
        return self.text[base:]

    def boxes(self, shown: int | None = None) -> list:
        return [b for end, b in self._found if shown is None or end <= shown]


def parse_boxes(text: str, n_images: int = 1) -> list:
    """The boxes of an answer whose coordinates are already pixels (the images' sizes unknown):
    labels and image assignment as ``GroundingProcessor``, coordinates as written."""
    class _Identity(GroundingProcessor):
        def rescale(self, axis, value, image):
            return value

    p = _Identity([{"image_size": (1, 1), "resized_size": (1, 1)}] * max(1, n_images))
    p.feed(text)
    p.flush()
    return p.boxes()


# ---------------------------------------------------------------------------------------------
# the PyTorch reference (edgevl/reference/youtu_vl.py, written from the spec: no transformers class)


def torch_pixel_values(image, max_image_patches, patch: int, merge: int) -> np.ndarray:
    """The HF processor path in torch (uint8 antialiased resize, fused normalisation, patchify)."""
    import torch
    import torch.nn.functional as F

    from ..processing.image import load_image

    im = load_image(image)
    th, tw = siglip2.target_size(im.height, im.width, max_image_patches, patch, merge)
    x = torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1)[None]
    x = F.interpolate(x, size=(th, tw), mode="bilinear", antialias=True, align_corners=False)[0]
    x = (x.float() - 127.5) / 127.5
    gh, gw = th // patch, tw // patch
    x = x.reshape(3, gh // merge, merge, patch, gw // merge, merge, patch).permute(1, 4, 2, 5, 3, 6, 0)
    return x.reshape(gh * gw, patch * patch * 3).numpy()


class YoutuVLReference(Reference):
    has_vision = True

    def __init__(self, model):
        self.model = model
        self.v = model.vision_config

    def prepare_images(self, images, infos):
        """[(pixel_values, spatial_shapes)] through torch's own resize path (not ours)."""
        out = []
        for im, info in zip(images, infos):
            n = info["max_image_patches"]
            out.append((torch_pixel_values(im, n, self.v.patch_size, self.v.spatial_merge_size),
                        tuple(info["spatial_shapes"])))
        return out

    def processor_diff(self, images, infos):
        return max(float(np.abs(pv - info["pixel_values"]).max())
                   for (pv, _), info in zip(self.prepare_images(images, infos), infos)
                   if "pixel_values" in info)

    def vision_states(self, images):
        import torch

        out = []
        with torch.no_grad():
            for pv, ss in images:
                merged, states = self.model.vision_features(torch.from_numpy(pv), ss, output_hidden_states=True)
                out.append((merged.numpy(), [s.numpy() for s in states[1:-1]]))
        return out

    def _pv(self, images):
        import torch

        if not images:
            return None, None
        if len(images) > 1:  # the merger rows of several images, fused in prompt order
            raise EdgevlError("the Youtu-VL reference takes one image per prompt")
        pv, ss = images[0]
        return torch.from_numpy(pv), ss

    def text_states(self, ids, images=None):
        import torch

        pv, ss = self._pv(images)
        t = torch.tensor([list(ids)])
        with torch.no_grad():
            states = [(s[0] if s.dim() == 3 else s).numpy() for s in self.model.text_hidden_states(t, pv, ss)]
            logits = self.model(t, pv, ss).logits
        return states, (logits[0] if logits.dim() == 3 else logits).float().numpy()

    def start(self, ids, images=None):
        import torch
        from transformers import DynamicCache

        pv, ss = self._pv(images)
        m = self.model
        emb = m._inputs_embeds(torch.tensor([list(ids)]), pv, ss)
        cache = DynamicCache(config=m.text_config)
        with torch.no_grad():
            out = m.model(inputs_embeds=emb, cache=cache, use_cache=True)
            return m.lm_head(out.last_hidden_state[0, -1]).float().numpy(), out.cache

    def step(self, token, state):
        import torch

        m = self.model
        with torch.no_grad():
            out = m.model(inputs_embeds=m.model.embed_tokens(torch.tensor([[int(token)]])), cache=state,
                          use_cache=True)
            return m.lm_head(out.last_hidden_state[0, -1]).float().numpy(), out.cache


# ---------------------------------------------------------------------------------------------
# the architecture


class YoutuVL(youtu.Youtu):
    """Youtu-VL: Youtu-LLM's language model (this class derives from it) plus the vision tower."""

    name = "youtu_vl"
    chat_template = YOUTU_VL_TEMPLATE
    has_vision = True
    tiny_variants = {
        # real window size (256 px): several windows only for large images
        "default": dict(),
        # full attention where the default pattern has window layers, small windows, odd text sizes
        "custom_full": dict(hidden_size=40, num_attention_heads=5, num_key_value_heads=5, qk_nope_head_dim=6,
                            v_head_dim=10, q_lora_rank=None,
                            vision_config={"fullatt_block_indexes": [0], "num_hidden_layers": 3,
                                           "window_size": 64, "hidden_size": 48, "num_attention_heads": 3}),
    }

    def convert(self, ckpt, out, dtype, options, on_tensor) -> dict:
        return convert(ckpt, out, dtype, options, on_tensor)

    def make_vision(self, model, net):
        return VisionEncoder(net, model.manifest["graphs"]["vision"])

    def output_processor(self, model, images):
        if not images or any(i is None for i in images):  # text-only, or bare rows without sizes
            return None
        return GroundingProcessor(images)

    def reference(self, ref_dir, dtype="fp32"):
        from ..reference.youtu_vl import YoutuVLForConditionalGeneration

        return YoutuVLReference(YoutuVLForConditionalGeneration.from_pretrained(ref_dir, dtype=torch_dtype(dtype)).eval())

    def make_tiny(self, folder, variant="default", seed=0, dtype="fp32", train_steps=0, n_coordinates: int = 64,
                  **overrides):
        """A random Youtu-VL checkpoint in the real layout (the project's reference writes it);
        ``train_steps`` trains its language model briefly on text."""
        import torch

        from ..demo.tokenizer import save_tokenizer
        from ..reference.youtu_vl import make_config, make_random
        from ..testing import tiny_tokenizer, train_briefly

        tok = tiny_tokenizer(400, True, n_coordinates)
        ids = save_tokenizer(tok, folder)
        ids.pop("pad_token_id")
        overrides = {**self.tiny_variants.get(variant, {}), **overrides}
        cfg = make_config(vocab_size=tok.get_vocab_size(), pad_token_id=None, **ids, **overrides)
        model = make_random(cfg, seed=seed)
        if train_steps:
            model = train_briefly(model, tok, train_steps, seed)
        model.save_pretrained(folder, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
        return Path(folder)


ARCH = YoutuVL()
