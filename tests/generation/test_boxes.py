"""What a new user trips on (issue 14): boxes at any image size, the checkpoint's generation
defaults, the demo package and the cache, help and version, verify's progress, small errors."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import edgevl
from edgevl import verification
from edgevl import cli
from edgevl.boxes import Box
from edgevl.demo import DEMO_CHECKPOINT, demo_package
from edgevl.demo import scenes as S
from edgevl.errors import EdgevlError
from edgevl.model import Model
from edgevl.models.youtu_vl.processing import target_size
from helpers import make_youtu

ROOT = Path(__file__).parents[1]


# -- 1. boxes in original-image pixels, for every image ---------------------------------------------

@pytest.fixture(scope="module")
def demo():
    return edgevl.load(demo_package())


def force(monkeypatch, model, text):
    """Make the model 'generate' exactly the tokens of ``text`` (then end of text)."""
    ids = model.tokenizer.encode(text) + [min(model.eos_ids)]

    def fake(self, input_ids, max_new_tokens=256, image=None, **kw):
        self.encode_images(image)  # the images are still processed as usual
        yield from ids

    monkeypatch.setattr(Model, "generate_tokens", fake)
    return ids


def scene(w, h, seed=3):
    return S.make_scene(seed).image.resize((w, h), Image.BICUBIC)


def resize_factors(w, h, model):
    """(x, y) original / resized, from the processor's size search (not from generation)."""
    rh, rw = target_size(h, w, model.vision.default_max_patches, 16, 2)
    return w / rw, h / rh


@pytest.mark.parametrize("size", [(640, 640), (100, 300)], ids=["640x640", "100x300"])
def test_boxes_are_the_models_coordinates_times_the_resize_factors(demo, monkeypatch, size):
    w, h = size
    coords = (84, 86, 123, 121) if w == 640 else (10, 20, 60, 180)  # in the resized image the model sees
    force(monkeypatch, demo, "<ref>triangle</ref><box><x_{}><y_{}><x_{}><y_{}></box>".format(*coords))
    done = edgevl.complete(demo, "Where is the triangle?", image=scene(w, h))
    fx, fy = resize_factors(w, h, demo)
    want = [round(coords[0] * fx), round(coords[1] * fy), round(coords[2] * fx), round(coords[3] * fy)]
    assert done.boxes == [Box("triangle", *want, 0)]
    assert all(0 <= x < w for x in want[::2]) and all(0 <= y < h for y in want[1::2])
    assert max(want) > 127  # beyond the demo's largest coordinate token: numbers, not tokens
    assert done.text == "<ref>triangle</ref><box><x_{}><y_{}><x_{}><y_{}></box>".format(*want)
    # the model's own coordinates stay available
    raw = edgevl.generate(demo, "Where is the triangle?", image=scene(w, h), postprocess=False)
    assert raw == "<ref>triangle</ref><box><x_{}><y_{}><x_{}><y_{}></box>".format(*coords)


def test_coordinates_past_the_resized_image_clamp_to_the_original():
    from edgevl.models.youtu_vl.runtime import GroundingProcessor

    p = GroundingProcessor([{"image_size": (300, 100), "resized_size": (192, 64)}])
    assert p.feed("<box><x_0><y_0><x_2047><y_2047></box>") == "<box><x_0><y_0><x_99><y_299></box>"


def test_real_generation_on_an_upscaled_scene_gives_boxes_in_its_pixels(demo):
    """The issue's case, generated for real: a 128x128 demo scene scaled to 640x640."""
    im = scene(640, 640, seed=5)
    raw = edgevl.generate(demo, "Where is the circle?", image=im, max_new_tokens=16, postprocess=False)
    coords = [int(v) for v in re.findall(r"<[xy]_(\d+)>", raw)]
    assert len(coords) == 4, raw
    done = edgevl.complete(demo, "Where is the circle?", image=im, max_new_tokens=16)
    assert len(done.boxes) == 1 and done.boxes[0].xyxy == tuple(min(round(c * 5), 639) for c in coords)


def test_each_box_goes_to_the_image_the_answer_names_else_the_last(demo, monkeypatch):
    big, tall = scene(640, 640), scene(100, 300, seed=4)
    (bx, by), (tx, ty) = resize_factors(640, 640, demo), resize_factors(100, 300, demo)
    force(monkeypatch, demo, "Image 1: <box><x_84><y_86><x_123><y_121></box> image 2: "
                             "<box><x_10><y_20><x_60><y_180></box>")
    done = edgevl.complete(demo, "Where are the shapes?", image=[big, tall])
    assert done.boxes == [Box(None, round(84 * bx), round(86 * by), round(123 * bx), round(121 * by), 0),
                          Box(None, round(10 * tx), round(20 * ty), round(60 * tx), round(180 * ty), 1)]
    force(monkeypatch, demo, "<box><x_10><y_20><x_60><y_180></box>")   # no mention: the last image,
    done = edgevl.complete(demo, "Where is it?", image=[big, tall])    # as the reference's img_input
    assert [b.image for b in done.boxes] == [1] and done.boxes[0].y2 == round(180 * ty)


def test_draw_boxes_and_the_server_use_the_structured_boxes(demo, monkeypatch, tmp_path, capsys):
    force(monkeypatch, demo, "<box><x_84><y_86><x_123><y_121></box>")
    scene(640, 640).save(tmp_path / "big.png")
    code = cli.main(["run", str(demo.path), "--image", str(tmp_path / "big.png"), "--prompt", "Where?",
                     "--draw-boxes", str(tmp_path / "boxes.png")])
    assert code == 0
    out = capsys.readouterr()
    assert out.out.strip() == "<box><x_420><y_430><x_615><y_605></box>" and "1 box(es) drawn" in out.err
    drawn = np.asarray(Image.open(tmp_path / "boxes.png").convert("RGB")).astype(int)
    plain = np.asarray(Image.open(tmp_path / "big.png").convert("RGB")).astype(int)
    changed = np.abs(drawn - plain).sum(-1) > 60
    assert changed[500, 418:423].any() and changed[500, 613:618].any()  # the left and right edges
    assert not changed[200:400, 130:400].any()  # nothing where the old clamped box (<= 127 .. 135) was

    from edgevl.server import make_server
    import base64
    import http.client
    import io

    buf = io.BytesIO()
    scene(640, 640).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    srv, _ = make_server(demo)
    try:
        for stream in (False, True):
            conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
            conn.request("POST", "/v1/chat/completions", json.dumps({"stream": stream, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Where?"}]}]}),
                         {"Content-Type": "application/json"})
            body = conn.getresponse().read().decode()
            if stream:
                chunks = [json.loads(line[6:]) for line in body.split("\n") if line.startswith("data: {")]
                boxes = chunks[-1]["choices"][0]["delta"]["boxes"]
                assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
            else:
                msg = json.loads(body)["choices"][0]["message"]
                boxes = msg["boxes"]
                assert msg["content"] == "<box><x_420><y_430><x_615><y_605></box>"
            assert boxes == [{"label": None, "box": [420, 430, 615, 605], "image": 0}]
    finally:
        srv.stop()


# -- 2. the checkpoint's generation_config.json sets the defaults --------------------------------------

@pytest.fixture(scope="module")
def penalised(tmp_path_factory):
    root = tmp_path_factory.mktemp("gencfg")
    ck = make_youtu(root / "ck", seed=3)
    cfg = json.loads((ck / "generation_config.json").read_text())
    (ck / "generation_config.json").write_text(json.dumps({**cfg, "repetition_penalty": 1.3}))
    return edgevl.convert(ck, root / "pk", dtype="fp32", progress=False)


def test_generation_config_penalty_applies_unless_temperature_0(penalised, capsys):
    m = edgevl.load(penalised)
    prompt = "The quick brown fox"
    ids = m.tokenizer.encode(prompt)
    greedy = list(m.generate_tokens(ids, 24, reuse_cache=False))
    penalised_ids = list(m.generate_tokens(ids, 24, repetition_penalty=1.3, reuse_cache=False))
    assert greedy != penalised_ids  # the penalty changes this model's answer
    text = lambda toks: m.tokenizer.decode([t for t in toks if t not in m.eos_ids])  # noqa: E731

    def run(*flags):
        assert cli.main(["run", str(penalised), "--raw", "--prompt", prompt, "--max-new-tokens", "24",
                         *flags]) == 0
        out = capsys.readouterr()
        return out.out[:-1], out.err

    assert run()[0] == text(penalised_ids)                       # no flags: the checkpoint's penalty
    assert run("--temperature", "0")[0] == text(greedy)          # plain greedy
    assert run("--repetition-penalty", "1")[0] == text(greedy)   # a flag overrides the config
    assert edgevl.generate(m, prompt, raw=True, max_new_tokens=24) == text(penalised_ids)
    assert edgevl.generate(m, prompt, raw=True, max_new_tokens=24, temperature=0) == text(greedy)
    err = run("--verbose")[1]
    assert "greedy: repetition_penalty 1.3 (generation_config.json)" in err, err
    err = run("--verbose", "--temperature", "0.5", "--top-p", "0.9")[1]
    assert "sampling: temperature 0.5 (given), top_k 0 (default), top_p 0.9 (given), " \
           "repetition_penalty 1.3 (generation_config.json)" in err, err


def test_sampling_settings_follow_transformers_reading_of_the_config():
    from edgevl.sample import resolve

    official = {"do_sample": True, "temperature": 0.1, "top_p": 0.001, "repetition_penalty": 1.05}
    s = resolve(official)
    assert (s.temperature, s.top_k, s.top_p, s.repetition_penalty) == (0.1, 50, 0.001, 1.05)  # top_k: HF's 50
    s = resolve({"temperature": 0.7, "top_p": 0.8})        # do_sample absent: greedy, as transformers
    assert s.temperature == 0 and s.repetition_penalty == 1.0
    s = resolve(official, temperature=0)
    assert s.kwargs() == {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}
    assert resolve({}).kwargs() == resolve(None).kwargs() == s.kwargs()
    with pytest.raises(EdgevlError, match="top_p must be in"):
        resolve(official, top_p=0)


def test_demo_generation_config_keeps_the_quickstart_greedy():
    """The README's quickstart answer is greedy output; the demo's config must not change that."""
    from edgevl.sample import resolve

    cfg = json.loads((DEMO_CHECKPOINT / "generation_config.json").read_text())
    assert resolve(cfg).kwargs() == resolve(None).kwargs()


# -- 4. the README gets a new user to a real model, with a set-up that is correct anywhere -------------

def test_readme_setup_is_what_ci_runs_and_names_the_cpu_wheel_index():
    readme = (ROOT / "README.md").read_text()
    setup = re.search(r"## Set up and test\n\n```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith(("#", "set ", "cd "))]
    assert ci[:len(setup)] == setup  # then only checks the README names (the aarch64 check)
    assert all(line.split()[0] in readme for line in ci[len(setup):])
    assert "--index-url https://download.pytorch.org/whl/cpu" in setup[0]
    first_screen = readme[:readme.index("## Set up and test")]
    for words in ("tencent/Youtu-VL-4B-Instruct", "tencent/Youtu-LLM-2B", "hf download", "edgevl convert",
                  "edgevl run"):
        assert words in first_screen, words


# -- 5. the demo package: where it lives, 'demo' everywhere, the cache ---------------------------------

def test_demo_path_is_printed_and_demo_names_it_everywhere(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EDGEVL_CACHE", str(tmp_path / "cache"))
    first = cli.resolve_model(None)
    assert f"[converting the demo model into {first} (once)]" in capsys.readouterr().err
    assert cli.resolve_model("demo") == cli.resolve_model(None) == first
    assert capsys.readouterr().err == ""  # said once, when converting
    (tmp_path / "mine").mkdir()
    assert cli.resolve_model(str(tmp_path / "mine")) == str(tmp_path / "mine")
    for cmd in ("run", "verify", "chat", "serve", "bench"):
        a = cli.build_parser().parse_args([cmd] + (["--prompt", "x"] if cmd == "run" else []))
        assert a.model is None, cmd  # the model is optional everywhere


def test_cache_lists_and_clears_only_its_own_files(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("EDGEVL_CACHE", str(cache))
    pkg = demo_package()
    (cache / "notes.txt").write_text("mine, not edgevl's")
    assert cli.main(["cache"]) == 0
    out = capsys.readouterr().out
    size = sum(p.stat().st_size for p in pkg.iterdir())
    assert str(cache) in out and pkg.name in out and f"{size / 2**20:.1f} MB" in out and "notes.txt" not in out
    assert cli.main(["cache", "clear"]) == 0
    assert "removed" in capsys.readouterr().out
    assert not pkg.exists() and (cache / "notes.txt").is_file()


def test_unwritable_cache_folder_is_named_as_the_cache(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("EDGEVL_CACHE", str(tmp_path / "file" / "cache"))
    with pytest.raises(EdgevlError, match=r"edgevl cache folder .*file/cache.*set EDGEVL_CACHE"):
        demo_package()


def test_bench_and_verify_take_demo(tmp_path, capsys):
    assert cli.main(["verify", "demo", "--max-new-tokens", "4"]) == 0  # --reference: the package's source
    out = capsys.readouterr()
    assert "PASS" in out.out
    lines = out.err.splitlines()
    assert lines[0].startswith("[1/4] loading the package")
    assert "prompt 'Describe the image in one sentence.'" in out.err and "(fp32)" in out.err
    assert "greedy tokens must be identical" in out.err and "[4/4] 4 greedy tokens" in out.err
    assert cli.main(["bench", "--repeats", "1", "--prompt-tokens", "8", "--gen-tokens", "2"]) == 0
    assert "| edgevl fp32 expanded-kv |" in capsys.readouterr().out


# -- 7. help, defaults, version ------------------------------------------------------------------------

def test_every_argument_has_help_with_its_default():
    import argparse

    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in subs.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.dest} has no help line"
            takes_value = action.nargs != 0 and not action.required and (action.option_strings or action.nargs == "?")
            shown = cli._Help("edgevl")._get_help_string(action)
            assert not takes_value or "default" in shown, f"{name} {action.dest}: {shown!r}"
    assert "default: bf16" in " ".join(subs["convert"].format_help().split())
    mip = " ".join(subs["run"].format_help().split())
    assert "the model's own" in mip and "max_image_patches" in mip


def test_version():
    r = subprocess.run([sys.executable, "-m", "edgevl.cli", "--version"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0 and r.stdout.strip() == f"edgevl {edgevl.__version__}"


# -- 8. slow steps say what they do at once ---------------------------------------------------------------

def test_demo_evaluate_prints_its_first_line_before_loading(capsys, monkeypatch):
    from edgevl.verification import demo_evaluate as E

    seen = []

    def loading(*a, **k):
        seen.append(capsys.readouterr().out)
        raise SystemExit(3)

    monkeypatch.setattr(E, "resolve", loading)
    with pytest.raises(SystemExit):
        E.main(["--n", "1", "--no-parity"])
    assert seen and seen[0].startswith("[0/1] evaluating 1 scenes"), seen


# -- 9. smaller ----------------------------------------------------------------------------------------------

def test_raw_with_an_image_names_the_flags(capsys):
    assert cli.main(["run", "--raw", "--image", "x.png", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--raw cannot be combined with --image" in err and "image=" not in err


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
        got = sum(f["bytes"] for name, f in files.items() if name.endswith((".bin")))
        want = package_bytes(shapes, tied, dtype)
        assert 0 <= got - want <= 2048, (dtype, got, want)  # ncnn's per-weight type tags


def test_demo_cache_is_keyed_by_the_edgevl_version(monkeypatch, tmp_path):
    """An upgrade converts the demo again instead of loading (or refusing) an older release's copy."""
    from edgevl.demo import demo_package_path

    monkeypatch.setenv("EDGEVL_CACHE", str(tmp_path))
    now = demo_package_path()
    assert now.parent == tmp_path and now.name.endswith(f"-{edgevl.__version__}")
    monkeypatch.setattr(edgevl, "__version__", "9.9.9")
    assert demo_package_path() != now
