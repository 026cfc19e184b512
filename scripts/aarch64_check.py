"""The two halves of the aarch64 check that scripts/check-aarch64.sh drives.

    host WORK              (x86 venv with torch) build tiny checkpoints, convert them, and write
                           WORK/cases.json + WORK/expected.npz: the PyTorch reference's greedy
                           tokens and teacher-forced logits, and host edgevl's tokens and logits
    target WORK LABEL      (emulated aarch64 Python: ncnn, numpy, Pillow, tokenizers, jinja2 —
                           no torch) run the same packages, write WORK/LABEL.json + .npz
    compare WORK LABEL... [DEMO.txt]
                           (host) print what was compared; exit 1 when the aarch64 demo answer or
                           an fp32 greedy token differs from x86 / the PyTorch reference, fp32
                           logits drift, fp16/bf16/q8 logits leave TOLERANCE of x86's, or KV-cache
                           decoding drifts from one pass

The aarch64 side only reads the converted packages: conversion is the user's one-off step and
runs on the host here (the demo command run by the shell script converts on aarch64 too).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# aarch64 against x86 on the same package: top-1 agreement, min logit cosine (at least as strict as
# the test suite's bounds against PyTorch fp32, tests/precision/test_youtu.py)
TOLERANCE = {"fp16": (0.98, 0.99), "bf16": (0.98, 0.99), "q8": (0.95, 0.98)}
FP32_MIN_COSINE = 0.99999  # the suite's per-layer bound for fp32
# the precision tests' prompts and lengths (tests/support/common.py PROMPTS, tests/support/precision.py
# N_NEW): 4 x 48 teacher-forced positions
YOUTU_PROMPTS = ["Describe the image in one sentence.", "How many shapes are there? 数一数。",
                 "def main():\n    return 42", "Zürich — “quotes”"]
N_YOUTU = 48
N_RANDOM_PROMPTS, N_RANDOM = 2, 32  # fp32 greedy on the random net, each KV-cache layout
VL_PROMPTS = ["Describe the image.", "How many shapes are there?", "Where is the green star?"]
N_VL = 24
SCENE_SEED = 37


def log(msg: str) -> None:
    print(f"[aarch64-check] {msg}", file=sys.stderr, flush=True)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-30)


# ----------------------------------------------------------------------------------------------
# shared by both sides: run one package on the cases


def _image(work: Path, name):
    from PIL import Image

    return None if name is None else Image.open(work / name).convert("RGB")


def run_package(work: Path, pk: dict, cases: list[dict], threads: int) -> dict:
    """Greedy tokens and teacher-forced logits of one package for its cases."""
    import edgevl
    from edgevl.generate import prepare

    model = edgevl.load(work / pk["path"], threads=threads)
    # one vision pass per image and package: emulated, it costs more than the decoding
    encode, encoded = model.encode_image, {}
    out = {}
    for c in cases:
        image = _image(work, c["image"])
        if image is not None:
            if c["image"] not in encoded:
                encoded[c["image"]] = encode(image)
            model.encode_image = lambda *_, e=encoded[c["image"]]: e
        prep = prepare(model, c["prompt"], image=image)
        r = {"ids": [int(t) for t in prep.input_ids]}
        if image is not None:
            r["pixel_values"] = model.vision.preprocess(image)["pixel_values"]
        if c["kind"] == "greedy":
            r["tokens"] = [int(t) for t in model.generate_tokens(prep.input_ids, c["n"], image=prep.encoded,
                                                                 reuse_cache=False, ignore_eos=True)]
        else:  # teacher-forced over the reference's greedy continuation
            seq = r["ids"] + c["continuation"]
            hidden, _ = model.decoder.forward(model.embed(seq, prep.image_rows), model.decoder.new_cache(),
                                              model.positions(seq, prep.images))
            r["logits"] = model.logits(hidden[len(r["ids"]) - 1:-1])
            if c.get("incremental"):  # the same positions through the KV cache, one token a step
                steps = [model.prefill(r["ids"], prep.image_rows, reuse_cache=False, images=prep.images)]
                steps += [model.step(t) for t in c["continuation"][:-1]]
                r["step_logits"] = np.stack(steps)
        out[c["name"]] = r
    return out


# ----------------------------------------------------------------------------------------------
# host


def _bf16_copy(src: Path, dst: Path, vl: bool) -> Path:
    """The same weights rounded to bf16, as real checkpoints ship (the suite's bf16/q8 case)."""
    import shutil

    import torch

    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name != "model.safetensors.index.json":
            shutil.copy(p, dst / p.name)
    if vl:
        from edgevl.verification.references.youtu_vl import YoutuVLForConditionalGeneration

        YoutuVLForConditionalGeneration.from_pretrained(src).save_pretrained(dst, dtype=torch.bfloat16)
    else:
        from transformers import YoutuForCausalLM

        YoutuForCausalLM.from_pretrained(src, dtype=torch.float32).to(torch.bfloat16).save_pretrained(dst)
    return dst


class Reference:
    """The fp32 PyTorch reference of one checkpoint (its architecture's): greedy tokens and
    teacher-forced logits."""

    def __init__(self, ck: Path):
        from edgevl import models, verification
        from edgevl.weights import Checkpoint

        self.ref = verification.get(models.resolve(Checkpoint(ck).config).name).reference(ck)

    def _images(self, image, infos):
        return None if image is None else self.ref.prepare_images([image], infos)

    def greedy(self, ids, n, image=None, infos=()) -> list[int]:
        return [int(t) for t in self.ref.greedy(ids, n, images=self._images(image, infos))]

    def logits(self, ids, continuation, image=None, infos=()) -> np.ndarray:
        _, logits = self.ref.text_states(list(ids) + list(continuation), self._images(image, infos))
        return logits[len(ids) - 1:-1]


def host(work: Path) -> None:
    import subprocess

    import torch

    torch.set_num_threads(1)
    import edgevl
    from edgevl import verification
    from edgevl.demo import demo_checkpoint
    from edgevl.demo.scenes import make_scene
    from edgevl.generate import prepare

    def make_youtu(folder, seed, train_steps=0):  # the test suite's Youtu-LLM checkpoints
        return verification.get("youtu").make_tiny(folder, "q_lora", seed=seed, train_steps=train_steps)

    t0 = time.time()
    ck = work / "checkpoints"
    cks = {
        # random weights: flat logits, so near-ties test the fp32 kernels' numerics
        "youtu-random": make_youtu(ck / "youtu-random", seed=1),
        # briefly trained (peaked logits), as the suite judges reduced precision
        "youtu-trained": make_youtu(ck / "youtu-trained", seed=12, train_steps=150),
        "demo-vl": demo_checkpoint(),
    }
    cks["youtu-trained-bf16"] = _bf16_copy(cks["youtu-trained"], ck / "youtu-trained-bf16", False)
    cks["demo-vl-bf16"] = _bf16_copy(cks["demo-vl"], ck / "demo-vl-bf16", True)
    log(f"host: checkpoints built ({time.time() - t0:.0f} s)")

    # package name -> (checkpoint, dtype, kv mode); fp16 from the fp32 checkpoint, bf16/q8 from bf16
    plan = {"youtu-random-fp32-absorbed": ("youtu-random", "fp32", "absorbed"),
            "youtu-random-fp32-expanded": ("youtu-random", "fp32", "expanded"),
            "youtu-trained-fp32": ("youtu-trained", "fp32", "absorbed"),
            "youtu-trained-fp16": ("youtu-trained", "fp16", "absorbed"),
            "youtu-trained-bf16": ("youtu-trained-bf16", "bf16", "absorbed"),
            "youtu-trained-q8": ("youtu-trained-bf16", "q8", "absorbed"),
            "demo-vl-fp32": ("demo-vl", "fp32", "expanded"),
            "demo-vl-fp16": ("demo-vl", "fp16", "expanded"),
            "demo-vl-bf16": ("demo-vl-bf16", "bf16", "expanded"),
            "demo-vl-q8": ("demo-vl-bf16", "q8", "expanded")}
    packages = {}
    for name, (ck_name, dtype, kv) in plan.items():
        edgevl.convert(cks[ck_name], work / "packages" / name, dtype=dtype, kv_cache=kv, progress=False)
        packages[name] = {"path": f"packages/{name}", "checkpoint": ck_name, "dtype": dtype}
    log(f"host: {len(packages)} packages converted ({time.time() - t0:.0f} s)")

    make_scene(SCENE_SEED).image.save(work / "scene.png")
    refs = {name: Reference(path) for name, path in cks.items()}
    expected: dict[str, np.ndarray] = {}
    cases: dict[str, list[dict]] = {p: [] for p in packages}

    def add(pk, kind, prompt, image, n, ref_ck, continuation=None):
        model = edgevl.load(work / packages[pk]["path"], threads=1)
        img = _image(work, image)
        prep = prepare(model, prompt, image=img)
        c = {"name": f"{pk}/{kind}/{len(cases[pk])}", "kind": kind, "prompt": prompt, "image": image, "n": n}
        if kind == "greedy":
            c["reference"] = refs[ref_ck].greedy(prep.input_ids, n, img, prep.images)
        else:
            c["continuation"] = continuation
            c["incremental"] = not any(x["kind"] == "forced" for x in cases[pk])
            expected[c["name"] + "/reference"] = refs[ref_ck].logits(prep.input_ids, continuation, img, prep.images)
        cases[pk].append(c)
        return c

    for pk in ("youtu-random-fp32-absorbed", "youtu-random-fp32-expanded"):
        greedy = [add(pk, "greedy", p, None, N_RANDOM, "youtu-random") for p in YOUTU_PROMPTS[:N_RANDOM_PROMPTS]]
        # greedy tokens alone missed fp16 arithmetic slipped into fp32 (tried): logits are checked too
        add(pk, "forced", YOUTU_PROMPTS[0], None, N_RANDOM, "youtu-random", continuation=greedy[0]["reference"])
    for p in YOUTU_PROMPTS:
        add("youtu-trained-fp32", "greedy", p, None, N_YOUTU, "youtu-trained")
    for p in VL_PROMPTS:
        add("demo-vl-fp32", "greedy", p, "scene.png", N_VL, "demo-vl")
    for fam, prompts, image, n in (("youtu-trained", YOUTU_PROMPTS, None, N_YOUTU),
                                   ("demo-vl", VL_PROMPTS, "scene.png", N_VL)):
        greedy = [c for c in cases[f"{fam}-fp32"] if c["kind"] == "greedy"]
        for dtype in ("fp32", "fp16", "bf16", "q8"):
            pk = f"{fam}-{dtype}"
            for p, g in zip(prompts, greedy):
                add(pk, "forced", p, image, n, packages[pk]["checkpoint"], continuation=g["reference"])
    log(f"host: PyTorch reference done ({time.time() - t0:.0f} s)")

    x86 = {}
    for pk, cs in cases.items():
        x86.update(run_package(work, packages[pk], cs, threads=1))
    _store(expected, x86, "x86")
    meta = {name: {"ids": r["ids"], **({"tokens": r["tokens"]} if "tokens" in r else {})} for name, r in x86.items()}
    log(f"host: x86 edgevl done ({time.time() - t0:.0f} s)")

    # the demo command exactly as the README shows it, in a private cache (it converts there)
    env = dict(os.environ, EDGEVL_CACHE=str(work / "x86-cache"), PYTHONPATH=str(ROOT))
    demo = subprocess.run([sys.executable, "-m", "edgevl", "run", "--image", "demo", "--seed", str(SCENE_SEED),
                           "--prompt", "Describe the image.", "--demo-out", str(work / "x86-demo.png")],
                          capture_output=True, text=True, env=env, cwd=work)
    if demo.returncode != 0:
        raise SystemExit(f"the demo command failed on the host:\n{demo.stderr}")
    np.savez(work / "expected.npz", **expected)
    (work / "cases.json").write_text(json.dumps(
        {"packages": packages, "cases": cases, "x86": meta, "x86_demo": demo.stdout}, ensure_ascii=False))
    log(f"host: done ({time.time() - t0:.0f} s)")


def _store(arrays: dict, results: dict, prefix: str) -> None:
    for name, r in results.items():
        for key in ("logits", "step_logits", "pixel_values"):
            if key in r:
                arrays[f"{name}/{prefix}/{key}"] = np.asarray(r[key], np.float32)


# ----------------------------------------------------------------------------------------------
# target


def fp16_options() -> dict:
    """What runtime.set_net_options chooses here for an fp16 package."""
    import ncnn

    from edgevl.runtime import set_net_options

    opt = ncnn.Option()
    set_net_options(opt, 1, "fp16")
    return {"use_fp16_storage": bool(opt.use_fp16_storage), "use_fp16_arithmetic": bool(opt.use_fp16_arithmetic)}


def _force_fp16_variant(variant: str) -> None:
    """Measurement only (ARM_FP16_VARIANT): run fp16 packages with chosen ncnn fp16 options."""
    import edgevl.runtime as rt

    plain = rt.set_net_options

    def options(opt, threads, dtype, packing=True):
        plain(opt, threads, dtype, packing)
        if dtype == "fp16":
            opt.use_fp16_storage = opt.use_fp16_packed = variant in ("storage", "arithmetic")
            opt.use_fp16_arithmetic = variant == "arithmetic"

    rt.set_net_options = options


def target(work: Path, label: str) -> None:
    import ncnn

    t0 = time.time()
    variant = os.environ.get("ARM_FP16_VARIANT")
    if variant:
        if variant not in ("off", "storage", "arithmetic"):
            raise SystemExit(f"ARM_FP16_VARIANT must be off, storage or arithmetic, got {variant!r}")
        _force_fp16_variant(variant)
    plan = json.loads((work / "cases.json").read_text())
    threads = int(os.environ.get("EDGEVL_THREADS", "1"))
    results, arrays = {}, {}
    for pk, cs in plan["cases"].items():
        res = run_package(work, plan["packages"][pk], cs, threads)
        _store(arrays, res, "arm")
        results.update({n: {k: v for k, v in r.items() if k in ("ids", "tokens")} for n, r in res.items()})
    np.savez(work / f"{label}.npz", **arrays)
    info = {"machine": platform.machine(), "python": platform.python_version(),
            "ncnn": getattr(ncnn, "__version__", "?"), "numpy": np.__version__,
            "asimdhp": bool(ncnn.cpu_support_arm_asimdhp()) if hasattr(ncnn, "cpu_support_arm_asimdhp") else None,
            "fp16_options": fp16_options(), "threads": threads, "seconds": round(time.time() - t0, 1),
            "cpu_seconds": round(time.process_time(), 1)}
    (work / f"{label}.json").write_text(json.dumps({"info": info, "results": results}))
    log(f"{label}: {len(results)} cases in {info['seconds']} s, {info['cpu_seconds']} s CPU (emulated: "
        "not a speed figure)")


# ----------------------------------------------------------------------------------------------
# compare


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def compare(work: Path, labels: list[str], demo_files: list[str]) -> int:
    plan = json.loads((work / "cases.json").read_text())
    exp = np.load(work / "expected.npz")
    failures: list[str] = []

    def fail(msg):
        failures.append(msg)
        print(f"  FAIL {msg}")

    print("demo command: edgevl run --image demo --seed 37 --prompt \"Describe the image.\"")
    print(f"  x86:     {plan['x86_demo'].strip()}")
    for f in demo_files:
        p = Path(f)
        got = p.read_text() if p.is_file() else ""
        print(f"  {p.stem}: {got.strip()}")
        if got.strip() != plan["x86_demo"].strip():
            fail(f"{p.stem}: the demo answer differs from x86's (see above)")

    for label in labels:
        res_file = work / f"{label}.json"
        if not res_file.is_file():
            fail(f"{label}: no results (the emulated run broke; its output is above)")
            continue
        got = json.loads(res_file.read_text())
        arm = np.load(work / f"{label}.npz")
        info = got["info"]
        opts = info["fp16_options"]
        print(f"\n{label}: {info['machine']} Python {info['python']}, ncnn {info['ncnn']}, numpy {info['numpy']}, "
              f"threads {info['threads']}; fp16 arithmetic in the CPU (asimdhp): {info['asimdhp']}; "
              f"fp16 packages run with fp16 storage {opts['use_fp16_storage']}, "
              f"arithmetic {opts['use_fp16_arithmetic']}")
        for pk, cases in plan["cases"].items():
            forced, greedy_ok = [], []
            for c in cases:
                name, r = c["name"], got["results"].get(c["name"])
                if r is None:
                    fail(f"{label} {name}: missing from the results")
                    continue
                if r["ids"] != plan["x86"][name]["ids"]:
                    fail(f"{label} {name}: the prompt's token ids differ from x86 (first at "
                         f"{_first_diff(r['ids'], plan['x86'][name]['ids'])}): image processing or tokenizer")
                    continue
                pv = f"{name}/arm/pixel_values"
                if pv in arm.files and not np.array_equal(arm[pv], exp[f"{name}/x86/pixel_values"]):
                    d = float(np.abs(arm[pv] - exp[f"{name}/x86/pixel_values"]).max())
                    print(f"  note {name}: pixel_values differ from x86 by up to {d:.3g}")
                if c["kind"] == "greedy":
                    if _greedy(label, c, r["tokens"], plan["x86"][name]["tokens"], fail):
                        greedy_ok.append(len(r["tokens"]))
                else:
                    forced.append((arm[f"{name}/arm/logits"], exp[f"{name}/x86/logits"], exp[f"{name}/reference"]))
                    if c.get("incremental"):
                        _incremental(label, name, plan["packages"][pk]["dtype"], arm[f"{name}/arm/step_logits"],
                                     arm[f"{name}/arm/logits"], fail)
            if greedy_ok:
                print(f"  ok   {pk}: fp32 greedy tokens identical to PyTorch and x86 for "
                      f"{len(greedy_ok)} prompts ({' + '.join(map(str, greedy_ok))} tokens)")
            if forced:
                _forced(label, pk, plan["packages"][pk]["dtype"], *(np.concatenate(x) for x in zip(*forced)),
                        fail=fail)

    print()
    if failures:
        print(f"aarch64 check FAILED: {len(failures)} problem(s):")
        for f in failures:
            print(f"  - {f}")
        return 1
    print("aarch64 check passed: the demo answer and every fp32 greedy token identical to x86 and to the "
          "PyTorch reference; fp16/bf16/q8 logits within TOLERANCE of x86's")
    return 0


def _greedy(label, c, arm, x86, fail):
    ref = c["reference"]
    d_ref, d_x86 = _first_diff(arm, ref), _first_diff(arm, x86)
    if d_ref is None and d_x86 is None:
        return True

    def at(seq, i):
        return seq[i] if i < len(seq) else "(none)"

    if d_ref is not None:
        fail(f"{label} {c['name']} ({c['prompt']!r}): fp32 greedy token {d_ref} is {at(arm, d_ref)}, "
             f"the PyTorch reference has {at(ref, d_ref)}")
    if d_x86 is not None:
        fail(f"{label} {c['name']}: fp32 greedy token {d_x86} is {at(arm, d_x86)}, x86 has {at(x86, d_x86)}")
    return False


def _agreement(a, b):
    return int((a.argmax(1) == b.argmax(1)).sum()), float(cosines(a, b).min())


def _tolerance(dtype):
    return (1.0, FP32_MIN_COSINE) if dtype == "fp32" else TOLERANCE[dtype]


def _incremental(label, name, dtype, steps, oneshot, fail):
    """Decoding through the KV cache (prefill, then one token a step) against one forward pass.
    Gated on the cosine (a broken cache collapses it); reduced precision may flip a near-tie."""
    n = oneshot.shape[0]
    top, cos = _agreement(steps, oneshot)
    tc = _tolerance(dtype)[1]
    line = f"{name}: KV-cache decoding vs one pass, top-1 {top}/{n}, min cos {cos:.6f}"
    if cos < tc or (dtype == "fp32" and top < n):
        fail(f"{label} {line} (needs cosine >= {tc}{', identical top-1' if dtype == 'fp32' else ''})")
    else:
        print(f"  ok   {line}")


def _forced(label, pk, dtype, arm, x86, ref, fail):
    """Teacher-forced logits over all prompts of one package. The gate is aarch64 vs x86 (the
    same package on the other ISA); the agreement of each with PyTorch fp32 is printed too."""
    n = ref.shape[0]
    top_x, cos_x = _agreement(arm, x86)
    top_r, cos_r = _agreement(arm, ref)
    top_xr, cos_xr = _agreement(x86, ref)
    line = (f"{pk} teacher-forced ({n} positions): aarch64 vs x86 top-1 {top_x}/{n}, min cos {cos_x:.6f} | "
            f"vs PyTorch fp32: aarch64 {top_r}/{n} {cos_r:.6f}, x86 {top_xr}/{n} {cos_xr:.6f}")
    t1, tc = _tolerance(dtype)
    bad = []
    if top_x / n < t1:
        bad.append(f"{dtype} top-1 agreement with x86 {top_x}/{n} < {t1}")
    if cos_x < tc:
        bad.append(f"{dtype} min logit cosine with x86 {cos_x:.6f} < {tc}")
    if bad:
        fail(f"{label} {line} — " + "; ".join(bad))
    else:
        print(f"  ok   {line}")


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "host":
        host(Path(argv[1]))
        return 0
    if len(argv) == 3 and argv[0] == "target":
        target(Path(argv[1]), argv[2])
        return 0
    if len(argv) >= 2 and argv[0] == "compare":
        labels = [a for a in argv[2:] if not a.endswith(".txt")]
        return compare(Path(argv[1]), labels, [a for a in argv[2:] if a.endswith(".txt")])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
