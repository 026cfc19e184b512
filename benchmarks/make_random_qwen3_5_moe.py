"""Write a random Qwen3.5-MoE text checkpoint (bf16, with the tiny test tokenizer) for the MoE
benchmarks. Two shapes:

- default: 449 M parameters, hidden 1024, 8 layers (3 delta-rule, 1 full attention, twice), 32
  experts of width 512, top-8, a 512-wide shared expert (not a real model's shape);
- ``--a3b-layers N``: the per-layer shapes of Qwen3.5-35B-A3B (hidden 2048, 16 key / 32 value
  delta-rule heads of 128, 16 attention heads of 256 with 2 KV heads, 128 experts of width 512,
  top-8, a 512-wide shared expert) over N layers (4: 1.75 B parameters, 3.5 GB). The real model
  has 40 layers and 256 experts; a layer's per-token work is the same (8 experts chosen).

    python benchmarks/make_random_qwen3_5_moe.py OUT_DIR [--a3b-layers 4] [--experts 32]

``--experts E`` changes the routed experts per layer (top-8 stays): with 16 layers of 32, the
non-expert weights are as large a part of the model as in the real one (the peak-memory check).

Used by benchmarks/run.sh for the expert-cache and llama.cpp (qwen35moe) comparisons.
"""

import argparse
from pathlib import Path

import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from edgevl.verification.families import qwen3_5 as q

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--a3b-layers", type=int, default=0, help="Qwen3.5-35B-A3B layer shapes, this many layers")
ap.add_argument("--experts", type=int, default=0, help="routed experts per layer (default: 128 A3B, 32 toy)")
a = ap.parse_args()
folder = Path(a.out)
tok = q.tiny_tokenizer()
ids = q.save_tiny_tokenizer(tok, folder)
(folder / "preprocessor_config.json").unlink()  # a text model
if a.a3b_layers:
    shape = dict(hidden_size=2048, num_hidden_layers=a.a3b_layers, num_attention_heads=16, num_key_value_heads=2,
                 head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                 linear_value_head_dim=128, num_experts=128, mrope_section=[11, 11, 10])
else:
    shape = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                 linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64,
                 num_experts=32, mrope_section=[5, 6, 5])
section = shape.pop("mrope_section")
if a.experts:
    shape["num_experts"] = a.experts
cfg = Qwen3_5MoeTextConfig(
    vocab_size=tok.get_vocab_size(), num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, eos_token_id=ids["im_end"], tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "mrope_section": section, "mrope_interleaved": True,
                     "partial_rotary_factor": 0.25}, **shape)
torch.manual_seed(0)
Qwen3_5MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
