"""Drafting options on a package that has no multi-token-prediction block: one line that names
the missing block, why it is missing and what to do, in the API and on the command line."""

import pytest

import edgevl
from edgevl.errors import EdgevlError
from support.cli import cli, one_line_error
from support.qwen import make_qwen3_5


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """Packages without the block: {"dropped": converted with --no-mtp, "absent": from a checkpoint without one}."""
    root = tmp_path_factory.mktemp("no_mtp")
    with_block = make_qwen3_5(root / "ck", mtp=True, text_only=True)
    without = make_qwen3_5(root / "ck0", text_only=True)
    return {"dropped": edgevl.convert(with_block, root / "dropped", dtype="fp32", mtp="drop", progress=False),
            "absent": edgevl.convert(without, root / "absent", dtype="fp32", progress=False)}


@pytest.mark.parametrize("option", [dict(draft_tokens=2), dict(draft_tokens=1), dict(draft_vocab=100)])
def test_draft_options_on_a_package_converted_with_no_mtp_name_the_block(bare, option):
    with pytest.raises(EdgevlError) as e:
        edgevl.load(bare["dropped"], **option)
    msg = str(e.value)
    assert "\n" not in msg and "from 1 to" not in msg, msg
    name = next(iter(option))
    for needle in ("MTP", "converted with --no-mtp", f"drop {name}", "without --no-mtp"):
        assert needle in msg, (needle, msg)


def test_draft_tokens_on_a_checkpoint_without_the_block(bare):
    with pytest.raises(EdgevlError, match=r"no .*MTP.* block.*checkpoint.*drop draft_tokens") as e:
        edgevl.load(bare["absent"], draft_tokens=2)
    assert "--no-mtp" not in str(e.value)  # nothing to convert again: the checkpoint has none


def test_draft_tokens_on_the_command_line(bare, capsys):
    code, _, err = cli(capsys, "run", bare["dropped"], "--prompt", "Hi", "--draft-tokens", "2")
    one_line_error(code, err, "MTP", "--no-mtp", "--draft-tokens")
    # speculative decoding off by default on such a package: it still runs
    code, out, err = cli(capsys, "run", bare["dropped"], "--prompt", "Hi", "--max-new-tokens", "2")
    assert code == 0, err
