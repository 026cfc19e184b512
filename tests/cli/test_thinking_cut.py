"""A thinking model whose token limit runs out inside its thinking has no answer to show: `run`
and `chat` say so (a note on stderr; with --json, the one-line error) instead of an empty answer
that would pass for the model's. A random Qwen3.5 thinks by default and never closes its thinking in a
few tokens."""

import io

import pytest

import edgevl
from edgevl.chat import chat_loop
from edgevl.random_model import write
from support.cli import cli, one_line_error


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    root = tmp_path_factory.mktemp("think")
    return edgevl.convert(write("qwen3_5", root / "ck"), root / "pkg", progress=False)


def test_run_says_the_limit_ran_out_inside_the_thinking(pkg, capsys):
    code, out, err = cli(capsys, "run", pkg, "--prompt", "Describe it.", "--max-new-tokens", "5")
    assert code == 0 and not out.strip()
    assert "[the token limit ran out inside the thinking, before any answer" in err and "--no-thinking" in err
    code, out, err = cli(capsys, "run", pkg, "--prompt", "Describe it.", "--max-new-tokens", "5", "--no-thinking")
    assert code == 0 and out.strip() and "ran out" not in err
    code, out, err = cli(capsys, "run", pkg, "--prompt", "Describe it.", "--max-new-tokens", "5", "--show-thinking")
    assert code == 0 and "<think>" in out and "ran out" not in err     # what there was is shown
    one_line_error(*cli(capsys, "run", pkg, "--prompt", "Describe it.", "--max-new-tokens", "5", "--json")[::2],
                   "the token limit ran out inside the thinking", "--no-thinking")


def test_chat_says_it_under_the_empty_answer(pkg):
    lines = iter(["Describe it.", "/quit"])
    out = io.StringIO()
    assert chat_loop(edgevl.load(pkg), input_fn=lambda _: next(lines), out=out, max_new_tokens=5) == 0
    assert "[the token limit ran out inside the thinking, before any answer" in out.getvalue()
    lines = iter(["Describe it.", "/quit"])
    out = io.StringIO()
    chat_loop(edgevl.load(pkg), input_fn=lambda _: next(lines), out=out, max_new_tokens=5, thinking=False)
    assert "ran out inside the thinking" not in out.getvalue()
