"""Youtu-LLM on both sides: tiny random (or briefly trained) checkpoints in the real layout, from
the verification wing's factory (``edgevl.verification.families.youtu``), and transformers' own
model and greedy decoding to compare with."""

from __future__ import annotations

from pathlib import Path

from edgevl.verification.families.youtu import VERIFY as YOUTU

# the random configs of the parity tests (YoutuConfig overrides of the factory's defaults)
CONFIGS = YOUTU.tiny_variants
# the smallest Youtu-LLM that still has every block (q_lora off, one layer): converts in ~30 ms
TINY = dict(hidden_size=32, intermediate_size=48, num_attention_heads=2, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, num_hidden_layers=1, max_position_embeddings=64)


def make_youtu(folder, seed: int = 0, dtype: str = "fp32", max_shard_size=None, init_scale: float = 0.15,
               train_steps: int = 0, **overrides) -> Path:
    """A random (or briefly trained) YoutuForCausalLM checkpoint; overrides are YoutuConfig kwargs."""
    folder = Path(folder)
    return YOUTU.make_tiny(folder, "q_lora", seed, dtype, train_steps, max_shard_size=max_shard_size,
                           init_scale=init_scale, **overrides)


def tiny_checkpoint(folder, seed: int = 1) -> Path:
    """The ``TINY`` Youtu-LLM: for tests of everything around the model (CLI, server, conversion)."""
    return make_youtu(folder, seed=seed, **TINY)


def convert_and_load(ck, root, dtype, kv="absorbed"):
    """The package of ``ck`` at ``dtype`` and KV-cache layout ``kv`` (converted once under ``root``), loaded."""
    import edgevl

    out = root / f"{ck.name}-{dtype}-{kv}"
    if not out.exists():
        edgevl.convert(ck, out, dtype=dtype, kv_cache=kv, progress=False)
    return edgevl.load(out)


def chat_ids(model, prompt):
    """Token ids of ``prompt`` as one user turn of the model's chat template."""
    return model.tokenizer.encode(model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))


def load_hf(folder):
    import torch
    from transformers import YoutuForCausalLM

    return YoutuForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(model, input_ids, n: int) -> list[int]:
    """Greedy tokens from transformers with its KV cache, no early stop, no logits processors."""
    from edgevl.verification.reference import TransformersCausalLM

    return TransformersCausalLM(model).greedy(input_ids, n, eos=())
