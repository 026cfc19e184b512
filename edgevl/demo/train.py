"""Train the offline demo model: a tiny Youtu-VL that describes synthetic scenes.

    python -m edgevl.demo.train --out edgevl/demo/model [--steps N] [--seed S] [--eval N]

Everything is seeded and runs on the CPU (2 threads by default):

1. a tokenizer corpus of scene QA text -> byte-level BPE with Youtu's pre-tokenizer, the
   Youtu-VL special tokens, ``<box>``/``</box>`` and 128 coordinate tokens ``<x_i>``/``<y_i>``;
2. the exact Youtu-VL architecture at a tiny size (``edgevl.reference.youtu_vl``): Siglip2-style
   vision tower with 64 px windows (a 128x128 image has 2x2 windows) and full-attention layers,
   the patch merger and an MLA language model;
3. training on freshly generated scenes (one stream, never repeated): the reference's own
   vision tower, merger and language model, cross-entropy on the answer tokens, plus an
   auxiliary loss that only training uses: a linear probe on each merger row (one 32x32 px
   cell) predicts the shape and the colour covering that cell. With the LM loss alone the
   vision tower learned shapes too slowly for a CPU budget (describe accuracy 0.10 after 40
   minutes); the probe gives it a dense signal. The probe is not saved: the shipped model is
   exactly the Youtu-VL architecture;
4. the checkpoint in the real Youtu-VL layout (config.json, model.safetensors, tokenizer files,
   chat_template.jinja, generation_config.json, preprocessor_config.json) plus train_log.json.

Prompts are built exactly the way the runtime builds them (``edgevl.generate.prepare``): the
chat template rendered by ``edgevl.tokenizer.Tokenizer``, tokenized without special tokens, the
single ``<|image_pad|>`` expanded to ``num_image_tokens`` copies; pixels come from
``edgevl.processing.siglip2.preprocess``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

from edgevl.demo import scenes as S
from edgevl.demo.evaluate import score
from edgevl.demo.tokenizer import EOS, save_tokenizer, train_tokenizer
from edgevl.processing.siglip2 import preprocess
from edgevl.models.youtu_vl import YOUTU_VL_TEMPLATE
from edgevl.tokenizer import Tokenizer

MAX_IMAGE_PATCHES = 64          # 128x128 -> 8x8 patches -> 16 image tokens
N_COORDINATES = S.IMAGE_SIZE    # <x_0>..<x_127>, <y_0>..<y_127>
BPE_VOCAB = 512
DEFAULT_STEPS = 7000
DEFAULT_BATCH = 32
DEFAULT_LR = 4e-4

# How often each question kind is trained (renormalised over the kinds a scene has).
KIND_WEIGHTS = {"describe": 0.35, "count": 0.2, "background": 0.05, "colour": 0.1, "shape": 0.1,
                "where": 0.1, "text": 0.1}
# Curriculum: the first part of training sees one shape per scene and mostly questions whose
# answer names it. Shape recognition has to be learned by the vision tower from the LM's loss;
# with 1-3 shapes and the full question mix from the start it is barely learned in the budget.
WARMUP_KIND_WEIGHTS = {"describe": 0.45, "shape": 0.25, "colour": 0.1, "count": 0.1, "background": 0.05,
                       "where": 0.05}
DEFAULT_CURRICULUM = 0.1        # fraction of the steps in the one-shape phase
MULTI_TURN_PROBABILITY = 0.1    # some rows are two-turn chats about one image

RUNTIME_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "generation_config.json", "preprocessor_config.json", "train_log.json")


def model_config(vocab_size: int, ids: dict) -> dict:
    """The demo model's config.json: real Youtu-VL layout and architecture, tiny sizes."""
    from edgevl.reference.youtu_vl import make_config

    hidden = 192
    return make_config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        max_position_embeddings=2048,
        rope_theta=500000.0,
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=None,
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
        vision_config={
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "window_size": 64,               # 2x2 merged cells per window: 4 windows in 128x128
            "fullatt_block_indexes": [1, 3],  # like the real [7, 15, 23, 26]: periodic + last
            "out_hidden_size": hidden,
            "num_patches": MAX_IMAGE_PATCHES,
        },
    )


# ---------------------------------------------------------------------------------------------
# Prompts (exactly as edgevl.generate.prepare builds them)
# ---------------------------------------------------------------------------------------------


class PromptBuilder:
    def __init__(self, folder):
        self.tok = Tokenizer(folder)
        self.eos = self.tok.token_to_id(EOS)
        self.image_token_id = self.tok.token_to_id("<|image_pad|>")
        self._cache: dict = {}

    def _ids(self, messages, n_image_tokens: int) -> list[int]:
        key = (json.dumps(messages), n_image_tokens)
        if key not in self._cache:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True)
            ids = self.tok.encode(text)
            if ids.count(self.image_token_id) != 1:
                n = ids.count(self.image_token_id)
                raise RuntimeError(f"expected one <|image_pad|> in the rendered prompt, got {n}")
            out = []
            for t in ids:
                out += [t] * n_image_tokens if t == self.image_token_id else [t]
            self._cache[key] = out
        return list(self._cache[key])

    def prompt(self, question: str, n_image_tokens: int) -> list[int]:
        """Single-turn prompt ids: user(image, question) + the generation prompt."""
        return self._ids([user_message(question)], n_image_tokens)

    def answer(self, text: str) -> list[int]:
        return self.tok.encode(text) + [self.eos]

    def row(self, turns, n_image_tokens: int) -> tuple[list[int], list[int]]:
        """(input_ids, labels) for a chat of (question, answer) turns about one image.

        Labels are the answer tokens plus <|end_of_text|>; everything else is -100. The history
        turns are rendered by the chat template itself and checked against the pieces.
        """
        messages = []
        ids: list[int] = []
        labels: list[int] = []
        for i, (q, a) in enumerate(turns):
            messages.append(user_message(q) if i == 0 else {"role": "user", "content": q})
            full = self._ids(messages, n_image_tokens)
            if full[:len(ids)] != ids:
                raise RuntimeError("chat template history does not tokenize as its pieces")
            labels += [-100] * (len(full) - len(ids))
            ans = self.answer(a)
            ids, labels = full + ans, labels + ans
            messages.append({"role": "assistant", "content": a})
        return ids, labels


def user_message(question: str) -> dict:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}


def image_inputs(image) -> dict:
    return preprocess(image, MAX_IMAGE_PATCHES)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def sample_turns(scene: S.Scene, rng: random.Random, n_turns: int,
                 weights: dict = KIND_WEIGHTS) -> list[tuple[str, str]]:
    by_kind: dict[str, list] = {}
    for kind, q, a in scene.qa_items():
        by_kind.setdefault(kind, []).append((q, a))
    turns = []
    for _ in range(n_turns):
        kinds = [k for k in weights if k in by_kind]
        kind = rng.choices(kinds, weights=[weights[k] for k in kinds])[0]
        turns.append(rng.choice(by_kind[kind]))
    return turns


def make_batch(rng: random.Random, builder: PromptBuilder, batch: int, one_shape: bool = False):
    import torch

    rows, labels, pixels, shape, aux_s, aux_c, aux_n = [], [], [], None, [], [], []
    for _ in range(batch):
        scene = S.make_scene(rng, 1 if one_shape else None)
        n_turns = 2 if rng.random() < MULTI_TURN_PROBABILITY else 1
        inp = image_inputs(scene.image)
        if shape is None:
            shape = inp["spatial_shapes"]
        elif inp["spatial_shapes"] != shape:
            raise RuntimeError("all training images must have the same size")
        weights = WARMUP_KIND_WEIGHTS if one_shape else KIND_WEIGHTS
        ids, lab = builder.row(sample_turns(scene, rng, n_turns, weights), inp["num_image_tokens"])
        rows.append(ids)
        labels.append(lab)
        pixels.append(inp["pixel_values"])
        a_s, a_c, a_n = cell_labels(scene)
        aux_s.append(a_s)
        aux_c.append(a_c)
        aux_n.append(a_n)
    width = max(len(r) for r in rows)
    # Right padding is invisible to the (causal) positions before it; its labels are ignored.
    ids_t = torch.full((batch, width), builder.eos, dtype=torch.long)
    lab_t = torch.full((batch, width), -100, dtype=torch.long)
    for i, (r, lab) in enumerate(zip(rows, labels)):
        ids_t[i, :len(r)] = torch.tensor(r)
        lab_t[i, :len(lab)] = torch.tensor(lab)
    aux = (torch.tensor(aux_s), torch.tensor(aux_c), torch.tensor(aux_n))
    return ids_t, torch.from_numpy(np.stack(pixels)), shape, lab_t, aux


def train_losses(model, probe, input_ids, pixels, shape, labels, aux):
    """(LM loss, probe loss, probe shape accuracy): the reference's forward, split open at the merger."""
    import torch.nn.functional as F

    merged, _ = model._vision(pixels, shape)                 # [B, cells, D]
    emb = model.model.embed_tokens(input_ids).clone()
    emb[input_ids == model.image_token_id] = merged.reshape(-1, merged.shape[-1])
    h = model.model(inputs_embeds=emb, use_cache=False).last_hidden_state
    logits = model.lm_head(h)
    lm = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    p = probe(merged)
    ns = len(AUX_SHAPES)
    nc = len(AUX_COLOURS)
    ps, pc, pn = p[..., :ns].reshape(-1, ns), p[..., ns:ns + nc].reshape(-1, nc), p[..., ns + nc:].reshape(-1, 2)
    ys, yc, yn = aux[0].reshape(-1), aux[1].reshape(-1), aux[2].reshape(-1)
    aux_loss = F.cross_entropy(ps, ys) + F.cross_entropy(pc, yc) + F.cross_entropy(pn, yn)
    on = ys > 0
    acc = float((ps.argmax(-1)[on] == ys[on]).float().mean()) if bool(on.any()) else float("nan")
    return lm, aux_loss, acc


CELL = 32                       # one merger row = 2x2 patches of 16 px
AUX_SHAPES = ("none",) + S.SHAPES + ("text",)
AUX_COLOURS = ("none",) + tuple(S.COLOURS)
AUX_MIN_PIXELS = 48             # a cell shows a shape when this many of its pixels are painted


def cell_labels(scene: S.Scene) -> tuple[list[int], list[int], list[int]]:
    """(shape class, colour class, holds-a-centre) per merger row (row-major 32 px cells).

    The third label marks the cell holding each shape's bbox centre: one per shape, so the
    features say how many shapes there are (a large shape covers several cells).
    """
    n = S.IMAGE_SIZE // CELL
    best = np.zeros((n, n), dtype=np.int64)
    shape_lab = np.zeros((n, n), dtype=np.int64)
    colour_lab = np.zeros((n, n), dtype=np.int64)
    centre = np.zeros((n, n), dtype=np.int64)
    for s in scene.shapes:
        cx, cy = s.center
        centre[min(int(cy) // CELL, n - 1), min(int(cx) // CELL, n - 1)] = 1
        m = (np.asarray(S.shape_mask(s)) > 0).reshape(n, CELL, n, CELL).sum(axis=(1, 3))
        take = (m >= AUX_MIN_PIXELS) & (m > best)
        best[take] = m[take]
        shape_lab[take] = AUX_SHAPES.index(s.shape)
        colour_lab[take] = AUX_COLOURS.index(s.colour)
    if scene.text_bbox is not None:
        x1, y1, x2, y2 = scene.text_bbox
        for cy in range(y1 // CELL, y2 // CELL + 1):
            for cx in range(x1 // CELL, x2 // CELL + 1):
                if best[cy, cx] == 0:
                    shape_lab[cy, cx] = AUX_SHAPES.index("text")
    return shape_lab.reshape(-1).tolist(), colour_lab.reshape(-1).tolist(), centre.reshape(-1).tolist()


def tokenizer_corpus(seed: int, n: int = 3000) -> list[str]:
    rng = random.Random(f"edgevl-demo-tokenizer-{seed}")
    texts = ["system\nYou are a helpful assistant.", "user\n", "assistant\n"]
    for _ in range(n):
        for q, a in S.make_scene(rng).qa():
            texts += [q, a]
    return texts


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


def init_weights(model, seed: int) -> None:
    """GPT-style init: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2 layers)."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(seed)
    n_text = len(model.model.layers)
    n_vis = len(model.siglip2.vision_model.encoder.layers)
    with torch.no_grad():
        for name, mod in sorted(model.named_modules(), key=lambda x: x[0]):
            if isinstance(mod, nn.Linear):
                if name == "lm_head" and model.tied:
                    continue
                std = 0.02
                leaf = name.rsplit(".", 1)[-1]
                if leaf in ("o_proj", "down_proj"):
                    std /= math.sqrt(2 * n_text)
                elif leaf in ("out_proj", "fc2"):
                    std /= math.sqrt(2 * n_vis)
                mod.weight.copy_(std * torch.randn(mod.weight.shape, generator=g))
                if mod.bias is not None:
                    mod.bias.zero_()
            elif isinstance(mod, nn.Embedding):
                mod.weight.copy_(0.02 * torch.randn(mod.weight.shape, generator=g))
            elif isinstance(mod, nn.LayerNorm):
                mod.weight.fill_(1.0)
                mod.bias.zero_()
            elif hasattr(mod, "weight") and isinstance(mod.weight, nn.Parameter) and mod.weight.dim() == 1 \
                    and "norm" in type(mod).__name__.lower():
                mod.weight.fill_(1.0)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Reference evaluation (PyTorch greedy decoding)
# ---------------------------------------------------------------------------------------------


def reference_answer(model, builder: PromptBuilder, scene: S.Scene, question: str, max_new_tokens: int = 64,
                     inputs: dict | None = None) -> tuple[list[int], str]:
    inp = inputs or image_inputs(scene.image)
    ids = builder.prompt(question, inp["num_image_tokens"])
    new = model.greedy_generate(ids, inp["pixel_values"], inp["spatial_shapes"], max_new_tokens=max_new_tokens,
                                eos_token_id=builder.eos)
    return new, builder.tok.decode(new)


def reference_eval(model, builder: PromptBuilder, seed, n: int, verbose: int = 0) -> dict:
    """Greedy accuracy of the PyTorch model on ``n`` fresh scenes from ``seed``."""
    desc_ok = count_ok = 0
    failures = []
    for i, scene in enumerate(S.make_scenes(seed, n)):
        inp = image_inputs(scene.image)
        _, desc = reference_answer(model, builder, scene, S.DESCRIBE_Q, inputs=inp)
        _, cnt = reference_answer(model, builder, scene, S.COUNT_Q, max_new_tokens=8, inputs=inp)
        d, c = score(desc, cnt, scene)
        desc_ok += d
        count_ok += c
        if not (d and c):
            failures.append({"scene": i, "truth": scene.description(), "describe": desc, "count": cnt,
                             "true_count": scene.count})
    for f in failures[:verbose]:
        print(f"  scene {f['scene']}: truth {f['truth']!r}\n    got {f['describe']!r} / {f['count']!r}")
    return {"describe_acc": desc_ok / n, "count_acc": count_ok / n, "n": n, "seed": seed,
            "failures": len(failures)}


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------


def write_side_files(out: Path, cfg: dict) -> None:
    eos = cfg["eos_token_id"]
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": [eos], "pad_token_id": eos,
           "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    pre = {
        "image_processor_type": "Siglip2ImageProcessorFast",
        "processor_class": "YoutuVLProcessor",
        "do_resize": True, "resample": 2,
        "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "patch_size": 16, "merge_size": 2,
        # The demo model was trained on 128x128 images only: 8x8 patches, 16 image tokens.
        "max_num_patches": MAX_IMAGE_PATCHES,
        "max_image_patches": MAX_IMAGE_PATCHES,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def plot_log(log: dict, path) -> None:
    """Training curve (smoothed LM loss) and the periodic describe/count accuracies, with Pillow."""
    from PIL import Image, ImageDraw

    hist, evals = log["history"], log.get("evals", [])
    W, H, L, R, T, B = 760, 320, 60, 60, 30, 40
    im = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(im)
    steps = max(h["step"] for h in hist)
    top = max(h["smoothed"] for h in hist[1:]) if len(hist) > 1 else 1.0
    x = lambda s: L + (W - L - R) * s / steps  # noqa: E731
    y_loss = lambda v: T + (H - T - B) * (1 - min(v, top) / top)  # noqa: E731
    y_acc = lambda a: T + (H - T - B) * (1 - a)  # noqa: E731
    d.rectangle((L, T, W - R, H - B), outline="black")
    d.line([(x(h["step"]), y_loss(h["smoothed"])) for h in hist], fill="#4363d8", width=2)
    for key, colour in (("describe_acc", "#e6194b"), ("count_acc", "#3cb44b")):
        pts = [(x(e["step"]), y_acc(e[key])) for e in evals]
        if len(pts) > 1:
            d.line(pts, fill=colour, width=2)
        for px, py in pts:
            d.ellipse((px - 3, py - 3, px + 3, py + 3), fill=colour)
    for frac in (0, 0.5, 1):
        d.text((W - R + 6, y_acc(frac) - 6), f"{frac:.1f}", fill="black")
        d.text((6, y_loss(top * frac) - 6), f"{top * frac:.2f}", fill="#4363d8")
        d.text((x(steps * frac) - 12, H - B + 6), f"{int(steps * frac)}", fill="black")
    d.text((L, 8), f"demo training: smoothed LM loss (blue, left), describe (red) / count (green) accuracy "
                   f"(right, 50 scenes); {log['seconds'] / 60:.0f} min, {log['threads']} threads", fill="black")
    d.text((W // 2 - 20, H - 18), "step", fill="black")
    im.save(path)


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))


def main(argv=None) -> int:
    # On a shared machine spinning OpenMP threads slow a 2-thread run down several times; this
    # only takes effect when torch is imported here, first.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    ap = argparse.ArgumentParser(prog="python -m edgevl.demo.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="edgevl/demo/model", help="output folder (default: edgevl/demo/model)")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    ap.add_argument("--lr", type=float, default=DEFAULT_LR)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--curriculum", type=float, default=DEFAULT_CURRICULUM,
                    help="fraction of the steps trained on one-shape scenes first (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--aux-weight", type=float, default=1.0, help="weight of the auxiliary cell probe loss")
    ap.add_argument("--eval", type=int, default=200, metavar="N",
                    help="after training, greedy-evaluate the PyTorch model on N fresh scenes (0 = skip)")
    ap.add_argument("--eval-seed", type=int, default=1234, help="seed of the evaluation scenes")
    ap.add_argument("--eval-every", type=int, default=0, metavar="K", help="also evaluate (50 scenes) every K steps")
    ap.add_argument("--plot", default=None, metavar="PNG", help="draw the training curve here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.batch < 1:
        ap.error("--steps and --batch must be at least 1")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        ap.error(f"--out {args.out} exists and is not a folder; pick a folder path")
    if args.plot and not Path(args.plot).resolve().parent.is_dir():
        ap.error(f"--plot {args.plot}: its folder does not exist; create it or pick another path")

    import torch

    from edgevl.reference.youtu_vl import YoutuVLForConditionalGeneration

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in RUNTIME_FILES:  # never leave a stale mix of old and new files
        (out / name).unlink(missing_ok=True)

    t0 = time.time()
    tok = train_tokenizer(tokenizer_corpus(args.seed), vocab_size=BPE_VOCAB, vision=True, n_coordinates=N_COORDINATES)
    ids = save_tokenizer(tok, out, chat_template=YOUTU_VL_TEMPLATE)
    vocab = tok.get_vocab_size()
    builder = PromptBuilder(out)
    cfg = model_config(vocab, ids)
    model = YoutuVLForConditionalGeneration(cfg)
    init_weights(model, args.seed)
    n_params = count_parameters(model)
    print(f"vocab {vocab}, parameters {n_params:,} ({n_params * 4 / 2**20:.1f} MiB fp32); "
          f"{args.steps} steps of batch {args.batch}, {args.threads} threads", flush=True)

    probe = torch.nn.Linear(cfg["hidden_size"], len(AUX_SHAPES) + len(AUX_COLOURS) + 2)
    decay, no_decay = [], []
    for name, p in list(model.named_parameters()) + [("probe." + n, p) for n, p in probe.named_parameters()]:
        (no_decay if p.dim() < 2 or "embed" in name else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    rng = random.Random(f"edgevl-demo-train-{args.seed}")
    history, evals = [], []
    running = None
    t_train = time.time()
    model.train()
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        one_shape = step < args.curriculum * args.steps
        input_ids, pixels, shape, labels, aux = make_batch(rng, builder, args.batch, one_shape)
        lm_loss, aux_loss, aux_acc = train_losses(model, probe, input_ids, pixels, shape, labels, aux)
        loss = lm_loss + args.aux_weight * aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(probe.parameters()), 1.0)
        opt.step()
        val = float(lm_loss.detach())
        running = val if running is None else 0.95 * running + 0.05 * val
        if (step + 1) % 50 == 0 or step == 0 or step + 1 == args.steps:
            el = time.time() - t_train
            history.append({"step": step + 1, "loss": round(val, 5), "smoothed": round(running, 5),
                            "aux_loss": round(float(aux_loss.detach()), 5), "aux_shape_acc": round(aux_acc, 4),
                            "lr": lr, "seconds": round(el, 1)})
            print(f"step {step + 1:5d}  loss {val:.4f}  (smoothed {running:.4f})  aux {float(aux_loss.detach()):.3f} "
                  f"shape-cells {aux_acc:.3f}  lr {lr:.2e}  {el:7.1f}s", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            model.eval()
            r = reference_eval(model, builder, args.eval_seed + 1, 50)
            model.train()
            r["step"] = step + 1
            evals.append(r)
            print(f"  eval@{step + 1}: describe {r['describe_acc']:.3f} count {r['count_acc']:.3f}", flush=True)
    train_seconds = time.time() - t_train
    model.eval()

    model.save_pretrained(out)
    write_side_files(out, cfg)
    log = {
        "steps": args.steps, "batch": args.batch, "lr": args.lr, "warmup": args.warmup, "seed": args.seed,
        "curriculum": args.curriculum, "aux_weight": args.aux_weight,
        "seconds": round(train_seconds, 1), "total_seconds": round(time.time() - t0, 1),
        "final_loss": history[-1]["loss"], "final_smoothed_loss": history[-1]["smoothed"],
        "parameters": n_params, "vocab_size": vocab,
        "torch_version": torch.__version__, "threads": torch.get_num_threads(),
        "python": sys.version.split()[0], "history": history, "evals": evals,
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    if args.plot:
        plot_log(log, args.plot)
    print(f"saved {out} after {train_seconds:.0f}s of training", flush=True)

    if args.eval:
        # Evaluate what was saved, loaded back the way users load it.
        loaded = YoutuVLForConditionalGeneration.from_pretrained(out)
        t1 = time.time()
        r = reference_eval(loaded, builder, args.eval_seed, args.eval, verbose=5)
        r["seconds"] = round(time.time() - t1, 1)
        log["reference_eval"] = r
        (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
        print(f"describe_acc={r['describe_acc']:.4f} count_acc={r['count_acc']:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
