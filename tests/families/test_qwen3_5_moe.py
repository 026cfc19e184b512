"""Qwen3.5-MoE packages (edgevl.convert + edgevl.load) vs transformers' Qwen3_5MoeForConditionalGeneration
(fp32, random tiny configs with different expert counts, top-k and shared-expert widths): greedy
tokens through the public API (text shorter and longer than a delta-rule chunk, and an image),
the same tokens with an expert cache far smaller than the experts (hit rate reported by the API,
`run --verbose` and `bench`), both checkpoint layouts of the experts, preloading, and bad input
(a package with q8 experts: tests/precision/test_qwen3_5_moe.py)."""

import json
import subprocess
import sys

import pytest
import torch

import edgevl
from edgevl.blocks import gated_delta as gd
from edgevl.errors import EdgevlError
from edgevl.generate import prepare
from edgevl.verification.families.qwen3_5_moe import VERIFY as ARCH
from support.common import CORPUS, first_diff, smooth_image
from support.qwen import hf_greedy, hf_inputs, hf_processor

CONFIGS = list(ARCH.tiny_variants)
N_NEW = 48
LONG = " ".join(CORPUS[:9])   # over two chunks (ours 32 tokens, transformers' 64)


PROMPTS = {
    "short": ([{"role": "user", "content": "Describe it."}], []),
    "long": ([{"role": "user", "content": LONG}], []),
    "image": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
              [smooth_image(90, 150, 1)]),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-moe")
    out = {}
    for i, name in enumerate(CONFIGS):
        ck = ARCH.make_tiny(root / name, name, seed=50 + i)
        out[name] = (ck, edgevl.convert(ck, root / f"{name}-fp32", dtype="fp32", progress=False))
    return out


_loaded = {}


def _load(models, name):
    if name not in _loaded:
        from transformers import Qwen3_5MoeForConditionalGeneration

        ck, pk = models[name]
        ref = Qwen3_5MoeForConditionalGeneration.from_pretrained(ck, dtype=torch.float32).eval()
        _loaded[name] = (edgevl.load(pk), ref, hf_processor(ck))
    return _loaded[name]


@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("name", CONFIGS)
def test_fp32_greedy_token_exact(models, name, prompt):
    model, ref, proc = _load(models, name)
    cfg = ref.config.text_config
    assert cfg.num_experts >= 8 and cfg.num_experts_per_tok >= 2 and cfg.shared_expert_intermediate_size > 0
    msgs, images = PROMPTS[prompt]
    ids, enc = hf_inputs(proc, msgs, images)
    assert (len(ids) < gd.CHUNK) if prompt == "short" else (len(ids) > 2 * 64) if prompt == "long" else True
    ours = list(model.generate_tokens(ids, N_NEW, image=images, ignore_eos=True, reuse_cache=False))
    theirs = hf_greedy(ref, enc, N_NEW)
    first = first_diff(ours, theirs)
    assert len(ours) == N_NEW and first is None, \
        f"{name}/{prompt}: first differing token at {first}: ours {ours[first]} vs {theirs[first]}"


def test_text_only_checkpoint(tmp_path):
    """Qwen3_5MoeForCausalLM (model_type qwen3_5_moe_text: the decoder at the root, no vision)."""
    ck = ARCH.make_tiny(tmp_path / "ck", CONFIGS[1], seed=3, text_only=True)
    assert json.loads((ck / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    model = edgevl.load(edgevl.convert(ck, tmp_path / "pk", dtype="fp32", progress=False))
    assert model.vision is None
    ids = prepare(model, LONG).input_ids
    ours = list(model.generate_tokens(ids, 24, ignore_eos=True))
    assert ours == ARCH.reference(ck).greedy(ids, 24)


def test_small_expert_cache_gives_identical_tokens(models):
    """One expert resident, and a quarter of the experts: the tokens of the all-resident run, the
    memory within the budget, and a hit rate below the all-resident run's."""
    _, pk = models[CONFIGS[0]]
    ids = prepare(edgevl.load(pk), LONG).input_ids
    full = edgevl.load(pk)
    want = list(full.generate_tokens(ids, N_NEW, ignore_eos=True))
    s_full = full.runtime_stats()["experts"]
    assert s_full["evictions"] == 0 and s_full["budget_bytes"] is None and "no limit" in s_full["summary"]
    spec = full.manifest["experts"]
    total = s_full["expert_cost_bytes"] * spec["num_experts"] * len(spec["layers"])
    for budget in (1.5 * s_full["expert_cost_bytes"], total / 4):
        small = edgevl.load(pk, expert_cache_mb=budget / 2 ** 20)
        assert list(small.generate_tokens(ids, N_NEW, ignore_eos=True)) == want, f"{budget} B cache changed tokens"
        s = small.runtime_stats()["experts"]
        assert s["evictions"] > 0 and s["hit_rate"] < s_full["hit_rate"] < 1
        assert s["peak_resident_bytes"] <= s["budget_bytes"] == int(budget)
        assert f"{100 * s['hit_rate']:.1f} % hit rate" in s["summary"]
    assert 0 < s["hit_rate"]          # a quarter of the experts still catches some repeats


def test_cli_reports_the_hit_rate(models, tmp_path):
    _, pk = models[CONFIGS[0]]
    run = [sys.executable, "-m", "edgevl", "run", str(pk), "--prompt", "How many shapes?", "--max-new-tokens", "4",
           "--threads", "1"]
    r = subprocess.run(run + ["--verbose", "--expert-cache-mb", "0.05"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "% hit rate" in r.stderr and "(0.05 MB budget" in r.stderr   # not "0 MB"
    r = subprocess.run(run + ["--expert-cache-mb", "-1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["error: expert_cache_mb must be >= 0, got -1"]
    r = subprocess.run([sys.executable, "-m", "edgevl", "bench", str(pk), "--prompt-tokens", "8", "--gen-tokens", "2",
                        "--threads", "1", "--repeats", "1", "--expert-cache-mb", "0.05",
                        "--json", str(tmp_path / "b.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "b.json").read_text())["results"]["edgevl"]
    ex = res["runtime"]["experts"]
    assert res["load_options"] == {"expert_cache_mb": 0.05} and ex["budget_bytes"] == int(0.05 * 2 ** 20)
    assert ex["misses"] > 0 and 0 <= ex["hit_rate"] < 1


def test_experts_that_do_not_fit_get_a_cache_by_default(models, monkeypatch, capsys):
    """With no --expert-cache-mb, experts that fit in 80 % of the available memory all stay
    resident; those that do not get a cache of that size (said on stderr) instead of loading
    until the system runs out; an explicit size, or an unknown amount of memory, is left alone."""
    from edgevl.blocks import moe

    _, pk = models[CONFIGS[0]]
    ids = edgevl.load(pk).tokenizer.encode("Describe it in a few words.", special=False)
    manifest = json.loads((pk / "manifest.json").read_text())
    spec, graphs = manifest["experts"], manifest["graphs"]
    total = spec["expert_bytes"] * spec["num_experts"] * len(spec["layers"])
    pending = sum((pk / f"{g}.bin").stat().st_size for g in graphs if g != "decoder")   # loaded after the experts open
    assert {"lm_head", "vision"} <= set(graphs)

    def store_of(model):
        return model.package.resources["experts"]

    monkeypatch.setattr(moe, "available_memory", lambda: int((10 * total + pending) / moe.AUTO_SHARE))
    roomy = edgevl.load(pk)
    assert store_of(roomy).budget is None and "note:" not in capsys.readouterr().err
    want = list(roomy.generate_tokens(ids, 8, ignore_eos=True))

    avail = int((total / 3 + pending) / moe.AUTO_SHARE)      # room for a third of the experts
    monkeypatch.setattr(moe, "available_memory", lambda: avail)
    tight = edgevl.load(pk)
    budget = store_of(tight).budget
    assert budget == int((moe.AUTO_SHARE * avail - pending) / 2 ** 20 * 2 ** 20)
    assert 0.3 * total < budget < 0.4 * total
    err = capsys.readouterr().err
    assert "do not fit in the memory available" in err and "--expert-cache-mb" in err
    assert list(tight.generate_tokens(ids, 8, ignore_eos=True)) == want
    assert store_of(tight).stats()["evictions"] > 0

    assert store_of(edgevl.load(pk, expert_cache_mb=1000)).budget == 1000 * 2 ** 20
    monkeypatch.setattr(moe, "available_memory", lambda: None)
    assert store_of(edgevl.load(pk)).budget is None


def test_runtime_option_errors(models):
    _, pk = models[CONFIGS[0]]
    with pytest.raises(EdgevlError, match="expert_cache_mb must be >= 0"):
        edgevl.load(pk, expert_cache_mb=-2)
    with pytest.raises(EdgevlError, match="must be a number"):
        edgevl.load(pk, expert_cache_mb="lots")
    with pytest.raises(EdgevlError,
                       match="no option 'expert_cache'.*they have: prefill_chunk, image_cache_mb, expert_cache_mb"):
        edgevl.load(pk, expert_cache=3)
    from edgevl.demo import demo_package

    with pytest.raises(EdgevlError, match=r"youtu_vl models have no option 'expert_cache_mb' \(--expert-cache-mb\)"):
        edgevl.load(demo_package(), expert_cache_mb=64)   # a dense model


def _rewrite(src, dst, fn):
    """Copy checkpoint ``src`` to ``dst`` with its tensors passed through ``fn(dict) -> dict``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    files = sorted(dst.glob("*.safetensors"))
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
        f.unlink()
    save_file(fn(tensors), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_fused_expert_tensors_convert_to_the_same_package(models, tmp_path):
    """A checkpoint holding transformers' in-memory layout (gate_up_proj [E, 2I, H], down_proj
    [E, H, I]) gives byte-identical experts and decoder to the per-expert layout on disk."""
    ck, pk = models[CONFIGS[0]]
    cfg = json.loads((ck / "config.json").read_text())["text_config"]
    E = cfg["num_experts"]

    def fuse(t):
        out = {k: v for k, v in t.items() if ".mlp.experts." not in k}
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.language_model.layers.{i}.mlp.experts"
            out[f"{p}.gate_up_proj"] = torch.stack([torch.cat([t[f"{p}.{e}.gate_proj.weight"],
                                                               t[f"{p}.{e}.up_proj.weight"]])
                                                    for e in range(E)])
            out[f"{p}.down_proj"] = torch.stack([t[f"{p}.{e}.down_proj.weight"] for e in range(E)])
        return out

    fused = _rewrite(ck, tmp_path / "fused", fuse)
    pk2 = edgevl.convert(fused, tmp_path / "pk", dtype="fp32", progress=False)
    for f in ("experts.bin", "experts.param", "decoder.bin", "decoder.param"):
        assert (pk2 / f).read_bytes() == (pk / f).read_bytes(), f


def test_missing_experts_is_a_one_line_error(models, tmp_path):
    ck, _ = models[CONFIGS[0]]
    gone = "model.language_model.layers.1.mlp.experts.3.up_proj.weight"
    bad = _rewrite(ck, tmp_path / "bad", lambda t: {k: v for k, v in t.items() if k != gone})
    with pytest.raises(EdgevlError) as e:
        edgevl.convert(bad, tmp_path / "out", dtype="bf16", progress=False)
    assert gone in str(e.value) and "missing" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
    r = subprocess.run([sys.executable, "-m", "edgevl", "convert", str(bad), str(tmp_path / "out2"), "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1


def test_preload_loads_every_expert_once_and_serve_starts_preloaded(models):
    """model.preload() (what serve and bench call) loads every routed expert when they are all
    kept resident, counts no hits doing it twice, and leaves a budgeted cache to the requests;
    the tokens do not change."""
    from edgevl.server import make_server

    ck, pk = models[CONFIGS[0]]
    spec = json.loads((pk / "manifest.json").read_text())["experts"]
    total = len(spec["layers"]) * spec["num_experts"]
    lazy = edgevl.load(pk)
    assert lazy.runtime_stats()["experts"]["misses"] == 0           # loading loads no expert
    ids = lazy.tokenizer.encode("Describe it.", special=False)
    want = list(lazy.generate_tokens(ids, 8, ignore_eos=True, reuse_cache=False))
    m = edgevl.load(pk).preload()
    assert m.runtime_stats()["experts"]["misses"] == total and m.runtime_stats()["experts"]["hits"] == 0
    m.preload()
    assert m.runtime_stats()["experts"]["hits"] == 0
    assert list(m.generate_tokens(ids, 8, ignore_eos=True, reuse_cache=False)) == want
    assert m.runtime_stats()["experts"]["misses"] == total          # nothing left to load
    budget = edgevl.load(pk, expert_cache_mb=0.05).preload()
    assert budget.runtime_stats()["experts"]["misses"] == 0
    server, _ = make_server(pk)
    try:
        assert server.model.runtime_stats()["experts"]["misses"] == total
    finally:
        server.stop()
