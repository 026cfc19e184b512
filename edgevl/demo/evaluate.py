"""Score the demo model through ncnn, and check it against the PyTorch reference token by token.

    python -m edgevl.demo.evaluate --seed S --n 200 [--model PATH]

For each of ``n`` fresh scenes (seeded stream ``S``) the ncnn model (``edgevl.load``) is asked,
greedily, "Describe the image." (``edgevl.generate.prepare`` + ``Model.generate_tokens``, the
path ``edgevl.generate`` takes) and "How many shapes are there?" (``edgevl.generate``). A
description is right when it names exactly the scene's set of (colour, shape) pairs; a count
when it gives the right number. Parity: the same ncnn greedy tokens for the describe question
must equal the PyTorch reference's (``YoutuVLForConditionalGeneration.greedy_generate`` in
fp32) on the same input ids.

``--model`` is a converted package (its reference checkpoint is the one it was converted from,
or ``--reference``) or a checkpoint folder (converted to a temporary fp32 package). Without it
the shipped demo model is used. The last line printed is always
``describe_acc=<float> count_acc=<float> parity=<float>``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from edgevl.demo import scenes as S

DEMO_DIR = Path(__file__).resolve().parent / "model"
MAX_NEW_TOKENS = 64


def _demo_package() -> Path | None:
    try:
        from edgevl.demo import demo_package
    except ImportError:
        return None
    return Path(demo_package())


def resolve(model: str | None, reference: str | None, tmp: Path) -> tuple[Path, Path]:
    """(ncnn package folder, reference checkpoint folder)."""
    import edgevl
    from edgevl.package import MANIFEST

    if model is None:
        pkg = _demo_package()
        if pkg is None:  # edgevl.demo.demo_package() not available: convert here
            pkg = edgevl.convert(DEMO_DIR, tmp / "package", dtype="fp32", progress=False)
        return Path(pkg), Path(reference) if reference else DEMO_DIR
    path = Path(model)
    if (path / MANIFEST).is_file():
        if reference:
            return path, Path(reference)
        src = json.loads((path / MANIFEST).read_text()).get("source", {}).get("path")
        if not src or not Path(src, "config.json").is_file():
            raise SystemExit(f"{path}: cannot find the checkpoint it was converted from; pass --reference")
        return path, Path(src)
    if (path / "config.json").is_file():
        pkg = edgevl.convert(path, tmp / "package", dtype="fp32", progress=False)
        return Path(pkg), Path(reference) if reference else path
    raise SystemExit(f"{path} is neither an edgevl package nor a checkpoint folder")


def score(describe: str, count: str, scene: S.Scene) -> tuple[bool, bool]:
    return S.parse_description(describe) == scene.truth_pairs(), S.parse_count(count) == scene.count


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgevl.demo.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1234, help="seed of the scene stream (never the training seed)")
    ap.add_argument("--n", type=int, default=200, help="number of scenes")
    ap.add_argument("--model", default=None, help="package or checkpoint folder (default: the shipped demo model)")
    ap.add_argument("--reference", default=None, help="reference checkpoint folder for the parity check")
    ap.add_argument("--threads", type=int, default=None, help="ncnn threads")
    ap.add_argument("--no-parity", action="store_true", help="skip the PyTorch parity check (parity=nan)")
    ap.add_argument("--show", type=int, default=5, metavar="K", help="print the first K failures")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error("--n must be at least 1")

    # the first line comes at once: loading torch and the models takes seconds
    print(f"[0/{args.n}] evaluating {args.n} scenes (seed {args.seed}); loading the models ...", flush=True)
    import edgevl
    from edgevl.generate import prepare
    from edgevl.models.youtu_vl import configured_max_patches
    from edgevl.processing.siglip2 import preprocess

    with tempfile.TemporaryDirectory(prefix="edgevl-demo-eval-") as tmp:
        pkg, ref_dir = resolve(args.model, args.reference, Path(tmp))
        m = edgevl.load(pkg, threads=args.threads)
        ref = None
        if not args.no_parity:
            import torch

            from edgevl.reference.youtu_vl import YoutuVLForConditionalGeneration

            if args.threads:
                torch.set_num_threads(args.threads)
            ref = YoutuVLForConditionalGeneration.from_pretrained(ref_dir, dtype=torch.float32)
        mip = configured_max_patches(ref_dir)
        eos = sorted(m.eos_ids)

        desc_ok = count_ok = same = 0
        failures, mismatches = [], []
        t0 = time.time()
        for i, scene in enumerate(S.make_scenes(args.seed, args.n)):
            # One greedy run gives both the scored description and the tokens checked for parity
            # (the path ``edgevl.generate`` takes; 128x128 scenes need no coordinate rescaling).
            prep = prepare(m, S.DESCRIBE_Q, image=scene.image)
            ncnn_tokens = list(m.generate_tokens(prep.input_ids, MAX_NEW_TOKENS, image=prep.image_rows))
            describe = m.tokenizer.decode([t for t in ncnn_tokens if t not in m.eos_ids])
            count = edgevl.generate(m, S.COUNT_Q, image=scene.image, max_new_tokens=16)
            d, c = score(describe, count, scene)
            desc_ok += d
            count_ok += c
            if not (d and c):
                failures.append((i, scene, describe, count))
            if ref is not None:
                inp = preprocess(scene.image, mip)
                if inp["num_image_tokens"] != prep.input_ids.count(m.image_token_id):
                    raise SystemExit("the runtime and the reference preprocess the image to different sizes "
                                     f"({prep.input_ids.count(m.image_token_id)} vs {inp['num_image_tokens']} tokens)")
                ref_tokens = ref.greedy_generate(prep.input_ids, inp["pixel_values"], inp["spatial_shapes"],
                                                 max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos)
                if ncnn_tokens == ref_tokens:
                    same += 1
                else:
                    mismatches.append((i, ncnn_tokens, ref_tokens))
            if i == 0 or (i + 1) % 50 == 0:
                print(f"[{i + 1}/{args.n}] describe {desc_ok / (i + 1):.3f} count {count_ok / (i + 1):.3f}"
                      + (f" parity {same / (i + 1):.3f}" if ref is not None else "")
                      + f"  {time.time() - t0:.0f}s", flush=True)

        for i, scene, describe, count in failures[:args.show]:
            print(f"scene {i}: truth {scene.description()!r} ({scene.count})\n"
                  f"   describe {describe!r}\n   count {count!r}")
        for i, a, b in mismatches[:args.show]:
            k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            print(f"scene {i}: ncnn and PyTorch differ at new token {k}: "
                  f"ncnn {m.tokenizer.decode(a, False)!r} / torch {m.tokenizer.decode(b, False)!r}")
        n = max(args.n, 1)
        parity = same / n if ref is not None else math.nan
        print(f"describe_acc={desc_ok / n:.4f} count_acc={count_ok / n:.4f} parity={parity:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
