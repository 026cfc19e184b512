"""Usage mistakes on the command line: one rule per value in every command, one ``error: ...``
line and exit 2 before any work."""

import io

import pytest

import edgevl
from edgevl import cli as edgevl_cli
from edgevl.chat import chat_loop
from edgevl.errors import EdgevlError
from support.cli import cli, one_line_error
from support.youtu import tiny_checkpoint

# every command that loads a model, with the arguments it requires
COMMANDS = {
    "run": ("run", "--prompt", "hi"),
    "chat": ("chat",),
    "serve": ("serve", "--port", "0"),
    "verify": ("verify",),
    "bench": ("bench",),
    "batch": ("batch", "--input", "in", "--prompt", "hi", "--output", "out.jsonl"),
}


@pytest.fixture
def no_cache(tmp_path, monkeypatch):
    """An empty cache and working folder: a usage error must come before the demo is converted
    and before anything is written."""
    monkeypatch.setenv("EDGEVL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def nothing_written(folder) -> bool:
    return not any(folder.iterdir())


# -- threads: 0 and negatives are mistakes everywhere (were: the default in run, 1 from the env) --

@pytest.mark.parametrize("value", ["0", "-1"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_threads_zero_or_negative_is_a_usage_error_in_every_command(no_cache, capsys, command, value):
    one_line_error(*cli(capsys, *COMMANDS[command], "--threads", value)[::2],
                   "--threads must be between 1 and", f"got {value}")
    assert nothing_written(no_cache)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_unknown_option_shows_the_commands_own_usage(no_cache, capsys, command):
    with pytest.raises(SystemExit) as e:
        edgevl_cli.main([*COMMANDS[command], "--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"usage: edgevl {command} "), err
    assert err.rstrip().endswith(f"edgevl {command}: error: unrecognized arguments: --bogus"), err
    assert nothing_written(no_cache)


def test_an_unknown_option_before_the_command_shows_the_top_level_usage(no_cache, capsys):
    """``edgevl --bogus run ...``: the option was given to edgevl itself, not to run."""
    with pytest.raises(SystemExit) as e:
        edgevl_cli.main(["--bogus", *COMMANDS["run"]])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: edgevl [-h]"), err
    assert err.rstrip().endswith("edgevl: error: unrecognized arguments: --bogus"), err
    assert nothing_written(no_cache)


@pytest.mark.parametrize("value", ["0", "-2"])
@pytest.mark.parametrize("command", ["run", "bench"])
def test_edgevl_threads_zero_or_negative_is_refused_before_any_work(no_cache, capsys, monkeypatch, command, value):
    monkeypatch.setenv("EDGEVL_THREADS", value)
    one_line_error(*cli(capsys, *COMMANDS[command])[::2], "EDGEVL_THREADS must be between 1 and", f"got {value}")
    assert nothing_written(no_cache)
    from edgevl.runtime import default_threads

    with pytest.raises(EdgevlError, match="EDGEVL_THREADS must be between 1 and"):
        default_threads()


def test_threads_zero_in_the_python_chat_and_verify(tmp_path):
    pkg = edgevl.convert(tiny_checkpoint(tmp_path / "ck"), tmp_path / "pk", dtype="fp32", progress=False)
    with pytest.raises(EdgevlError, match="threads must be between 1 and"):
        chat_loop(pkg, threads=0, input_fn=lambda _: "/quit", out=io.StringIO())
    pytest.importorskip("torch")
    from edgevl.verification.verify import compare

    with pytest.raises(EdgevlError, match="threads must be between 1 and"):
        compare(pkg, tmp_path / "ck", "hi", threads=0)


# -- argparse values: the same one line as every other mistake (was: argparse's usage + error) ----

@pytest.mark.parametrize("args,needle", [
    (("run", "--prompt", "hi", "--max-new-tokens", "-1"), "--max-new-tokens must be >= 1, got -1"),
    (("run", "--prompt", "hi", "--max-new-tokens", "many"), "--max-new-tokens must be an integer, got 'many'"),
    (("run", "--prompt", "hi", "--threads", "two"), "--threads must be an integer, got 'two'"),
    (("verify", "--seed", "-3"), "--seed must be >= 0, got -3"),
])
def test_bad_integer_flags_are_one_line(no_cache, capsys, args, needle):
    code, _, err = cli(capsys, *args)
    one_line_error(code, err, needle)
    assert "usage:" not in err and nothing_written(no_cache)


# -- convert --help tells what q8 is now ------------------------------------------------------

def test_convert_help_describes_q8_as_int8_with_per_row_activations(capsys):
    with pytest.raises(SystemExit) as e:
        edgevl_cli.main(["convert", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "block-quantized" not in text
    assert "q8: int8 weights" in text and "activations quantized per row at run time" in text


# -- flags that cannot go together ------------------------------------------------------------

def test_raw_with_an_image_names_the_flags(capsys):
    assert edgevl_cli.main(["run", "--raw", "--image", "x.png", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--raw cannot be combined with --image" in err and "image=" not in err
