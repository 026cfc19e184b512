"""What `edgevl serve` has done so far, for a Prometheus scraper (``GET /metrics``).

The text exposition format (version 0.0.4) written by hand: counters, gauges and histograms
with a few fixed labels, no client library. A metric either keeps its own values (``inc``,
``observe``, under one lock for the registry) or reads them when scraped (``read``: a function
returning a number, or ``{label values: number}``), e.g. the engine's own counters.
"""

from __future__ import annotations

import math
import os
import resource
import threading


def _escape(v) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(x: float) -> str:
    if x == math.inf:
        return "+Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class Metric:
    """One metric family: ``kind`` counter, gauge or histogram; ``labels`` the names of its
    labels (every sample gives a value for each, in order)."""

    def __init__(self, name: str, help: str, kind: str, labels: tuple = (), read=None, buckets=()):
        self.name, self.help, self.kind, self.labels, self.read = name, help, kind, tuple(labels), read
        self.buckets = tuple(sorted(buckets)) + (math.inf,) if kind == "histogram" else ()
        self.values: dict = {}       # label values -> number, or [bucket counts, sum, count]
        if not self.labels:          # shown from the start (at 0), as scrapers expect
            self.values[()] = [[0] * len(self.buckets), 0.0, 0] if kind == "histogram" else 0

    def _key(self, labels: dict) -> tuple:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name} takes the labels {self.labels}, got {tuple(labels)}")
        return tuple(str(labels[k]) for k in self.labels)

    def _labels(self, key: tuple, extra: str = "") -> str:
        pairs = [f'{k}="{_escape(v)}"' for k, v in zip(self.labels, key)] + ([extra] if extra else [])
        return "{" + ",".join(pairs) + "}" if pairs else ""

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        values = self.read() if self.read is not None else self.values
        if not isinstance(values, dict):
            values = {(): values}
        for key, v in sorted(values.items()):
            if self.kind != "histogram":
                out.append(f"{self.name}{self._labels(key)} {_number(v)}")
                continue
            counts, total, n = v
            running = 0
            for le, c in zip(self.buckets, counts):
                running += c
                le_label = 'le="' + _number(le) + '"'
                out.append(f"{self.name}_bucket{self._labels(key, le_label)} {running}")
            out.append(f"{self.name}_sum{self._labels(key)} {_number(total)}")
            out.append(f"{self.name}_count{self._labels(key)} {n}")
        return out


class Registry:
    def __init__(self):
        self.metrics: dict[str, Metric] = {}
        self.lock = threading.Lock()

    def add(self, name: str, help: str, kind: str = "counter", labels: tuple = (), read=None,
            buckets=()) -> Metric:
        m = Metric(name, help, kind, labels, read, buckets)
        self.metrics[name] = m
        return m

    def inc(self, name: str, amount: float = 1, **labels) -> None:
        m = self.metrics[name]
        with self.lock:
            key = m._key(labels)
            m.values[key] = m.values.get(key, 0) + amount

    def observe(self, name: str, value: float, **labels) -> None:
        m = self.metrics[name]
        with self.lock:
            key = m._key(labels)
            v = m.values.setdefault(key, [[0] * len(m.buckets), 0.0, 0])
            v[0][next(i for i, le in enumerate(m.buckets) if value <= le)] += 1
            v[1] += value
            v[2] += 1

    def render(self) -> str:
        with self.lock:
            return "\n".join(line for m in self.metrics.values() for line in m.lines()) + "\n"


def peak_rss() -> int:
    """The most resident memory this process has held, in bytes (ru_maxrss is KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def process_metrics(reg: Registry) -> None:
    """The process's memory and CPU time (what an edge box's operator watches): resident memory
    from /proc (0 where there is none), its peak and the CPU time from getrusage."""
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def rss() -> float:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            return 0

    def peak() -> float:
        return max(peak_rss(), rss())   # the kernel updates the peak lazily: never under the current size

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    reg.add("process_resident_memory_bytes", "Resident memory of the server process.", "gauge", read=rss)
    reg.add("edgevl_peak_resident_memory_bytes", "The most resident memory the process has held.", "gauge",
            read=peak)
    reg.add("process_cpu_seconds_total", "CPU time of the server process, user and system.", read=cpu)
