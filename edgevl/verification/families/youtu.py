"""Youtu-LLM's verification: transformers' ``YoutuForCausalLM`` is the reference; tiny checkpoints
are that class with random (or briefly trained) weights and a small Youtu-style tokenizer."""

from __future__ import annotations

from pathlib import Path

from ...models.youtu_vl.model import CHAT_TEMPLATE as YOUTU_VL_TEMPLATE
from ..reference import FamilyVerification, TransformersCausalLM, torch_dtype
from ..tiny import init_random, tiny_tokenizer, train_briefly
from ..tokenizers import save_tokenizer


class YoutuVerification(FamilyVerification):
    tiny_variants = {
        "q_lora": dict(),
        "no_q_lora": dict(q_lora_rank=None, hidden_size=72, num_attention_heads=3),
        "rope32_v_ne_nope": dict(qk_rope_head_dim=32, qk_nope_head_dim=16, v_head_dim=40, num_hidden_layers=3),
        "untied": dict(tie_word_embeddings=False, kv_lora_rank=24),
        "theta10000": dict(rope_theta=10000.0, intermediate_size=80),
    }

    def reference(self, ref_dir, dtype="fp32"):
        from transformers import YoutuForCausalLM

        return TransformersCausalLM(YoutuForCausalLM.from_pretrained(ref_dir, dtype=torch_dtype(dtype)).eval())

    def make_tiny(self, folder, variant=None, seed=0, dtype="fp32", train_steps=0, max_shard_size=None,
                  init_scale: float = 0.15, **overrides) -> Path:
        """A random (or briefly trained) YoutuForCausalLM checkpoint; overrides are YoutuConfig kwargs."""
        import torch
        from transformers import YoutuConfig, YoutuForCausalLM

        overrides = {**self.variant(variant), **overrides}
        tok = tiny_tokenizer()
        ids = save_tokenizer(tok, folder, chat_template=YOUTU_VL_TEMPLATE)
        theta = overrides.pop("rope_theta", 500000.0)
        cfg = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
                   qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=20, max_position_embeddings=512,
                   rope_parameters={"rope_type": "default", "rope_theta": float(theta)},
                   bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
                   # no pad id: transformers 5.24 zeroes the pad row of the embedding when loading,
                   # which would make the reference differ from the checkpoint it was saved from
                   pad_token_id=None, tie_word_embeddings=True)
        cfg.update(overrides)
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
        torch.manual_seed(seed)
        model = init_random(YoutuForCausalLM(YoutuConfig(**cfg)).eval(), seed, init_scale)
        if train_steps:
            model = train_briefly(model, tok, train_steps, seed)
        if dtype == "bf16":
            model = model.to(torch.bfloat16)
        model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
        return Path(folder)


VERIFY = YoutuVerification()
