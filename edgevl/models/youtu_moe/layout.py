"""The Youtu MoE checkpoint layout: the ONE table to change when a real checkpoint appears.

No modeling code or checkpoint of the model is public (docs/models/youtu_moe.md, section 8), so
the tensor names are ASSUMED: transformers' in-memory names of the blocks the model is built
from (``kimi_linear`` for KDA and the MoE block, ``youtu`` MLA plus ``self_attn.g_proj``,
``mlp.gate.qb_beta [2, E]``, ``qwen3_vl`` vision under ``visual.``). Both the converter
(``models/youtu_moe.py``) and the PyTorch reference (``reference/youtu_moe.py``) read it, so the
two cannot drift apart. Kept free of torch and ncnn: the converter imports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointLayout:
    """How the internal (transformers in-memory) parameter names map to checkpoint tensor names.

    ``renames``: (regex, replacement) applied in order to an internal name (``re.sub``);
    ``experts``: ``"fused"`` stores ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows first) and
    ``mlp.experts.down_proj [E, H, I]``; ``"per_expert"`` stores
    ``mlp.experts.{e}.{gate,up,down}.weight`` with the names in ``expert_names``."""
    renames: tuple = ()
    experts: str = "fused"
    expert_names: tuple = ("gate_proj", "up_proj", "down_proj")

    def name(self, internal: str) -> str:
        for pattern, repl in self.renames:
            internal = re.sub(pattern, repl, internal)
        return internal


# transformers' in-memory names, unchanged (the layout's assumption).
CHECKPOINT_LAYOUT = CheckpointLayout()
