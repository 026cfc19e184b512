"""Pieces the vision towers share (SigLIP-2 in Youtu-VL, Qwen3-VL's in the Qwen3.5 family and the
Youtu MoE): the transformer MLP with its GELU, and self-attention with 2-D RoPE.

Both towers rotate each head with ``rotate_half`` pairs (RotaryEmbed 0=0) over host-computed
cos/sin tables of the patches' (row, col) positions, and attend over all of an image's patches
(or, in Youtu-VL's window layers, over each window; ``edgevl/models/youtu_vl/model.py``).
"""

from __future__ import annotations

from .. import ncnn_graph as G
from .base import Ctx, heads_last

# config.json's ``hidden_act`` -> whether ncnn's GELU takes the tanh form (else the exact erf one)
GELU_TANH = {"gelu_pytorch_tanh": True, "gelu_new": True, "gelu": False}


def emit_vit_mlp(ctx: Ctx, x: str, p: str, hidden: int, inter: int, act: str, fc1: str = "fc1",
                 fc2: str = "fc2") -> str:
    """fc2(gelu(fc1(x))), both Linear layers with bias (``{p}.{fc1}``, ``{p}.{fc2}``)."""
    h = ctx.linear(x, f"{p}.{fc1}", inter, hidden, bias=True)
    h = G.gelu(ctx.g, h, tanh=GELU_TANH[act], name=f"{p}.act")
    return ctx.linear(h, f"{p}.{fc2}", hidden, inter, bias=True)


def rope_attention(g: G.Graph, q: str, k: str, v: str, cos: str, sin: str, head_dim: int, heads: int,
                   name: str) -> str:
    """Full attention of heads-first q/k/v (c=heads, h=patches, w=head_dim) with 2-D RoPE on q and
    k; returns (h=patches, w=heads*head_dim)."""
    q = G.rotary(g, q, cos, sin, interleaved=False, name=f"{name}.q_rope")
    k = G.rotary(g, k, cos, sin, interleaved=False, name=f"{name}.k_rope")
    o = G.sdpa(g, q, k, v, scale=head_dim ** -0.5, name=f"{name}.sdpa")
    return heads_last(g, o, head_dim, heads, f"{name}.o")
