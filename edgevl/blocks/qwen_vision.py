"""Qwen3-VL's vision tower, as Qwen3.5, Qwen3.5-MoE and the Youtu MoE use it: the graph
(patch embedding, position table, blocks with 2-D RoPE, the 2x2 patch merger), the checks a
package needs to take images, and its run-time driver (the learned position table resampled per
image, the RoPE tables, merge-block patch order). Facts: docs/models/qwen3_5.md, "Vision tower".

Hold it next to transformers' ``Qwen3_5VisionModel``. The image processor is
``edgevl/processing/qwen_vl.py``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .. import ncnn_graph as G
from .. import processing
from ..errors import EdgevlError
from ..processing import qwen_vl
from ..processing import video as vid
from .base import Q8_QUANT as INT8
from .base import Ctx, GraphInfo, RowStack, config_args, heads_first, save_graph, storage_dtype
from .vision import GELU_TANH, emit_vit_mlp, rope_attention


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
    def from_config(cls, cfg: dict) -> VisionArgs:
        vc = cfg.get("vision_config") or {}
        rp = vc.get("rope_parameters") if isinstance(vc, dict) else None
        for name, v in (("vision_config", vc), ("vision_config.rope_parameters", rp or {})):
            if not isinstance(v, dict):
                raise EdgevlError(f"config.json field {name} must be a JSON object, got {type(v).__name__}; fix the "
                                  "checkpoint's config")
        rp = rp or {}
        v = config_args(cls, vc, rope_theta=float(rp.get("rope_theta", 10000.0)))
        if v.hidden_act not in GELU_TANH:
            raise EdgevlError(f"vision hidden_act {v.hidden_act!r} is not supported (expected gelu or "
                              "gelu_pytorch_tanh)")
        if v.hidden_size % v.num_heads or v.head_dim % 4:
            raise EdgevlError("vision_config: num_heads must divide hidden_size into heads of a multiple of 4 "
                              "(2-D RoPE)")
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


def emit_vision_attention(ctx: Ctx, x: str, p: str, v: VisionArgs, cos: str, sin: str) -> str:
    """Qwen3_5VisionAttention: fused qkv, 2-D RoPE over the whole head, full attention (one image)."""
    g, D, nh, hd = ctx.g, v.hidden_size, v.num_heads, v.head_dim
    qkv = ctx.linear(x, f"{p}.qkv", 3 * D, D, bias=True)
    q, k, val = (heads_first(g, t, hd, nh, f"{p}.{n}") for t, n in
                 zip(G.slice_(g, qkv, [D, D, D], axis=1, name=f"{p}.split"), "qkv"))
    o = rope_attention(g, q, k, val, cos, sin, hd, nh, p)
    return ctx.linear(o, f"{p}.proj", D, D, bias=True)


def emit_vision_block(ctx: Ctx, x: str, p: str, v: VisionArgs, i: int, cos: str, sin: str) -> str:
    g, D = ctx.g, v.hidden_size
    h = ctx.layer_norm(x, f"{p}.norm1", D, 1e-6)
    x = G.binary(g, x, emit_vision_attention(ctx, h, f"{p}.attn", v, cos, sin), "add", name=f"{p}.attn_residual")
    h = ctx.layer_norm(x, f"{p}.norm2", D, 1e-6)
    h = emit_vit_mlp(ctx, h, f"{p}.mlp", D, v.intermediate_size, v.hidden_act, "linear_fc1", "linear_fc2")
    return G.binary(g, x, h, "add", name=f"{p}.mlp_residual", out=f"vision.layer{i}.out")


def emit_merger(ctx: Ctx, x: str, p: str, v: VisionArgs) -> str:
    """Qwen3_5VisionPatchMerger: LayerNorm per patch, 2x2 patches as one row, fc1, erf GELU, fc2."""
    g, D, m2 = ctx.g, v.hidden_size, v.spatial_merge_size ** 2
    x = ctx.layer_norm(x, f"{p}.norm", D, 1e-6)
    x = G.reshape(g, x, D * m2, -1, name=f"{p}.group")
    x = ctx.linear(x, f"{p}.linear_fc1", D * m2, D * m2, bias=True)
    x = G.gelu(g, x, tanh=False, name=f"{p}.act")
    return ctx.linear(x, f"{p}.linear_fc2", v.out_hidden_size, D * m2, bias=True, out="merged")


def build_vision(ctx: Ctx, v: VisionArgs, prefix: str) -> GraphInfo:
    """Patch embedding (the Conv3d with kernel = stride as one Gemm) + the host-resampled learned
    position table, the blocks, the merger. Inputs (h=patches): ``pixel_values`` (w=C*T*p*p),
    ``vision_pos`` (w=hidden), ``vision_cos``/``vision_sin`` (w=head_dim/2)."""
    g = ctx.g
    pv, pos = g.input("pixel_values"), g.input("vision_pos")
    cos, sin = g.input("vision_cos"), g.input("vision_sin")
    g.section("embed")
    w = ctx.tensor(f"{prefix}.patch_embed.proj.weight",
                   (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size))
    bias = ctx.array(f"{prefix}.patch_embed.proj.bias", (v.hidden_size,))
    x = G.gemm(g, pv, RowStack([w], "patch_embed"), ctx.dtype, bias=bias, name=f"{prefix}.patch_embed")
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


def write_vision(ckpt, out: Path, dtype: str, on_tensor, v: VisionArgs, prefix: str, quantize: bool = False) -> dict:
    """vision.param/.bin and the position table ``vision_pos_embed.bin``; the manifest entry.
    ``quantize``: the blocks' and merger's Gemms in int8 (the patch embedding stays float: one
    Gemm over raw pixels), else the package's float type (bf16 in q8 packages)."""
    g = G.Graph(out / "vision.bin")
    info = build_vision(Ctx(ckpt, g, storage_dtype(dtype), INT8 if quantize else None, on_tensor), v, prefix)
    info.extra["quantized"] = bool(quantize)
    side = int(round(v.num_position_embeddings ** 0.5))
    table = ckpt.get(f"{prefix}.pos_embed.weight", (v.num_position_embeddings, v.hidden_size))
    on_tensor(table)
    table.numpy().astype("<f4").tofile(out / "vision_pos_embed.bin")
    info.extra["pos_embed"] = {"file": "vision_pos_embed.bin", "side": side, "dim": v.hidden_size}
    return save_graph(g, out / "vision.param", info)


def vision_token_ids(cfg: dict, tower: bool) -> dict:
    """The manifest's token ids of the vision side: ``image_token_id`` when the package has a
    tower, and the video and vision start/end ids config.json names."""
    keys = (("image_token_id",) if tower else ()) + ("video_token_id", "vision_start_token_id",
                                                     "vision_end_token_id")
    return {k: int(cfg[k]) for k in keys if cfg.get(k) is not None}


def open_vision(pkg, net) -> VisionEncoder:
    """The vision encoder of a loaded package (its vision graph and position table)."""
    info = pkg.manifest["graphs"]["vision"]
    table = pkg.file(info["extra"]["pos_embed"]["file"], "vision table")
    return VisionEncoder(net, info, table, qwen_vl.ProcessorConfig.from_folder(pkg.path),
                         vid.VideoConfig.from_folder(pkg.path))


def checked_vision_args(ckpt, hidden_size: int, prefix: str, what: str):
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
    got = processing.settings(folder, "preprocessor_config.json")
    if got is None:
        raise EdgevlError(f"{folder} has no preprocessor_config.json, nor an image_processor entry in "
                          "processor_config.json (the image processor's sizes, mean and std), which a model with a "
                          "vision_config needs; copy it from the model's original files")
    d, p = got
    try:
        c = qwen_vl.ProcessorConfig.from_dict(d)
    except (TypeError, ValueError, AttributeError) as e:
        raise EdgevlError(f"{p} holds a value of the wrong type ({' '.join(str(e).split())[:80]}); fix or "
                          "re-download it") from None
    if (c.patch_size, c.merge_size, c.temporal_patch_size) != (v.patch_size, v.spatial_merge_size,
                                                               v.temporal_patch_size):
        raise EdgevlError(f"preprocessor_config.json's patch/merge/temporal sizes {c.patch_size}/{c.merge_size}/"
                          f"{c.temporal_patch_size} differ from vision_config's {v.patch_size}/"
                          f"{v.spatial_merge_size}/{v.temporal_patch_size}; the checkpoint files do not belong "
                          "together")


# ---------------------------------------------------------------------------------------------
# run time


def vision_rope_tables(gh: int, gw: int, head_dim: int, theta: float, merge: int):
    """cos/sin [gh*gw, head_dim/2] of the vision tower's 2-D RoPE in merge-block patch order:
    [h * f, w * f] with f over head_dim/4 frequencies (``Qwen3_5VisionRotaryEmbedding``)."""
    half = head_dim // 2
    inv = (1.0 / (theta ** (np.arange(0, half, 2, dtype=np.float64) / half))).astype(np.float32)
    rows, cols = merge_order(gh, gw, merge)
    f = np.concatenate([rows[:, None].astype(np.float32) * inv, cols[:, None].astype(np.float32) * inv], 1)
    return np.cos(f).astype(np.float32), np.sin(f).astype(np.float32)


def merge_order(gh: int, gw: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
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
    rows, cols = merge_order(gh, gw, merge)

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

    def __init__(self, net, info: dict, pos_table_path, processor_config=None, video_config=None):
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
        self.video_cfg = video_config or vid.VideoConfig()
        if (self.video_cfg.patch_size, self.video_cfg.merge_size, self.video_cfg.temporal_patch_size) != (
                self.v.patch_size, self.v.spatial_merge_size, self.v.temporal_patch_size):
            raise EdgevlError("video_preprocessor_config.json's patch/merge/temporal sizes differ from the vision "
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
        pre = qwen_vl.preprocess(image, self.config_for(max_image_patches))
        pre["max_image_patches"] = self.default_max_patches if max_image_patches is None else int(max_image_patches)
        return pre

    def image_tokens(self, height: int, width: int, max_image_patches=None) -> int:
        """Tokens an image of this size will take, from its size alone (nothing decoded)."""
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

    def video_tokens(self, video, fps: float | None = None, max_frames: int | None = None,
                     max_pixels: int | None = None, count_text=None, max_decode: int | None = None) -> int:
        """Prompt tokens a clip will take (its pads, timestamps and start/end tokens), from its
        header alone (nothing decoded); bad files fail here in one line. ``count_text`` (the
        tokenizer's count of a text) counts each ``<T seconds>``; without it, 12 at most."""
        cfg = self.video_cfg
        if isinstance(video, vid.DecodedVideo):
            (th, tw), stamps = video.sampled.resized_size, video.sampled.timestamps
        else:
            clip = vid.open_clip(video)
            indices, (th, tw) = vid.plan(clip, cfg, fps, max_frames, max_pixels, max_decode)
            stamps = vid.timestamps(indices, clip.fps, cfg.temporal_patch_size)
        per = (th // cfg.patch_size) * (tw // cfg.patch_size) // cfg.merge_size ** 2
        return sum(per + 2 + (12 if count_text is None else count_text(f"<{t:.1f} seconds>")) for t in stamps)

    def encode_video(self, video, fps: float | None = None, max_frames: int | None = None,
                     max_pixels: int | None = None):
        """One clip -> merger rows [temporal patches * tokens per patch, hidden] and its info
        (``kind`` "video", ``grid_thw``, ``timestamps`` ...). The tower attends within one temporal
        patch only, so it runs once per patch: memory stays that of one pair of frames."""
        t0 = time.perf_counter()
        s = (video.sampled if isinstance(video, vid.DecodedVideo)
             else vid.load_video(video, self.video_cfg, fps, max_frames, max_pixels))
        gt, gh, gw = s.grid_thw
        v, tp = self.v, self.video_cfg.temporal_patch_size
        tables = self.inputs({"pixel_values": None, "grid_thw": (1, gh, gw)})
        pv_name, out = self.info["inputs"]["pixel_values"], self.info["outputs"]["merged"]
        rows = []
        for k in range(gt):
            pv = vid.patch_rows(np.stack(s.frames[k * tp:(k + 1) * tp]), self.video_cfg)
            s.frames[k * tp:(k + 1) * tp] = [None] * tp      # each pair is let go once encoded
            rows.append(self.net.run({**tables, pv_name: pv}, [out])[0])
        info = {"kind": "video", "grid_thw": s.grid_thw, "merge_size": v.spatial_merge_size,
                "timestamps": s.timestamps, "frame_indices": s.indices, "source_fps": s.source_fps,
                "video_size": s.video_size, "resized_size": s.resized_size,
                "tokens_per_frame": gh * gw // v.spatial_merge_size ** 2}
        info["num_video_tokens"] = gt * info["tokens_per_frame"]
        info["seconds"] = time.perf_counter() - t0       # decoding and encoding
        return np.concatenate(rows, 0), info
