"""Random expert packages and routing workloads for the MoE tests (no torch: also imported by
the peak-memory subprocess)."""

import json
from pathlib import Path

import numpy as np

from edgevl.blocks import moe


def record_routes(monkeypatch, layer: int) -> list:
    """The experts the router picks at ``layer`` on every call from now on (each row's ids,
    sorted), appended to the list returned; routing itself is unchanged."""
    seen = []
    real = moe.Router.__call__

    def record(self, at, logits, modality=None):
        idx, w = real(self, at, logits, modality)
        if at == layer:
            seen.append(np.sort(idx, axis=1))
        return idx, w

    monkeypatch.setattr(moe.Router, "__call__", record)
    return seen


def random_experts(n, hidden, inter, seed):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        yield ((rng.random((2 * inter, hidden), np.float32) - 0.5) * 0.1,
               (rng.random((hidden, inter), np.float32) - 0.5) * 0.1)


def write_random_package(folder: Path, layers, num_experts, hidden, inter, dtype, top_k):
    w = moe.ExpertWriter(folder, hidden, inter, num_experts, dtype)
    for i, layer in enumerate(layers):
        w.add_layer(layer, random_experts(num_experts, hidden, inter, seed=i))
    spec = w.finish({"kind": "softmax", "top_k": top_k, "renormalize": True})
    (folder / "experts.json").write_text(json.dumps(spec))
    return spec


def workload(store, layers, hidden, num_experts, k, steps, seed):
    """Decode-like single rows plus a prefill, routed by random logits that favour low expert ids
    (real routers have popular experts); all outputs."""
    rng = np.random.default_rng(seed)
    popularity = np.linspace(3, -3, num_experts, dtype=np.float32)
    router = moe.Router(store.spec["routing"])
    outs = []
    for n in [16] + [1] * steps:
        for layer in layers:
            x = rng.standard_normal((n, hidden)).astype(np.float32)
            logits = rng.standard_normal((n, num_experts)).astype(np.float32) * 2 + popularity
            idx, w = router(layer, logits)
            outs.append(store.compute(layer, x, idx, w))
    return outs
