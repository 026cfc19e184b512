"""Write a random Qwen3.5-MoE text checkpoint of moderate size (not a real model's shape): 449 M
parameters, hidden 1024, 8 layers (3 delta-rule, 1 full attention, twice), 32 experts of width
512, top-8, a 512-wide shared expert; bf16, with the tiny test tokenizer.

    python benchmarks/make_random_qwen3_5_moe.py OUT_DIR

Used by benchmarks/run.sh for the expert-cache and llama.cpp (qwen35moe) comparisons.
"""

import sys
from pathlib import Path

import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from edgevl.models import qwen3_5 as q

folder = Path(sys.argv[1])
tok = q.tiny_tokenizer()
ids = q.save_tiny_tokenizer(tok, folder)
(folder / "preprocessor_config.json").unlink()  # a text model
cfg = Qwen3_5MoeTextConfig(
    vocab_size=tok.get_vocab_size(), hidden_size=1024, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
    linear_value_head_dim=64, num_experts=32, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, eos_token_id=ids["im_end"], tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "mrope_section": [5, 6, 5], "mrope_interleaved": True,
                     "partial_rotary_factor": 0.25})
torch.manual_seed(0)
Qwen3_5MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
