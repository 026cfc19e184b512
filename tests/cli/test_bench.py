"""The benchmark harness on a tiny model: JSON keys, table, plot, usage errors, a reference that
cannot run (speed itself lives in benchmarks/)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import edgevl
from edgevl.demo import DEMO_CHECKPOINT
from edgevl.errors import EdgevlError
from support.cli import cli, one_line_error
from support.youtu import make_youtu


def test_bench_json_table_and_plot(tmp_path):
    ck = make_youtu(tmp_path / "ck", seed=2)
    edgevl.convert(ck, tmp_path / "pk", dtype="fp32", kv_cache="absorbed", progress=False)
    edgevl.convert(ck, tmp_path / "pk-q8", dtype="q8", progress=False)
    r = subprocess.run([sys.executable, "-m", "edgevl", "bench", tmp_path / "pk", "--extra-model", tmp_path / "pk-q8",
                        "--compare", "torch", "--prompt-tokens", "16", "--gen-tokens", "4", "--threads", "1",
                        "--repeats", "2", "--json", tmp_path / "r.json", "--plot", tmp_path / "r.png",
                        "--markdown", tmp_path / "r.md"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "r.json").read_text())
    assert set(res["results"]) == {"edgevl", "torch"}
    assert set(res["variants"]) == {"edgevl fp32 absorbed-kv", "edgevl q8 expanded-kv", "torch fp32"}
    for _name, v in res["results"].items():
        for k in ("prefill_tok_s", "decode_tok_s", "ttft_s", "peak_rss_bytes", "kv_bytes_per_token"):
            assert k in v
        assert v["decode_tok_s"] > 0 and v["peak_rss_bytes"] > 10 << 20
    assert len(res["runs"]["edgevl fp32 absorbed-kv"]) == 2
    # absorbed MLA cache: (latent + rope) keys + latent values, fp32, per layer
    assert res["results"]["edgevl"]["kv_bytes_per_token"] == 2 * (32 + 16 + 32) * 4
    assert (tmp_path / "r.png").stat().st_size > 1000
    md = (tmp_path / "r.md").read_text()
    assert "| edgevl q8 expanded-kv |" in md and "peak RSS GiB" in md
    for name, runs in res["runs"].items():  # the spread is the runs' min and max
        lo, hi = res["variants"][name]["spread"]["decode_tok_s"]
        assert lo == min(x["decode_tok_s"] for x in runs) and hi == max(x["decode_tok_s"] for x in runs)


def test_bench_bad_model_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgevl", "bench", tmp_path / "none"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,needle", [
    (("--repeats", "0"), "--repeats must be >= 1, got 0"),          # was: IndexError
    (("--repeats", "-1"), "--repeats must be >= 1, got -1"),
    (("--gen-tokens", "-1"), "--gen-tokens must be >= 1, got -1"),  # was: a negative speed
    (("--gen-tokens", "0"), "--gen-tokens must be >= 1, got 0"),
    (("--prompt-tokens", "-5"), "--prompt-tokens must be >= 1, got -5"),  # was: a numpy error
    (("--prompt-tokens", "x"), "--prompt-tokens must be an integer, got 'x'"),
    (("--threads", "0"), "--threads must be between 1 and"),
])
def test_bench_counts_below_one_are_usage_errors_before_any_work(tmp_path, capsys, monkeypatch, args, needle):
    monkeypatch.setenv("EDGEVL_CACHE", str(tmp_path / "cache"))   # the demo is not even converted
    one_line_error(*cli(capsys, "bench", *args)[::2], needle)
    assert not (tmp_path / "cache").exists()


def test_bench_api_refuses_zero_runs():
    from edgevl.bench import bench, bench_images

    with pytest.raises(EdgevlError, match="--repeats must be an integer >= 1, got 0"):
        bench({}, 16, 4, 1, 0)
    with pytest.raises(EdgevlError, match="--gen-tokens must be an integer >= 1, got -1"):
        bench({}, 16, -1, 1, 2)
    with pytest.raises(EdgevlError, match="--repeats must be an integer >= 1"):
        bench_images({}, [(64, 64)], 1, 0)


def test_bench_images_json_and_table(tmp_path):
    """--images times image encoding per size; the token counts are the model's own."""
    from edgevl.verification.families.youtu_vl import VERIFY

    ck = VERIFY.make_tiny(tmp_path / "vl", "custom_full", seed=3)
    edgevl.convert(ck, tmp_path / "pk", dtype="fp32", progress=False)
    r = subprocess.run([sys.executable, "-m", "edgevl", "bench", tmp_path / "pk", "--images", "96x64,40x200",
                        "--threads", "1", "--repeats", "2", "--json", tmp_path / "r.json", "--markdown",
                        tmp_path / "r.md"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "r.json").read_text())
    (name, v), = res["results"].items()
    model = edgevl.load(tmp_path / "pk")
    for size, (w, h) in (("96x64", (96, 64)), ("40x200", (40, 200))):
        cell = v["images"][size]
        assert cell["tokens"] == model.vision.image_tokens(h, w)
        lo, hi = cell["spread"]["encode_s"]
        assert 0 < lo <= cell["encode_s"] <= hi
    assert len(res["runs"][name]) == 2
    assert "| 96x64 s (CPU-s) |" in (tmp_path / "r.md").read_text()
    bad = subprocess.run([sys.executable, "-m", "edgevl", "bench", tmp_path / "pk", "--images", "640by480"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --images takes sizes like")
    bad = subprocess.run([sys.executable, "-m", "edgevl", "bench", tmp_path / "pk", "--images", "96x64", "--plot",
                          tmp_path / "r.png"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --plot draws the text runs"), bad.stderr


def test_bench_speculative_and_long_labels(tmp_path, capsys):
    """A load option that is a word (--speculative none) names its row like a number does, and
    the plot keeps long row names whole."""
    from PIL import Image

    from edgevl.bench import plot

    code, out, err = cli(capsys, "bench", "--speculative", "none", "--prompt-tokens", "8", "--gen-tokens", "2",
                         "--repeats", "1", "--threads", "1", "--json", tmp_path / "r.json")
    assert code == 0, err
    (name,) = json.loads((tmp_path / "r.json").read_text())["variants"]
    assert name.endswith(" speculative none"), name
    long = "edgevl q8 auto experts auto dense keep mtp expert-cache-mb 0.1"
    plot({long: {"prefill_tok_s": 10.0, "decode_tok_s": 5.0}, "short": {"prefill_tok_s": 1.0, "decode_tok_s": 1.0}},
         tmp_path / "p.png")
    im = Image.open(tmp_path / "p.png").convert("L")
    # the bars start right of the longest name: the row's pixels left of its bar hold only its name
    from PIL import ImageDraw
    width = int(ImageDraw.Draw(im).textlength(long))
    assert im.width > width + 16 + 700


def test_table_states_the_ratio_to_llamacpp_at_the_same_precision():
    """Each edgevl variant against the llama.cpp run of its precision (q8 against q8_0), from the
    medians; none for a precision llama.cpp did not run, and no section without llama.cpp."""
    from edgevl.bench import markdown_table

    def row(dtype, prefill, decode):
        r = {"prefill_tok_s": prefill, "decode_tok_s": decode, "ttft_s": 0.1, "load_s": 1.0,
             "peak_rss_bytes": 1 << 30, "kv_bytes_per_token": None}
        return dict(r, dtype=dtype) if dtype else r

    res = {"edgevl q8": row("q8", 300.0, 90.0), "edgevl bf16": row("bf16", 200.0, 60.0),
           "edgevl fp32": row("fp32", 100.0, 30.0), "llama.cpp q8_0": row(None, 200.0, 75.0),
           "llama.cpp bf16": row(None, 250.0, 64.0)}
    md = markdown_table(res)
    assert "- edgevl q8 / llama.cpp q8_0: decode 1.20×, prefill 1.50×" in md
    assert "- edgevl bf16 / llama.cpp bf16: decode 0.94×, prefill 0.80×" in md
    assert "edgevl fp32 /" not in md
    # an MoE package names its counterpart; plain bf16 is not it
    res = {"edgevl bf16 auto experts": dict(row("bf16", 100.0, 50.0), llamacpp_type="bf16+q8_0-experts"),
           "llama.cpp bf16": row(None, 250.0, 64.0), "llama.cpp bf16+q8_0-experts": row(None, 200.0, 40.0)}
    assert ("- edgevl bf16 auto experts / llama.cpp bf16+q8_0-experts: decode 1.25×, prefill 0.50×"
            in markdown_table(res))
    assert "/ llama.cpp bf16:" not in markdown_table(res)
    assert "same precision" not in markdown_table({"edgevl q8": row("q8", 300.0, 90.0)})


def test_moe_packages_pair_with_llamacpp_at_their_mixed_precision(tmp_path):
    """An MoE package's routed experts are stored apart from its dense path (q8 experts in a bf16
    package by default): llama.cpp's counterpart is a GGUF mixed the same way, not plain bf16."""
    from edgevl.bench import llamacpp_types
    from edgevl.models.qwen3_5_moe import ARCH
    from edgevl.models.youtu import ARCH as YOUTU
    from edgevl.verification.families.qwen3_5_moe import VERIFY

    ck = VERIFY.make_tiny(tmp_path / "ck", "e8k2-tied", seed=1, text_only=True)
    edgevl.convert(ck, tmp_path / "pk", dtype="bf16", progress=False)                 # experts q8 by default
    edgevl.convert(ck, tmp_path / "pk-q8", dtype="q8", dense="q8", progress=False)
    assert llamacpp_types([tmp_path / "pk", tmp_path / "pk-q8", tmp_path / "pk"]) == ["bf16+q8_0-experts", "q8_0"]

    def moe(dtype, experts, dense="auto"):
        return ARCH.bench.type_of({"dtype": dtype, "experts": {"dtype": experts}, "options": {"dense": dense}})

    assert moe("bf16", "bf16") == "bf16" and moe("fp32", "fp32") == "f32"
    assert moe("fp16", "q8") == "f16+q8_0-experts"
    assert moe("q8", "q8", dense="q8") == "q8_0"
    assert moe("q8", "q8") == "bf16+q8_0-experts-head"            # dense path bf16, head int8
    assert moe("q8", "bf16") == "bf16+q8_0-head"
    assert moe("q8", "fp16", dense="q8") == "q8_0+f16-experts"
    assert ARCH.bench.type_of({"dtype": "bf16"}) == "bf16"                   # no experts section
    assert YOUTU.bench.type_of({"dtype": "q8"}) == "q8_0" and YOUTU.bench.type_of({"dtype": "fp16"}) == "f16"


def test_mixed_gguf_types_force_llamacpp_tensor_names():
    """``BASE+TYPE-PART``: the converter's per-tensor override picks weights by their GGUF names."""
    from edgevl.bench import GGUF_HEAD, forced_quant, parse_gguf_type
    from edgevl.models.qwen3_5_moe import ARCH

    parts = {**GGUF_HEAD, **ARCH.bench.parts}     # an MoE architecture's parts, and the head
    assert parse_gguf_type("q8_0", parts) == ("q8_0", {})
    base, forced = parse_gguf_type("bf16+q8_0-experts-head", parts)
    types = {"Q8_0": "Q8_0 type", "F16": "F16 type"}
    force = forced_quant(forced, lambda self, name, new, bid, n: False, types)
    assert base == "bf16"
    for name, n, want in (("blk.3.ffn_gate_exps.weight", 3, "Q8_0 type"),
                          ("blk.0.ffn_down_exps.weight", 3, "Q8_0 type"),
                          ("blk.1.ffn_gate_up_exps.weight", 3, "Q8_0 type"), ("output.weight", 2, "Q8_0 type"),
                          ("token_embd.weight", 2, "Q8_0 type"), ("blk.3.ffn_gate_shexp.weight", 2, False),
                          ("blk.3.ffn_gate_inp.weight", 2, False), ("blk.3.attn_q.weight", 2, False),
                          ("blk.3.ffn_exps_norm.weight", 1, False)):
        assert force(None, "hf.name", name, 3, n) == want, name
    _, forced = parse_gguf_type("bf16+q8_0-experts", parts)
    assert forced_quant(forced, lambda *a: False, types)(None, "x", "output.weight", None, 2) is False
    for bad in ("bf16+q4-experts", "bf16+q8_0-mlp", "bf16+q8_0", "q9"):
        with pytest.raises(EdgevlError, match="GGUF type"):
            parse_gguf_type(bad, parts)


def test_bench_reference_failure_says_what_could_not_run(tmp_path):
    from edgevl.bench import _run_worker

    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_bytes((DEMO_CHECKPOINT / "config.json").read_bytes())  # no weights
    with pytest.raises(EdgevlError) as e:
        _run_worker("torch", {"reference": str(ref), "vocab": 700, "prompt_tokens": 8, "gen_tokens": 2,
                              "threads": 1})
    msg = str(e.value)
    assert f"the PyTorch reference ({ref}) could not run: EdgevlError: " in msg and "safetensors" in msg, msg
    log = re.search(r"its full output: (\S+)\)", msg).group(1)
    assert "Traceback" in Path(log).read_text()
    os.unlink(log)


def test_llamacpp_converter_is_told_when_a_qwen_checkpoint_has_no_mtp_block():
    """llama.cpp's converter stops on a Qwen3.5 checkpoint without an MTP block unless told."""
    from edgevl import models

    for name in ("qwen3_5", "qwen3_5_moe"):
        of = models.get(name).bench.convert_args_of
        assert of({"text_config": {"num_hidden_layers": 2}}) == ("--no-mtp",)
        assert of({"text_config": {"mtp_num_hidden_layers": 1}}) == ()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_torch_row_is_named_after_the_precision_it_ran_at(tmp_path, capsys, monkeypatch, dtype):
    """The reference runs at the package's precision where torch has it (an fp32 package: fp32, the
    others bf16), and the row's name is what its worker reports its weights were in."""
    from edgevl import bench

    ck = make_youtu(tmp_path / "ck", seed=2)
    edgevl.convert(ck, tmp_path / "pk", dtype=dtype, progress=False)
    # the workers in this process (the measurement itself is not under test)
    monkeypatch.setattr(bench, "_run_worker", lambda kind, args: bench.WORKERS[kind](args))
    code, out, err = cli(capsys, "bench", tmp_path / "pk", "--compare", "torch", "--repeats", "1", "--prompt-tokens",
                         "8", "--gen-tokens", "2", "--threads", "1", "--json", tmp_path / "r.json")
    assert code == 0, err
    variants = json.loads((tmp_path / "r.json").read_text())["variants"]
    torch_rows = [name for name in variants if name.startswith("torch")]
    assert torch_rows == [f"torch {dtype}"] and variants[f"torch {dtype}"]["dtype"] == dtype
    assert f"| torch {dtype} |" in out


def test_a_reference_that_kept_some_weights_in_fp32_says_so(tmp_path, capsys, monkeypatch):
    from edgevl import bench

    ck = make_youtu(tmp_path / "ck", seed=2)
    edgevl.convert(ck, tmp_path / "pk", dtype="bf16", progress=False)

    def run(kind, args):
        r = bench.WORKERS[kind](args)
        return dict(r, dtype="bf16+fp32") if kind == "torch" else r   # as a model keeping its router in fp32

    monkeypatch.setattr(bench, "_run_worker", run)
    code, out, err = cli(capsys, "bench", tmp_path / "pk", "--compare", "torch", "--repeats", "1", "--prompt-tokens",
                         "8", "--gen-tokens", "2", "--threads", "1", "--json", tmp_path / "r.json")
    assert code == 0, err
    res = json.loads((tmp_path / "r.json").read_text())
    assert list(res["variants"]) == ["edgevl bf16 expanded-kv", "torch bf16+fp32"] == list(res["runs"])
    assert "| torch bf16+fp32 |" in out and "torch bf16 |" not in out


def test_a_torch_reference_of_another_model_is_refused(tmp_path, capsys):
    """`--compare torch --reference DIR` times DIR as the package's reference: another family's
    checkpoint is refused in one line instead of filling the table."""
    from edgevl.verification.families.qwen3_5 import VERIFY as QWEN

    ck = make_youtu(tmp_path / "ck", seed=2)
    edgevl.convert(ck, tmp_path / "pk", dtype="fp32", progress=False)
    other = QWEN.make_tiny(tmp_path / "qwen", seed=0, text_only=True)
    one_line_error(*cli(capsys, "bench", tmp_path / "pk", "--compare", "torch", "--reference", other, "--repeats",
                        "1")[::2], "is a qwen3_5 checkpoint but the package is youtu")
