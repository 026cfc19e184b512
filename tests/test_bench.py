"""The benchmark harness on a tiny model: JSON keys, table, plot (speed itself lives in benchmarks/)."""

import json
import subprocess
import sys

import edgevl
from helpers import make_youtu


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
    assert set(res["variants"]) == {"edgevl fp32 absorbed-kv", "edgevl q8 expanded-kv", "torch bf16"}
    for name, v in res["results"].items():
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


def test_bench_images_json_and_table(tmp_path):
    """--images times image encoding per size; the token counts are the model's own."""
    from edgevl.models.youtu_vl import ARCH

    ck = ARCH.make_tiny(tmp_path / "vl", "custom_full", seed=3)
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
    assert "same precision" not in markdown_table({"edgevl q8": row("q8", 300.0, 90.0)})
