"""Qwen3.5-MoE (transformers ``qwen3_5_moe``): Qwen3.5's hybrid decoder (Gated DeltaNet + gated
full attention, M-RoPE) and vision tower with a sparse MoE block as every layer's MLP.

Everything but the MLP is ``qwen3_5.py``'s, by import: the same graph builders, host driver,
vision encoder and reference adapter. Hold this file next to transformers'
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

from ..errors import EdgevlError
from . import moe, qwen3_5


@dataclass
class MoeTextArgs(qwen3_5.TextArgs):
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512

    text_model_types: ClassVar[tuple] = ("qwen3_5_moe_text",)

    @classmethod
    def from_config(cls, cfg: dict) -> "MoeTextArgs":
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
    qwen3_5.checked_vision_args(ckpt, a.hidden_size)   # before the experts are written
    prefix = qwen3_5.text_prefix(ckpt)
    # the experts first: a checkpoint that lacks some fails before the long decoder pass
    w = moe.ExpertWriter(out, a.hidden_size, a.moe_intermediate_size, a.num_experts,
                         moe.expert_dtype(dtype, options.get("experts", "auto")))
    for i in range(a.num_hidden_layers):
        w.add_layer(i, layer_experts(ckpt, f"{prefix}.layers.{i}.mlp.experts", a, on_tensor))
    experts = w.finish({"kind": "softmax", "top_k": a.num_experts_per_tok, "renormalize": True})
    # q8: the routed experts (most of the weights) and the head in int8, the dense path as
    # ``dense`` says (moe.dense_float_layers)
    parts = qwen3_5.convert(ckpt, out, dtype, on_tensor, a, emit_moe_mlp, float_layers=keep)
    parts["experts"] = experts
    return parts


MOE_TINY = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


class Qwen3_5Moe(moe.MoeArchitecture, qwen3_5.Qwen3_5):
    name = "qwen3_5_moe"
    hf_classes = {"vlm": "Qwen3_5MoeForConditionalGeneration", "causal_lm": "Qwen3_5MoeForCausalLM",
                  "config": "Qwen3_5MoeConfig", "text_config": "Qwen3_5MoeTextConfig"}
    text_args = MoeTextArgs
    # a bf16/q8 rounding flips a near-tied expert choice on a few rows (with top-2 of 8 one flip
    # replaces about half of a layer's routed output): measured 1 of 192 teacher-forced rows at
    # 0.94 logit cosine in q8, the rest >= 0.977; with the fp32 package's routing forced, >= 0.98
    precision_outlier_rows = 0.02
    tiny_variants = {
        # 8 experts top-2, L L L F, Hv = 2 Hk, tied
        "e8k2-tied": dict(MOE_TINY),
        # 12 experts top-3, wider shared expert, L F L F, Hv = Hk, untied, head 128
        "e12k3-untied-hd128": dict(num_experts=12, num_experts_per_tok=3, moe_intermediate_size=24,
                                   shared_expert_intermediate_size=72, linear_num_value_heads=2,
                                   linear_key_head_dim=32, linear_value_head_dim=32, head_dim=128,
                                   num_attention_heads=4, num_key_value_heads=2, full_attention_interval=2,
                                   tie_word_embeddings=False),
    }

    def convert(self, ckpt, out, dtype, options, on_tensor) -> dict:
        return convert(ckpt, out, dtype, options, on_tensor)

    def hooks(self, model) -> dict:
        return {**super().hooks(model), "moe": moe.moe_hook(self.open_experts(model))}

    def make_tiny(self, folder, variant="e8k2-tied", seed=0, dtype="fp32", train_steps=0, **overrides):
        """A random (or briefly trained) Qwen3_5MoeForConditionalGeneration; overrides as in
        ``Qwen3_5.make_tiny`` plus the MoE sizes (num_experts, num_experts_per_tok,
        moe_intermediate_size, shared_expert_intermediate_size)."""
        over = {**MOE_TINY, **self.tiny_variants.get(variant, {}), **overrides}
        return qwen3_5.make_tiny(folder, seed, dtype, train_steps=train_steps, classes=self.hf_classes, **over)


ARCH = Qwen3_5Moe()
