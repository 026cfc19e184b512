"""Bad input gets one clear line and a non-zero exit from the CLI — never a traceback."""

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

import edgevl
from support.youtu import make_youtu


def cli(*args, cwd=None):
    r = subprocess.run([sys.executable, "-m", "edgevl", *map(str, args)], capture_output=True, text=True,
                       cwd=cwd, timeout=300)
    return r.returncode, r.stdout, r.stderr


def assert_one_line_error(code, err, *needles):
    assert code != 0
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    # progress lines may come first; the error is one line, and the last
    assert len(errors) == 1 and lines[-1] == errors[0], err
    for n in needles:
        assert n in errors[0], (n, errors[0])


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("err")
    ck = make_youtu(root / "ck", seed=3, max_position_embeddings=64, max_shard_size="40KB")
    edgevl.convert(ck, root / "pk", dtype="fp32", progress=False)
    return root, ck, root / "pk"


def no_partial_output(parent, name):
    left = [p.name for p in parent.iterdir() if name in p.name]
    assert left == [], left


def test_convert_not_a_folder(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    assert_one_line_error(*cli("convert", tmp_path / "file.txt", tmp_path / "out")[::2], "is not a folder")
    assert_one_line_error(*cli("convert", tmp_path / "nope", tmp_path / "out")[::2], "does not exist")


def test_convert_no_config(tmp_path):
    (tmp_path / "m").mkdir()
    assert_one_line_error(*cli("convert", tmp_path / "m", tmp_path / "out")[::2], "no config.json")


def test_convert_unsupported_model_type(good, tmp_path):
    _, ck, _ = good
    bad = tmp_path / "llama"
    shutil.copytree(ck, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (bad / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(*cli("convert", bad, tmp_path / "out")[::2], "model_type 'llama'", "not supported")


def test_convert_missing_shard(good, tmp_path):
    _, ck, _ = good
    bad = tmp_path / "shards"
    shutil.copytree(ck, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert_one_line_error(*cli("convert", bad, tmp_path / "out")[::2], shard.name, "missing")
    no_partial_output(tmp_path, "out")


def test_convert_wrong_shape_leaves_no_package(good, tmp_path):
    _, ck, _ = good
    bad = tmp_path / "shape"
    shutil.copytree(ck, bad)
    for f in sorted(bad.glob("model-*.safetensors")):
        t = load_file(str(f))
        key = next((k for k in t if k.endswith("layers.1.mlp.down_proj.weight")), None)
        if key:
            t[key] = t[key][:, :-1].contiguous()
            save_file(t, str(f), metadata={"format": "pt"})
    code, _, err = cli("convert", bad, tmp_path / "out")
    assert_one_line_error(code, err, "layers.1.mlp.down_proj.weight", "shape")
    no_partial_output(tmp_path, "out")  # conversion failed midway: nothing that looks like a package


def test_convert_refuses_existing_output(good, tmp_path):
    _, ck, _ = good
    (tmp_path / "out").mkdir()
    assert_one_line_error(*cli("convert", ck, tmp_path / "out")[::2], "already exists", "--force")


def test_run_checksum_mismatch(good, tmp_path):
    _, _, pk = good
    bad = tmp_path / "pk"
    shutil.copytree(pk, bad)
    data = bytearray((bad / "decoder.bin").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "decoder.bin").write_bytes(bytes(data))
    assert_one_line_error(*cli("run", bad, "--prompt", "hi")[::2], "decoder.bin", "sha256")


def test_run_missing_package_file(good, tmp_path):
    _, _, pk = good
    bad = tmp_path / "pk"
    shutil.copytree(pk, bad)
    (bad / "lm_head.param").unlink()
    assert_one_line_error(*cli("run", bad, "--prompt", "hi")[::2], "lm_head.param", "missing")


def test_run_on_checkpoint_or_wrong_path(good, tmp_path):
    _, ck, _ = good
    assert_one_line_error(*cli("run", ck, "--prompt", "hi")[::2], "convert it first")
    assert_one_line_error(*cli("run", tmp_path / "none", "--prompt", "hi")[::2], "does not exist")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(*cli("run", tmp_path / "empty", "--prompt", "hi")[::2], "not an edgevl package")


def test_run_empty_and_too_long_prompts(good):
    _, _, pk = good
    assert_one_line_error(*cli("run", pk, "--prompt", "  ")[::2], "prompt is empty")
    assert_one_line_error(*cli("run", pk, "--prompt", "word " * 200)[::2], "context length is 64")


def test_run_bad_flags(good):
    _, _, pk = good
    assert_one_line_error(*cli("run", pk, "--prompt", "hi", "--top-p", "0")[::2], "top_p")
    code, _, err = cli("run", pk, "--prompt", "hi", "--max-new-tokens", "-3")
    assert code != 0 and "Traceback" not in err and "--max-new-tokens" in err


def test_run_text_model_with_image(good, tmp_path):
    from PIL import Image

    _, _, pk = good
    Image.new("RGB", (40, 40)).save(tmp_path / "a.png")
    assert_one_line_error(*cli("run", pk, "--prompt", "hi", "--image", tmp_path / "a.png")[::2], "no vision tower")


def test_run_streams_text(good):
    _, _, pk = good
    code, out, err = cli("run", pk, "--prompt", "hello", "--max-new-tokens", "5", "-v")
    assert code == 0, err
    assert "generated" in err
