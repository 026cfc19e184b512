"""A small, faithful PyTorch reference of Youtu-VL-4B (vision tower + merger + Youtu LLM).

The model's description is docs/models/youtu_vl.md (numbers in brackets, e.g. [8], are its
sections). The language model is transformers' own ``YoutuModel``; the Siglip2-variant vision
tower and the patch merger are written here, from that description, with parameter names equal
to the real checkpoint keys [8], so
the same class loads the real safetensors and tiny random test models.

The window partition and the 2-D RoPE table are computed here in torch, on purpose
independently of the numpy preprocessing in ``edgevl.models.youtu_vl.processing`` (checked against
this module). Clarity beats speed: window attention runs window by window.

Items the description marks as inferred ([I]) are kept configurable and say so where they are used.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import YoutuConfig, YoutuModel

__all__ = [
    "VisionConfig",
    "text_config_from_dict",
    "make_config",
    "window_partition",
    "vision_rope_angles",
    "Siglip2VisionTower",
    "VLPatchMerger",
    "YoutuVLOutput",
    "YoutuVLForConditionalGeneration",
    "make_random",
]

# Checkpoint keys that exist in some exports but are unused by Youtu-VL [4.2, 13].
_IGNORED_KEYS = ("siglip2.vision_model.embeddings.position_embedding.weight",)


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass
class VisionConfig:
    """The ``vision_config`` block of config.json [2.2]."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    patch_size: int = 16
    num_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    spatial_merge_size: int = 2
    window_size: int = 256  # pixels [4.3]
    fullatt_block_indexes: list[int] = field(default_factory=lambda: [7, 15, 23, 26])
    out_hidden_size: int = 2560
    # Not config.json keys in the sources; the values are what every port hard-codes [4.4, 5].
    rope_theta: float = 10000.0
    merger_rms_norm_eps: float = 1e-6
    # [I] [5]: exact-erf GELU is confirmed for VLLM/MLX only, inferred for the original remote code;
    # kept switchable ("gelu" = erf, "gelu_pytorch_tanh" = tanh approximation).
    merger_act: str = "gelu"

    @classmethod
    def from_dict(cls, d: dict) -> VisionConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if "fullatt_block_indexes" in kw:
            kw["fullatt_block_indexes"] = [int(i) for i in kw["fullatt_block_indexes"]]
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.patch_size * self.patch_size

    @property
    def window_cells(self) -> int:
        """Window side in merged cells: 256 px / (2 * 16 px) = 8 [4.3]."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    def validate(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("vision_config.hidden_size must be divisible by num_attention_heads")
        # 2-D RoPE: half of head_dim is rotated, split into a row half and a column half, each
        # with head_dim/4 frequencies [4.4].
        if self.head_dim % 4:
            raise ValueError(f"vision head_dim {self.head_dim} must be divisible by 4 (2-D RoPE, [4.4])")
        if self.window_cells < 1 or self.window_size % (self.spatial_merge_size * self.patch_size):
            raise ValueError("vision_config.window_size must be a multiple of patch_size*spatial_merge_size")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"fullatt_block_indexes {bad} out of range for {self.num_hidden_layers} layers")


def _rope_theta(cfg: dict) -> float:
    """Text RoPE theta, taken only from what the config says [2.1, 12.11]."""
    rp = cfg.get("rope_parameters")
    if rp:
        rope_type = rp.get("rope_type", rp.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"rope_type {rope_type!r}: Youtu-VL uses plain RoPE [2.1]")
        if "rope_theta" not in rp:
            raise ValueError("config rope_parameters has no rope_theta")
        return float(rp["rope_theta"])
    if cfg.get("rope_scaling"):
        raise NotImplementedError("config has rope_scaling; Youtu-VL has none [2.1]")
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    # transformers' YoutuConfig would silently fall back to 10000 (the real model uses 500000);
    # guessing either is how a wrong reference is born, so refuse.
    raise ValueError("config.json has neither rope_theta nor rope_parameters; cannot build the text RoPE")


def text_config_from_dict(cfg: dict) -> YoutuConfig:
    """Build transformers' ``YoutuConfig`` from a real-layout Youtu-VL config.json dict [2.1, 7].

    Text fields sit at the root; a nested ``text_config`` (not seen in the sources) is merged
    over the root in case some export uses it.
    """
    d = dict(cfg)
    if isinstance(d.get("text_config"), dict):
        d.update(d["text_config"])
    heads = int(d["num_attention_heads"])
    # [I] [2.1]: num_key_value_heads is inferred; HF MLA expands K/V per head, so it must equal heads.
    kv_heads = int(d.get("num_key_value_heads") or heads)
    if kv_heads != heads:
        raise ValueError(f"num_key_value_heads={kv_heads} must equal num_attention_heads={heads} for MLA")
    return YoutuConfig(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_hidden_layers=int(d["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        kv_lora_rank=int(d["kv_lora_rank"]),
        q_lora_rank=None if d.get("q_lora_rank") is None else int(d["q_lora_rank"]),
        qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        v_head_dim=int(d["v_head_dim"]),
        qk_nope_head_dim=int(d["qk_nope_head_dim"]),
        hidden_act=d.get("hidden_act", "silu"),
        # [I] [2.1]: irrelevant for default RoPE; only a bookkeeping bound.
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        pad_token_id=d.get("pad_token_id"),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        # Explicit: YoutuConfig's own default theta is 10000 [7, 12.11].
        rope_parameters={"rope_type": "default", "rope_theta": _rope_theta(d)},
        rope_interleave=bool(d.get("rope_interleave", True)),
        attention_bias=bool(d.get("attention_bias", False)),
        # Eager = the plain softmax(QK^T)V path; the reference values clarity over speed.
        attn_implementation="eager",
    )


def make_config(vocab_size: int = 512, **overrides) -> dict:
    """A complete real-layout config.json dict [2] for a TINY model, with overrides applied.

    Token ids default to the top of the vocabulary so any ``vocab_size`` works; pass the ids
    explicitly to match a real tokenizer. ``vision_config={...}`` is merged into the nested
    block. If ``hidden_size`` is overridden and ``vision_config.out_hidden_size`` is not, the
    merger output follows the text width (they must be equal).
    """
    v = int(vocab_size)
    cfg = {
        "architectures": ["YoutuVLForConditionalGeneration"],
        "model_type": "youtu_vl",
        "vocab_size": v,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000.0,
        "rope_interleave": True,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": v - 7,
        "eos_token_id": v - 6,
        "pad_token_id": v - 6,
        "vision_start_token_id": v - 4,
        "vision_end_token_id": v - 3,
        "image_token_id": v - 2,
        "video_token_id": v - 1,
        "torch_dtype": "float32",
        "vision_config": {
            "model_type": "siglip2_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "num_channels": 3,
            "patch_size": 16,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
            "spatial_merge_size": 2,
            "window_size": 256,
            "fullatt_block_indexes": [1, 3],
            "out_hidden_size": 48,
            "num_patches": 256,
            "vision_use_head": False,
        },
    }
    vis_over = overrides.pop("vision_config", None) or {}
    cfg.update(overrides)
    if "hidden_size" in overrides and "out_hidden_size" not in vis_over:
        cfg["vision_config"]["out_hidden_size"] = cfg["hidden_size"]
    cfg["vision_config"].update(vis_over)
    return cfg


# --------------------------------------------------------------------------------------------
# Vision geometry: window partition [4.3] and 2-D RoPE angles [4.4]
# --------------------------------------------------------------------------------------------


def _grid(spatial_shapes) -> tuple[int, int]:
    """(gh, gw) from a tuple, [2], [1, 2] or [B, 2] (all rows equal) tensor/list."""
    t = torch.as_tensor(spatial_shapes).reshape(-1, 2)
    if not bool((t == t[0]).all()):
        raise ValueError(f"all images in a batch must have the same spatial shape, got {t.tolist()}")
    return int(t[0, 0]), int(t[0, 1])


def window_partition(gh: int, gw: int, window_cells: int = 8, merge: int = 2):
    """Window order of the merged groups, for one image of gh x gw patches [4.3].

    Returns ``(window_index, cu_window_seqlens)``: ``window_index`` [gh*gw/merge^2] int64 lists the
    processor group ids (g = R*Wm + C) window by window (windows row-major, cells row-major
    inside a window; the last window row/column may be partial); ``cu_window_seqlens`` int64 is
    [0, cumulative patches per window...].
    """
    if gh % merge or gw % merge:
        raise ValueError(f"grid {gh}x{gw} must be divisible by spatial_merge_size={merge}")
    hm, wm = gh // merge, gw // merge
    ids = torch.arange(hm * wm).reshape(hm, wm)
    index, cu = [], [0]
    for r0 in range(0, hm, window_cells):
        for c0 in range(0, wm, window_cells):
            block = ids[r0 : r0 + window_cells, c0 : c0 + window_cells].reshape(-1)
            index.append(block)
            cu.append(cu[-1] + block.numel() * merge * merge)
    # HF runs unique_consecutive on cu; with this tiling no window is empty, so it is a no-op.
    return torch.cat(index), torch.tensor(cu, dtype=torch.long)


def patch_coords(gh: int, gw: int, merge: int = 2) -> torch.Tensor:
    """[N, 2] (row, col) of every patch in processor (2x2-merge) order [3.5]."""
    wm = gw // merge
    p = torch.arange(gh * gw)
    g, u = p // (merge * merge), p % (merge * merge)
    row = (g // wm) * merge + u // merge
    col = (g % wm) * merge + u % merge
    return torch.stack([row, col], dim=-1)


def vision_rope_angles(gh: int, gw: int, head_dim: int, theta: float = 10000.0, merge: int = 2) -> torch.Tensor:
    """[N, head_dim/2] float32 RoPE angles in processor order [4.4].

    The rotary sub-dimension is head_dim/2 with head_dim/4 frequencies theta^(-2j/(head_dim/2));
    the first head_dim/4 angles use the patch row, the next head_dim/4 the patch column.
    """
    rdim = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, rdim, 2, dtype=torch.float32) / rdim))
    rc = patch_coords(gh, gw, merge).to(torch.float32)
    return torch.cat([rc[:, :1] * inv, rc[:, 1:] * inv], dim=-1)


def _permute_groups(x: torch.Tensor, index: torch.Tensor, group: int) -> torch.Tensor:
    """Reorder dim -2 of x at group granularity: out[group*k+u] = x[group*index[k]+u] [4.3]."""
    *lead, n, d = x.shape
    x = x.reshape(*lead, n // group, group, d)
    return x[..., index, :, :].reshape(*lead, n, d)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (rotate_half) RoPE in float32 [4.4]; x [B, H, N, d], cos/sin [N, d]."""
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


# --------------------------------------------------------------------------------------------
# Vision tower [4]
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """HF-style RMSNorm: normalise in float32, cast back, then scale [7 'RMSNorm as in HF']."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dt)


def _act(name: str) -> nn.Module:
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_tanh"):
        return nn.GELU(approximate="tanh")
    if name == "gelu":
        return nn.GELU()
    raise ValueError(f"unsupported activation {name!r}")


class Siglip2Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        # A Linear over channel-last patch vectors [4.1]; no position embedding [4.2].
        self.patch_embedding = nn.Linear(cfg.patch_dim, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))


class Siglip2Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.out_proj = nn.Linear(h, h)

    def forward(self, x, cos, sin, cu_seqlens: list[int]) -> torch.Tensor:
        b, n, _ = x.shape

        def heads(t):
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        q = _apply_rope(heads(self.q_proj(x)), cos, sin)  # RoPE on q and k only, not v [4.4]
        k = _apply_rope(heads(self.k_proj(x)), cos, sin)
        v = heads(self.v_proj(x))
        # Block-diagonal bidirectional attention: each segment of cu_seqlens attends only to
        # itself. Windows are contiguous after the permutation, so per-segment attention equals
        # the HF additive block mask [4.5] without an N x N tensor [12.9].
        outs = []
        for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            outs.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]))
        o = torch.cat(outs, dim=2).transpose(1, 2).reshape(b, n, -1)
        return self.out_proj(o)


class Siglip2MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = _act(cfg.hidden_act)  # tanh GELU in the vision MLP [4.5, 12.10]

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Siglip2EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = Siglip2Attention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = Siglip2MLP(cfg)

    def forward(self, x, cos, sin, cu_seqlens):
        # Pre-LN residual block [4.5].
        x = x + self.self_attn(self.layer_norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.layer_norm2(x))


class Siglip2Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList([Siglip2EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])


class Siglip2VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.embeddings = Siglip2Embeddings(cfg)
        self.encoder = Siglip2Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)


class Siglip2VisionTower(nn.Module):
    """``siglip2``: holds ``vision_model`` so parameter names match the checkpoint [8]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.vision_model = Siglip2VisionTransformer(cfg)

    def forward(self, pixel_values: torch.Tensor, grid: tuple[int, int], output_hidden_states: bool = False):
        """pixel_values [B, N, patch_dim] in processor order, all B images of grid (gh, gw).

        Returns (last_hidden_state [B, N, hidden] post-LN in processor order, hidden_states or
        None). hidden_states = [embeddings, after layer 0, ..., after layer L-1], all in
        processor order, before post_layernorm.
        """
        cfg = self.config
        vm = self.vision_model
        gh, gw = grid
        m2 = cfg.spatial_merge_size ** 2
        b, n, _ = pixel_values.shape
        if n != gh * gw:
            raise ValueError(f"pixel_values has {n} patches but spatial_shapes says {gh}x{gw}={gh * gw}")
        dev = pixel_values.device
        win_index, cu_win = window_partition(gh, gw, cfg.window_cells, cfg.spatial_merge_size)
        win_index = win_index.to(dev)
        restore = torch.argsort(win_index)
        cu_win = cu_win.tolist()
        cu_full = [0, n]  # one image per batch row, so "full" = the whole row [4.5]

        # RoPE angles move with their patch: permute them like the hidden states [4.4, 12.4].
        ang = vision_rope_angles(gh, gw, cfg.head_dim, cfg.rope_theta, cfg.spatial_merge_size).to(dev)
        emb = _permute_groups(torch.cat([ang, ang], dim=-1), win_index, m2)
        cos, sin = emb.cos(), emb.sin()

        x = vm.embeddings(pixel_values)
        hidden = [x] if output_hidden_states else None
        x = _permute_groups(x, win_index, m2)
        full = set(cfg.fullatt_block_indexes)
        for i, layer in enumerate(vm.encoder.layers):
            x = layer(x, cos, sin, cu_full if i in full else cu_win)
            if output_hidden_states:
                hidden.append(_permute_groups(x, restore, m2))
        x = _permute_groups(x, restore, m2)  # un-permute after the last layer [4.6]
        return vm.post_layernorm(x), hidden


class VLPatchMerger(nn.Module):
    """``merger`` [5]: RMSNorm, concatenate 4 consecutive tokens, Linear-GELU-Linear."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.group = cfg.spatial_merge_size ** 2
        ctx = cfg.hidden_size * self.group
        self.ln_q = RMSNorm(cfg.hidden_size, eps=cfg.merger_rms_norm_eps)
        self.mlp = nn.Sequential(nn.Linear(ctx, ctx), _act(cfg.merger_act), nn.Linear(ctx, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, hidden] in processor order -> [B, N/4, out_hidden]."""
        b, n, d = x.shape
        z = self.ln_q(x).reshape(b, n // self.group, d * self.group)  # [TL | TR | BL | BR]
        return self.mlp(z)


# --------------------------------------------------------------------------------------------
# Full model
# --------------------------------------------------------------------------------------------


@dataclass
class YoutuVLOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


def _parse_size(s) -> int:
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMG]i?B|B)?\s*", str(s), re.I)
    if not m:
        raise ValueError(f"cannot parse max_shard_size {s!r}")
    unit = (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(m.group(1)) * mult)


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class YoutuVLForConditionalGeneration(nn.Module):
    """Youtu-VL: ``siglip2`` (vision tower), ``merger``, ``model`` (YoutuModel), ``lm_head`` [1]."""

    def __init__(self, config: dict):
        super().__init__()
        self.config_dict = copy.deepcopy(config)
        self.vision_config = VisionConfig.from_dict(config["vision_config"])
        self.text_config = text_config_from_dict(config)
        if self.vision_config.out_hidden_size != self.text_config.hidden_size:
            raise ValueError("vision_config.out_hidden_size must equal the text hidden_size")
        self.image_token_id = int(config["image_token_id"])
        self.siglip2 = Siglip2VisionTower(self.vision_config)
        self.merger = VLPatchMerger(self.vision_config)
        self.model = YoutuModel(self.text_config)
        # HF builds embed_tokens with padding_idx=pad_token_id (= eos 128001 in the real config);
        # that only freezes the pad row's gradient. The forward pass is unchanged, so drop it to
        # let a trained demo model learn its eos embedding.
        self.model.embed_tokens.padding_idx = None
        self.lm_head = nn.Linear(self.text_config.hidden_size, self.text_config.vocab_size, bias=False)
        self.tied = bool(self.text_config.tie_word_embeddings)
        if self.tied:  # [2.1], [12.13]
            self.lm_head.weight = self.model.embed_tokens.weight

    # ---- helpers -----------------------------------------------------------------------

    def _reset_rotary(self) -> None:
        """(Re)build the text RoPE inv_freq in float32 on the model's device.

        transformers computes inv_freq in float32 even when loading in bf16; a plain
        ``.to(bf16)`` would round it, so keep it float32 after every dtype/device move.
        """
        from transformers.models.youtu.modeling_youtu import YoutuRotaryEmbedding

        dev = self.lm_head.weight.device
        if dev.type == "meta":
            dev = torch.device("cpu")
        self.model.rotary_emb = YoutuRotaryEmbedding(self.text_config).to(dev)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.lm_head.weight.device.type != "meta":
            self._reset_rotary()
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def _vision(self, pixel_values, spatial_shapes, output_hidden_states=False):
        pv = torch.as_tensor(pixel_values)
        if pv.dim() == 2:
            pv = pv[None]
        if pv.dim() != 3:
            raise ValueError(f"pixel_values must be [N, D] or [B, N, D], got {tuple(pv.shape)}")
        pv = pv.to(device=self.device, dtype=self.dtype)
        grid = _grid(spatial_shapes)
        x, hidden = self.siglip2(pv, grid, output_hidden_states)
        merged = self.merger(x)
        if output_hidden_states:
            hidden += [x, merged]
        return merged, hidden

    def _inputs_embeds(self, input_ids, pixel_values=None, spatial_shapes=None):
        """Fusion [6]: embed, then overwrite image-token rows with merger rows, in order."""
        emb = self.model.embed_tokens(input_ids)
        mask = input_ids == self.image_token_id
        n_tok = int(mask.sum())
        if pixel_values is None:
            if n_tok:
                raise ValueError(f"input_ids contain {n_tok} image tokens but no pixel_values were given")
            return emb
        if spatial_shapes is None:
            raise ValueError("spatial_shapes is required with pixel_values")
        img, _ = self._vision(pixel_values, spatial_shapes)
        img = img.reshape(-1, img.shape[-1])
        if n_tok != img.shape[0]:
            raise ValueError(
                f"image token count mismatch: input_ids contain {n_tok} tokens with id "
                f"{self.image_token_id}, but the images give {img.shape[0]} merged rows (N/4 per image)"
            )
        # Masked-scatter semantics: row-major over [B, L], so image b fills row b when every row
        # holds N/4 placeholders. Index-put keeps gradients to both sources.
        emb = emb.clone()
        emb[mask] = img.to(emb.dtype)
        return emb

    # ---- public API --------------------------------------------------------------------

    def forward(self, input_ids, pixel_values=None, spatial_shapes=None, labels=None) -> YoutuVLOutput:
        """Logits [B, L, V] (and the shift-by-one CE loss when labels are given, -100 ignored)."""
        input_ids = torch.as_tensor(input_ids, device=self.device)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        emb = self._inputs_embeds(input_ids, pixel_values, spatial_shapes)
        # position_ids default to 0..L-1, plain 1-D RoPE [6]; causal mask only.
        h = self.model(inputs_embeds=emb, use_cache=False).last_hidden_state
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            labels = torch.as_tensor(labels, device=logits.device).reshape(input_ids.shape)
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        return YoutuVLOutput(logits=logits, loss=loss)

    @torch.no_grad()
    def vision_features(self, pixel_values, spatial_shapes, output_hidden_states: bool = False):
        """Merger output [N/4, out_hidden] (or [B, N/4, out_hidden] for B > 1 images).

        With ``output_hidden_states`` returns ``(merged, hidden)`` where hidden is a list, all in
        processor (un-permuted) order: [patch embeddings, after encoder layer 0, ..., after
        layer L-1, post_layernorm output, merger output] -- L+3 entries, [N, hidden] each
        (batch dim kept when B > 1; the last is [N/4, out_hidden]).
        """
        merged, hidden = self._vision(pixel_values, spatial_shapes, output_hidden_states)
        squeeze = merged.shape[0] == 1
        if squeeze:
            merged = merged[0]
        if not output_hidden_states:
            return merged
        if squeeze:
            hidden = [t[0] for t in hidden]
        return merged, hidden

    @torch.no_grad()
    def text_hidden_states(self, input_ids, pixel_values=None, spatial_shapes=None) -> list[torch.Tensor]:
        """Per-decoder-layer LM hidden states, [L, hidden] each for a single row.

        Entries: [fused input embeddings, after decoder layer 0, ..., after layer n-1,
        after the final model.norm] -- n+2 entries. Captured with forward hooks on the very
        modules ``forward`` runs, so they are exactly what the logits are computed from.
        """
        input_ids = torch.as_tensor(input_ids, device=self.device)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        emb = self._inputs_embeds(input_ids, pixel_values, spatial_shapes)
        out = [emb]
        hooks = [
            layer.register_forward_hook(lambda _m, _i, o: out.append(o[0] if isinstance(o, tuple) else o))
            for layer in self.model.layers
        ]
        try:
            last = self.model(inputs_embeds=emb, use_cache=False).last_hidden_state
        finally:
            for hk in hooks:
                hk.remove()
        out.append(last)
        if input_ids.shape[0] == 1:
            out = [t[0] for t in out]
        return out

    @torch.no_grad()
    def greedy_generate(
        self,
        input_ids,
        pixel_values=None,
        spatial_shapes=None,
        max_new_tokens: int = 32,
        eos_token_id=None,
        use_cache: bool = True,
    ) -> list[int]:
        """Greedy (argmax) decoding of one prompt; returns the new token ids only.

        eos_token_id: an int or a list; generation stops after emitting one (it is included).
        use_cache=True uses transformers' MLA cache; False recomputes the whole sequence each step.
        """
        ids = torch.as_tensor(input_ids, device=self.device).reshape(1, -1)
        eos = set()
        if eos_token_id is not None:
            eos = {int(e) for e in (eos_token_id if isinstance(eos_token_id, (list, tuple, set)) else [eos_token_id])}
        emb = self._inputs_embeds(ids, pixel_values, spatial_shapes)
        new: list[int] = []
        if use_cache:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.text_config)
            step_in = emb
            for _ in range(max_new_tokens):
                out = self.model(inputs_embeds=step_in, cache=cache, use_cache=True)
                cache = out.cache
                tok = int(self.lm_head(out.last_hidden_state[:, -1]).argmax(-1))
                new.append(tok)
                if tok in eos:
                    break
                step_in = self.model.embed_tokens(torch.tensor([[tok]], device=self.device))
        else:
            for _ in range(max_new_tokens):
                h = self.model(inputs_embeds=emb, use_cache=False).last_hidden_state
                tok = int(self.lm_head(h[:, -1]).argmax(-1))
                new.append(tok)
                if tok in eos:
                    break
                nxt = self.model.embed_tokens(torch.tensor([[tok]], device=self.device))
                emb = torch.cat([emb, nxt], dim=1)
        return new

    # ---- checkpoint I/O [8] -------------------------------------------------------------

    def checkpoint_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """State dict with the checkpoint's key names; lm_head.weight only when untied."""
        sd = {}
        for k, v in self.state_dict().items():
            if self.tied and k == "lm_head.weight":
                continue
            v = v.detach()
            if dtype is not None:
                v = v.to(dtype)
            sd[k] = v.contiguous().clone()  # own storage: save_file rejects shared tensors
        return sd

    def save_pretrained(self, save_dir, max_shard_size=None, dtype: torch.dtype = torch.float32) -> None:
        """Write config.json (real layout) and model.safetensors, or shards + index."""
        os.makedirs(save_dir, exist_ok=True)
        cfg = copy.deepcopy(self.config_dict)
        cfg["torch_dtype"] = _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))
        with open(os.path.join(save_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        sd = self.checkpoint_state_dict(dtype)
        meta = {"format": "pt"}
        if max_shard_size is None:
            save_file(sd, os.path.join(save_dir, "model.safetensors"), metadata=meta)
            return
        limit = _parse_size(max_shard_size)
        shards, cur, cur_size = [], {}, 0
        for k, v in sd.items():
            nbytes = v.numel() * v.element_size()
            if cur and cur_size + nbytes > limit:
                shards.append(cur)
                cur, cur_size = {}, 0
            cur[k] = v
            cur_size += nbytes
        if cur:
            shards.append(cur)
        weight_map, total = {}, 0
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(save_dir, name), metadata=meta)
            for k, v in shard.items():
                weight_map[k] = name
                total += v.numel() * v.element_size()
        with open(os.path.join(save_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    @staticmethod
    def _read_tensors(load_dir) -> dict[str, torch.Tensor]:
        index = os.path.join(load_dir, "model.safetensors.index.json")
        single = os.path.join(load_dir, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            sd = {}
            for name in files:
                sd.update(load_file(os.path.join(load_dir, name)))
            return sd
        if os.path.exists(single):
            return load_file(single)
        raise FileNotFoundError(f"{load_dir}: no model.safetensors or model.safetensors.index.json")

    @classmethod
    def from_pretrained(cls, load_dir, dtype: torch.dtype = torch.float32) -> YoutuVLForConditionalGeneration:
        """Load a real-layout checkpoint directory with strict key matching [8]."""
        cfg_path = os.path.join(load_dir, "config.json")
        if not os.path.exists(cfg_path):
            raise FileNotFoundError(f"{load_dir}: no config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        # Build on the meta device and adopt the loaded tensors (assign=True): the real model is
        # 5.3 B parameters, so skipping a random fp32 init saves minutes and ~21 GB.
        with torch.device("meta"):
            model = cls(cfg)
        raw = cls._read_tensors(load_dir)
        sd = {}
        for k, v in raw.items():
            if k in _IGNORED_KEYS or k.endswith("embeddings.position_ids"):
                continue  # [4.2]: unused learned position embedding [I whether present]
            if k.startswith("siglip2.") and not k.startswith("siglip2.vision_model."):
                k = "siglip2.vision_model." + k[len("siglip2."):]  # bare-prefix variant [8]
                if k in _IGNORED_KEYS:
                    continue
            sd[k] = v
        if model.tied:
            # [8]: lm_head.weight may be absent or duplicated when tied; the embedding is the source.
            sd.pop("lm_head.weight", None)
        expected = model.checkpoint_state_dict()
        missing = sorted(set(expected) - set(sd))
        unexpected = sorted(set(sd) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"{load_dir}: checkpoint keys do not match the model: "
                f"{len(missing)} missing {missing[:8]}, {len(unexpected)} unexpected {unexpected[:8]}"
            )
        bad = [(k, tuple(sd[k].shape), tuple(v.shape)) for k, v in expected.items() if sd[k].shape != v.shape]
        if bad:
            raise ValueError(f"{load_dir}: shape mismatch (key, file, model): {bad[:8]}")
        sd = {k: v.to(dtype).contiguous() for k, v in sd.items()}
        if model.tied:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        model.load_state_dict(sd, strict=True, assign=True)
        if model.tied:  # assign=True wraps each key in its own Parameter: re-tie
            model.lm_head.weight = model.model.embed_tokens.weight
        model._reset_rotary()  # non-persistent buffers are still on meta
        left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
        if left:
            raise RuntimeError(f"tensors left uninitialised after loading: {left[:8]}")
        return model.eval()

    @classmethod
    def make_random(cls, config: dict, seed: int = 0) -> YoutuVLForConditionalGeneration:
        """Random weights, deterministic from ``seed``, scaled for well-conditioned activations.

        Linear weights ~ N(0, (gain/sqrt(fan_in))^2); biases ~ N(0, 0.02^2); norm weights
        1 + N(0, 0.1^2) (never exactly 1, so a missed load is visible); token embeddings
        ~ N(0, 0.1^2). The gains were tuned so a random tiny model decodes varied tokens: with
        large embeddings a tied LM echoes its input token, and with flat attention it repeats one
        token; sharper q/k (gain 3 in MLA, 2 in vision) and stronger residual branches (o_proj,
        down_proj gain 3) avoid both.
        """
        model = cls(config)
        g = torch.Generator().manual_seed(int(seed))
        gains = {"q_b_proj": 3.0, "kv_b_proj": 3.0, "o_proj": 3.0, "down_proj": 3.0, "q_proj": 2.0, "k_proj": 2.0}
        with torch.no_grad():
            for name, p in model.named_parameters():  # named_parameters yields a tied weight once
                leaf = name.split(".")[-2] if "." in name else name
                if p.dim() == 1 and ("norm" in name or "ln_q" in name):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                elif p.dim() == 1:
                    p.copy_(0.02 * torch.randn(p.shape, generator=g))
                elif "embed_tokens" in name or "lm_head" in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
                else:
                    std = gains.get(leaf, 1.0) / math.sqrt(p.shape[1])
                    p.copy_(std * torch.randn(p.shape, generator=g))
        return model.eval()


def make_random(config: dict, seed: int = 0) -> YoutuVLForConditionalGeneration:
    """Module-level alias of ``YoutuVLForConditionalGeneration.make_random``."""
    return YoutuVLForConditionalGeneration.make_random(config, seed)
