"""Qwen3.5-MoE's verification: transformers' ``Qwen3_5MoeForConditionalGeneration`` (or
``ForCausalLM``) is the reference (Qwen3.5's reference class, its MTP block included); tiny
checkpoints are built as Qwen3.5's with the MoE sizes."""

from __future__ import annotations

from pathlib import Path

from ...models.qwen3_5_moe.model import MoeTextArgs
from ..reference import FamilyVerification
from . import qwen3_5

HF_CLASSES = {"vlm": "Qwen3_5MoeForConditionalGeneration", "causal_lm": "Qwen3_5MoeForCausalLM",
              "config": "Qwen3_5MoeConfig", "text_config": "Qwen3_5MoeTextConfig"}
MOE_TINY = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


class Qwen3_5MoeVerification(FamilyVerification):
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

    def reference(self, ref_dir, dtype="fp32"):
        return qwen3_5.load_reference(ref_dir, dtype, HF_CLASSES, MoeTextArgs.text_model_types)

    def make_tiny(self, folder, variant=None, seed=0, dtype="fp32", train_steps=0, mtp=False, mtp_train_steps=0,
                  **overrides) -> Path:
        """A random (or briefly trained) Qwen3_5MoeForConditionalGeneration; overrides as for
        Qwen3.5 plus the MoE sizes (num_experts, num_experts_per_tok, moe_intermediate_size,
        shared_expert_intermediate_size); ``mtp``/``mtp_train_steps`` add the multi-token-prediction
        block, whose layer has the sparse MoE block of the main layers (``qwen3_5.make_tiny``)."""
        over = {**MOE_TINY, **self.variant(variant), **overrides}
        return qwen3_5.make_tiny(folder, seed, dtype, train_steps=train_steps, classes=HF_CLASSES, mtp=mtp,
                                 mtp_train_steps=mtp_train_steps, **over)


VERIFY = Qwen3_5MoeVerification()
