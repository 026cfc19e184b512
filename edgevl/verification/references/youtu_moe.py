"""A PyTorch reference of the Youtu MoE hybrid (``YoutuVLMoEForConditionalGeneration``).

No modeling code or checkpoint of this model is public; it is described only by a llama.cpp
patch verified on the real weights (docs/models/youtu_moe.md, sections 1-5). This module
composes transformers 5.24 blocks and changes only what the patch describes:

- KDA layers: ``kimi_linear``'s ``KimiLinearDeltaAttention`` with the lower-bounded forget gate
  ``g = lb · sigmoid(exp(A_log) · (f_b(f_a x) + dt_bias))``, ``lb = kda_gate_lower_bound``
  (−5; fla's ``naive_kda_lowerbound_gate``), instead of Kimi's ``−exp(A_log)·softplus(...)``;
- attention layers (every 4th): ``youtu``'s MLA (``YoutuAttention``, adjacent-pair rope) with a
  sigmoid output gate ``self_attn.g_proj`` applied per head before ``o_proj``, and rope angles
  from interleaved M-RoPE over the rope dims (Qwen3-VL's text rotary embedding, HF
  ``mrope_section`` semantics, [12, 10, 10] in the real model);
- MoE layers (all but layer 0, which is dense): ``kimi_linear``'s ``KimiLinearMoE`` (experts +
  shared expert) with quantile-balanced routing: experts = top-k of ``logits − qb_beta[modality]``,
  weights = ``sigmoid(logits[top]) / (Σ + 1e-20) · routed_scaling_factor`` (2.83); the modality
  of a row is 1 when it carries an image embedding, else 0;
- vision: transformers' ``Qwen3VLVisionModel`` unchanged (its deepstack features, if the config
  names deepstack layers, are added after the first decoder layers as in Qwen3-VL; whether the
  real model uses deepstack is unknown, so the default config has none).

ASSUMPTIONS, kept in one place so a real checkpoint needs only them changed:
``CHECKPOINT_LAYOUT`` (tensor names: this module's parameter names are transformers' in-memory
names — ``kimi_linear`` for KDA and MoE, ``youtu`` for MLA plus ``self_attn.g_proj``,
``mlp.gate.qb_beta [2, E]``, ``qwen3_vl`` vision under ``visual.``), ``MODEL_TYPE`` and the
config keys read by :func:`make_config` (kimi_linear's names plus ``kda_gate_lower_bound`` and
``mla_output_gate``).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DynamicCache, KimiLinearConfig, YoutuConfig
from transformers.models.kimi_linear.modeling_kimi_linear import (
    KimiLinearDeltaAttention,
    KimiLinearForgetGate,
    KimiLinearMLP,
    KimiLinearMoE,
    KimiLinearRMSNorm,
)
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig, Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding, Qwen3VLVisionModel
from transformers.models.youtu.modeling_youtu import YoutuAttention

from ...models.youtu_moe.layout import CHECKPOINT_LAYOUT, CheckpointLayout

ARCHITECTURE = "YoutuVLMoEForConditionalGeneration"
MODEL_TYPE = "youtu_vl_moe"  # ASSUMED: no public config.json


# --------------------------------------------------------------------------------------------
# The checkpoint layout (ASSUMED, docs/models/youtu_moe.md, section 8): the one table to change for a real checkpoint is
# CHECKPOINT_LAYOUT, imported above from a torch-free module the converter reads too

_EXPERT_KEYS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def to_checkpoint(sd: dict, layout: CheckpointLayout = CHECKPOINT_LAYOUT) -> dict:
    """Internal state dict -> checkpoint tensors (names and expert storage per ``layout``)."""
    out = {}
    for k, v in sd.items():
        m = _EXPERT_KEYS.match(k)
        if m and layout.experts == "per_expert":
            gate, up, down = layout.expert_names
            for e in range(v.shape[0]):
                p = layout.name(f"{m.group(1)}.{e}")
                if m.group(2) == "gate_up_proj":
                    inter = v.shape[1] // 2
                    out[f"{p}.{gate}.weight"] = v[e, :inter].clone()
                    out[f"{p}.{up}.weight"] = v[e, inter:].clone()
                else:
                    out[f"{p}.{down}.weight"] = v[e].clone()
        else:
            out[layout.name(k)] = v
    return out


def from_checkpoint(tensors: dict, expected: dict, layout: CheckpointLayout = CHECKPOINT_LAYOUT) -> dict:
    """Checkpoint tensors -> internal state dict for the ``expected`` internal keys (-> shapes);
    a missing or surplus tensor is an error naming it."""
    sd, used = {}, set()
    for k, shape in expected.items():
        m = _EXPERT_KEYS.match(k)
        if m and layout.experts == "per_expert":
            gate, up, down = layout.expert_names
            parts = []
            for e in range(shape[0]):
                p = layout.name(f"{m.group(1)}.{e}")
                names = ([f"{p}.{gate}.weight", f"{p}.{up}.weight"] if m.group(2) == "gate_up_proj"
                         else [f"{p}.{down}.weight"])
                missing = [n for n in names if n not in tensors]
                if missing:
                    raise ValueError(f"checkpoint lacks {missing[0]}")
                used.update(names)
                parts.append(torch.cat([tensors[n] for n in names], 0))
            sd[k] = torch.stack(parts)
        else:
            n = layout.name(k)
            if n not in tensors:
                raise ValueError(f"checkpoint lacks {n}")
            used.add(n)
            sd[k] = tensors[n]
        if tuple(sd[k].shape) != tuple(shape):
            raise ValueError(f"{k}: checkpoint shape {tuple(sd[k].shape)}, model expects {tuple(shape)}")
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"checkpoint has {len(extra)} tensors the model does not use, e.g. {extra[:4]}")
    return sd


# --------------------------------------------------------------------------------------------
# Configuration


def make_config(vocab_size: int = 512, **overrides) -> dict:
    """A complete config.json dict for a TINY model, with overrides applied (``vision_config``
    and ``rope_parameters`` are merged into their nested blocks).

    The layout is the real one (docs/models/youtu_moe.md, section 2): [KDA, KDA, KDA, MLA] groups,
    layer 0 dense, the rest sparse. Token ids default to the top of the vocabulary."""
    v = int(vocab_size)
    n_layers = int(overrides.get("num_hidden_layers", 8))
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": v,
        "hidden_size": 64,
        "intermediate_size": 96,               # layer 0's dense MLP
        "num_hidden_layers": n_layers,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layers)],
        "mlp_layer_types": ["dense" if i == 0 else "sparse" for i in range(n_layers)],
        # MLA (Youtu-LLM names)
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 24,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "rope_interleave": True,
        "mla_output_gate": "headwise",         # ASSUMED: sigmoid, one scalar per head ("elementwise": per channel)
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        # KDA (kimi_linear names)
        "linear_num_heads": 4,
        "linear_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "kda_gate_lower_bound": -5.0,
        # MoE (kimi_linear names)
        "num_experts": 16,
        "num_experts_per_token": 4,
        "moe_intermediate_size": 32,
        "num_shared_experts": 1,
        "routed_scaling_factor": 2.83,
        "num_modalities": 2,                   # qb_beta rows: 0 text, 1 image/video
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": v - 7,
        "eos_token_id": v - 6,
        "pad_token_id": None,
        "vision_start_token_id": v - 4,
        "vision_end_token_id": v - 3,
        "image_token_id": v - 2,
        "video_token_id": v - 1,
        "torch_dtype": "float32",
        "vision_config": {
            "model_type": "qwen3_vl_vision",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 16,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "out_hidden_size": 64,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [],
            "hidden_act": "gelu_pytorch_tanh",
        },
    }
    vis = overrides.pop("vision_config", None) or {}
    rope = overrides.pop("rope_parameters", None) or {}
    cfg.update(overrides)
    if "hidden_size" in overrides and "out_hidden_size" not in vis:
        cfg["vision_config"]["out_hidden_size"] = cfg["hidden_size"]
    cfg["vision_config"].update(vis)
    cfg["rope_parameters"].update(rope)
    return cfg


def make_preprocessor_config(config: dict, min_pixels: int = 64 * 64, max_pixels: int = 256 * 256) -> dict:
    """preprocessor_config.json for Qwen2-VL-style processing (ASSUMED like Qwen3-VL's)."""
    vc = config["vision_config"]
    return {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": vc["patch_size"],
            "temporal_patch_size": vc["temporal_patch_size"], "merge_size": vc["spatial_merge_size"],
            "size": {"shortest_edge": int(min_pixels), "longest_edge": int(max_pixels)},
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True}


@dataclass
class TextConfigs:
    """The transformers configs the composed blocks read (built from one config.json dict)."""
    kimi: KimiLinearConfig       # KDA, MoE, dense MLP, norms, the hybrid cache's layer types
    mla: YoutuConfig             # MLA attention
    rope: Qwen3VLTextConfig      # interleaved M-RoPE over the MLA rope dims
    raw: dict = field(default_factory=dict)


def text_configs(cfg: dict) -> TextConfigs:
    from dataclasses import MISSING, fields

    from ...models.youtu_moe.model import TextArgs

    # a field the checkpoint leaves out takes the default the converter assumed for it, so the
    # reference describes the model the package holds
    cfg = {**{f.name: f.default for f in fields(TextArgs) if f.default not in (MISSING, None)}, **cfg}
    heads = int(cfg["num_attention_heads"])
    if int(cfg.get("num_key_value_heads") or heads) != heads:
        raise ValueError("MLA expands K/V per head: num_key_value_heads must equal num_attention_heads")
    if cfg.get("mla_output_gate") not in (None, "headwise", "elementwise"):
        raise ValueError(f"mla_output_gate must be headwise, elementwise or null, got {cfg.get('mla_output_gate')!r}")
    rp = dict(cfg["rope_parameters"])
    if rp.get("rope_type", "default") != "default":
        raise NotImplementedError(f"rope_type {rp['rope_type']!r}")
    rope_dim = int(cfg["qk_rope_head_dim"])
    section = [int(s) for s in rp.get("mrope_section", [rope_dim // 2, 0, 0])]
    if sum(section) != rope_dim // 2:
        raise ValueError(f"mrope_section {section} must sum to qk_rope_head_dim/2 = {rope_dim // 2}")
    if not rp.get("mrope_interleaved", True):
        raise NotImplementedError("only interleaved M-RoPE is described for this model")
    common = dict(vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
                  num_hidden_layers=int(cfg["num_hidden_layers"]), num_attention_heads=heads,
                  num_key_value_heads=heads, rms_norm_eps=float(cfg["rms_norm_eps"]), hidden_act=cfg["hidden_act"],
                  max_position_embeddings=int(cfg["max_position_embeddings"]), tie_word_embeddings=False,
                  pad_token_id=None, bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"))
    mla_keys = dict(q_lora_rank=cfg["q_lora_rank"], kv_lora_rank=int(cfg["kv_lora_rank"]),
                    qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=rope_dim,
                    v_head_dim=int(cfg["v_head_dim"]), attention_bias=bool(cfg.get("attention_bias", False)))
    kimi = KimiLinearConfig(
        **common, **mla_keys, intermediate_size=int(cfg["intermediate_size"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]), num_local_experts=int(cfg["num_experts"]),
        num_experts_per_tok=int(cfg["num_experts_per_token"]), n_shared_experts=int(cfg["num_shared_experts"]),
        routed_scaling_factor=float(cfg["routed_scaling_factor"]), n_group=1, topk_group=1, norm_topk_prob=True,
        layer_types=list(cfg["layer_types"]), mlp_layer_types=list(cfg["mlp_layer_types"]),
        linear_num_heads=int(cfg["linear_num_heads"]), linear_head_dim=int(cfg["linear_head_dim"]),
        linear_conv_kernel_dim=int(cfg["linear_conv_kernel_dim"]))
    kimi._attn_implementation = "eager"
    kimi._experts_implementation = "eager"
    mla = YoutuConfig(**common, **mla_keys, intermediate_size=int(cfg["intermediate_size"]),
                      rope_interleave=bool(cfg.get("rope_interleave", True)),
                      rope_parameters={"rope_type": "default", "rope_theta": float(rp["rope_theta"])},
                      attn_implementation="eager")
    rope = Qwen3VLTextConfig(head_dim=rope_dim, hidden_size=int(cfg["hidden_size"]), num_attention_heads=heads,
                             max_position_embeddings=int(cfg["max_position_embeddings"]),
                             rope_parameters={"rope_type": "default", "rope_theta": float(rp["rope_theta"]),
                                              "mrope_section": section, "mrope_interleaved": True})
    return TextConfigs(kimi, mla, rope, dict(cfg))


# --------------------------------------------------------------------------------------------
# Blocks: each is the transformers block with only the patch's change


class LowerBoundForgetGate(KimiLinearForgetGate):
    """KDA forget gate with the lower bound: g = lb · sigmoid(exp(A_log) · (f_b(f_a x) + dt_bias)),
    per channel, in fp32. ``lower_bound=None`` is Kimi's softplus form (the parent)."""

    def __init__(self, config, lower_bound: float | None):
        super().__init__(config)
        self.lower_bound = lower_bound

    def forward(self, hidden_states):
        if self.lower_bound is None:
            return super().forward(hidden_states)
        hidden_shape = (*hidden_states.shape[:2], -1, self.head_dim)
        f = self.f_b_proj(self.f_a_proj(hidden_states))
        g = (f.float() + self.dt_bias.float().view(1, 1, -1)).view(hidden_shape)
        return self.lower_bound * torch.sigmoid(torch.exp(self.A_log.float()) * g)


class KDAttention(KimiLinearDeltaAttention):
    """kimi_linear's KDA layer with the lower-bounded gate (conv, recurrence, o_norm, gates unchanged)."""

    def __init__(self, config, layer_idx: int, lower_bound: float | None):
        super().__init__(config, layer_idx)
        self.forget_gate = LowerBoundForgetGate(config, lower_bound)


class GatedMLA(YoutuAttention):
    """youtu's MLA with a sigmoid output gate per head (``g_proj``) on the attention output,
    before ``o_proj``. ``gate=None`` is plain YoutuAttention. Rope angles come from the model
    (interleaved M-RoPE), applied to adjacent pairs as YoutuAttention does."""

    def __init__(self, config, layer_idx: int, gate: str | None):
        super().__init__(config, layer_idx)
        self.gate_kind = gate
        if gate is not None:
            width = self.num_heads * (1 if gate == "headwise" else self.v_head_dim)
            self.g_proj = nn.Linear(config.hidden_size, width, bias=False)
            self.o_proj.register_forward_pre_hook(self._apply_gate)
        self._gate = None

    def _apply_gate(self, module, args):
        (o,) = args
        g = self._gate
        if self.gate_kind == "headwise":  # [B, L, heads] -> one scalar per head's v values
            g = g.unsqueeze(-1).expand(*g.shape, self.v_head_dim).reshape(*g.shape[:-1], -1)
        return (o * g.to(o.dtype),)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        if self.gate_kind is not None:
            self._gate = torch.sigmoid(self.g_proj(hidden_states).float())
        try:
            return super().forward(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        finally:
            self._gate = None


class QuantileBalancedRouter(nn.Module):
    """Router with per-modality selection bias: experts = top-k of (logits − qb_beta[modality]),
    weights = sigmoid(logits) of those, normalised (+1e-20) and scaled (docs/models/youtu_moe.md, section 5)."""

    def __init__(self, config, num_modalities: int = 2):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_local_experts
        self.hidden_dim = config.hidden_size
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim, dtype=torch.float32))
        self.qb_beta = nn.Parameter(torch.zeros(num_modalities, self.num_experts, dtype=torch.float32))

    def forward(self, hidden_states, modality):
        x = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(x.float(), self.weight.float())
        selection = logits - self.qb_beta.float()[modality.reshape(-1)]
        idx = torch.topk(selection, self.top_k, dim=-1, sorted=False)[1]
        w = logits.sigmoid().gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.routed_scaling_factor
        return logits, w, idx


class QuantileBalancedMoE(KimiLinearMoE):
    """kimi_linear's MoE block (routed experts + shared expert) with the quantile-balanced router."""

    def __init__(self, config, num_modalities: int = 2):
        super().__init__(config)
        self.gate = QuantileBalancedRouter(config, num_modalities)

    def forward(self, hidden_states, modality):
        shape = hidden_states.shape
        _, w, idx = self.gate(hidden_states, modality)
        x = hidden_states.reshape(-1, shape[-1])
        routed = self.experts(x, idx, w).reshape(shape)
        return routed + self.shared_experts(hidden_states)


class DecoderLayer(nn.Module):
    def __init__(self, tc: TextConfigs, i: int):
        super().__init__()
        c, raw = tc.kimi, tc.raw
        self.is_linear = c.layer_types[i] == "linear_attention"
        self.is_sparse = c.mlp_layer_types[i] == "sparse"
        lb = raw.get("kda_gate_lower_bound", -5.0)
        self.self_attn = (KDAttention(c, i, None if lb is None else float(lb)) if self.is_linear
                          else GatedMLA(tc.mla, i, raw.get("mla_output_gate", "headwise")))
        self.mlp = QuantileBalancedMoE(c, int(raw.get("num_modalities", 2))) if self.is_sparse else KimiLinearMLP(c)
        self.input_layernorm = KimiLinearRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = KimiLinearRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, position_embeddings, mask, cache, modality):
        h = self.input_layernorm(x)
        if self.is_linear:
            h = self.self_attn(h, cache=cache)
        else:
            h = self.self_attn(h, position_embeddings, mask, cache=cache)[0]
        x = x + h
        m = self.post_attention_layernorm(x)
        m = self.mlp(m, modality) if self.is_sparse else self.mlp(m)
        return x + m


class TextModel(nn.Module):
    def __init__(self, tc: TextConfigs):
        super().__init__()
        c = tc.kimi
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(tc, i) for i in range(c.num_hidden_layers)])
        self.norm = KimiLinearRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = Qwen3VLTextRotaryEmbedding(tc.rope)

    def forward(self, embeds, positions, cache=None, past: int = 0, modality=None, deepstack=None,
                visual_mask=None, hooks=None):
        """embeds [1, L, H], positions [3, L] (rotary, per M-RoPE axis) -> final-normed [1, L, H]."""
        L = embeds.shape[1]
        mask = torch.full((L, past + L), torch.finfo(embeds.dtype).min, dtype=embeds.dtype)
        mask = torch.triu(mask, diagonal=past + 1)[None, None]
        pe = self.rotary_emb(embeds, positions[:, None, :].to(embeds.device))
        if modality is None:
            modality = torch.zeros(1, L, dtype=torch.long)
        x = embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, pe, mask, cache, modality)
            if deepstack is not None and i < len(deepstack) and visual_mask is not None and visual_mask.any():
                x = x.clone()
                x[visual_mask] = x[visual_mask] + deepstack[i].to(x.dtype)
            if hooks is not None:
                hooks.append(x)
        return self.norm(x)


# --------------------------------------------------------------------------------------------
# Positions (M-RoPE, Qwen3-VL rules; computed here independently of transformers' get_rope_index)


def rope_positions(input_ids, image_grid_thw=None, image_token_id: int | None = None, merge: int = 2,
                   start: int = 0) -> torch.Tensor:
    """[3, L] rotary positions (T, H, W): text tokens advance all three by 1; an image's
    placeholder run (t·h·w/merge² tokens) gets T = s, H = s + row, W = s + col on the merged
    grid, and text after it resumes at s + max(h, w)/merge."""
    ids = [int(t) for t in torch.as_tensor(input_ids).reshape(-1)]
    grids = [tuple(int(v) for v in g) for g in (image_grid_thw if image_grid_thw is not None else [])]
    out, pos, i, img = [], start, 0, 0
    while i < len(ids):
        if image_token_id is not None and ids[i] == image_token_id:
            if img >= len(grids):
                raise ValueError("more image placeholder runs than image grids")
            t, h, w = grids[img]
            gh, gw = h // merge, w // merge
            n = t * gh * gw
            if ids[i:i + n] != [image_token_id] * n:
                raise ValueError(f"image {img} needs {n} placeholder tokens in a row")
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
            out.append(torch.stack([tt.reshape(-1) + pos, hh.reshape(-1) + pos, ww.reshape(-1) + pos]))
            pos += max(gh, gw)
            i += n
            img += 1
        else:
            out.append(torch.full((3, 1), pos))
            pos += 1
            i += 1
    if img != len(grids):
        raise ValueError(f"{len(grids)} image grids but {img} placeholder runs")
    return torch.cat(out, 1) if out else torch.zeros(3, 0, dtype=torch.long)


# --------------------------------------------------------------------------------------------
# The model


@dataclass
class State:
    """Greedy-decoding state: transformers' hybrid cache, token count, next rotary position."""
    cache: DynamicCache
    length: int
    next_position: int


class YoutuVLMoEForConditionalGeneration(nn.Module):
    """``model`` (text), ``visual`` (Qwen3-VL tower), ``lm_head``."""

    def __init__(self, config: dict):
        super().__init__()
        self.config_dict = copy.deepcopy(config)
        self.tc = text_configs(config)
        self.vision_config = Qwen3VLVisionConfig(**{k: v for k, v in config["vision_config"].items()
                                                    if k != "model_type"})
        self.vision_config._attn_implementation = "eager"
        if self.vision_config.out_hidden_size != self.tc.kimi.hidden_size:
            raise ValueError("vision_config.out_hidden_size must equal hidden_size")
        self.image_token_id = config.get("image_token_id")
        self.modality_token_ids = [t for t in (config.get("image_token_id"), config.get("video_token_id"))
                                   if t is not None]
        self.model = TextModel(self.tc)
        self.visual = Qwen3VLVisionModel(self.vision_config)
        self.lm_head = nn.Linear(self.tc.kimi.hidden_size, self.tc.kimi.vocab_size, bias=False)
        self.tied = bool(config.get("tie_word_embeddings", False))
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self):
        return self.lm_head.weight.dtype

    def _reset_rotary(self) -> None:
        # rope frequencies are non-persistent fp32 buffers: rebuilt after a dtype move or a
        # meta-device load, as transformers keeps them fp32 whatever the weights' dtype
        self.model.rotary_emb = Qwen3VLTextRotaryEmbedding(self.tc.rope)
        self.visual.rotary_pos_emb = type(self.visual.rotary_pos_emb)(self.vision_config)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.lm_head.weight.device.type != "meta":
            self._reset_rotary()
        return self

    # ---- inputs ---------------------------------------------------------------------------

    def modality(self, input_ids) -> torch.Tensor:
        """[1, L]: 1 where a row carries a vision embedding (image/video placeholder), else 0."""
        ids = torch.as_tensor(input_ids).reshape(1, -1)
        m = torch.zeros_like(ids)
        for t in self.modality_token_ids:
            m |= (ids == t).long()
        return m

    @torch.no_grad()
    def vision_features(self, pixel_values, image_grid_thw):
        """(merged rows [N/merge², H], deepstack features per deepstack layer)."""
        out = self.visual(torch.as_tensor(pixel_values).to(self.dtype), grid_thw=torch.as_tensor(image_grid_thw))
        return out.pooler_output, list(out.deepstack_features or [])

    def _embed(self, input_ids, pixel_values=None, image_grid_thw=None):
        ids = torch.as_tensor(input_ids).reshape(1, -1)
        emb = self.model.embed_tokens(ids)
        mask = (ids == self.image_token_id if self.image_token_id is not None
                else torch.zeros_like(ids, dtype=torch.bool))
        n = int(mask.sum())
        if pixel_values is None:
            if n:
                raise ValueError(f"input_ids hold {n} image tokens but no pixel_values were given")
            return emb, mask, None
        rows, deep = self.vision_features(pixel_values, image_grid_thw)
        if rows.shape[0] != n:
            raise ValueError(f"{n} image tokens but the images give {rows.shape[0]} rows")
        emb = emb.clone()
        emb[mask] = rows.to(emb.dtype)
        return emb, mask, [d.to(emb.dtype) for d in deep] or None

    def positions(self, input_ids, image_grid_thw=None) -> torch.Tensor:
        return rope_positions(input_ids, image_grid_thw, self.image_token_id,
                              int(self.vision_config.spatial_merge_size))

    # ---- forward / generation -----------------------------------------------------------

    @torch.no_grad()
    def forward(self, input_ids, pixel_values=None, image_grid_thw=None):
        """Logits [L, V] of one prompt (no cache)."""
        return self.text_states(input_ids, pixel_values, image_grid_thw)[1]

    @torch.no_grad()
    def text_states(self, input_ids, pixel_values=None, image_grid_thw=None):
        """([input embeddings, after each decoder layer ..., after the final norm] as [L, H]
        each, logits [L, V])."""
        emb, vmask, deep = self._embed(input_ids, pixel_values, image_grid_thw)
        states = []
        h = self.model(emb, self.positions(input_ids, image_grid_thw), modality=self.modality(input_ids),
                       deepstack=deep, visual_mask=vmask, hooks=states)
        return [emb[0]] + [s[0] for s in states] + [h[0]], self.lm_head(h)[0].float()

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.tc.kimi)

    @torch.no_grad()
    def start(self, input_ids, pixel_values=None, image_grid_thw=None, state: State | None = None):
        """Prefill (on top of ``state`` if given): (last-position logits [V], state)."""
        emb, vmask, deep = self._embed(input_ids, pixel_values, image_grid_thw)
        if state is None:
            state = State(self.new_cache(), 0, 0)
        pos = self.positions(input_ids, image_grid_thw) + state.next_position
        h = self.model(emb, pos, state.cache, state.length, self.modality(input_ids), deep, vmask)
        state.length += emb.shape[1]
        state.next_position = int(pos.max()) + 1
        return self.lm_head(h[0, -1]).float(), state

    @torch.no_grad()
    def step(self, token: int, state: State):
        """One decode step (a text token: modality 0)."""
        emb = self.model.embed_tokens(torch.tensor([[int(token)]]))
        pos = torch.full((3, 1), state.next_position)
        h = self.model(emb, pos, state.cache, state.length)
        state.length += 1
        state.next_position += 1
        return self.lm_head(h[0, -1]).float(), state

    @torch.no_grad()
    def greedy_generate(self, input_ids, pixel_values=None, image_grid_thw=None, max_new_tokens: int = 32,
                        eos_token_id=None, use_cache: bool = True) -> list[int]:
        """Argmax decoding; returns the new ids (an eos is included and stops). ``use_cache=False``
        recomputes the whole sequence every step (a check on the cache)."""
        eos = set() if eos_token_id is None else set(eos_token_id if isinstance(eos_token_id, (list, tuple, set))
                                                     else [eos_token_id])
        ids = [int(t) for t in torch.as_tensor(input_ids).reshape(-1)]
        new = []
        if use_cache:
            logits, state = self.start(ids, pixel_values, image_grid_thw)
        for _ in range(max_new_tokens):
            if not use_cache:
                logits = self.forward(ids + new, pixel_values, image_grid_thw)[-1]
            tok = int(torch.argmax(logits))
            new.append(tok)
            if tok in eos:
                break
            if use_cache:
                logits, state = self.step(tok, state)
        return new

    # ---- checkpoint I/O (real HF layout: config.json + safetensors) ------------------------

    def checkpoint_state_dict(self, dtype=None, layout: CheckpointLayout = CHECKPOINT_LAYOUT) -> dict:
        sd = {}
        for k, v in self.state_dict().items():
            if self.tied and k == "lm_head.weight":
                continue
            v = v.detach()
            sd[k] = (v.to(dtype) if dtype is not None else v).contiguous().clone()
        return to_checkpoint(sd, layout)

    def save_pretrained(self, save_dir, dtype=torch.float32, layout: CheckpointLayout = CHECKPOINT_LAYOUT,
                        preprocessor: dict | None = None) -> None:
        """config.json, model.safetensors and preprocessor_config.json."""
        os.makedirs(save_dir, exist_ok=True)
        cfg = copy.deepcopy(self.config_dict)
        cfg["torch_dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        with open(os.path.join(save_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        with open(os.path.join(save_dir, "preprocessor_config.json"), "w") as f:
            json.dump(preprocessor or make_preprocessor_config(cfg), f, indent=2)
        save_file(self.checkpoint_state_dict(dtype, layout), os.path.join(save_dir, "model.safetensors"),
                  metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, load_dir, dtype=torch.float32, layout: CheckpointLayout = CHECKPOINT_LAYOUT):
        with open(os.path.join(load_dir, "config.json")) as f:
            cfg = json.load(f)
        with torch.device("meta"):
            model = cls(cfg)
        tensors = {}
        index = os.path.join(load_dir, "model.safetensors.index.json")
        files = (sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index)
                 else ["model.safetensors"])
        for name in files:
            tensors.update(load_file(os.path.join(load_dir, name)))
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()
                    if not (model.tied and k == "lm_head.weight")}
        sd = {k: v.to(dtype).contiguous() for k, v in from_checkpoint(tensors, expected, layout).items()}
        if model.tied:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        model.load_state_dict(sd, strict=True, assign=True)
        if model.tied:
            model.lm_head.weight = model.model.embed_tokens.weight
        model._reset_rotary()
        left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
        if left:
            raise RuntimeError(f"tensors left uninitialised after loading: {left[:8]}")
        return model.eval()

    @classmethod
    def make_random(cls, config: dict, seed: int = 0) -> YoutuVLMoEForConditionalGeneration:
        """Deterministic random weights, scaled for varied greedy tokens on a tiny model.

        Matrices ~ N(0, (gain/√fan_in)²) (fan_in: the last dim for expert stacks, else all but the
        first); 1-D norm weights 1 + N(0, 0.1²) (never exactly 1, so a missed load shows); other
        1-D (biases, dt_bias) N(0, 0.02²); ``A_log`` N(0, 0.3²); ``qb_beta`` N(0, 0.5²) per
        modality row (the real rows differ by 0.39 on average); embeddings N(0, 0.1²)."""
        model = cls(config)
        g = torch.Generator().manual_seed(int(seed))
        gains = {"q_b_proj": 3.0, "kv_b_proj": 3.0, "o_proj": 3.0, "down_proj": 3.0, "q_proj": 2.0, "k_proj": 2.0}
        with torch.no_grad():
            for name, p in model.named_parameters():
                leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
                if name.endswith("A_log"):
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
                elif name.endswith("qb_beta"):
                    p.copy_(0.5 * torch.randn(p.shape, generator=g))
                elif p.dim() == 1 and "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                elif p.dim() == 1:
                    p.copy_(0.02 * torch.randn(p.shape, generator=g))
                elif "embed_tokens" in name or "lm_head" in name or "pos_embed" in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
                else:
                    fan_in = p.shape[-1] if ".experts." in name else math.prod(p.shape[1:])
                    p.copy_(gains.get(leaf, 1.0) / math.sqrt(fan_in) * torch.randn(p.shape, generator=g))
        return model.eval()


def make_random(config: dict, seed: int = 0) -> YoutuVLMoEForConditionalGeneration:
    return YoutuVLMoEForConditionalGeneration.make_random(config, seed)


def preprocess(images, preprocessor: dict):
    """(pixel_values, image_grid_thw) for PIL images with transformers' default (torchvision)
    Qwen2-VL processor, rebuilt without torchvision (docs/models/qwen3_5.md, section 8)."""
    from ..reference import qwen_image_processor

    p = qwen_image_processor(**{k: v for k, v in preprocessor.items() if k != "image_processor_type"})
    out = p(images=list(images), return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]
