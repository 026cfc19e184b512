"""A minimal progress bar on stderr (conversion, hashing, benchmarks, batch jobs)."""

from __future__ import annotations

import os
import shutil
import sys
import time


class Progress:
    def __init__(self, total: float, desc: str = "", unit: str = "B", enabled: bool = True, stream=None):
        self.total, self.desc, self.unit = max(float(total), 1.0), desc, unit
        self.n = 0.0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = self._last = time.monotonic()
        self._last_pct = -1

    def _fmt(self, v: float) -> str:
        if self.unit != "B":
            return f"{v:.0f}"
        for u in ("B", "KB", "MB", "GB", "TB"):
            if v < 1024 or u == "TB":
                return f"{v:.1f}{u}" if u != "B" else f"{v:.0f}B"
            v /= 1024
        return str(v)

    def _rate(self, v: float) -> str:
        # items can come slower than one a second (a batch row on a big model): keep decimals
        return f"{self._fmt(v)}/s" if self.unit == "B" else f"{v:.3g} {self.unit}/s"

    def update(self, n: float, note: str = "") -> None:
        self.n += n
        if not self.enabled:
            return
        try:
            self._show(note)
        except OSError:     # the reader of stderr went away (`2>&1 | head`): the work goes on unseen
            self.enabled = False

    def _show(self, note: str) -> None:
        now = time.monotonic()
        pct = int(100 * min(self.n, self.total) / self.total)
        rate = self.n / max(now - self.t0, 1e-9)
        eta = (self.total - self.n) / rate if rate > 0 else 0
        if self.tty:
            if now - self._last < 0.1 and self.n < self.total:
                return
            # one line however narrow the terminal: a redraw that wraps leaves a line per update
            cols = self._columns() - 1
            tail = (f"{pct:3d}% {self._fmt(self.n)}/{self._fmt(self.total)} {self._rate(rate)} eta {eta:4.0f}s")
            width = max(0, min(28, cols - len(self.desc) - len(tail) - 4))
            fill = int(width * pct / 100)
            line = f"{self.desc} [{'#' * fill}{'.' * (width - fill)}] {tail}" if width else f"{self.desc} {tail}"
            room = cols - len(line) - 1
            line = line + " " + note[:min(40, room - 1)] if room > 1 else line
            self.stream.write("\r" + line[:cols].ljust(cols))   # spaces over a longer line before
        elif pct // 10 != self._last_pct // 10 or self.n >= self.total:
            self.stream.write(f"{self.desc}: {pct}% ({self._fmt(self.n)}/{self._fmt(self.total)}) "
                              f"{self._rate(rate)} eta {eta:.0f}s\n")
            self._last_pct = pct
        self.stream.flush()
        self._last = now

    def _columns(self) -> int:
        """The width of the terminal the bar is drawn on (its own stream's, not stdout's: a job's
        output may go to a file); COLUMNS wins, as for shutil."""
        if os.environ.get("COLUMNS", "").isdigit() and int(os.environ["COLUMNS"]) > 0:
            return int(os.environ["COLUMNS"])
        try:
            return os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            return shutil.get_terminal_size((100, 24)).columns

    def close(self) -> None:
        if self.enabled and self.tty:
            try:
                self.stream.write("\n")
                self.stream.flush()
            except OSError:
                self.enabled = False
