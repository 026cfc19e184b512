"""Per-layer CPU time of one forward of a package's graph (decoder or vision), by layer type.

    python benchmarks/profile_graph.py PACKAGE vision --image 1024x768 [--threads 1]
    python benchmarks/profile_graph.py PACKAGE decoder --tokens 1

ncnn's Python wheel has no per-layer timer, so this extracts every layer's output in graph order
from one extractor: each extract runs exactly the layers not yet run, and its time is theirs.
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


def layers_of(param: str):
    lines = Path(param).read_text().split("\n")[2:]
    out = []
    for line in lines:
        p = line.split()
        if len(p) < 4 or p[0] in ("Input", "Split"):
            continue
        n_in, n_out = int(p[2]), int(p[3])
        out.append((p[0], p[1], p[4 + n_in]))  # type, name, first output blob
    return out


def profile(net, feeds: dict, param: str, reps: int = 1):
    from edgevl.runtime import to_mat

    layers = layers_of(param)
    cpu = collections.Counter()
    wall = collections.Counter()
    per_layer = collections.Counter()
    for _ in range(reps):
        ex = net.net.create_extractor()
        ex.set_light_mode(True)
        for k, v in feeds.items():
            ex.input(k, v if isinstance(v, ncnn.Mat) else to_mat(v))
        for typ, name, blob in layers:
            c0, t0 = time.process_time(), time.perf_counter()
            m = ncnn.Mat()
            if ex.extract(blob, m) != 0:
                raise SystemExit(f"extract {blob} of {name} failed")
            c, t = time.process_time() - c0, time.perf_counter() - t0
            cpu[typ] += c
            wall[typ] += t
            per_layer[name] += c
    return cpu, wall, per_layer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("package")
    ap.add_argument("graph", choices=["vision", "decoder"])
    ap.add_argument("--image", default="1024x768", help="WxH of a synthetic image (vision)")
    ap.add_argument("--tokens", type=int, default=1, help="rows fed to the decoder (no cache)")
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
        feeds, _ = enc.inputs(enc.preprocess(img))
        net = enc.net
    else:
        from edgevl.runtime import causal_mask

        n = a.tokens
        emb = m.embed(list(range(100, 100 + n)))
        cos, sin = m.decoder.rope(np.arange(n)[None])
        names = m.decoder.info["inputs"]
        feeds = {names["embeds"]: emb, names["mask"]: causal_mask(0, n), names["cos"]: cos, names["sin"]: sin}
        net = m.decoder.net
    profile(net, feeds, param)  # warm-up
    cpu, wall, per_layer = profile(net, feeds, param, a.reps)
    total_c, total_w = sum(cpu.values()) / a.reps, sum(wall.values()) / a.reps
    print(f"{a.graph}: {total_c:.3f} CPU-s, {total_w:.3f} s wall per forward ({a.threads} thread(s))")
    print("| layer type | CPU s | share | wall s |\n|---|---|---|---|")
    for typ, c in cpu.most_common():
        print(f"| {typ} | {c / a.reps:.3f} | {100 * c / sum(cpu.values()):.1f} % | {wall[typ] / a.reps:.3f} |")
    print("\nslowest layers:")
    for name, c in per_layer.most_common(a.top):
        print(f"  {name}: {c / a.reps * 1000:.1f} ms")
    if a.group:
        import re

        groups = collections.Counter()
        for name, c in per_layer.items():
            groups[re.sub(r"\d+", "#", name)] += c
        print("\nby name pattern:")
        for name, c in groups.most_common(a.top):
            print(f"  {name}: {c / a.reps:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
