"""Per-layer CPU time of one forward of a package's graph (decoder or vision), by layer type.

    python benchmarks/profile_graph.py PACKAGE vision --image 1024x768 [--threads 1]
    python benchmarks/profile_graph.py PACKAGE decoder --tokens 1 [--step]

ncnn's Python wheel has no per-layer timer, so this extracts every layer's output in graph order
from one extractor: each extract runs exactly the layers not yet run, and its time is theirs.
The decoder runs through the model's own forward (``prefill``, or with ``--step`` one decode
step after a ``--tokens`` prompt), so recurrent and MoE decoders run their host passes (the
delta rule, the experts) between extractions as they do in use: the graph's layers are timed one
by one, and what the forward spent outside them is reported as host time.
Use one thread for CPU times (ncnn's OpenMP workers spin while they wait, which CPU time would
count); wall times are printed too.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import ncnn
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Timer:
    """Per-layer CPU and wall time, summed over what was profiled."""

    def __init__(self):
        self.cpu, self.wall, self.per_layer = collections.Counter(), collections.Counter(), collections.Counter()

    def time(self, ex, typ: str, name: str, blob: str, kind: int = 0) -> None:
        c0, t0 = time.process_time(), time.perf_counter()
        m = ncnn.Mat()
        if ex.extract(blob, m, kind) != 0:
            raise SystemExit(f"extract {blob} of {name} failed")
        c, t = time.process_time() - c0, time.perf_counter() - t0
        self.cpu[typ] += c
        self.wall[typ] += t
        self.per_layer[name] += c


def profile(net, feeds: dict, param: str, timer: Timer) -> None:
    """One forward of a graph without host passes (the vision tower): every layer in graph order."""
    from edgevl.runtime import to_mat

    ex = net.net.create_extractor()
    ex.set_light_mode(True)
    for k, v in feeds.items():
        ex.input(k, v if isinstance(v, ncnn.Mat) else to_mat(v))
    for typ, name, _, outs in Graph(param).layers:
        if typ not in ("Input", "Split"):
            timer.time(ex, typ, name, outs[0])


class Graph:
    """A .param file's layers: (type, name, input blobs, output blobs), and each blob's producer."""

    def __init__(self, param: str):
        self.layers, self.producer = [], {}
        for line in Path(param).read_text().split("\n")[2:]:
            p = line.split()
            if len(p) < 4:
                continue
            n_in, n_out = int(p[2]), int(p[3])
            ins, outs = p[4:4 + n_in], p[4 + n_in:4 + n_in + n_out]
            for b in outs:
                self.producer[b] = len(self.layers)
            self.layers.append((p[0], p[1], ins, outs))

    def pending(self, blob: str, have: set) -> list[int]:
        """Indices of the layers an extraction of ``blob`` would run (its ancestors not yet run,
        stopping at blobs in ``have``: fed or computed), in graph order."""
        seen, stack = set(), [blob]
        while stack:
            b = stack.pop()
            i = self.producer.get(b)
            if b in have or i is None or i in seen:
                continue
            seen.add(i)
            stack.extend(self.layers[i][2])
        return sorted(seen)


class TimedExtractor:
    """Stands in for a decoder's ncnn.Extractor: before each extraction the forward asks for, it
    runs the blob's pending ancestor layers one extraction each, in graph order, timing each."""

    def __init__(self, ex, graph: Graph, timer: Timer):
        self.ex, self.graph, self.timer, self.have = ex, graph, timer, set()

    def __getattr__(self, name):    # the rest (light mode, allocators) as the wrapped one
        return getattr(self.ex, name)

    def input(self, name, m):
        self.have.add(name)
        return self.ex.input(name, m)

    def extract(self, name, m, kind: int = 0):
        for i in self.graph.pending(name, self.have):
            typ, lname, _, outs = self.graph.layers[i]
            if typ not in ("Input", "Split"):
                self.timer.time(self.ex, typ, lname, outs[0], 1)   # kind 1: no layout conversion
            self.have.update(outs)
        self.have.add(name)
        return self.ex.extract(name, m, kind)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("package")
    ap.add_argument("graph", choices=["vision", "decoder"])
    ap.add_argument("--image", default="1024x768", help="WxH of a synthetic image (vision)")
    ap.add_argument("--tokens", type=int, default=1, help="rows fed to the decoder (no cache)")
    ap.add_argument("--step", action="store_true", help="profile one decode step after a --tokens prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--top", type=int, default=12, help="slowest single layers to list")
    ap.add_argument("--group", action="store_true", help="also sum layers by name with digits dropped")
    a = ap.parse_args(argv)

    import edgevl

    m = edgevl.load(a.package, threads=a.threads)
    param = str(Path(a.package) / f"{a.graph}.param")
    if a.graph == "vision":
        from PIL import Image

        w, h = (int(x) for x in a.image.split("x"))
        rng = np.random.default_rng(0)
        img = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        enc = m.vision
        if enc is None:
            raise SystemExit(f"{a.package} has no vision tower")
        feeds = enc.inputs(enc.preprocess(img))
        feeds = feeds[0] if isinstance(feeds, tuple) else feeds   # Youtu-VL adds its window layout
        profile(enc.net, feeds, param, Timer())  # warm-up
        timer = Timer()
        for _ in range(a.reps):
            profile(enc.net, feeds, param, timer)
        host = 0.0
    else:
        timer, graph, net = Timer(), Graph(param), m.decoder.net
        if getattr(net, "sections", None) is not None:
            raise SystemExit("profile a package loaded whole (not in low-memory mode)")
        plain = net.extractor
        text = m.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * (1 + a.tokens // 8), special=False)
        ids = (text * (1 + a.tokens // max(1, len(text))))[:a.tokens]   # text tokens: no image placeholders

        def forward(t: Timer | None) -> float:
            if a.step:
                tok = int(np.argmax(m.prefill(ids, reuse_cache=False)))
            net.extractor = plain if t is None else (lambda: TimedExtractor(plain(), graph, t))
            t0 = time.perf_counter()
            try:
                m.step(tok) if a.step else m.prefill(ids, reuse_cache=False)
            finally:
                net.extractor = plain
            return time.perf_counter() - t0

        forward(Timer())  # warm-up
        total = sum(forward(timer) for _ in range(a.reps))
        host = total - sum(timer.wall.values())   # host passes, the lm_head, Python glue
    cpu, wall, per_layer = timer.cpu, timer.wall, timer.per_layer
    total_c, total_w = sum(cpu.values()) / a.reps * 1e3, sum(wall.values()) / a.reps * 1e3
    print(f"{a.graph}: {total_c:.2f} CPU-ms, {total_w:.2f} ms wall per forward in the graph's layers "
          f"({a.threads} thread(s))"
          + (f"; {host / a.reps * 1e3:.2f} ms wall outside them" if a.graph == "decoder" else ""))
    print("| layer type | CPU ms | share | wall ms |\n|---|---|---|---|")
    for typ, c in cpu.most_common():
        print(f"| {typ} | {c / a.reps * 1e3:.2f} | {100 * c / sum(cpu.values()):.1f} % | "
              f"{wall[typ] / a.reps * 1e3:.2f} |")
    print("\nslowest layers (CPU ms):")
    for name, c in per_layer.most_common(a.top):
        print(f"  {name}: {c / a.reps * 1e3:.2f}")
    if a.group:
        import re

        groups = collections.Counter()
        for name, c in per_layer.items():
            groups[re.sub(r"\d+", "#", name)] += c
        print("\nby name pattern (CPU ms):")
        for name, c in groups.most_common(a.top):
            print(f"  {name}: {c / a.reps * 1e3:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
