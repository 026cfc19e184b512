"""Youtu-VL's vision tower settings (config.json's ``vision_config``) and the window slots of its
vision graph."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...blocks.base import config_args
from ...blocks.vision import GELU_TANH
from ...errors import EdgevlError

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
    window_size: int = 256                        # pixels
    fullatt_block_indexes: list[int] = field(default_factory=lambda: [7, 15, 23, 26])
    out_hidden_size: int = 2560
    # inferred, not published (docs/models/youtu_vl.md, "Vision tower"): config fields so that a
    # checkpoint can say otherwise
    rope_theta: float = 10000.0                   # the vision RoPE base
    merger_rms_norm_eps: float = 1e-6
    merger_act: str = "gelu"                      # exact erf GELU in the merger

    @classmethod
    def from_config(cls, cfg: dict) -> VisionArgs:
        v = config_args(cls, cfg.get("vision_config") or {}, where="config.json vision_config")
        if v.hidden_size % v.num_attention_heads or v.head_dim % 4:
            raise EdgevlError("vision_config: head size must divide hidden_size and be a multiple of 4 (2-D RoPE)")
        for act in (v.hidden_act, v.merger_act):
            if act not in GELU_TANH:
                raise EdgevlError(f"vision activation {act!r} is not supported (expected gelu or gelu_pytorch_tanh)")
        return v

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.patch_size * self.patch_size
