"""The scripts in benchmarks/ on tiny models: run.sh's usage line, package_sizes.py's byte rule
against real conversions, profile_graph.py and moe_memory.py on a Qwen3.5-MoE package."""

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import edgevl
from edgevl import verification
from edgevl.verification.families.qwen3_5_moe import VERIFY as ARCH
from support.common import ROOT
from support.youtu import make_youtu

CONFIGS = list(ARCH.tiny_variants)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The first tiny Qwen3.5-MoE variant, as tests/families/test_qwen3_5_moe.py builds it:
    name -> (checkpoint, fp32 package)."""
    root = tmp_path_factory.mktemp("qwen-moe")
    name = CONFIGS[0]
    ck = ARCH.make_tiny(root / name, name, seed=50)
    return {name: (ck, edgevl.convert(ck, root / f"{name}-fp32", dtype="fp32", progress=False))}


def test_benchmark_script_usage_matches_the_script():
    text = (ROOT / "benchmarks" / "run.sh").read_text()
    usage = next(line for line in text.splitlines() if "benchmarks/run.sh" in line)
    for var in re.findall(r"\$\{(\w+):-", text):
        if var != "WORK":
            assert var in text.split("set -euo")[0], f"the usage comment does not mention {var}"
    assert "[THREADS" not in usage  # threads come from the THREADS variable, not arguments


@pytest.mark.parametrize("arch", ["youtu_vl", "youtu", "youtu_untied"])
def test_readme_package_sizes_follow_what_convert_writes(tmp_path, arch):
    """benchmarks/package_sizes.py computes the README's disk sizes from shapes; its byte rule must
    match real conversions (every dtype, tied and untied heads) to within ncnn's weight type tags."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from package_sizes import package_bytes

    from edgevl.weights import Checkpoint

    if arch == "youtu_vl":
        ck = verification.get("youtu_vl").make_tiny(tmp_path / "ck")
    else:
        ck = make_youtu(tmp_path / "ck", tie_word_embeddings=arch == "youtu")
    c = Checkpoint(ck)
    shapes = {k: tuple(c.get(k).shape) for k in c.keys()}
    tied = json.loads((ck / "config.json").read_text()).get("tie_word_embeddings", True)
    for dtype in ("fp32", "fp16", "bf16", "q8"):
        pk = edgevl.convert(ck, tmp_path / dtype, dtype=dtype, progress=False)
        files = json.loads((pk / "manifest.json").read_text())["files"]
        got = sum(f["bytes"] for name, f in files.items() if name.endswith(".bin"))
        want = package_bytes(shapes, tied, dtype)
        assert 0 <= got - want <= 2048, (dtype, got, want)  # ncnn's per-weight type tags


def test_profile_graph_times_a_decoder_with_host_passes(models, capsys):
    """benchmarks/profile_graph.py on a decoder with host passes (delta rule, experts) — it
    crashed inside ncnn before: its timing extractor runs the same step to the same logits, times
    every computing layer once, and the whole decode step runs."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import profile_graph as pg

    pk = models[CONFIGS[0]][1]
    model = edgevl.load(pk)
    ids = model.tokenizer.encode("Describe it in a few words.", special=False)
    net, plain = model.decoder.net, model.decoder.net.extractor
    graph = pg.Graph(str(pk / "decoder.param"))

    def step(timer):
        tok = int(np.argmax(model.prefill(ids, reuse_cache=False)))
        if timer is not None:
            net.extractor = lambda: pg.TimedExtractor(plain(), graph, timer)
        try:
            return model.step(tok)
        finally:
            net.extractor = plain

    timer = pg.Timer()
    assert np.array_equal(step(None), step(timer))
    computing = [name for typ, name, _, _ in graph.layers if typ not in ("Input", "Split")]
    timed = set(timer.per_layer)
    assert timed and timed <= set(computing)
    assert {p["hook"] for p in model.decoder.passes} >= {"moe", "gated_delta"}
    assert pg.main([str(pk), "decoder", "--tokens", "5", "--step"]) == 0
    out = capsys.readouterr().out
    assert "| Gemm |" in out and "outside them" in out


def test_moe_memory_benchmark_reports_the_bound(models, tmp_path, capsys):
    """benchmarks/moe_memory.py: one fresh process per cache size, the same tokens in each, peak
    RSS beside the bound 1.15 x (cache + the non-expert .bin files)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import moe_memory

    pk = models[CONFIGS[0]][1]
    out = tmp_path / "m.json"
    assert moe_memory.main([str(pk), "--cache-mb", "0.05", "--cache-mb", "-1", "--prompt-tokens", "12",
                            "--gen-tokens", "4", "--threads", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    small, full = res["runs"]
    dense = sum(f.stat().st_size for f in Path(pk).glob("*.bin") if f.name != "experts.bin")
    assert small["non_expert_bytes"] == dense and small["expert_bytes"] == (Path(pk) / "experts.bin").stat().st_size
    assert small["bound"] == pytest.approx(1.15 * (0.05 * 2 ** 20 + dense)) and full["bound"] is None
    assert res["tokens_identical"] and len(small["tokens"]) == 4
    assert small["peak"] >= small["loaded_rss"] > 0 and 0 <= small["hit_rate"] < full["hit_rate"]
    assert "| 0.05 |" in capsys.readouterr().out
