"""Train the offline demo model: a tiny Youtu-VL that describes and grounds synthetic scenes.

    python -m edgevl.verification.demo_train [--out FOLDER] [--steps N] [--seed S] [--eval N] [--init CHECKPOINT]

The model is written to a new folder (``./demo-model-N`` unless ``--out`` names one); a folder
that already holds a model, such as the shipped ``edgevl/demo/model``, is only replaced with
``--overwrite``. Everything is seeded and runs on the CPU (2 threads by default):

1. a tokenizer corpus of scene QA text -> byte-level BPE with Youtu's pre-tokenizer, the
   Youtu-VL special tokens, ``<box>``/``</box>`` and 128 coordinate tokens ``<x_i>``/``<y_i>``;
2. the exact Youtu-VL architecture at a tiny size (``edgevl.verification.references.youtu_vl``): Siglip2-style
   vision tower with 64 px windows (a 128x128 image has 2x2 windows) and full-attention layers,
   the patch merger and an MLA language model;
3. a vision-only phase (``pretrain_vision``): the vision tower and merger learn, through a
   linear probe on each merger row (one 32x32 px cell), the shape, colour, word, background and
   box of what covers that cell. The tower has no absolute position embedding, and with the
   language loss alone boxes were often one 16 px grid step off;
4. training on freshly generated scenes (one stream, never repeated): cross-entropy on the
   answer tokens (coordinate tokens with their neighbours as soft targets) on chats of 1-3
   questions per image, with many questions about one named shape ("Where is the star?"),
   plus training-only losses: the cell probe above (unless ``--freeze-vision``), and "the asked
   shape is here" -- ``ATTENTION_HEADS`` of layer ``ATTENTION_LAYER`` of the language model are
   trained to look, from every token of such an answer, at the cells of that shape (with
   ``--phrase-attention`` also from each phrase of a description at the shape it names).
   ``--freeze-vision`` keeps the tower and merger as the probes left them and trains the
   language model alone. Nothing of this is saved but the model: the checkpoint is exactly
   Youtu-VL;
5. the checkpoint in the real Youtu-VL layout (config.json, model.safetensors, tokenizer files,
   chat_template.jinja, generation_config.json, preprocessor_config.json) plus train_log.json.

Prompts are built exactly the way the runtime builds them (``edgevl.generate.prepare``): the
chat template rendered by ``edgevl.tokenizer.Tokenizer``, tokenized without special tokens, the
single ``<|image_pad|>`` expanded to ``num_image_tokens`` copies; pixels come from
``edgevl.models.youtu_vl.processing.preprocess``.

**The shipped model** (``edgevl/demo/model``; its ``train_log.json`` records the second run, the
first run's log is ``train_log.first_run.json`` beside it) was trained in two runs of this
file, 2 torch threads on the project's 2-core machine::

    python -m edgevl.verification.demo_train --out m1 --steps 7500 --vision-steps 3000 --freeze-vision --eval-every 1000
    python -m edgevl.verification.demo_train --init m1 --out m2 --steps 2500 --lr 2e-4 --warmup 100 \
        --freeze-vision --phrase-attention --eval-every 500 \
        --weights describe=0.25,shape=0.3,where=0.15,colour=0.1,count=0.05,background=0.02,text=0.13

The first run (81 minutes: 3000 vision steps, then the language model alone on the frozen
tower) gave grounding 0.997 on 200 scenes where the tower and language model trained together
had reached 0.27-0.42 (docs/demo-model.md); the second (30 minutes) trained
descriptions to look at each shape they name. Asking a shape's kind by its colour ("What is the
red shape?") stayed at about 0.67 in both: the attention heads find a shape by its kind, not by
its colour (docs/demo-model.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import resource
import sys
import time
from pathlib import Path

import numpy as np

from edgevl.demo import scenes as S
from edgevl.models.youtu_vl.model import CHAT_TEMPLATE as YOUTU_VL_TEMPLATE
from edgevl.models.youtu_vl.processing import preprocess
from edgevl.tokenizer import Tokenizer
from edgevl.verification.tokenizers import EOS, save_tokenizer, train_tokenizer

MAX_IMAGE_PATCHES = 64          # 128x128 -> 8x8 patches -> 16 image tokens
N_COORDINATES = S.IMAGE_SIZE    # <x_0>..<x_127>, <y_0>..<y_127>
BPE_VOCAB = 512
DEFAULT_STEPS = 7500
DEFAULT_BATCH = 32
DEFAULT_LR = 4e-4

# How often each question kind is trained (renormalised over the kinds a scene has). Grounding
# and the other questions about one named shape get a large share: they need the language model
# to find the shape asked about among the image tokens, which the descriptions never ask for.
KIND_WEIGHTS = {"describe": 0.22, "count": 0.08, "background": 0.03, "colour": 0.12, "shape": 0.12,
                "where": 0.3, "text": 0.13}
# Curriculum: the first part of training sees one shape per scene and mostly questions whose
# answer names it. Shape recognition has to be learned by the vision tower from the LM's loss;
# with 1-3 shapes and the full question mix from the start it is barely learned in the budget.
WARMUP_KIND_WEIGHTS = {"describe": 0.4, "shape": 0.2, "colour": 0.1, "count": 0.05, "background": 0.05,
                       "where": 0.15, "text": 0.05}
DEFAULT_CURRICULUM = 0.05       # fraction of the steps in the one-shape phase
DEFAULT_VISION_STEPS, DEFAULT_VISION_LR = 3000, 1e-3  # vision-only phase first (pretrain_vision)
# Rows are chats of 1-3 questions about one image: later turns reuse the image and prompt tokens,
# so a step trains more answers for little more compute. A description (it names every shape and
# where it is) is always the last turn, so no other answer can be copied from it.
TURNS = {1: 0.5, 2: 0.3, 3: 0.2}
SHARE = 0.3                     # scenes whose shapes share a colour or a kind (see scenes.make_scene)
# Coordinate answers: the target is spread over the neighbouring coordinate tokens of the same
# axis (a box 1-2 px off is still the right box), so nearby tokens learn similar embeddings.
COORD_SMOOTHING, COORD_SIGMA = 0.5, 1.5
# "The asked shape is here": in this LM layer, the attention of these heads from every position
# of an answer about one named shape (or about the written word) is trained to fall on the image
# cells that shape (word) covers.
ATTENTION_LAYER = 1
ATTENTION_HEADS = (0, 1, 2, 3)

RUNTIME_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "generation_config.json", "preprocessor_config.json", "train_log.json")


def model_config(vocab_size: int, ids: dict) -> dict:
    """The demo model's config.json: real Youtu-VL layout and architecture, tiny sizes."""
    from edgevl.verification.references.youtu_vl import make_config

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

    def row(self, turns, n_image_tokens: int) -> tuple[list[int], list[int], list[int]]:
        """(input_ids, labels, answer starts) for a chat of (question, answer) turns about one image.

        Labels are the answer tokens plus <|end_of_text|>; everything else is -100. The history
        turns are rendered by the chat template itself and checked against the pieces. Answer
        start k means the logits at position k - 1 choose the answer's first token.
        """
        messages = []
        ids: list[int] = []
        labels: list[int] = []
        starts: list[int] = []
        for i, (q, a) in enumerate(turns):
            messages.append(user_message(q) if i == 0 else {"role": "user", "content": q})
            full = self._ids(messages, n_image_tokens)
            if full[:len(ids)] != ids:
                raise RuntimeError("chat template history does not tokenize as its pieces")
            labels += [-100] * (len(full) - len(ids))
            starts.append(len(full))
            ans = self.answer(a)
            ids, labels = full + ans, labels + ans
            messages.append({"role": "assistant", "content": a})
        return ids, labels, starts


def user_message(question: str) -> dict:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}


def image_inputs(image) -> dict:
    return preprocess(image, MAX_IMAGE_PATCHES)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def sample_turns(scene: S.Scene, rng: random.Random, n_turns: int,
                 weights: dict = KIND_WEIGHTS) -> list[tuple[str, str, str]]:
    """``n_turns`` distinct (kind, question, answer) items; a description only as the last turn."""
    items = scene.qa_items()
    turns: list = []
    for _ in range(n_turns):
        left = [it for it in items if it not in turns and not (turns and turns[-1][0] == "describe")]
        kinds = sorted({k for k, _, _ in left}, key=list(weights).index) if left else []
        kinds = [k for k in kinds if k in weights]
        if not kinds:
            break
        kind = rng.choices(kinds, weights=[weights[k] for k in kinds])[0]
        turns.append(rng.choice([it for it in left if it[0] == kind]))
    describe = [t for t in turns if t[0] == "describe"]
    return [t for t in turns if t[0] != "describe"] + describe


_ASKED_SHAPE = re.compile(r"^(?:Where is|What color is) the (\w+)\?$")
_ASKED_COLOUR = re.compile(r"^What is the (\w+) shape\?$")


def asked_shape(scene: S.Scene, question: str) -> S.Shape | None:
    """The one shape a question is about ("Where is the star?", "What is the red shape?"), else None."""
    if m := _ASKED_SHAPE.match(question):
        hits = [s for s in scene.shapes if s.shape == m.group(1)]
    elif m := _ASKED_COLOUR.match(question):
        hits = [s for s in scene.shapes if s.colour == m.group(1)]
    else:
        return None
    return hits[0] if len(hits) == 1 else None


def cell_of(x: float, y: float) -> int:
    n = S.IMAGE_SIZE // CELL
    return min(int(y) // CELL, n - 1) * n + min(int(x) // CELL, n - 1)


def asked_cells(scene: S.Scene, question: str) -> list[int] | None:
    """The cells (1/0, row-major) holding what a question is about: the one named shape, or the
    written word for "What is written?"; None for questions about the whole scene."""
    target = asked_shape(scene, question)
    if target is not None:
        return shape_cells(target)
    if question == S.TEXT_Q and scene.text_bbox is not None:
        n = S.IMAGE_SIZE // CELL
        x1, y1, x2, y2 = scene.text_bbox
        out = np.zeros((n, n), dtype=int)
        out[y1 // CELL:y2 // CELL + 1, x1 // CELL:x2 // CELL + 1] = 1
        return out.reshape(-1).tolist()
    return None


def shape_cells(s: S.Shape) -> list[int]:
    """1 for each cell (row-major) the shape covers with at least AUX_MIN_PIXELS / 2 pixels, and its centre's cell."""
    n = S.IMAGE_SIZE // CELL
    cover = (np.asarray(S.shape_mask(s)) > 0).reshape(n, CELL, n, CELL).sum(axis=(1, 3)).reshape(-1)
    out = (cover >= AUX_MIN_PIXELS // 2).astype(int)
    out[cell_of(*s.center)] = 1
    return out.tolist()


def phrase_pointers(builder: PromptBuilder, scene: S.Scene, answer: str) -> list[tuple[int, list[int]]]:
    """(answer token index, cells) for a description: every token of "a <size> <colour> <kind>
    <position>" points at that shape's cells, so each phrase is read from the shape it names."""
    enc = builder.tok.tok.encode(answer, add_special_tokens=False)
    regions, cursor = [], 0
    for s in scene.shapes:
        at = answer.find(s.phrase(), cursor)
        if at < 0:
            return []
        regions.append((max(0, at - 2), at + len(s.phrase()), shape_cells(s)))
        cursor = at + len(s.phrase())
    out = []
    for k, (c0, c1) in enumerate(enc.offsets):
        for r0, r1, cover in regions:
            if c0 < r1 and c1 > r0:
                out.append((k, cover))
                break
    return out


def make_batch(rng: random.Random, builder: PromptBuilder, batch: int, one_shape: bool = False,
               phrases: bool = False, weights: dict | None = None):
    import torch

    rows, labels, pixels, shape, cells, pointers = [], [], [], None, [], []
    for b in range(batch):
        scene = S.make_scene(rng, 1 if one_shape else None, share=SHARE)
        n_turns = rng.choices(list(TURNS), weights=list(TURNS.values()))[0]
        inp = image_inputs(scene.image)
        if shape is None:
            shape = inp["spatial_shapes"]
        elif inp["spatial_shapes"] != shape:
            raise RuntimeError("all training images must have the same size")
        kind_weights = WARMUP_KIND_WEIGHTS if one_shape else (weights or KIND_WEIGHTS)
        turns = sample_turns(scene, rng, n_turns, kind_weights)
        ids, lab, starts = builder.row([(q, a) for _, q, a in turns], inp["num_image_tokens"])
        rows.append(ids)
        labels.append(lab)
        pixels.append(inp["pixel_values"])
        cells.append(cell_labels(scene))
        for (kind, q, a), start in zip(turns, starts):
            cover = asked_cells(scene, q)
            if cover is not None:
                for pos in range(start - 1, start - 1 + len(builder.answer(a))):
                    pointers.append((b, pos, *cover))
            elif phrases and kind == "describe":
                for k, cells_k in phrase_pointers(builder, scene, a):
                    pointers.append((b, start - 1 + k, *cells_k))
    width = max(len(r) for r in rows)
    # Right padding is invisible to the (causal) positions before it; its labels are ignored.
    ids_t = torch.full((batch, width), builder.eos, dtype=torch.long)
    lab_t = torch.full((batch, width), -100, dtype=torch.long)
    for i, (r, lab) in enumerate(zip(rows, labels)):
        ids_t[i, :len(r)] = torch.tensor(r)
        lab_t[i, :len(lab)] = torch.tensor(lab)
    aux = {k: torch.tensor(np.stack([c[k] for c in cells])) for k in cells[0]}
    aux["pointer"] = torch.tensor(pointers, dtype=torch.long).reshape(-1, 2 + (S.IMAGE_SIZE // CELL) ** 2)
    return ids_t, torch.from_numpy(np.stack(pixels)), shape, lab_t, aux


GRID_STEP = 16                  # coordinates split as (value // 16, value % 16): the patch, and the pixel in it


class Probes:
    """Training-only heads on the merger rows (thrown away; the shipped model is exactly Youtu-VL).

    A linear probe on each merger row (one 32x32 px cell) predicts the shape, the colour, "a
    shape's centre is here", the written word, and the four box coordinates of the shape covering
    the cell. A coordinate is predicted as its 16 px patch (8 classes) and its pixel in the patch
    (16 classes). The box is in image pixels, not relative to the cell, so every cell of a shape
    says the same box and an attention head that mixes them (values carry no position) still
    reads it. The vision tower has no absolute position embedding (only 2-D RoPE), so it must
    learn where it is from the image borders; this target teaches it that, which the language
    loss alone did not (a shape's box was often one 16 px grid step off).
    """

    def __init__(self, hidden: int):
        import torch

        n_patch = S.IMAGE_SIZE // GRID_STEP
        self.sizes = {"shape": len(AUX_SHAPES), "colour": len(AUX_COLOURS), "centre": 2,
                      "word": len(AUX_WORDS), "background": len(S.BACKGROUNDS), "box": 4 * (n_patch + GRID_STEP)}
        self.n_patch = n_patch
        self.cell = torch.nn.Linear(hidden, sum(self.sizes.values()))

    def named_parameters(self):
        for n, p in self.cell.named_parameters():
            yield f"probe.cell.{n}", p

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def split(self, merged):
        out, k = {}, 0
        p = self.cell(merged)
        for name, n in self.sizes.items():
            out[name] = p[..., k:k + n]
            k += n
        return out

    def loss(self, merged, aux) -> tuple:
        """(summed cross-entropies, {'cell_shape_acc', 'cell_box_acc'}) for merger rows [B, cells, D]."""
        import torch.nn.functional as F

        p = self.split(merged)
        flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        ys = aux["shape"].reshape(-1)
        loss = (F.cross_entropy(flat(p["shape"]), ys) + F.cross_entropy(flat(p["colour"]), aux["colour"].reshape(-1))
                + F.cross_entropy(flat(p["centre"]), aux["centre"].reshape(-1))
                + F.cross_entropy(flat(p["word"]), aux["word"].reshape(-1))
                + F.cross_entropy(flat(p["background"]), aux["background"].reshape(-1)))
        on = ys > 0
        stats = {"cell_shape_acc": float((flat(p["shape"]).argmax(-1)[on] == ys[on]).float().mean())
                 if bool(on.any()) else math.nan, "cell_box_acc": math.nan}
        yw = aux["word"].reshape(-1)
        stats["cell_word_acc"] = float((flat(p["word"]).argmax(-1)[yw > 0] == yw[yw > 0]).float().mean()) \
            if bool((yw > 0).any()) else math.nan
        box_on = aux["box_on"].reshape(-1) > 0
        if bool(box_on.any()):
            bx = flat(p["box"])[box_on].reshape(-1, 4, self.n_patch + GRID_STEP)
            want = aux["box"].reshape(-1, 4)[box_on]
            coarse, fine = bx[..., :self.n_patch], bx[..., self.n_patch:]
            loss = loss + F.cross_entropy(coarse.reshape(-1, self.n_patch), (want // GRID_STEP).reshape(-1)) \
                + F.cross_entropy(fine.reshape(-1, GRID_STEP), (want % GRID_STEP).reshape(-1))
            got = coarse.argmax(-1) * GRID_STEP + fine.argmax(-1)
            stats["cell_box_acc"] = float(((got - want).abs() <= 2).all(-1).float().mean())
        return loss, stats


def coordinate_ids(tok) -> dict[str, list[int]]:
    """{'x': [id of <x_0>, ...], 'y': [...]} from a tokenizer (empty lists when it has none)."""
    out = {}
    for axis in ("x", "y"):
        ids = []
        for i in range(N_COORDINATES):
            t = tok.token_to_id(f"<{axis}_{i}>")
            if t is None:
                break
            ids.append(t)
        out[axis] = ids
    return out


class CoordinateTargets:
    """Soft targets for coordinate tokens: (1 - eps) on the true token, eps spread as a Gaussian
    (sigma px) over the same axis's tokens."""

    def __init__(self, coord_ids: dict, vocab: int, eps: float = COORD_SMOOTHING, sigma: float = COORD_SIGMA):
        import torch

        self.eps = eps
        self.table = {}  # token id -> dense target row index
        rows = []
        for ids in coord_ids.values():
            pos = torch.arange(len(ids), dtype=torch.float32)
            for i, t in enumerate(ids):
                g = torch.exp(-0.5 * ((pos - i) / sigma) ** 2)
                row = torch.zeros(vocab)
                row[ids] = eps * g / g.sum()
                row[t] += 1 - eps
                self.table[t] = len(rows)
                rows.append(row)
        self.rows = torch.stack(rows) if rows else torch.zeros(0, vocab)
        self.lookup = torch.full((vocab,), -1, dtype=torch.long)
        for t, r in self.table.items():
            self.lookup[t] = r

    def loss(self, logits, labels):
        """Cross-entropy of next-token ``logits`` [B, L, V] against ``labels`` [B, L] (shifted here)."""
        import torch.nn.functional as F

        lg = logits[:, :-1].reshape(-1, logits.shape[-1])
        y = labels[:, 1:].reshape(-1)
        keep = y != -100
        lg, y = lg[keep], y[keep]
        if not self.eps or not len(self.rows):
            return F.cross_entropy(lg, y)
        r = self.lookup[y]
        coord = r >= 0
        logp = F.log_softmax(lg, dim=-1)
        nll = -logp.gather(1, y[:, None])[:, 0]
        if bool(coord.any()):
            nll = nll.clone()
            nll[coord] = -(self.rows[r[coord]] * logp[coord]).sum(-1)
        return nll.mean()


def train_losses(model, probes: Probes, targets: CoordinateTargets, input_ids, pixels, shape, labels, aux,
                 frozen_vision: bool = False):
    """(LM loss, auxiliary loss, stats): the reference's forward, split open at the merger and at
    one LM attention layer (whose attention probabilities the eager attention returns). With
    ``frozen_vision`` the tower runs without gradients and the cell probes are left out."""
    import torch

    if frozen_vision:
        with torch.no_grad():
            merged, _ = model._vision(pixels, shape)
    else:
        merged, _ = model._vision(pixels, shape)             # [B, cells, D]
    emb = model.model.embed_tokens(input_ids).clone()
    emb[input_ids == model.image_token_id] = merged.reshape(-1, merged.shape[-1])
    seen = []
    hook = model.model.layers[ATTENTION_LAYER].self_attn.register_forward_hook(lambda _m, _i, o: seen.append(o[1]))
    try:
        h = model.model(inputs_embeds=emb, use_cache=False).last_hidden_state
    finally:
        hook.remove()
    logits = model.lm_head(h)
    lm = targets.loss(logits, labels)

    if frozen_vision:
        probe = torch.zeros(())
        stats = {"cell_shape_acc": math.nan, "cell_box_acc": math.nan, "cell_word_acc": math.nan}
    else:
        probe, stats = probes.loss(merged, aux)
    ptr = aux["pointer"]
    if len(ptr):
        # all rows hold the image at the same positions (it is in the first user turn)
        image_pos = torch.nonzero(input_ids[0] == model.image_token_id)[:, 0]
        att = seen[0][ptr[:, 0]][:, list(ATTENTION_HEADS)]                      # [P, heads, L, L]
        att = att[torch.arange(len(ptr)), :, ptr[:, 1]][..., image_pos]           # [P, heads, cells]
        mass = (att * ptr[:, None, 2:]).sum(-1)
        probe = probe + -torch.log(mass + 1e-4).mean()
        stats["attention_mass"] = float(mass.detach().mean())
    else:
        stats["attention_mass"] = math.nan
    return lm, probe, stats


CELL = 32                       # one merger row = 2x2 patches of 16 px
AUX_SHAPES = ("none",) + S.SHAPES + ("text",)
AUX_COLOURS = ("none",) + tuple(S.COLOURS)
AUX_WORDS = ("none",) + S.WORDS
AUX_MIN_PIXELS = 48             # a cell shows a shape when this many of its pixels are painted


def cell_labels(scene: S.Scene) -> dict[str, np.ndarray]:
    """Per merger row (row-major 32 px cells): ``shape``/``colour`` class of the shape covering
    most of the cell, ``centre`` (holds a shape's bbox centre), ``word`` (the written word, on the
    cells its box touches), ``box`` (x1, y1, x2, y2 of the cell's shape, image pixels) with
    ``box_on`` where the cell has one, and ``background`` (the scene's, on every cell: a frozen
    tower must still say it).

    ``centre`` marks one cell per shape, so the features say how many shapes there are (a large
    shape covers several cells).
    """
    n = S.IMAGE_SIZE // CELL
    best = np.zeros((n, n), dtype=np.int64)
    shape_lab = np.zeros((n, n), dtype=np.int64)
    colour_lab = np.zeros((n, n), dtype=np.int64)
    centre = np.zeros((n, n), dtype=np.int64)
    word = np.zeros((n, n), dtype=np.int64)
    box = np.zeros((n, n, 4), dtype=np.int64)
    for s in scene.shapes:
        cx, cy = s.center
        centre[min(int(cy) // CELL, n - 1), min(int(cx) // CELL, n - 1)] = 1
        m = (np.asarray(S.shape_mask(s)) > 0).reshape(n, CELL, n, CELL).sum(axis=(1, 3))
        take = (m >= AUX_MIN_PIXELS) & (m > best)
        best[take] = m[take]
        shape_lab[take] = AUX_SHAPES.index(s.shape)
        colour_lab[take] = AUX_COLOURS.index(s.colour)
        box[take] = s.bbox
    if scene.text_bbox is not None:
        x1, y1, x2, y2 = scene.text_bbox
        for cy in range(y1 // CELL, y2 // CELL + 1):
            for cx in range(x1 // CELL, x2 // CELL + 1):
                word[cy, cx] = AUX_WORDS.index(scene.text)
                if best[cy, cx] == 0:
                    shape_lab[cy, cx] = AUX_SHAPES.index("text")
    return {"shape": shape_lab.reshape(-1), "colour": colour_lab.reshape(-1), "centre": centre.reshape(-1),
            "word": word.reshape(-1), "box": box.reshape(-1, 4), "box_on": (best > 0).astype(np.int64).reshape(-1),
            "background": np.full(n * n, list(S.BACKGROUNDS).index(scene.background), dtype=np.int64)}


def vision_batch(rng: random.Random, batch: int):
    """Pixels [B, N, D], spatial shape and cell labels of ``batch`` fresh scenes (no text)."""
    import torch

    pixels, cells, shape = [], [], None
    for _ in range(batch):
        scene = S.make_scene(rng, share=SHARE)
        inp = image_inputs(scene.image)
        shape = inp["spatial_shapes"]
        pixels.append(inp["pixel_values"])
        cells.append(cell_labels(scene))
    aux = {k: torch.tensor(np.stack([c[k] for c in cells])) for k in cells[0]}
    return torch.from_numpy(np.stack(pixels)), shape, aux


def pretrain_vision(model, probes: Probes, steps: int, batch: int, lr: float, seed: int, log: list) -> None:
    """Train the vision tower and merger on the cell probes alone, before the language model.

    A quarter of the cost of a full step, and the cell targets (above all the box, which needs
    absolute positions the tower has to find from the image borders) are learned in a few
    hundred steps this way, where mixed with the language loss from a random start they took
    thousands.
    """
    import torch

    params = list(model.siglip2.parameters()) + list(model.merger.parameters()) + probes.parameters()
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = random.Random(f"edgevl-demo-vision-{seed}")
    t0 = time.time()
    for step in range(steps):
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, steps, lr, min(100, steps // 10 + 1))
        pixels, shape, aux = vision_batch(rng, batch)
        merged, _ = model._vision(pixels, shape)
        loss, stats = probes.loss(merged, aux)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step + 1) % 100 == 0 or step + 1 == steps:
            log.append({"step": step + 1, "loss": round(float(loss.detach()), 5),
                        **{k: round(v, 4) for k, v in stats.items()}, "seconds": round(time.time() - t0, 1)})
            print(f"vision {step + 1:5d}  probes {float(loss.detach()):.3f}  "
                  f"shape-cells {stats['cell_shape_acc']:.3f}  box-cells {stats['cell_box_acc']:.3f}  "
                  f"word-cells {stats['cell_word_acc']:.3f}  {time.time() - t0:7.1f}s", flush=True)


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


def init_coordinate_embeddings(model, coord_ids: dict, seed: int) -> None:
    """Start <x_i>/<y_i> embeddings (tied to the output layer) as a sum of three random vectors:
    one for the axis, one for the 16 px patch i // 16 and one for the pixel i % 16 in it -- the
    same split the cell probe teaches the vision tower -- instead of 256 unrelated vectors.
    Neighbouring coordinates then start out similar, and a hidden state can pick a coordinate as
    a patch plus a pixel.
    """
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    emb = model.model.embed_tokens.weight
    d = emb.shape[1]
    with torch.no_grad():
        for ids in coord_ids.values():
            if not ids:
                continue
            i = torch.arange(len(ids))
            axis = torch.randn(d, generator=g)
            coarse = torch.randn(len(ids) // GRID_STEP + 1, d, generator=g)
            fine = torch.randn(GRID_STEP, d, generator=g)
            vec = axis + coarse[i // GRID_STEP] + fine[i % GRID_STEP]
            emb[ids] = vec / vec.std() * 0.02


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


def batched_greedy(model, prompts: list[list[int]], pixels, shape, eos: int,
                   max_new_tokens: int = 48) -> list[list[int]]:
    """Greedy answers to many prompts at once (each prompt's image row in ``pixels`` [B, N, D]).

    Recomputes the whole (short) sequence every step; rows are right padded, which the causal
    positions before the padding never see. Only for the quick evaluations during training.
    """
    import torch

    with torch.no_grad():
        merged, _ = model._vision(torch.as_tensor(pixels), shape)
        lens = [len(p) for p in prompts]
        ids = torch.full((len(prompts), max(lens) + max_new_tokens), eos, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.tensor(p)
        emb = model.model.embed_tokens(ids)
        emb[ids == model.image_token_id] = merged.reshape(-1, merged.shape[-1])
        out: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        for _ in range(max_new_tokens):
            width = max(lens[i] for i in active)
            h = model.model(inputs_embeds=emb[active, :width], use_cache=False).last_hidden_state
            last = h[torch.arange(len(active)), torch.tensor([lens[i] - 1 for i in active])]
            toks = model.lm_head(last).argmax(-1).tolist()
            still = []
            for i, t in zip(active, toks):
                out[i].append(t)
                emb[i, lens[i]] = model.model.embed_tokens.weight[t]
                lens[i] += 1
                if t != eos:
                    still.append(i)
            active = still
            if not active:
                break
    return out


def reference_eval(model, builder: PromptBuilder, seed, n: int, verbose: int = 0, chunk: int = 96) -> dict:
    """Greedy accuracy of the PyTorch model on every skill of ``n`` fresh scenes from ``seed``
    (the questions and scoring of ``edgevl.verification.demo_evaluate``)."""
    from edgevl.verification.demo_evaluate import Tally, judge

    tally = Tally()
    items = []  # (scene index, scene, kind, question, truth, pixels)
    shape = None
    for i, scene in enumerate(S.make_scenes(seed, n)):
        inp = image_inputs(scene.image)
        shape = inp["spatial_shapes"]
        for kind, q, a in scene.qa_items():
            items.append((i, scene, kind, q, a, inp))
    items.sort(key=lambda it: it[2] != "describe")  # descriptions are the long answers: batch them together
    failures = []
    for k in range(0, len(items), chunk):
        part = items[k:k + chunk]
        prompts = [builder.prompt(q, inp["num_image_tokens"]) for _, _, _, q, _, inp in part]
        pixels = np.stack([inp["pixel_values"] for *_, inp in part])
        longest = 48 if any(it[2] == "describe" for it in part) else 12  # a box is 7 tokens
        answers = batched_greedy(model, prompts, pixels, shape, builder.eos, longest)
        for (i, scene, kind, q, a, _), toks in zip(part, answers):
            text = builder.tok.decode([t for t in toks if t != builder.eos])
            skill, ok = judge(kind, text, a, scene)
            tally.add(skill, ok)
            if not ok:
                failures.append((i, q, a, text))
    for i, q, a, text in failures[:verbose]:
        print(f"  scene {i}: {q!r} truth {a!r} got {text!r}")
    r = {k: v for k, v in tally.as_dict().items() if k != "parity"}
    r.update({"n": n, "seed": seed, "questions": len(items)})
    return r


def format_eval(r: dict) -> str:
    return " ".join(f"{k.removesuffix('_acc')} {v:.3f}" for k, v in r.items() if k.endswith("_acc"))


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


SKILL_COLOURS = {"describe_acc": "#e6194b", "count_acc": "#3cb44b", "colour_acc": "#f58231",
                 "shape_acc": "#911eb4", "background_acc": "#a9a9a9", "grounding_acc": "#000000",
                 "reading_acc": "#42d4f4"}


def plot_log(log: dict, path) -> None:
    """Training curve (smoothed LM loss) and the periodic per-skill accuracies, with Pillow."""
    from PIL import Image, ImageDraw

    hist, evals = log["history"], log.get("evals", [])
    W, H, L, R, T, B = 860, 360, 60, 150, 30, 40
    im = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(im)
    steps = max(h["step"] for h in hist)
    top = max(h["smoothed"] for h in hist[1:]) if len(hist) > 1 else 1.0
    x = lambda s: L + (W - L - R) * s / steps  # noqa: E731
    y_loss = lambda v: T + (H - T - B) * (1 - min(v, top) / top)  # noqa: E731
    y_acc = lambda a: T + (H - T - B) * (1 - a)  # noqa: E731
    d.rectangle((L, T, W - R, H - B), outline="black")
    for step, label in log.get("marks", []):  # e.g. where a continuation run starts
        for yy in range(T, H - B, 6):
            d.line([(x(step), yy), (x(step), yy + 3)], fill="#808080")
        d.text((x(step) + 4, T + 4), label, fill="#606060")
    d.line([(x(h["step"]), y_loss(h["smoothed"])) for h in hist], fill="#4363d8", width=2)
    row = 0
    for key, colour in SKILL_COLOURS.items():
        pts = [(x(e["step"]), y_acc(e[key])) for e in evals
               if isinstance(e.get(key), (int, float)) and e[key] == e[key]]
        if not pts:  # a skill this run did not evaluate (older logs: describe and count only)
            continue
        if len(pts) > 1:
            d.line(pts, fill=colour, width=2)
        for px, py in pts:
            d.ellipse((px - 3, py - 3, px + 3, py + 3), fill=colour)
        ly = T + 18 * row
        row += 1
        d.line([(W - R + 40, ly + 6), (W - R + 60, ly + 6)], fill=colour, width=3)
        d.text((W - R + 64, ly), key.removesuffix("_acc"), fill="black")
    ly = T + 18 * row
    d.line([(W - R + 40, ly + 6), (W - R + 60, ly + 6)], fill="#4363d8", width=3)
    d.text((W - R + 64, ly), "LM loss", fill="black")
    for frac in (0, 0.5, 1):
        d.text((W - R + 6, y_acc(frac) - 6), f"{frac:.1f}", fill="black")
        d.text((6, y_loss(top * frac) - 6), f"{top * frac:.2f}", fill="#4363d8")
        d.text((x(steps * frac) - 12, H - B + 6), f"{int(steps * frac)}", fill="black")
    n = evals[0]["n"] if evals else 0
    d.text((L, 8), f"demo training: smoothed LM loss (blue, left axis), skill accuracies (right axis, "
                   f"{n} fresh scenes, PyTorch greedy); {log['seconds'] / 60:.0f} min, {log['threads']} threads",
           fill="black")
    d.text((W // 2 - 60, H - 18), "step", fill="black")
    im.save(path)


def combine_logs(first: dict, second: dict) -> dict:
    """One log for ``plot_log`` from a run and its continuation (``--init``): the second run's
    steps follow the first's."""
    off = first["steps"]
    shift = lambda rows: [dict(r, step=r["step"] + off) for r in rows]  # noqa: E731
    return {"history": first["history"] + shift(second["history"]),
            "evals": first.get("evals", []) + shift(second.get("evals", [])),
            "seconds": first["seconds"] + second["seconds"], "threads": first["threads"],
            "marks": [(off, "continued (--init)")]}


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))


def default_out() -> Path:
    """A new folder in the current directory (the shipped model is only replaced when asked)."""
    k = 1
    while Path(f"demo-model-{k}").exists():
        k += 1
    return Path(f"demo-model-{k}")


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv=None) -> int:
    # On a shared machine spinning OpenMP threads slow a 2-thread run down several times; this
    # only takes effect when torch is imported here, first.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    ap = argparse.ArgumentParser(prog="python -m edgevl.verification.demo_train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None,
                    help="output folder (default: a new ./demo-model-N); an existing model there is only "
                         "replaced with --overwrite")
    ap.add_argument("--overwrite", action="store_true", help="replace the model already in --out")
    ap.add_argument("--init", default=None, metavar="CHECKPOINT",
                    help="continue from this demo checkpoint (its tokenizer is kept) instead of from scratch")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    ap.add_argument("--lr", type=float, default=DEFAULT_LR)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--curriculum", type=float, default=DEFAULT_CURRICULUM,
                    help="fraction of the steps trained on one-shape scenes first (default %(default)s; "
                         "0 with --init)")
    ap.add_argument("--vision-steps", type=int, default=None, metavar="N",
                    help=f"train the vision tower on the cell probes alone for N steps first (default "
                         f"{DEFAULT_VISION_STEPS}; 0 with --init)")
    ap.add_argument("--vision-lr", type=float, default=DEFAULT_VISION_LR)
    ap.add_argument("--phrase-attention", action="store_true",
                    help="also train the attention target on descriptions: each shape's phrase looks at that shape")
    ap.add_argument("--weights", default=None, metavar="KIND=W,...",
                    help="question mix, e.g. describe=0.3,shape=0.2 (kinds left out keep their default weight)")
    ap.add_argument("--freeze-vision", action=argparse.BooleanOptionalAction, default=True,
                    help="after the vision phase, train only the language model: the tower and merger stay as "
                         "the cell probes left them (default; --no-freeze-vision trains them together)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--aux-weight", type=float, default=1.0, help="weight of the training-only probe losses")
    ap.add_argument("--eval", type=int, default=200, metavar="N",
                    help="after training, greedy-evaluate the PyTorch model on N fresh scenes (0 = skip)")
    ap.add_argument("--eval-seed", type=int, default=1234, help="seed of the evaluation scenes")
    ap.add_argument("--eval-every", type=int, default=0, metavar="K", help="also evaluate (50 scenes) every K steps")
    ap.add_argument("--plot", default=None, metavar="PNG", help="draw the training curve here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.batch < 1:
        ap.error("--steps and --batch must be at least 1")
    if args.vision_steps is not None and args.vision_steps < 0:
        ap.error("--vision-steps must be 0 or more")
    weights = dict(KIND_WEIGHTS)
    for item in (args.weights.split(",") if args.weights else []):
        kind, _, w = item.partition("=")
        try:
            if kind.strip() not in KIND_WEIGHTS or not float(w) >= 0:
                raise ValueError
            weights[kind.strip()] = float(w)
        except ValueError:
            ap.error(f"--weights {item!r}: write KIND=NUMBER (a number >= 0) with KIND one of "
                     f"{', '.join(KIND_WEIGHTS)}")
    if not all(weights[k] > 0 for k in ("describe", "count", "background", "text")):
        # every scene has these questions: a scene whose other kinds are all at 0 would have none to ask
        ap.error("--weights: describe, count, background and text need a weight above 0 (every scene asks them)")
    out = Path(args.out) if args.out else default_out()
    if out.exists() and not out.is_dir():
        ap.error(f"--out {out} exists and is not a folder; pick a folder path")
    if (out / "config.json").exists() and not args.overwrite:
        ap.error(f"--out {out} already holds a model; pass --overwrite to replace it, or pick a new folder")
    if args.plot and not Path(args.plot).resolve().parent.is_dir():
        ap.error(f"--plot {args.plot}: its folder does not exist; create it or pick another path")
    if args.init and not Path(args.init, "config.json").is_file():
        ap.error(f"--init {args.init}: no config.json there; pass a demo checkpoint folder")
    if args.init and out.resolve() == Path(args.init).resolve():
        ap.error("--init and --out are the same folder; write the continued model to a new folder")

    import torch

    from edgevl.verification.references.youtu_vl import YoutuVLForConditionalGeneration

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out.mkdir(parents=True, exist_ok=True)
    for name in RUNTIME_FILES:  # never leave a stale mix of old and new files
        (out / name).unlink(missing_ok=True)

    t0, c0 = time.time(), cpu_seconds()
    if args.init:
        from tokenizers import Tokenizer as HFTokenizer

        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (out / name).write_bytes(Path(args.init, name).read_bytes())
        tok = HFTokenizer.from_file(str(out / "tokenizer.json"))
        model = YoutuVLForConditionalGeneration.from_pretrained(args.init, dtype=torch.float32)
        cfg = model.config_dict
        curriculum = 0.0 if args.curriculum == DEFAULT_CURRICULUM else args.curriculum
    else:
        tok = train_tokenizer(tokenizer_corpus(args.seed), vocab_size=BPE_VOCAB, vision=True,
                              n_coordinates=N_COORDINATES)
        ids = save_tokenizer(tok, out, chat_template=YOUTU_VL_TEMPLATE)
        cfg = model_config(tok.get_vocab_size(), ids)
        model = YoutuVLForConditionalGeneration(cfg)
        init_weights(model, args.seed)
        curriculum = args.curriculum
    vocab = tok.get_vocab_size()
    coords = coordinate_ids(tok)
    if not args.init:
        init_coordinate_embeddings(model, coords, args.seed)
    builder = PromptBuilder(out)
    targets = CoordinateTargets(coords, cfg["vocab_size"])
    n_params = count_parameters(model)
    print(f"vocab {vocab}, parameters {n_params:,} ({n_params * 4 / 2**20:.1f} MiB fp32); "
          f"{args.steps} steps of batch {args.batch}, {args.threads} threads"
          + (f", continuing from {args.init}" if args.init else ""), flush=True)

    probes = Probes(cfg["hidden_size"])
    vision_steps = args.vision_steps if args.vision_steps is not None else (0 if args.init else DEFAULT_VISION_STEPS)
    vision_log: list = []
    t_vis, c_vis = time.time(), cpu_seconds()
    if vision_steps:
        model.train()
        pretrain_vision(model, probes, vision_steps, args.batch, args.vision_lr, args.seed, vision_log)
    vision_seconds, vision_cpu = time.time() - t_vis, cpu_seconds() - c_vis
    if args.freeze_vision:
        model.siglip2.requires_grad_(False)
        model.merger.requires_grad_(False)
    decay, no_decay = [], []
    for name, p in list(model.named_parameters()) + list(probes.named_parameters()):
        if not p.requires_grad or (args.freeze_vision and name.startswith("probe.")):
            continue
        (no_decay if p.dim() < 2 or "embed" in name else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    rng = random.Random(f"edgevl-demo-train-{args.seed}")
    history, evals = [], []
    running = None
    t_train, c_train = time.time(), cpu_seconds()
    eval_seconds = eval_cpu = 0.0
    model.train()
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        one_shape = step < curriculum * args.steps
        input_ids, pixels, shape, labels, aux = make_batch(rng, builder, args.batch, one_shape,
                                                           args.phrase_attention, weights)
        lm_loss, probe_loss, stats = train_losses(model, probes, targets, input_ids, pixels, shape, labels, aux,
                                                  args.freeze_vision)
        loss = lm_loss + args.aux_weight * probe_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        opt.step()
        val = float(lm_loss.detach())
        running = val if running is None else 0.95 * running + 0.05 * val
        if (step + 1) % 50 == 0 or step == 0 or step + 1 == args.steps:
            el = time.time() - t_train
            history.append({"step": step + 1, "loss": round(val, 5), "smoothed": round(running, 5),
                            "probe_loss": round(float(probe_loss.detach()), 5),
                            **{k: round(v, 4) for k, v in stats.items()}, "lr": lr, "seconds": round(el, 1)})
            print(f"step {step + 1:5d}  loss {val:.4f}  (smoothed {running:.4f})  "
                  f"probes {float(probe_loss.detach()):.3f} shape-cells {stats['cell_shape_acc']:.3f} "
                  f"box-cells {stats['cell_box_acc']:.3f} word-cells {stats['cell_word_acc']:.3f} "
                  f"attention-on-asked {stats['attention_mass']:.3f}  lr {lr:.2e}  {el:7.1f}s", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            te, ce = time.time(), cpu_seconds()
            model.eval()
            r = reference_eval(model, builder, args.eval_seed + 1, 50)
            model.train()
            eval_seconds += time.time() - te
            eval_cpu += cpu_seconds() - ce
            r["step"] = step + 1
            evals.append(r)
            print(f"  eval@{step + 1}: {format_eval(r)}", flush=True)
            # a long run can be stopped and its last evaluated weights still used
            model.save_pretrained(out / "checkpoint")
    train_seconds = time.time() - t_train
    train_cpu = cpu_seconds() - c_train
    model.eval()

    model.save_pretrained(out)
    write_side_files(out, cfg)
    log = {
        "steps": args.steps, "batch": args.batch, "lr": args.lr, "warmup": args.warmup, "seed": args.seed,
        "curriculum": curriculum, "aux_weight": args.aux_weight, "init": args.init,
        "kind_weights": weights, "phrase_attention": args.phrase_attention, "turns": TURNS, "share": SHARE,
        "coordinate_smoothing": [COORD_SMOOTHING, COORD_SIGMA],
        "attention_target": {"layer": ATTENTION_LAYER, "heads": list(ATTENTION_HEADS)},
        "vision_steps": vision_steps, "vision_lr": args.vision_lr, "vision_history": vision_log,
        "freeze_vision": args.freeze_vision,
        "vision_seconds": round(vision_seconds, 1), "vision_cpu_seconds": round(vision_cpu, 1),
        "seconds": round(vision_seconds + train_seconds, 1), "cpu_seconds": round(vision_cpu + train_cpu, 1),
        "eval_seconds": round(eval_seconds, 1), "eval_cpu_seconds": round(eval_cpu, 1),
        "total_seconds": round(time.time() - t0, 1), "total_cpu_seconds": round(cpu_seconds() - c0, 1),
        "final_loss": history[-1]["loss"], "final_smoothed_loss": history[-1]["smoothed"],
        "parameters": n_params, "vocab_size": vocab,
        "torch_version": torch.__version__, "threads": torch.get_num_threads(),
        "python": sys.version.split()[0], "history": history, "evals": evals,
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    if args.plot:
        plot_log(log, args.plot)
    print(f"saved {out} after {vision_seconds + train_seconds:.0f}s of training "
          f"({vision_cpu + train_cpu:.0f} CPU-seconds; vision phase {vision_seconds:.0f}s, "
          f"evaluations {eval_seconds:.0f}s)", flush=True)

    if args.eval:
        # Evaluate what was saved, loaded back the way users load it.
        loaded = YoutuVLForConditionalGeneration.from_pretrained(out)
        t1 = time.time()
        r = reference_eval(loaded, builder, args.eval_seed, args.eval, verbose=5)
        r["seconds"] = round(time.time() - t1, 1)
        log["reference_eval"] = r
        (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
        print(format_eval(r), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
