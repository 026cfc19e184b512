"""Score the demo model through ncnn on every skill, and check it against the PyTorch reference.

    python -m edgevl.verification.demo_evaluate --seed S --n 200 [--model PATH]

For each of ``n`` fresh scenes (seeded stream ``S``) the ncnn model (``edgevl.load``) is asked,
greedily, every question the scene answers (``Scene.qa_items``), through the path
``edgevl.generate`` takes (``edgevl.generate.prepare`` + ``Model.generate_tokens``):

- describe: "Describe the image." is right when it names exactly the scene's set of
  (colour, shape) pairs;
- count: "How many shapes are there?" gives the right number;
- colour: "What color is the star?" (each shape kind the scene has once) names its colour;
- shape: "What is the blue shape?" (each colour the scene has once) names its shape;
- background: "What color is the background?" names the background;
- grounding: "Where is the star?" (each shape kind the scene has once) gives a box whose IoU
  with the star's true box is above 0.5 (a detail line says how many wrong boxes land on another
  shape of the scene and how many on none, the one-shape scenes' score, and what a perfect box
  around a randomly chosen shape of the scene would score);
- reading: "What is written?" on scenes that show a word gives that word (on the others the
  answer "Nothing." is counted separately).

Parity: for every question, the ncnn greedy tokens must be the PyTorch reference's greedy tokens
(``YoutuVLForConditionalGeneration`` in fp32) on the same input ids. It is checked with one
batched reference forward pass per scene over the prompts followed by the ncnn tokens: the
reference's argmax at every answer position must be the next ncnn token (the eos included), which
holds exactly when the reference's own greedy decoding would produce the same tokens (up to
rounding differences between one batched pass and step-by-step decoding, which matter only
where two logits nearly tie).

``--model`` is a converted package (its reference checkpoint is the one it was converted from,
or ``--reference``) or a checkpoint folder (converted to a temporary fp32 package). Without it
the shipped demo model is used. Each skill is printed on its own line; the last line printed is
always ``describe_acc=<f> count_acc=<f> grounding_acc=<f> parity=<f>`` followed by
``colour_acc``, ``shape_acc``, ``background_acc``, ``reading_acc`` and ``nothing_acc``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

from edgevl.demo import DEMO_CHECKPOINT
from edgevl.demo import scenes as S

DEMO_DIR = DEMO_CHECKPOINT  # the shipped demo model
MAX_NEW_TOKENS = 64

# Skills in report order: (key, question kind in Scene.qa_items, what the line says).
SKILLS = (
    ("describe", "describe", "names exactly the scene's (colour, shape) pairs"),
    ("count", "count", "right number of shapes"),
    ("colour", "colour", "'What color is the <shape>?'"),
    ("shape", "shape", "'What is the <colour> shape?'"),
    ("background", "background", "background colour"),
    ("grounding", "where", "'Where is the <shape>?': IoU > 0.5 with that shape"),
    ("reading", "text", "'What is written?' on scenes with a word"),
    ("nothing", "text", "'What is written?' -> 'Nothing.' on scenes without one"),
)
SUMMARY_KEYS = ("describe", "count", "grounding", "parity", "colour", "shape", "background", "reading", "nothing")

_COLOUR_RE = re.compile(r"\b(" + "|".join(list(S.COLOURS) + list(S.BACKGROUNDS)) + r")\b", re.I)
_SHAPE_RE = re.compile(r"\b(" + "|".join(S.SHAPES) + r")s?\b", re.I)


def iou(a, b) -> float:
    """IoU of two inclusive pixel boxes (x1, y1, x2, y2)."""
    ix = max(0, min(a[2], b[2]) - max(a[0], b[0]) + 1)
    iy = max(0, min(a[3], b[3]) - max(a[1], b[1]) + 1)
    area = lambda r: max(0, r[2] - r[0] + 1) * max(0, r[3] - r[1] + 1)  # noqa: E731
    union = area(a) + area(b) - ix * iy
    return ix * iy / union if union > 0 else 0.0


def _first(regex, text: str) -> str | None:
    m = regex.search(text)
    return m.group(1).lower() if m else None


def judge(kind: str, answer: str, truth: str, scene: S.Scene) -> tuple[str, bool]:
    """(skill, right?) for the model's ``answer`` to a question of ``kind`` whose true answer is ``truth``."""
    if kind == "describe":
        return "describe", S.parse_description(answer) == scene.truth_pairs()
    if kind == "count":
        return "count", S.parse_count(answer) == scene.count
    if kind in ("colour", "background"):
        return kind, _first(_COLOUR_RE, answer) == _first(_COLOUR_RE, truth)
    if kind == "shape":
        return "shape", _first(_SHAPE_RE, answer) == _first(_SHAPE_RE, truth)
    if kind == "where":
        got = S.parse_box(answer)
        return "grounding", got is not None and iou(got, S.parse_box(truth)) > 0.5
    if kind == "text":
        ok = answer.strip().rstrip(".").strip().lower() == truth.strip().rstrip(".").lower()
        return ("reading" if scene.text is not None else "nothing"), ok
    raise ValueError(f"unknown question kind {kind!r}")


def score(describe: str, count: str, scene: S.Scene) -> tuple[bool, bool]:
    return judge("describe", describe, "", scene)[1], judge("count", count, "", scene)[1]


class Tally:
    """Right/asked per skill, plus token parity."""

    def __init__(self):
        self.right = {k: 0 for k, _, _ in SKILLS}
        self.asked = {k: 0 for k, _, _ in SKILLS}
        self.same = self.compared = 0
        # where grounding goes wrong: [questions, right, box on another shape, box on no shape,
        # one-shape-scene questions, right ones among them, chance of a perfect box around a random shape]
        self.where = [0, 0, 0, 0, 0, 0, 0.0]

    def add_where(self, answer: str, truth: str, scene: S.Scene) -> None:
        got, want = S.parse_box(answer), S.parse_box(truth)
        hits = [s for s in scene.shapes if got is not None and iou(got, s.bbox) > 0.5]
        right = got is not None and iou(got, want) > 0.5
        w = self.where
        w[0] += 1
        w[1] += right
        w[2] += bool(hits) and not right
        w[3] += not hits and not right
        w[4] += scene.count == 1
        w[5] += scene.count == 1 and right
        w[6] += sum(iou(s.bbox, want) > 0.5 for s in scene.shapes) / scene.count

    def add(self, skill: str, ok: bool) -> None:
        self.asked[skill] += 1
        self.right[skill] += bool(ok)

    def acc(self, skill: str) -> float:
        if skill == "parity":
            return self.same / self.compared if self.compared else math.nan
        return self.right[skill] / self.asked[skill] if self.asked[skill] else math.nan

    def as_dict(self) -> dict:
        return {f"{k}_acc" if k != "parity" else k: round(self.acc(k), 4) for k in SUMMARY_KEYS}

    def lines(self) -> list[str]:
        out = [f"{key:<11}{self.acc(key):.4f}  ({self.right[key]}/{self.asked[key]})  {what}"
               for key, _, what in SKILLS]
        n, right, other, nowhere, single, single_right, chance = self.where
        if n:
            out.append(f"  grounding detail: {other}/{n} boxes on another shape of the scene, {nowhere}/{n} on no "
                       f"shape; one-shape scenes {single_right}/{single}; a perfect box around a random shape "
                       f"of the scene would score {chance / n:.3f}")
        out.append(f"{'parity':<11}{self.acc('parity'):.4f}  ({self.same}/{self.compared})  "
                   "ncnn fp32 greedy tokens == PyTorch reference, every answer")
        return out

    def summary(self) -> str:
        return " ".join(f"{k}={v:.4f}" for k, v in self.as_dict().items())


def reference_choices(ref, inp: dict, asked) -> list[list[int]]:
    """For each (question, prompt ids, tokens): the reference's greedy choice after every prefix of
    ``tokens`` (one batched, teacher-forced fp32 forward pass for all questions about one image).

    Equal to ``tokens`` exactly when the reference's greedy decoding gives ``tokens``.
    """
    import torch

    rows = [ids + tokens for _, ids, tokens in asked]
    width = max(len(r) for r in rows)
    batch = torch.zeros((len(rows), width), dtype=torch.long)
    for j, r in enumerate(rows):
        # Right padding with the image token would add image rows; pad with the first prompt token.
        batch[j] = torch.tensor(r + [r[0]] * (width - len(r)))
    pixels = torch.as_tensor(inp["pixel_values"])[None].expand(len(rows), -1, -1)
    with torch.no_grad():
        logits = ref(batch, pixels, inp["spatial_shapes"]).logits
    out = []
    for j, (_, ids, tokens) in enumerate(asked):
        start = len(ids) - 1  # the logits at position p choose token p + 1
        out.append(logits[j, start:start + len(tokens)].argmax(-1).tolist())
    return out


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgevl.verification.demo_evaluate",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1234, help="seed of the scene stream (never the training seed)")
    ap.add_argument("--n", type=int, default=200, help="number of scenes")
    ap.add_argument("--model", default=None, help="package or checkpoint folder (default: the shipped demo model)")
    ap.add_argument("--reference", default=None, help="reference checkpoint folder for the parity check")
    # The demo model is tiny: more threads gain nothing, and torch's and ncnn's OpenMP pools on
    # the same few cores slow each other down (200 scenes: 72 s with 1, 14 min with the defaults
    # on a loaded 2-core machine).
    ap.add_argument("--threads", type=int, default=1, help="ncnn and torch threads (default 1)")
    ap.add_argument("--no-parity", action="store_true", help="skip the PyTorch parity check (parity=nan)")
    ap.add_argument("--show", type=int, default=5, metavar="K", help="print the first K wrong answers")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error("--n must be at least 1")
    # the first line comes at once: loading torch and the models takes seconds
    print(f"[0/{args.n}] evaluating {args.n} scenes (seed {args.seed}), every question each scene answers; "
          "loading the models ...", flush=True)
    import edgevl
    from edgevl.generate import prepare
    from edgevl.models.youtu_vl.model import configured_max_patches
    from edgevl.models.youtu_vl.processing import preprocess

    with tempfile.TemporaryDirectory(prefix="edgevl-demo-eval-") as tmp:
        pkg, ref_dir = resolve(args.model, args.reference, Path(tmp))
        m = edgevl.load(pkg, threads=args.threads)
        ref = None
        if not args.no_parity:
            import torch

            from edgevl.verification.references.youtu_vl import YoutuVLForConditionalGeneration

            if args.threads:
                torch.set_num_threads(args.threads)
            ref = YoutuVLForConditionalGeneration.from_pretrained(ref_dir, dtype=torch.float32)
        mip = configured_max_patches(ref_dir)

        tally = Tally()
        wrong, mismatches = [], []
        t0 = time.time()
        for i, scene in enumerate(S.make_scenes(args.seed, args.n)):
            asked = []  # (question, prompt ids, ncnn tokens)
            for kind, question, truth in scene.qa_items():
                # The path ``edgevl.generate`` takes (128x128 scenes need no coordinate rescaling).
                prep = prepare(m, question, image=scene.image)
                tokens = list(m.generate_tokens(prep.input_ids, MAX_NEW_TOKENS, image=prep.image_rows))
                answer = m.tokenizer.decode([t for t in tokens if t not in m.eos_ids])
                skill, ok = judge(kind, answer, truth, scene)
                tally.add(skill, ok)
                if kind == "where":
                    tally.add_where(answer, truth, scene)
                if not ok:
                    wrong.append((i, question, truth, answer))
                asked.append((question, prep.input_ids, tokens))
            if ref is not None:
                inp = preprocess(scene.image, mip)
                for _question, ids, _tokens in asked:
                    if inp["num_image_tokens"] != ids.count(m.image_token_id):
                        raise SystemExit("the runtime and the reference preprocess the image to different sizes "
                                         f"({ids.count(m.image_token_id)} vs {inp['num_image_tokens']} tokens)")
                for (question, _, tokens), ref_tokens in zip(asked, reference_choices(ref, inp, asked)):
                    tally.compared += 1
                    if tokens == ref_tokens:
                        tally.same += 1
                    else:
                        mismatches.append((i, question, tokens, ref_tokens))
            if i == 0 or (i + 1) % 25 == 0 or i + 1 == args.n:
                print(f"[{i + 1}/{args.n}] describe {tally.acc('describe'):.3f} count {tally.acc('count'):.3f} "
                      f"grounding {tally.acc('grounding'):.3f}"
                      + (f" parity {tally.acc('parity'):.3f}" if ref is not None else "")
                      + f"  {time.time() - t0:.0f}s", flush=True)

        for i, question, truth, answer in wrong[:args.show]:
            print(f"scene {i}: {question!r} truth {truth!r} got {answer!r}")
        for i, question, a, b in mismatches[:args.show]:
            k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            print(f"scene {i} {question!r}: ncnn and PyTorch differ at new token {k}: ncnn "
                  f"{m.tokenizer.decode(a[:k + 1], False)!r} / torch {m.tokenizer.decode(b[:k + 1], False)!r}")
        for line in tally.lines():
            print(line)
        print(tally.summary(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
