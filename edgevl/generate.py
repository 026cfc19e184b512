"""Text-level generation for every model: prompt/messages -> ids (+ images) -> streamed text.

``stream_generate`` yields text pieces that are always complete UTF-8 and never contain a stop
string; ``generate`` joins them. ``stream_events`` yields the same pieces with token ids, counts
and the finish reason (the server and the CLI use it); its last event also carries the boxes the
answer names (``edgevl.boxes.Box``, in original-image pixels). ``complete`` returns text, boxes
and counts at once.

Sampling settings left as None come from the checkpoint's ``generation_config.json``
(``sample.resolve``); ``temperature=0`` means plain greedy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

from .errors import EdgevlError
from .sample import resolve as resolve_sampling
from .tokenizer import StreamDecoder


@dataclass
class Prepared:
    input_ids: list
    image_rows: list = field(default_factory=list)
    images: list = field(default_factory=list)   # processor info per image (sizes, grid)

    @property
    def encoded(self) -> list:
        """(rows, info) per image, as Model.generate_tokens takes them."""
        return list(zip(self.image_rows, self.images))


@dataclass
class Event:
    text: str
    token: int | None = None
    finish_reason: str | None = None              # "stop" | "length" | None
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill_tokens: int = 0                       # prompt tokens actually computed (cache reuse)
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    boxes: list = field(default_factory=list)    # last event only: Box tuples the answer names


@dataclass
class Completion:
    """A whole answer: ``text``, the ``boxes`` it names, why it ended and the token counts."""
    text: str
    boxes: list
    finish_reason: str
    prompt_tokens: int
    generation_tokens: int


def _image_parts(messages) -> list:
    parts = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            parts += [p for p in c if isinstance(p, dict) and p.get("type") in ("image", "image_url")]
    return parts


def _validate_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise EdgevlError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise EdgevlError("each message needs 'role' and 'content' keys")
        if m["role"] not in ("system", "user", "assistant"):
            raise EdgevlError(f"unknown message role {m['role']!r}; use system, user or assistant")


def prepare(model, prompt, image=None, raw: bool = False, max_image_patches: int | None = None) -> Prepared:
    """Render the chat template, tokenize, encode images and expand each image placeholder."""
    tok = model.tokenizer
    images = [] if image is None else list(image) if isinstance(image, (list, tuple)) else [image]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise EdgevlError("the prompt is empty; pass some text")
        if raw or not tok.chat_template:
            if images:
                raise EdgevlError("images need the chat template; do not combine image= with raw=True")
            text = prompt
        else:
            content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}] if images else prompt
            text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    else:
        _validate_messages(prompt)
        parts = _image_parts(prompt)
        payloads = [p.get("image") for p in parts]
        if images and any(x is not None for x in payloads):
            raise EdgevlError("give images either inside the messages or with image=, not both")
        if not images:
            images = [x for x in payloads if x is not None]
        if len(images) != len(parts):
            raise EdgevlError(f"the messages have {len(parts)} image parts but {len(images)} images were given")
        text = tok.apply_chat_template(prompt, add_generation_prompt=True)
    if images and model.vision is None:
        raise EdgevlError("this model has no vision tower; it cannot take images (use a vision-language model)")

    ids = tok.encode(text)
    prep = Prepared(input_ids=[])
    pad = model.image_token_id
    n_pads = sum(1 for t in ids if t == pad) if pad is not None else 0
    if n_pads != len(images):
        raise EdgevlError(f"the prompt has {n_pads} image placeholders but {len(images)} images were given")
    for im in images:
        rows, info = model.encode_image(im, max_image_patches)
        prep.image_rows.append(rows)
        prep.images.append(info)
    k = 0
    for t in ids:
        if pad is not None and t == pad:
            prep.input_ids += [pad] * int(prep.image_rows[k].shape[0])
            k += 1
        else:
            prep.input_ids.append(t)
    return prep


def default_max_new_tokens(model) -> int:
    """The checkpoint's ``max_new_tokens`` (generation_config.json), else 256."""
    n = model.generation_config.get("max_new_tokens")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 256


def stream_events(model, prompt, image=None, max_new_tokens: int | None = None, temperature: float | None = None,
                  top_k: int | None = None, top_p: float | None = None, repetition_penalty: float | None = None,
                  seed: int | None = None, stop=None, raw: bool = False, max_image_patches: int | None = None,
                  reuse_cache: bool = True, postprocess: bool = True) -> Iterator[Event]:
    """``postprocess=False`` shows the text as generated (e.g. grounding coordinates in pixels of
    the resized image the model saw) and finds no boxes."""
    stop = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
    settings = resolve_sampling(model.generation_config, temperature, top_k, top_p, repetition_penalty)
    if max_new_tokens is None:
        max_new_tokens = default_max_new_tokens(model)
    t0 = time.perf_counter()
    prep = prepare(model, prompt, image=image, raw=raw, max_image_patches=max_image_patches)
    # architecture-specific post-processing of the answer text (e.g. grounding coordinates)
    post = model.arch.output_processor(model, prep.images) if postprocess else None
    detok = StreamDecoder(model.tokenizer)
    gen = model.generate_tokens(prep.input_ids, max_new_tokens, image=prep.encoded, seed=seed,
                                reuse_cache=reuse_cache, **settings.kwargs())
    n_prompt, n_gen = len(prep.input_ids), 0
    pending = ""            # text held back because it may start a stop string
    shown = 0               # characters yielded so far
    t_first = None
    finish = "length"
    hold = max((len(s) for s in stop), default=0) - 1

    def stats(text, token, reason=None):
        nonlocal shown
        shown += len(text)
        now = time.perf_counter()
        pt = (t_first or now) - t0
        gt = now - (t_first or now)
        return Event(text, token, reason, n_prompt, n_gen, model.last_prefill_tokens,
                     model.last_prefill_tokens / pt if pt > 0 else 0.0,
                     (n_gen - 1) / gt if gt > 0 and n_gen > 1 else 0.0,
                     post.boxes(shown) if post and reason else [])

    for token in gen:
        if t_first is None:
            t_first = time.perf_counter()
        n_gen += 1
        if token in model.eos_ids:
            finish = "stop"
            break
        piece = detok.add(token)
        pending += post.feed(piece) if post else piece
        if stop:
            hit = min((i for i in (pending.find(s) for s in stop) if i >= 0), default=-1)
            if hit >= 0:
                yield stats(pending[:hit], token, "stop")
                return
            # keep back the longest tail that could still grow into a stop string
            keep = 0
            for k in range(min(hold, len(pending)), 0, -1):
                if any(s.startswith(pending[-k:]) for s in stop):
                    keep = k
                    break
            out, pending = (pending[:-keep], pending[-keep:]) if keep else (pending, "")
        else:
            out, pending = pending, ""
        yield stats(out, token)
    tail = detok.flush()
    tail = pending + (post.feed(tail) + post.flush() if post else tail)
    if stop:
        hit = min((i for i in (tail.find(s) for s in stop) if i >= 0), default=-1)
        if hit >= 0:
            tail, finish = tail[:hit], "stop"
    yield stats(tail, None, finish)


def stream_generate(model, prompt, image=None, **kwargs) -> Iterator[str]:
    """Yield text pieces as they are generated (see ``stream_events`` for the options)."""
    for ev in stream_events(model, prompt, image=image, **kwargs):
        if ev.text:
            yield ev.text


def generate(model, prompt, image=None, **kwargs) -> str:
    """Generate a whole answer. ``prompt`` is a string (chat-templated) or a list of messages."""
    return "".join(stream_generate(model, prompt, image=image, **kwargs))


def complete(model, prompt, image=None, **kwargs) -> Completion:
    """Generate a whole answer and return it with the boxes it names (``stream_events`` options)."""
    text, last = [], None
    for ev in stream_events(model, prompt, image=image, **kwargs):
        text.append(ev.text)
        last = ev
    return Completion("".join(text), last.boxes, last.finish_reason, last.prompt_tokens, last.generation_tokens)
