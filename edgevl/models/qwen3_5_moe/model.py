"""Qwen3.5-MoE (transformers ``qwen3_5_moe``): Qwen3.5's hybrid decoder (Gated DeltaNet + gated
full attention, M-RoPE) and vision tower with a sparse MoE block as every layer's MLP.

Everything but the MLP is Qwen3.5's, by import (``edgevl/models/qwen3_5``): the same graph
builders and host driver. Hold this file next to transformers'
``modeling_qwen3_5_moe.py: Qwen3_5MoeSparseMoeBlock``:

- in the decoder graph (``moe.emit_sparse_moe``): the router Gemm (``mlp.gate``, logits in fp32)
  and the shared expert scaled by ``sigmoid(shared_expert_gate(x))``;
- on the host (``moe.moe_hook``, one decoder pass per layer after its mixer): softmax over all
  experts, the top ``num_experts_per_tok``, renormalised to sum to 1 (transformers always
  renormalises for this family), the chosen experts run as small ncnn nets from ``experts.bin``
  (``moe.ExpertStore``, at most ``expert_cache_mb`` of them resident) and their weighted sum
  fed back before the residual.

Checkpoint layout: transformers saves the routed experts per expert
(``mlp.experts.{e}.{gate,up,down}_proj.weight``, fused into ``gate_up_proj [E, 2I, H]`` /
``down_proj [E, H, I]`` only in memory, by its conversion mapping ``qwen2_moe``); a checkpoint
holding the fused tensors is read as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...blocks import moe, qwen_vision
from ...blocks.rope import mrope, mrope_positions_of
from ...errors import EdgevlError
from ..protocol import VISION_OPTION, Architecture
from ..qwen3_5 import model as qwen3_5


@dataclass
class MoeTextArgs(qwen3_5.TextArgs):
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512

    text_model_types: ClassVar[tuple] = ("qwen3_5_moe_text",)

    @classmethod
    def from_config(cls, cfg: dict) -> MoeTextArgs:
        a = super().from_config(cfg)
        if a.num_experts_per_tok > a.num_experts:
            raise EdgevlError(f"text_config.num_experts_per_tok {a.num_experts_per_tok} exceeds num_experts "
                              f"{a.num_experts}")
        return a


def emit_moe_mlp(ctx, x: str, p: str, a: MoeTextArgs, i: int):
    """Qwen3_5MoeSparseMoeBlock: router + shared expert (with its sigmoid gate) in the graph, the
    routed experts' sum fed by the ``moe`` host pass."""
    return moe.emit_sparse_moe(ctx, x, i, p, a.hidden_size, a.num_experts,
                               shared={"prefix": f"{p}.shared_expert", "inter": a.shared_expert_intermediate_size,
                                       "gate": f"{p}.shared_expert_gate"})


def layer_experts(ckpt, prefix: str, a: MoeTextArgs, on_tensor):
    """(gate_up, down) lazy sources of each expert of one layer, ``prefix`` = ``...layers.{i}.mlp.experts``:
    fused [E, 2I, H] / [E, H, I] tensors when the checkpoint has them, else per-expert Linears."""
    H, I, E = a.hidden_size, a.moe_intermediate_size, a.num_experts
    if f"{prefix}.gate_up_proj" in ckpt:
        return [moe.fused_expert(ckpt, f"{prefix}.gate_up_proj", f"{prefix}.down_proj", e, H, I, E, on_tensor)
                for e in range(E)]
    return [moe.split_expert(ckpt, f"{prefix}.{e}", H, I, on_tensor) for e in range(E)]


def convert(ckpt, out, dtype: str, options: dict, on_tensor) -> dict:
    """Qwen3.5's package (decoder with sparse MLPs, head, delta-rule nets, vision) plus
    ``experts.bin``/``experts.param`` and the manifest's ``experts`` section."""
    keep = moe.dense_float_layers(dtype, options.get("dense", "auto"))   # checked before any file is written
    a = MoeTextArgs.from_config(ckpt.config)
    qwen_vision.checked_vision_args(ckpt, a.hidden_size, qwen3_5.VISION_PREFIX, "qwen3_5_moe")   # before the experts
    prefix = qwen3_5.text_prefix(ckpt)
    # the experts first: a checkpoint that lacks some fails before the long decoder pass
    w = moe.ExpertWriter(out, a.hidden_size, a.moe_intermediate_size, a.num_experts,
                         moe.expert_dtype(dtype, options.get("experts", "auto")))
    for i in range(a.num_hidden_layers):
        w.add_layer(i, layer_experts(ckpt, f"{prefix}.layers.{i}.mlp.experts", a, on_tensor))
    mtp = options.get("mtp", "keep")
    if qwen3_5.mtp_present(ckpt, a, mtp == "keep"):   # the MTP layer's experts: layer index N
        w.add_layer(a.num_hidden_layers, layer_experts(ckpt, "mtp.layers.0.mlp.experts", a, on_tensor))
    experts = w.finish({"kind": "softmax", "top_k": a.num_experts_per_tok, "renormalize": True})
    # q8: the routed experts (most of the weights) and the head in int8, the dense path as
    # ``dense`` says (moe.dense_float_layers)
    parts = qwen3_5.convert(ckpt, out, dtype, on_tensor, a, emit_moe_mlp, float_layers=keep, mtp=mtp,
                            vision=options.get("vision", "auto"))
    parts["experts"] = experts
    return parts


class Qwen3_5Moe(Architecture):
    """Qwen3.5's decoder, prompting and vision tower (by import) with the MoE block's options,
    expert store and llama.cpp profile."""
    name = "qwen3_5_moe"
    has_vision = True
    chat_template = qwen3_5.CHAT_TEMPLATE
    reasoning_tokens = qwen3_5.ARCH.reasoning_tokens
    template_switches = qwen3_5.ARCH.template_switches
    options = {**moe.OPTIONS, "mtp": qwen3_5.MTP_OPTION, "vision": VISION_OPTION}
    runtime_options = moe.RUNTIME_OPTIONS
    bench = moe.bench_profile(qwen3_5.ARCH.bench.convert_args, qwen3_5.ARCH.bench.convert_args_of)

    def convert(self, ckpt, out, dtype, options, on_tensor) -> dict:
        return convert(ckpt, out, dtype, options, on_tensor)

    def thinking_args(self, thinking):
        return qwen3_5.ARCH.thinking_args(thinking)

    def hooks(self, pkg) -> dict:
        return {**qwen3_5.delta_rule_hooks(pkg), "moe": moe.moe_hook(moe.open_experts(pkg))}

    def rope(self, info):
        return mrope(info)

    def positions(self, input_ids, images, image_token_id):
        return mrope_positions_of(input_ids, images, image_token_id)

    def snapshot_points(self, tokenizer, input_ids):
        return qwen3_5.ARCH.snapshot_points(tokenizer, input_ids)

    def make_vision(self, pkg, net):
        return qwen_vision.open_vision(pkg, net)

    def runtime_stats(self, pkg) -> dict:
        return moe.runtime_stats(pkg)

    def preload(self, pkg, progress: bool = False) -> None:
        moe.preload(pkg, progress)


ARCH = Qwen3_5Moe()
