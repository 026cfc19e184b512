"""Expert dispatch (edgevl/blocks/moe.py): the in-graph router and shared expert plus the host
hook against transformers' Qwen3.5-MoE block and the Youtu MoE reference's block; the on-demand
expert cache (identical outputs, hit rate, resident bytes and process peak RSS)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from edgevl import ncnn_graph as G
from edgevl import runtime
from edgevl.blocks import base, moe
from edgevl.errors import EdgevlError, PackageError
from edgevl.weights import Checkpoint
from support.common import ROOT, TESTS
from support.moe import workload, write_random_package


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():  # per test: a global switch would break later tests that train
        yield


def moe_block_decoder(tmp: Path, ckpt, prefix: str, hidden: int, num_experts: int, shared: dict | None,
                      experts, routing: dict, dtype: str = "fp32", bias=None, cache_mb=None):
    """A one-block decoder graph (embeds -> sparse MoE -> hidden) driven by runtime.Decoder, the
    experts written by ExpertWriter and computed by the host hook."""
    g = G.Graph(tmp / "dec.bin")
    ctx = base.weight_ctx(ckpt, g, dtype, lambda t: None)
    x = g.input("embeds")
    for name in ("mask", "rope_cos", "rope_sin"):
        g.input(name)
    y, spec = moe.emit_sparse_moe(ctx, x, 0, prefix, hidden, num_experts, shared=shared)
    G.binary_scalar(g, y, "add", 0.0, out="hidden")
    g.save(tmp / "dec.param")
    w = moe.ExpertWriter(tmp, hidden, experts[0][1].shape[1], num_experts, moe.expert_dtype(dtype))
    w.add_layer(0, experts, bias)
    store = moe.ExpertStore(tmp, w.finish(routing), threads=1, cache_mb=cache_mb)
    net = runtime.Net(str(tmp / "dec.param"), str(tmp / "dec.bin"), 1, "bf16" if dtype == "q8" else dtype)
    info = {"inputs": {"embeds": "embeds", "mask": "mask", "cos": "rope_cos", "sin": "rope_sin"},
            "outputs": {"hidden": "hidden"}, "state": [], "passes": [spec]}
    zeros = lambda pos: (np.zeros((pos.shape[1], 2), np.float32),) * 2  # noqa: E731 - no rope here
    dec = runtime.Decoder(net, info, zeros, {"moe": moe.moe_hook(store)})
    return dec, store


def run_rows(dec, x):
    return dec.forward(x, dec.new_cache(), np.arange(len(x))[None])[0]


# -- Qwen3.5-MoE ----------------------------------------------------------------------------------

QH, QI, QE, QK, QSI = 48, 40, 12, 3, 56


@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from edgevl.verification.tiny import init_random

    cfg = Qwen3_5MoeTextConfig(vocab_size=64, hidden_size=QH, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                               linear_key_head_dim=8, linear_value_head_dim=8, num_experts=QE, num_experts_per_tok=QK,
                               moe_intermediate_size=QI, shared_expert_intermediate_size=QSI,
                               layer_types=["full_attention"])
    model = init_random(Qwen3_5MoeForCausalLM(cfg).eval(), 0, 0.15)
    folder = tmp_path_factory.mktemp("qwen35moe")
    model.save_pretrained(folder)
    return model, folder


def qwen_block(qwen_moe, tmp, dtype="fp32", cache_mb=None):
    model, folder = qwen_moe
    ckpt = Checkpoint(folder)
    p = "model.layers.0.mlp"
    experts = [moe.split_expert(ckpt, f"{p}.experts.{e}", QH, QI) for e in range(QE)]
    dec, store = moe_block_decoder(tmp, ckpt, p, QH, QE, {"prefix": f"{p}.shared_expert", "inter": QSI,
                                                         "gate": f"{p}.shared_expert_gate"},
                                   experts, {"kind": "softmax", "top_k": QK, "renormalize": True}, dtype,
                                   cache_mb=cache_mb)
    return model.model.layers[0].mlp, dec, store


def test_qwen3_5_moe_block_matches_transformers_fp32(qwen_moe, tmp_path):
    block, dec, store = qwen_block(qwen_moe, tmp_path)
    rng = np.random.default_rng(1)
    for n in (37, 1, 1, 2):                                       # prefill rows, then single rows
        x = rng.standard_normal((n, QH)).astype(np.float32)
        want = block(torch.from_numpy(x)[None])[0].numpy()
        got = run_rows(dec, x)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 2e-6, f"{n} rows: relative error {err:.2e}"
    assert store.misses > 0 and store.hits > 0


def test_qwen3_5_moe_block_q8_experts(qwen_moe, tmp_path):
    block, dec, _ = qwen_block(qwen_moe, tmp_path, "q8")
    x = np.random.default_rng(2).standard_normal((29, QH)).astype(np.float32)
    want = block(torch.from_numpy(x)[None])[0].numpy()
    got = run_rows(dec, x)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 0.03, f"q8 experts (bf16 router/shared) relative L2 error {rel:.3f}"


def test_softmax_routing_matches_transformers_router(qwen_moe):
    model, _ = qwen_moe
    router = model.model.layers[0].mlp.gate
    x = torch.randn(20, QH, generator=torch.Generator().manual_seed(3))
    logits, w, idx = router(x)
    gi, gw = moe.softmax_topk(logits.numpy(), QK)
    order_t, order_g = np.argsort(idx.numpy(), 1), np.argsort(gi, 1)
    assert np.array_equal(np.take_along_axis(idx.numpy(), order_t, 1), np.take_along_axis(gi, order_g, 1))
    assert np.allclose(np.take_along_axis(w.numpy(), order_t, 1), np.take_along_axis(gw, order_g, 1), atol=1e-6)


def test_group_by_expert():
    idx = np.array([[3, 0], [0, 2], [3, 1]])
    w = np.array([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]], np.float32)
    got = [(e, rows.tolist(), ws.tolist()) for e, rows, ws in moe.group_by_expert(idx, w)]
    assert got == [(0, [0, 1], pytest.approx([0.2, 0.3])), (1, [2], pytest.approx([0.6])),
                   (2, [1], pytest.approx([0.4])), (3, [0, 2], pytest.approx([0.1, 0.5]))]


# -- Youtu MoE (against the reference) -------------------------------------------------------------


def test_youtu_moe_block_matches_reference_text_and_image_rows(tmp_path):
    from edgevl.verification.references import youtu_moe as R

    cfg = R.make_config()
    model = R.make_random(cfg, 0)
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    ckpt = Checkpoint(folder)
    H, E, I, k = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"], cfg["num_experts_per_token"]
    layer = 2
    p = f"model.layers.{layer}.mlp"
    experts = [moe.fused_expert(ckpt, f"{p}.experts.gate_up_proj", f"{p}.experts.down_proj", e, H, I, E)
               for e in range(E)]
    img = cfg["image_token_id"]
    routing = {"kind": "sigmoid_biased", "top_k": k, "scale": cfg["routed_scaling_factor"], "eps": 1e-20,
               "modality_token_ids": [img, cfg["video_token_id"]]}
    dec, store = moe_block_decoder(tmp_path, ckpt, p, H, E, {"prefix": f"{p}.shared_experts", "inter": I, "gate": None},
                                   experts, routing, bias=ckpt.numpy(f"{p}.gate.qb_beta"))
    block = model.model.layers[layer].mlp
    rng = np.random.default_rng(4)
    x = rng.standard_normal((12, H)).astype(np.float32)
    ids = np.array([5, 6, img, img, img, img, 7, 8, img, 9, 10, 11])
    modality = torch.from_numpy((ids == img).astype(np.int64))[None]
    want = block(torch.from_numpy(x)[None], modality)[0].numpy()
    # the hook as the Decoder calls it for a pass that asks for ids (the end-to-end path:
    # tests/families/test_youtu_moe.py)
    spec = dec.passes[0]
    hook = dec.hooks["moe"]
    ex_blobs = {spec["args"]["input"]: x, spec["args"]["logits"]: x @ ckpt.numpy(f"{p}.gate.weight").T}
    routed = hook(ex_blobs, seq=len(x), ids=ids, **spec["args"])[spec["args"]["output"]]
    shared = model.model.layers[layer].mlp.shared_experts(torch.from_numpy(x)).numpy()
    assert np.abs(routed + shared - want).max() < 1e-5
    # modality matters: the same rows as text give another result (rows 2-5, 8 change experts)
    as_text = hook(ex_blobs, seq=len(x), ids=np.zeros_like(ids), **spec["args"])[spec["args"]["output"]]
    changed = np.abs(as_text - routed).max(axis=1) > 1e-4
    assert changed[ids == img].any() and not changed[ids != img].any()
    # through the graph (text rows: the runtime gives no ids, so modality 0)
    want_text = block(torch.from_numpy(x)[None], torch.zeros_like(modality))[0].numpy()
    assert np.abs(run_rows(dec, x) - want_text).max() < 1e-5
    for r in range(3):
        assert np.abs(run_rows(dec, x[r:r + 1]) - want_text[r:r + 1]).max() < 1e-5


# -- the expert cache -------------------------------------------------------------------------------


def test_small_expert_cache_gives_identical_outputs_and_bounded_memory(tmp_path):
    # a fifth of the experts: ~5 resident per layer, 2 chosen per layer and step
    layers, E, H, I, k = [1, 2], 32, 256, 384, 2
    spec = write_random_package(tmp_path, layers, E, H, I, "q8", k)
    total = spec["expert_bytes"] * E * len(layers)
    full = moe.ExpertStore(tmp_path, spec)
    want = workload(full, layers, H, E, k, 40, seed=5)
    assert full.stats()["misses"] == sum(map(len, full._nets.values())) and full.stats()["evictions"] == 0
    full.close()

    budget_mb = total / 5 / (1 << 20)                        # a fifth of the expert weights
    before = moe._heap_bytes()
    small = moe.ExpertStore(tmp_path, spec, cache_mb=budget_mb)
    got = workload(small, layers, H, E, k, 40, seed=5)
    held = moe._heap_bytes() - before
    s = small.stats()
    assert all(np.array_equal(a, b) for a, b in zip(got, want)), "tokens must not depend on the cache size"
    assert 0 < s["hit_rate"] < 1 and s["evictions"] > 0
    assert f"{100 * s['hit_rate']:.1f} % hit rate" in small.summary() and "MB budget" in small.summary()
    assert s["peak_resident_bytes"] <= s["budget_bytes"]
    # what ncnn really holds for the resident experts stays within the budget (+15 %)
    assert held <= 1.15 * s["budget_bytes"] + (1 << 20), f"{held / 2**20:.1f} MB held for a {budget_mb:.1f} MB budget"
    assert held >= 0.5 * s["resident_bytes"], "the heap measure must see the resident experts"
    assert spec["expert_bytes"] <= s["expert_cost_bytes"] < 1.3 * spec["expert_bytes"]
    small.close()

    # cache 0: nothing kept, still the same outputs
    none = moe.ExpertStore(tmp_path, spec, cache_mb=0)
    assert all(np.array_equal(a, b) for a, b in zip(workload(none, layers, H, E, k, 5, seed=5), want))
    assert none.stats()["hits"] == 0 and none.stats()["peak_resident_bytes"] == none.cost
    # the summary says a budget under one expert is exceeded by the one being computed, not "0 MB"
    assert "(0 MB budget; the expert being computed stays resident over a smaller budget)" in none.summary()
    half = moe.ExpertStore(tmp_path, spec, cache_mb=0.5 * none.cost / 2**20)
    workload(half, layers, H, E, k, 2, seed=5)
    assert f"({0.5 * none.cost / 2**20:.2g} MB budget; the expert being computed" in half.summary(), half.summary()
    half.close()
    with pytest.raises(EdgevlError, match="expert cache size must be >= 0"):
        moe.ExpertStore(tmp_path, spec, cache_mb=-1)


def test_a_cache_below_one_steps_working_set_still_hits(tmp_path):
    """Decode sweeps the layers in order, so one LRU over all layers with a cache smaller than a
    step's working set (layers x top-k) evicts exactly the experts the next step needs first
    (no hits at all here). Split per layer, a fifth of the experts still catches about its
    share of uniformly random choices, with the same outputs and resident bytes within the budget."""
    layers, E, H, I, k = [0, 1, 2, 3], 16, 256, 128, 4
    spec = write_random_package(tmp_path, layers, E, H, I, "q8", k)
    rng = np.random.default_rng(11)
    steps = [(rng.standard_normal((1, H)).astype(np.float32), rng.standard_normal((1, E)).astype(np.float32))
             for _ in range(60 * len(layers))]
    router = moe.Router(spec["routing"])

    def decode(store):
        outs = []
        for i, (x, logits) in enumerate(steps):
            idx, w = router(layers[i % len(layers)], logits)
            outs.append(store.compute(layers[i % len(layers)], x, idx, w))
        return outs

    full = moe.ExpertStore(tmp_path, spec)
    want = decode(full)
    full.close()
    budget = spec["expert_bytes"] * E * len(layers) / 5     # 3.2 experts' bytes per layer
    small = moe.ExpertStore(tmp_path, spec, cache_mb=budget / (1 << 20))
    got = decode(small)
    s = small.stats()
    per_layer = int(budget / len(layers) // s["expert_cost_bytes"])
    assert 0 < per_layer < k, "the cache must hold less than one step's experts"
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert s["peak_resident_bytes"] <= s["budget_bytes"]
    expected = per_layer / E                    # a uniform choice hits a resident expert this often
    assert per_layer >= 2 and s["hit_rate"] > 0.6 * expected, (s, expected)
    small.close()


@pytest.mark.parametrize("dtype", ["q8", "bf16"])
def test_experts_load_straight_into_ncnns_buffers(tmp_path, monkeypatch, capfd, dtype):
    """Expert nets load through a reader that fills ncnn's weight buffers from the file (no
    Python bytes, no copy in the binding), or with checksums from the buffer they were checked
    in: the same outputs as the copying path, and a file cut short is a one-line error (before
    ncnn reads: it prints nothing), not a net of garbage."""
    assert moe._SpanReader.usable(), "this ncnn wheel must hand a Python reader its buffers"
    E, H, I = 5, 64, 48
    spec = write_random_package(tmp_path, [0], E, H, I, dtype, 2)
    x = np.random.default_rng(3).standard_normal((3, H)).astype(np.float32)
    store = moe.ExpertStore(tmp_path, spec)
    direct = [store.run(0, e, x) for e in range(E)]
    store.close()
    unchecked = dict(spec, checksum=None)      # read straight from the file
    store = moe.ExpertStore(tmp_path, unchecked)
    assert all(np.array_equal(store.run(0, e, x), want) for e, want in enumerate(direct))
    store.close()
    monkeypatch.setattr(moe._SpanReader, "_usable", False)     # the copying path
    store = moe.ExpertStore(tmp_path, spec)
    copied = [store.run(0, e, x) for e in range(E)]
    store.close()
    assert all(np.array_equal(a, b) for a, b in zip(direct, copied))
    assert len({float(np.abs(a).sum()) for a in direct}) == E    # each load read its own expert
    monkeypatch.setattr(moe._SpanReader, "_usable", True)
    path = tmp_path / spec["file"]
    path.write_bytes(path.read_bytes()[:spec["expert_bytes"] * (E - 1) + 100])
    for s in (spec, unchecked):
        store = moe.ExpertStore(tmp_path, s)
        assert np.array_equal(store.run(0, E - 2, x), direct[E - 2])
        capfd.readouterr()
        with pytest.raises(PackageError, match=f"experts.bin ends inside expert {E - 1} of layer 0: it is shorter "
                                               "than the manifest says"):
            store.run(0, E - 1, x)
        assert capfd.readouterr().err == ""
        store.close()


def test_expert_writer_records_each_experts_checksum(tmp_path):
    """Conversion writes one digest per expert block (sha256, first 16 bytes) into the manifest's
    experts section: the runtime checks each block against it when it reads the block."""
    import hashlib

    E, H, I = 5, 32, 24
    spec = write_random_package(tmp_path, [0, 3], E, H, I, "q8", 2)
    data = (tmp_path / spec["file"]).read_bytes()
    assert spec["checksum"] == "sha256-128"
    for entry in spec["layers"]:
        blocks = [data[entry["offset"] + e * spec["expert_bytes"]:][:spec["expert_bytes"]] for e in range(E)]
        assert entry["hashes"] == [hashlib.sha256(b).digest()[:16].hex() for b in blocks]
    assert len({h for entry in spec["layers"] for h in entry["hashes"]}) == 2 * E


PEAK_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path[:0] = [{root!r}, {tests!r}]
    from edgevl.blocks import moe
    from support.moe import workload

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    folder, budget = sys.argv[1], (None if sys.argv[2] == "none" else float(sys.argv[2]))
    spec = json.loads(open(folder + "/experts.json").read())
    store = moe.ExpertStore(folder, spec, threads=1, cache_mb=budget)
    base = status("VmRSS")
    outs = workload(store, [0], spec["hidden_size"], spec["num_experts"], 8, int(sys.argv[3]), seed=1)
    print(json.dumps({{"base": base, "peak": status("VmHWM"), "stats": store.stats(),
                      "checksum": float(sum(np.abs(o).sum() for o in outs))}}))
""")


def test_peak_rss_stays_near_the_expert_budget(tmp_path):
    """64 experts of 3 x 512x1024 in q8 (108 MB): with a 24 MB cache the process peak RSS grows by
    the budget (+15 %) plus what the same run needs with no cache at all (one expert loading,
    ncnn's first-run buffers), not by the expert weights."""
    E, H, I = 64, 1024, 512
    spec = write_random_package(tmp_path, [0], E, H, I, "q8", 8)
    total = spec["expert_bytes"] * E
    script = tmp_path / "peak.py"
    script.write_text(PEAK_SCRIPT.format(root=str(ROOT), tests=str(TESTS)))
    runs = {}
    for budget, steps in (("24", 24), ("0", 4), ("none", 24)):    # "0": the run's needs without a cache
        r = subprocess.run([sys.executable, str(script), str(tmp_path), budget, str(steps)],
                           capture_output=True, text=True, cwd=TESTS, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        runs[budget] = dict(out, grown=out["peak"] - out["base"])
    small, zero, full = runs["24"], runs["0"], runs["none"]
    assert small["checksum"] == full["checksum"]
    budget = 24 << 20
    assert budget < total / 4
    assert small["grown"] <= 1.15 * budget + zero["grown"], \
        f"peak RSS grew {small['grown'] / 2**20:.1f} MB with a 24 MB expert cache ({zero['grown'] / 2**20:.1f} MB " \
        f"with none; {total / 2**20:.0f} MB of experts)"
    loaded = full["stats"]["misses"] * spec["expert_bytes"]   # the same run without a cache holds what it loaded
    assert loaded > 2 * budget and full["grown"] > 0.9 * loaded, (full["stats"], full["grown"])
    assert 0 < small["stats"]["hit_rate"] < full["stats"]["hit_rate"]


def test_expert_sources_read_the_right_rows(tmp_path):
    """Fused [E, 2I, H] / [E, H, I] tensors (bf16 on disk) and per-expert Linear weights give the
    same (gate_up, down) matrices the experts compute with."""
    from safetensors.torch import save_file

    E, H, I = 5, 12, 7
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16)
    down = torch.randn(E, H, I, generator=g).to(torch.bfloat16)
    tensors = {"m.experts.gate_up_proj": gate_up, "m.experts.down_proj": down}
    for e in range(E):
        tensors[f"s.experts.{e}.gate_proj.weight"] = gate_up[e, :I].clone()
        tensors[f"s.experts.{e}.up_proj.weight"] = gate_up[e, I:].clone()
        tensors[f"s.experts.{e}.down_proj.weight"] = down[e].clone()
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    ckpt = Checkpoint(tmp_path)
    seen = []
    for e in range(E):
        gu, dn = moe.fused_expert(ckpt, "m.experts.gate_up_proj", "m.experts.down_proj", e, H, I, E, seen.append)
        sgu, sdn = moe.split_expert(ckpt, f"s.experts.{e}", H, I)
        assert gu.shape == sgu.shape == (2 * I, H) and dn.shape == sdn.shape == (H, I)
        want_gu, want_dn = gate_up[e].float().numpy(), down[e].float().numpy()
        assert np.array_equal(gu.read_rows(0, 2 * I), want_gu) and np.array_equal(dn.read_rows(0, H), want_dn)
        assert np.array_equal(gu.read_rows(3, I + 2), want_gu[3:I + 2])     # across gate/up
        assert np.array_equal(sgu.read_rows(3, I + 2), want_gu[3:I + 2])
        assert np.array_equal(sdn.read_rows(0, H), want_dn)
    assert {t.name for t in seen} == {"m.experts.gate_up_proj", "m.experts.down_proj"}
    with pytest.raises(EdgevlError, match="has shape"):
        moe.fused_expert(ckpt, "m.experts.gate_up_proj", "m.experts.down_proj", 0, H, I + 1, E)


def test_an_evicted_experts_net_takes_the_next_expert(tmp_path):
    """A miss loads the new expert into the net of the expert it evicts (every expert has the
    same shapes, so ncnn refills the same weight buffers instead of the heap taking new ones and
    fragmenting; docs/moe.md, section 7): over hundreds of evictions the outputs equal
    those of fresh nets, and the store never holds more nets than its budget's experts."""
    layers, E, H, I = [0, 1], 24, 512, 384
    spec = write_random_package(tmp_path, layers, E, H, I, "q8", 2)
    x = np.random.default_rng(4).standard_normal((1, H)).astype(np.float32)
    full = moe.ExpertStore(tmp_path, spec)
    want = {(layer, e): full.run(layer, e, x) for layer in layers for e in range(E)}
    full.close()
    store = moe.ExpertStore(tmp_path, spec, cache_mb=2.5 * spec["expert_bytes"] * len(layers) / (1 << 20))
    nets = set()
    for i in range(400):
        layer, e = layers[i % 2], (7 * i + i // 2) % E
        evicted = None if store.cached(layer, e) else next(iter(store._nets[layer].values()), None)
        full_layer = len(store._nets[layer]) * store.cost + store.cost > store.share
        assert np.array_equal(store.run(layer, e, x), want[(layer, e)]), (i, layer, e)
        if evicted is not None and full_layer:
            assert store._nets[layer][e] is evicted     # the least recently used expert's net, reloaded
        nets |= {id(n) for per in store._nets.values() for n in per.values()}
    s = store.stats()
    assert s["evictions"] > 300 and s["peak_resident_bytes"] <= s["budget_bytes"]
    assert len(nets) <= 2 * len(layers), "evictions must reuse nets, not make new ones"
    store.close()
