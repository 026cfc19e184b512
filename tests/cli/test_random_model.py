"""`edgevl random-model`: a small random Qwen3.5 checkpoint (vision tower, MTP block) made offline
without torch. The README's commands run as written: make it and a clip, convert, answer about the
clip with drafting on; its layout is the one transformers' own class saves."""

import base64
import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from support.cli import cli, one_line_error
from support.common import ROOT
from support.server import post

SECTION = "### Video, speculative decoding and the server, offline"


def readme_commands() -> list[str]:
    """The edgevl commands of the README's offline random-model block, in order."""
    readme = (ROOT / "README.md").read_text()
    assert SECTION in readme, "the README lost its random-model section"
    block = re.search(r"```bash\n(.*?)```", readme[readme.index(SECTION):], re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.startswith("edgevl ")]


def edgevl(command: str, cwd, no_torch: bool = False):
    """One README command line in a fresh interpreter (``no_torch``: and torch never imported)."""
    argv = shlex.split(command)[1:]
    code = ("import sys; from edgevl.cli import main; rc = main(sys.argv[1:]); "
            "assert not {'torch', 'transformers'} & set(sys.modules), 'torch was imported'; sys.exit(rc)")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code if no_torch else "from edgevl.cli import main; "
                        "import sys; sys.exit(main(sys.argv[1:]))", *argv], cwd=cwd, capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, (command, r.stderr)
    return r, time.monotonic() - t0


def test_the_readme_commands_make_convert_and_draft_on_a_video(tmp_path):
    commands = readme_commands()
    kinds = [shlex.split(c)[1] for c in commands]
    assert kinds[:3] == ["random-model", "convert", "run"] and "serve" in kinds, commands
    _, made = edgevl(commands[0], tmp_path, no_torch=True)
    _, converted = edgevl(commands[1], tmp_path, no_torch=True)
    assert made + converted < 60, (made, converted)   # seconds, not minutes (about 2 s each here)
    r, _ = edgevl(commands[2], tmp_path, no_torch=True)
    assert "--video" in commands[2] and re.search(r"\[video 1: \d+ frames sampled", r.stderr), r.stderr
    drafted = re.search(r"speculative decoding \(MTP[^)]*\): (\d+) of (\d+) drafts accepted", r.stderr)
    assert drafted and int(drafted.group(2)) > 0, r.stderr   # drafting ran
    assert r.stdout.strip()

    serve = shlex.split(next(c for c in commands if shlex.split(c)[1] == "serve"))
    serve[serve.index("--port") + 1] = "0"   # any free port
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    server = subprocess.Popen([sys.executable, "-m", "edgevl", *serve[1:]], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = re.search(r"at http://127\.0\.0\.1:(\d+)/v1", server.stdout.readline())
        assert url, server.communicate(timeout=30)
        clip = base64.b64encode((tmp_path / "clip.gif").read_bytes()).decode()
        status, reply, _ = post(int(url.group(1)), {"messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": f"data:image/gif;base64,{clip}"}},
            {"type": "text", "text": "What happens?"}]}], "max_tokens": 8,
            "chat_template_kwargs": {"enable_thinking": False}})
        assert status == 200 and reply["choices"][0]["message"]["content"].strip(), reply
    finally:
        server.terminate()
        server.communicate(timeout=30)


def test_the_layout_is_what_transformers_saves(tmp_path, capsys):
    """Tensor names and shapes, config keys and special tokens of the checkpoint made without
    torch equal those of transformers' Qwen3_5ForConditionalGeneration with the MTP block (the
    verification wing's tiny checkpoint of the same shape); transformers loads it with nothing
    missing."""
    from safetensors import safe_open
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    from support.qwen import make_qwen3_5

    code, _, err = cli(capsys, "random-model", "qwen3_5", tmp_path / "mine")
    assert code == 0, err
    make_qwen3_5(tmp_path / "ref", mtp=True)

    def layout(folder):
        with safe_open(str(folder / "model.safetensors"), "np") as f:
            return {k: f.get_slice(k).get_shape() for k in f.keys()}

    mine, theirs = layout(tmp_path / "mine"), layout(tmp_path / "ref")
    vocab = json.loads((tmp_path / "mine" / "config.json").read_text())["text_config"]["vocab_size"]
    assert mine.pop("model.language_model.embed_tokens.weight")[0] == vocab
    theirs.pop("model.language_model.embed_tokens.weight")
    assert mine == theirs

    cfg, ref_cfg = (json.loads((tmp_path / f / "config.json").read_text()) for f in ("mine", "ref"))
    for part in ("text_config", "vision_config"):
        assert set(cfg[part]) == set(ref_cfg[part]), part
    assert set(cfg) == set(ref_cfg) - {"transformers_version"}   # not written by transformers
    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "mine", output_loading_info=True)
    assert not info["missing_keys"] and all(k.startswith("mtp.") for k in info["unexpected_keys"]), info
    tok, ref_tok = (AutoTokenizer.from_pretrained(tmp_path / f) for f in ("mine", "ref"))
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert tok.convert_ids_to_tokens(cfg[name]) == ref_tok.convert_ids_to_tokens(ref_cfg[name]), name
    assert tok.eos_token == ref_tok.eos_token
    assert tok.decode(tok("Zürich — “quotes” 数一数").input_ids) == "Zürich — “quotes” 数一数"


def test_nothing_is_overwritten_and_the_seed_decides(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    one_line_error(*cli(capsys, "random-model", "qwen3_5", tmp_path / "out")[::2], "already exists")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]
    one_line_error(*cli(capsys, "random-model", "qwen3_5", tmp_path / "x", "--clip", tmp_path / "no" / "c.gif")[::2],
                   "does not exist")
    one_line_error(*cli(capsys, "random-model", "qwen3_5", tmp_path / "x", "--clip", tmp_path / "out")[::2], ".gif")
    assert not (tmp_path / "x").exists()
    for name in ("a", "b"):
        code, _, err = cli(capsys, "random-model", "qwen3_5", tmp_path / name, "--seed", "3")
        assert code == 0, err
    code, _, err = cli(capsys, "random-model", "qwen3_5", tmp_path / "c", "--seed", "4")
    a, b, c = ((tmp_path / n / "model.safetensors").read_bytes() for n in "abc")
    assert a == b != c
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c", "out"]   # no partial folder left


@pytest.mark.parametrize("seed", ["-1", "x"])
def test_a_bad_seed_is_one_line(tmp_path, capsys, seed):
    one_line_error(*cli(capsys, "random-model", "qwen3_5", tmp_path / "out", "--seed", seed)[::2], "--seed")
    assert not (tmp_path / "out").exists()
