"""Video encoding: peak memory and time of a long clip through a package's vision tower.

    python benchmarks/video.py PKG [--seconds 60] [--size 1280x720] [--rate 30] [--json OUT]
    python benchmarks/video.py PKG --answer [--seconds 10] [--size 640x360] [--rate 25] [--json OUT]

``--answer`` times a whole answer instead: the clip decoded and encoded, the prompt's prefill, and
16 greedy tokens (the README's video example).

Writes a synthetic clip (PyAV, MPEG-4 Part 2: a picture panning and changing colour) unless
``--clip`` gives one, then in a fresh process per measurement, with the package loaded first:

- ``encode``: ``Model.encode_video`` of the whole clip at the checkpoint's default sampling;
- ``one patch``: the same on a 2-frame clip of the resized size (the tower's activations for one
  temporal patch, which encode_video runs one at a time).

Peak RSS is the kernel's high-water mark, reset after loading (``/proc/self/clear_refs``). What a
clip costs beyond the loaded model is compared with the sampled frames (uint8, resized), the
output rows and one patch's activations.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def kb(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def worker(pkg: str, clip: str, fps_frames: int | None) -> dict:
    import numpy as np

    import edgevl

    model = edgevl.load(pkg, threads=2)
    np.zeros(1)
    loaded = kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:     # reset VmHWM to the current RSS
        f.write("5")
    t0 = time.perf_counter()
    rows, info = model.encode_video(clip)
    seconds = time.perf_counter() - t0
    peak = kb("VmHWM")
    h, w = info["resized_size"]
    return {"loaded_mb": loaded / 1024, "peak_mb": peak / 1024, "added_mb": (peak - loaded) / 1024,
            "seconds": seconds, "frames": len(info["frame_indices"]), "grid_thw": info["grid_thw"],
            "resized": [h, w], "tokens": int(rows.shape[0]), "rows_mb": rows.nbytes / 2 ** 20,
            "frames_mb": (len(info["frame_indices"]) + len(info["frame_indices"]) % 2) * h * w * 3 / 2 ** 20}


def answer(pkg: str, clip: str) -> dict:
    import edgevl
    from edgevl.generate import prepare

    model = edgevl.load(pkg, threads=2)
    t0 = time.perf_counter()
    prep = prepare(model, "What happens in this video?", video=clip, thinking=False)
    t1 = time.perf_counter()
    gen = model.generate_tokens(prep.input_ids, 16, image=prep.encoded, ignore_eos=True)
    next(gen)
    t2 = time.perf_counter()
    rest = list(gen)
    t3 = time.perf_counter()
    info = next(i for i in prep.images if i.get("kind") == "video")
    h, w = info["resized_size"]
    return {"frames": len(info["frame_indices"]), "resized": [h, w], "grid_thw": list(info["grid_thw"]),
            "video_tokens": info["num_video_tokens"], "prompt_tokens": len(prep.input_ids),
            "encode_s": t1 - t0, "prefill_s": t2 - t1, "decode_tps": len(rest) / (t3 - t2)}


def write_clip(path: Path, seconds: float, width: int, height: int, rate: int) -> None:
    import av
    import numpy as np

    n = int(seconds * rate)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=rate)
        s.width, s.height, s.pix_fmt, s.bit_rate = width, height, "yuv420p", 2_000_000
        for i in range(n):
            t = i / n
            img = np.stack([(xx + 900 * t) % 256, (yy + 300 * t) % 256, np.full_like(xx, 255 * t)], -1)
            for pkt in s.encode(av.VideoFrame.from_ndarray(img.astype(np.uint8), format="rgb24")):
                c.mux(pkt)
            if i % rate == 0:
                print(f"\rwriting the clip: {i // rate}/{int(seconds)} s", end="", file=sys.stderr, flush=True)
        for pkt in s.encode():
            c.mux(pkt)
    print(file=sys.stderr)


def run(pkg: str, clip: str, mode: str = "memory") -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", pkg, clip, mode], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pkg", nargs="?")
    ap.add_argument("--clip", help="a clip to measure (default: a synthetic one, written to --workdir)")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--size", default="1280x720")
    ap.add_argument("--rate", type=int, default=30)
    ap.add_argument("--workdir", default="/tmp/edgevl-video-bench")
    ap.add_argument("--json")
    ap.add_argument("--answer", action="store_true", help="time a whole answer (see above)")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        pkg, clip, mode = a.worker
        print(json.dumps(answer(pkg, clip) if mode == "answer" else worker(pkg, clip, None)))
        return 0
    if not a.pkg:
        ap.error("PKG is required")
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    width, height = (int(x) for x in a.size.split("x"))
    clip = Path(a.clip) if a.clip else work / f"clip-{int(a.seconds)}s-{a.size}-{a.rate}fps.mp4"
    if not clip.exists():
        write_clip(clip, a.seconds, width, height, a.rate)
    if a.answer:
        print("answering about the clip ...", file=sys.stderr)
        res = {"clip": {"seconds": a.seconds, "size": a.size, "rate": a.rate},
               "answer": run(a.pkg, str(clip), "answer")}
        print(json.dumps(res, indent=1))
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
        return 0
    print("encoding the clip ...", file=sys.stderr)
    whole = run(a.pkg, str(clip))
    h, w = whole["resized"]
    pair = work / f"pair-{w}x{h}.gif"
    from PIL import Image

    Image.new("RGB", (w, h), (90, 20, 200)).save(pair, save_all=True,
                                                   append_images=[Image.new("RGB", (w, h), (10, 200, 40))])
    print("encoding one temporal patch ...", file=sys.stderr)
    one = run(a.pkg, str(pair))
    bound = whole["frames_mb"] + whole["rows_mb"] + one["added_mb"] + 200
    res = {"clip": {"seconds": a.seconds, "size": a.size, "rate": a.rate}, "encode": whole, "one_patch": one,
           "bound_mb": bound, "within": whole["added_mb"] <= bound}
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
