"""Random safetensors checkpoints written tensor by tensor: ~2 GB shards and an index, like a
real download, without ever holding the model in memory (shared by the make_random_* scripts)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

DTYPES = ("bf16", "fp16", "fp32")


def write_shards(shapes: dict, out: Path, dtype: str, draw, shard_gb: float = 2.0) -> int:
    """Write ``draw(name, shape)`` (a float tensor) for every tensor in ``shapes``; returns bytes."""
    import torch
    from safetensors.torch import save_file

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    out.mkdir(parents=True, exist_ok=True)
    limit = shard_gb * (1 << 30)
    shards, cur, cur_bytes, total = [], {}, 0, 0
    t0 = time.time()
    names = list(shapes)
    for i, name in enumerate(names):
        cur[name] = draw(name, shapes[name]).to(dt)
        cur_bytes += cur[name].numel() * cur[name].element_size()
        if cur_bytes >= limit or i == len(names) - 1:
            shards.append(list(cur))
            save_file(cur, str(out / f"part-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
            print(f"  wrote shard {len(shards)} ({cur_bytes / 1e9:.2f} GB, {time.time() - t0:.0f}s)", file=sys.stderr)
            total += cur_bytes
            cur, cur_bytes = {}, 0
    # rename to the HF shard pattern now that the count is known, and write the index
    weight_map = {}
    for k, names_k in enumerate(shards, 1):
        final = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        (out / f"part-{k:05d}.safetensors").rename(out / final)
        weight_map.update({n: final for n in names_k})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


def param_count(shapes: dict) -> int:
    return sum(int(np.prod(s)) for s in shapes.values())


def write_config(cfg, out: Path, architecture: str, dtype: str) -> None:
    """config.json as a download has it: the architecture's class name and the weights' dtype."""
    d = cfg.to_dict()
    d["architectures"] = [architecture]
    d["dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
    (Path(out) / "config.json").write_text(json.dumps(d, indent=1))
