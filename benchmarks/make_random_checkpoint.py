"""Write a random-weight Youtu-LLM-2B-shaped checkpoint (transformers' YoutuConfig defaults).

    python benchmarks/make_random_checkpoint.py OUT_DIR [--dtype bf16] [--layers N]

Tensor names and shapes come from transformers' own YoutuForCausalLM built on the meta device;
values are drawn per tensor (std 0.02, norms near 1) and written in ~2 GB safetensors shards with
an index, like a real download — without ever holding the model in memory. A small byte-level
BPE tokenizer is saved beside it (benchmarks feed random ids; the tokenizer is only for loading).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (smaller tests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gb", type=float, default=2.0)
    a = ap.parse_args(argv)

    import torch
    from transformers import YoutuConfig, YoutuForCausalLM

    from edgevl.verification.tokenizers import save_tokenizer, train_tokenizer
    from random_weights import param_count, write_config, write_shards

    cfg = YoutuConfig(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if a.layers:
        cfg.num_hidden_layers = a.layers
    with torch.device("meta"):
        model = YoutuForCausalLM(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    out = Path(a.out)
    print(f"{param_count(shapes) / 1e9:.2f}B parameters, {len(shapes)} tensors -> {out}", file=sys.stderr)
    g = torch.Generator().manual_seed(a.seed)
    t0 = time.time()

    def draw(name, shape):
        if "norm" in name:
            return 1.0 + 0.05 * torch.randn(shape, generator=g)
        return 0.02 * torch.randn(shape, generator=g)

    write_shards(shapes, out, a.dtype, draw, a.shard_gb)
    write_config(cfg, out, "YoutuForCausalLM", a.dtype)
    tok = train_tokenizer(["The quick brown fox jumps over the lazy dog. " * 4, "你好，世界"], vocab_size=300,
                          vision=False)
    save_tokenizer(tok, out)
    print(f"done in {time.time() - t0:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
