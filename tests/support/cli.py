"""The command line run in this process, and what a usage mistake must look like."""

from __future__ import annotations


def cli(capsys, *args) -> tuple[int, str, str]:
    """``edgevl ARGS`` in this process (exit code, stdout, stderr)."""
    from edgevl.cli import main

    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str, *needles: str) -> str:
    """Exit 2 and exactly one ``error: ...`` line (the last), naming every needle."""
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), err
    assert sum(line.startswith("error: ") for line in lines) == 1, err
    for n in needles:
        assert n in lines[-1], (n, lines[-1])
    return lines[-1]
