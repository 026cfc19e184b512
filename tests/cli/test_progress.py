"""The progress bar of long commands (convert, batch, bench) keeps to one line of the terminal
however narrow it is: a redraw that wraps would leave a line per update."""

import io

import pytest

from edgevl.progress import Progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("columns", [30, 60, 100, 200])
def test_each_redraw_fits_the_terminal(columns, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(columns))
    out = Terminal()
    bar = Progress(1000, desc="batch", unit="rows", stream=out)
    for k in range(1, 4):
        bar._last = -1.0   # redraw now
        bar.update(300, "photos/2026/a-very-long-folder-name/IMG_0001.jpg" if k == 1 else "a.png")
    redraws = out.getvalue().split("\r")[1:]
    assert len(redraws) == 3 and all(len(r) == columns - 1 for r in redraws), [len(r) for r in redraws]
    assert all("%" in r for r in redraws)
    assert "a.png" in redraws[-1] or columns < 100   # the note where there is room for it


def test_the_width_is_the_bars_own_terminals(monkeypatch):
    """The bar goes to stderr: its terminal's width counts, not stdout's (a job's output may go to
    a file, where the fallback would be 100 columns)."""
    import fcntl
    import os
    import struct
    import termios

    monkeypatch.delenv("COLUMNS", raising=False)
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 50, 0, 0))
    with os.fdopen(slave, "w") as tty:
        bar = Progress(1000, desc="batch", unit="rows", stream=tty)
        bar._last = -1.0
        bar.update(500, "photos/2026/a-very-long-folder-name/IMG_0001.jpg")
        tty.flush()
        drawn = os.read(master, 4096).decode()
    os.close(master)
    assert drawn.startswith("\r") and len(drawn) - 1 == 49, repr(drawn)
