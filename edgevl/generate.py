"""Text-level generation for every model: prompt/messages -> ids (+ images) -> streamed text.

``stream_generate`` yields text pieces that are always complete UTF-8 and never contain a stop
string; ``generate`` joins them. ``stream_events`` yields the same pieces with token ids, counts
and the finish reason (the server and the CLI use it); its last event also carries the boxes the
answer names (``edgevl.boxes.Box``, in original-image pixels). ``complete`` returns text, boxes
and counts at once.

Sampling settings left as None come from the checkpoint's ``generation_config.json``
(``sample.resolve``); ``temperature=0`` means plain greedy.

Models that think before answering (their architecture declares ``reasoning_tokens``, e.g.
``<think>``/``</think>``) get that text apart from the answer: ``Event.reasoning``, never mixed
into ``Event.text``; ``stream_generate``/``generate`` leave it out unless ``show_reasoning``.
``chat_template_kwargs`` reach the chat template (e.g. ``{"enable_thinking": False}``);
``thinking=False`` asks any model that can switch its thinking off for a direct answer.

``response_format`` / ``json_schema=`` constrain the answer (``edgevl.structured``): a JSON
schema, any JSON object, a regular expression, a choice or a grammar; a thinking model's
reasoning stays free and the constraint starts after it. ``Completion.json`` is the parsed answer.
"""

from __future__ import annotations

import json as _json
import os
import re
import time
from collections import deque
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field

import numpy as np

from . import structured
from . import tools as tool_calls
from .errors import ContextOverflow, EdgevlError
from .model import check_model
from .sample import Logprobs, check_logit_bias, check_seed
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
    videos: list = field(default_factory=list)   # last event only: each video's processor info
    reasoning: str = ""                           # thinking text (models with reasoning markers)
    drafted: int = 0                              # last event only: speculative decoding's drafts
    accepted: int = 0                             # ... and how many of them were accepted
    logprobs: list = field(default_factory=list)  # logprobs=True: this token's entry, if it is the answer's
    reasoning_tokens: int = 0                     # last event only: tokens of the reasoning, markers included


@dataclass
class Completion:
    """A whole answer: ``text``, the ``boxes`` it names, why it ended and the token counts
    (``reasoning``: the model's thinking, for models that have it)."""
    text: str
    boxes: list
    finish_reason: str
    prompt_tokens: int
    generation_tokens: int
    reasoning: str = ""
    structure: str | None = None       # the kind of constrained answer (structured.KINDS), if any
    tool_calls: list = field(default_factory=list)   # OpenAI tool_calls the answer makes (tools=)
    logprobs: list | None = None       # logprobs=True: an entry per answer token, OpenAI's shape

    @property
    def json(self):
        """The answer parsed, for answers constrained to JSON (``response_format`` json_object or
        json_schema, ``json_schema=``); an answer the token limit cut is an error, not half an object."""
        if self.structure not in ("json_object", "json_schema"):
            raise EdgevlError("this answer was not constrained to JSON; pass json_schema= or response_format="
                              "{\"type\": \"json_object\"}")
        if self.tool_calls and not self.text.strip():
            raise EdgevlError("the answer is tool calls (Completion.tool_calls), not JSON; run the tools and send "
                              "their results for the answer")
        if self.finish_reason != "stop" and self.reasoning and not self.text.strip():
            raise EdgevlError(f"the token limit ({self.generation_tokens} tokens) ran out inside the thinking, before "
                              "any answer; raise max_new_tokens or pass thinking=False")
        if self.finish_reason != "stop":
            raise EdgevlError(f"the answer was cut by the token limit after {self.generation_tokens} tokens, before "
                              "its JSON ended; raise max_new_tokens")
        try:
            return _json.loads(self.text)
        except ValueError as e:    # a stop string cut it
            raise EdgevlError(f"the answer is not whole JSON ({e}); a stop string cut it: drop the stop strings") \
                from None


class ReasoningSplitter:
    """Routes generated tokens to the answer or to the reasoning, by the architecture's marker
    tokens. Starts in reasoning when the prompt left a start marker open (a template that
    opens the think block itself). Newlines around the reasoning and at the start of the answer
    after it (after an end marker, the answer's or the prompt's own) are dropped, as the chat
    template does when it reads an answer back; an answer that follows no marker (a raw
    continuation) is the text its tokens spell."""

    def __init__(self, tokenizer, markers, prompt_ids):
        # a tool call's tags stay in the text even where the tokenizer has them as special tokens
        self.detok = StreamDecoder(tokenizer, keep=[i for i in map(tokenizer.token_to_id, tool_calls.TAGS)
                                                    if i is not None])
        self.start = self.end = None
        if markers:
            self.start, self.end = (tokenizer.token_to_id(m) for m in markers)
        if self.start is None or self.end is None:
            self.start = self.end = None
        last = {t: i for i, t in enumerate(prompt_ids) if t in (self.start, self.end)} if self.start is not None else {}
        self.thinking = last.get(self.start, -1) > last.get(self.end, -1)
        self.lead = bool(last)   # at the start of a part after a marker: newlines there are dropped
        self.held = ""        # reasoning newlines held back (dropped if the reasoning ends there)

    @property
    def active(self) -> bool:
        return self.start is not None

    def add(self, token: int) -> tuple[str, str]:
        """(answer text, reasoning text) this token completes."""
        if token in (self.start, self.end) and self.start is not None:
            out = self._route(self.detok.flush())
            # newlines held at the end of the reasoning are dropped
            self.thinking, self.lead, self.held = token == self.start, True, ""
            return out
        return self._route(self.detok.add(token))

    def flush(self) -> tuple[str, str]:
        return self._route(self.detok.flush(), end=True)

    def _route(self, text: str, end: bool = False) -> tuple[str, str]:
        if self.lead:
            text = text.lstrip("\n")
            self.lead = not text
        if not self.thinking:
            return text, ""
        text = self.held + text
        body = text.rstrip("\n")
        self.held = "" if end else text[len(body):]
        return "", body


def _image_parts(messages, kinds=("image", "image_url")) -> list:
    parts = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            parts += [p for p in c if isinstance(p, dict) and p.get("type") in kinds]
    return parts


def _payload(part: dict, kind: str):
    """The image or video a message part carries: ``{"type": kind, kind: X}``, OpenAI's
    ``{"type": kind + "_url", kind + "_url": {"url": U}}`` or Hugging Face's ``"url"``/``"path"``
    keys; U a local path, or for images a base64 ``data:`` URL. None where the part has none."""
    if part.get(kind) is not None:
        return part[kind]
    url = part.get(kind + "_url")
    url = url.get("url") if isinstance(url, dict) else url
    url = url if url is not None else part.get("url", part.get("path"))
    if not isinstance(url, str):
        return url
    if url.startswith(("http://", "https://")):
        raise EdgevlError(f"{kind} URLs are not fetched; download the file and give its path or bytes")
    from .processing.image import data_url_bytes, is_data_url, local_path

    if is_data_url(url):
        if kind != "image":
            raise EdgevlError("a video is given by its file's path, not a data: URL")
        return data_url_bytes(url)
    return local_path(url)


def video_span(tok, model) -> tuple[str, str, str]:
    """The texts of a video placeholder as templates write it: start, pad, end."""
    def text(key, default):
        i = model.manifest.get(key)
        return (tok.id_to_token(i) if i is not None else None) or default

    return (text("vision_start_token_id", "<|vision_start|>"), tok.id_to_token(model.video_token_id),
            text("vision_end_token_id", "<|vision_end|>"))


def video_placeholder_tokens(tok, model, rendered: str) -> int:
    """Tokens of the video placeholders in a rendered prompt, which a video's own tokens replace
    (its start/pad/end group is rewritten whole, see :func:`_video_groups`; a bare pad alone)."""
    start, pad, end = video_span(tok, model)
    wrapped = rendered.count(start + pad + end)
    return 3 * wrapped + (rendered.count(pad) - wrapped)


def _video_groups(tok, model, infos):
    """A rewrite of the rendered prompt: each video's ``<|vision_start|><|video_pad|><|vision_end|>``
    (or a bare ``<|video_pad|>``) becomes, per temporal patch, ``<T seconds>`` and its own
    start/pad/end group with one pad, which ``prepare`` then expands to the patch's tokens."""
    start, pad, end = video_span(tok, model)
    pad = pad if infos else None

    def rewrite(rendered: str) -> str:
        out, at = [], 0
        for k, info in enumerate(infos):
            groups = "".join(f"<{t:.1f} seconds>{start}{pad}{end}" for t in info["timestamps"])
            span = start + pad + end
            i = rendered.find(span, at)
            j = rendered.find(pad, at)
            if j < 0:
                raise EdgevlError(f"the prompt has {k} video placeholders but {len(infos)} videos were given")
            if i < 0 or i + len(start) != j:
                i, span = j, pad       # a template that writes the bare pad
            out += [rendered[at:i], groups]
            at = i + len(span)
        rest = rendered[at:]
        if pad is not None and pad in rest:
            raise EdgevlError(f"the prompt has more video placeholders than the {len(infos)} videos given")
        return "".join(out) + rest

    return rewrite


def _validate_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise EdgevlError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise EdgevlError("each message needs 'role' and 'content' keys")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise EdgevlError(f"unknown message role {m['role']!r}; use system, user, assistant or tool")


def template_kwargs(kwargs, switches=()) -> dict:
    """``chat_template_kwargs`` checked: named values, none the template renderer sets itself, the
    template's ``switches`` (``Architecture.template_switches``) booleans, and no value a string
    that reads as a boolean — to a template the string "false" is true (thinking stayed on)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise EdgevlError("chat_template_kwargs must be an object of named values, e.g. {\"enable_thinking\": false}")
    reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"} & set(kwargs)
    if reserved:
        raise EdgevlError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
    for k, v in kwargs.items():
        # a template reads any non-empty string as true: "false" would switch a thing on
        if (k in switches and not isinstance(v, bool)) or (isinstance(v, str) and v.strip().lower() in BOOLEAN_WORDS):
            raise EdgevlError(f"chat_template_kwargs {k} must be true or false (a JSON boolean), got {v!r:.40}")
    return dict(kwargs)


BOOLEAN_WORDS = ("true", "false", "yes", "no", "on", "off", "0", "1")


def model_template_kwargs(model, chat_template_kwargs=None, thinking: bool | None = None) -> dict:
    """The template arguments for ``model``: its switch for ``thinking`` (None: the template's
    default) under the given ``chat_template_kwargs``, checked against its switches."""
    if thinking is not None and not isinstance(thinking, bool):   # "false" would read as true
        raise EdgevlError(f"thinking must be True, False or None, got {thinking!r:.40}")
    kw = {**model.arch.thinking_args(thinking), **template_kwargs(chat_template_kwargs)}
    return template_kwargs(kw, model.arch.template_switches)


_MARK = re.compile("\ue000([0-9]+)\ue001")


def _contents(messages) -> list[str]:
    """The message texts, in order: what users wrote, as opposed to what the template adds."""
    out = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, list):
            out += [p["text"] for p in c
                    if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)]
    return out


def _strings(value, where: str):
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k, where)
            yield from _strings(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _strings(v, f"{where}[{i}]")


def _other_strings(messages, kw: dict):
    """(where, text) of every string the template may write besides the message contents:
    the messages' other fields (tool calls) and the template arguments (tools)."""
    for i, m in enumerate(messages):
        for k, v in m.items():
            if k != "content":
                yield from _strings(v, f"messages[{i}].{k}")
    for k, v in kw.items():
        yield from _strings(v, k)


def _masked(messages, marks: dict) -> list[dict]:
    """The messages with content k (``_contents``' order) replaced by ``marks[k]`` where given."""
    k, out = 0, []

    def mark(text):
        nonlocal k
        k += 1
        return marks.get(k - 1, text)

    for m in messages:
        c = m.get("content")
        if isinstance(c, str):
            c = mark(c)
        elif isinstance(c, list):
            c = [dict(p, text=mark(p["text"])) if isinstance(p, dict) and p.get("type") == "text"
                 and isinstance(p.get("text"), str) else p for p in c]
        out.append(dict(m, content=c))
    return out


def encode_messages(tok, messages, allow_special_in_content: bool = False, chat_template_kwargs=None,
                    rewrite=None) -> list[int]:
    """Render the chat template and tokenize it. Control tokens come only from the template:
    special-token text inside a message (``<|end_of_text|><|begin_of_text|>system``...) is
    tokenized as plain text, so a client cannot forge turns, unless ``allow_special_in_content``.
    ``chat_template_kwargs``: as ``template_kwargs`` checks them. ``rewrite``: a change of the
    rendered text before tokenization (videos' per-patch groups)."""
    kw = template_kwargs(chat_template_kwargs)
    rewrite = rewrite or (lambda t: t)
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, **kw)
    contents = _contents(messages)
    specials = tok.special_tokens
    if not allow_special_in_content:
        # what else the template writes from the request (tool calls' names and arguments, the
        # tools' definitions) would become control tokens: refused rather than split
        for where, value in _other_strings(messages, kw):
            bad = next((sp for sp in specials if sp in value), None)
            if bad is not None:
                raise EdgevlError(f"{where} contains the control-token text {bad!r}, which would act as a "
                                  "control token there; remove it")
    if allow_special_in_content or not any(sp in c for c in contents for sp in specials):
        return tok.encode(rewrite(rendered))  # the common case: the exact tokens of the whole rendered prompt
    # Render again with a marker in each content's place: the text between markers is the
    # template's own (control tokens allowed), the contents are encoded as plain text. The rewrite
    # runs on that rendering, so a placeholder's text typed in a message is not taken for one.
    if any("\ue000" in c for c in contents):
        raise EdgevlError("message contents may not contain U+E000 together with control-token text")
    # only the contents that hold such text: an empty one stays empty (templates branch on that,
    # e.g. an assistant turn of calls only), and the others tokenize as in the common case
    marks = {k: f"\ue000{k}\ue001" for k, c in enumerate(contents) if any(sp in c for sp in specials)}
    masked = tok.apply_chat_template(_masked(messages, marks), add_generation_prompt=True, **kw)
    if _MARK.sub(lambda m: contents[int(m[1])], masked) != rendered:   # the template rewrites contents
        bad = next(sp for c in contents for sp in specials if sp in c)
        raise EdgevlError(f"a message contains the control-token text {bad!r}, which this chat template cannot "
                          "keep as plain text; remove it")
    ids = []
    for k, piece in enumerate(_MARK.split(rewrite(masked))):
        ids += tok.encode(contents[int(piece)], special=False) if k % 2 else tok.encode(piece)
    return ids


def _as_videos(video) -> list:
    """``video=``: one clip (a path, ``{"frames": ..., "fps": ...}``, or a list of frames: PIL
    images, uint8 arrays or paths of still pictures, which no clip is) or a list of clips."""
    if video is None:
        return []
    import numpy as np
    from PIL import Image

    from .processing.video import FRAME_SUFFIXES

    # paths of still pictures (.png, .jpg ...; not GIF or WebP, which may be clips) are frames of one
    # clip: as clips, each would be one frame
    stills = tuple(x for x in FRAME_SUFFIXES if x not in (".gif", ".webp"))
    if isinstance(video, (list, tuple)) and len(video) > 1 and all(
            isinstance(x, (str, os.PathLike)) and os.path.splitext(str(x))[1].lower() in stills for x in video):
        return [video]
    if isinstance(video, (list, tuple)) and not any(
            isinstance(x, Image.Image) or isinstance(x, np.ndarray) and x.ndim != 4 for x in video):
        return list(video)
    return [video]


def _check_video_tokens(model, videos: list, options: dict, text_tokens: int = 0) -> None:
    """Refuse, from their headers, videos that cannot fit in the context beside ``text_tokens``
    (the rest of the prompt, a lower bound): decoding and encoding them first cost seconds and a
    GB (a 1280x720 clip at 30 fps) for nothing."""
    if not videos:
        return
    need = sum(model.video_tokens(v, **options) for v in videos)
    if need + text_tokens >= model.max_context:
        what = f"the video{'s' if len(videos) > 1 else ''} take{'' if len(videos) > 1 else 's'} {need} tokens"
        if text_tokens:
            what += f" and the rest of the prompt at least {text_tokens}"
        raise ContextOverflow(f"{what}, but this model's maximum context length is {model.max_context} tokens; send a "
                          "shorter video or sample "
                          "fewer or smaller frames (--fps, --max-frames, --video-max-pixels; video_options in the "
                          "API)")


def _check_tool_turns(model, messages: list) -> None:
    """Tool calls and results in the history need a template that writes them: one without a
    tool-call format would drop an assistant's calls (an empty turn) or render a tool result as
    some other role, and the model would answer a conversation it was never shown."""
    if tool_calls.call_format(model) is not None:
        return
    for i, m in enumerate(messages):
        if isinstance(m, dict) and (m.get("role") == "tool" or m.get("role") == "assistant" and m.get("tool_calls")):
            raise EdgevlError(f"messages[{i}]: a {m['role']} turn with tool calls or results needs a model whose chat "
                              f"template has a tool-call format; this model ({model.arch.name}) has none")


def prepare(model, prompt, image=None, raw: bool = False, max_image_patches: int | None = None,
            allow_special_in_content: bool = False, chat_template_kwargs=None,
            thinking: bool | None = None, video=None, video_options: dict | None = None) -> Prepared:
    """Render the chat template, tokenize, encode images and videos and expand each placeholder.

    Message contents are plain text (see ``encode_messages``); ``raw=True`` tokenizes the prompt
    as it is, special-token text included. ``thinking``: ask a model that can think first to do
    so or not (its chat template's switch; None: the template's default). ``video``: one clip or
    a list (``Model.encode_video`` says what a clip may be); ``video_options``: its ``fps``,
    ``max_frames`` and ``max_pixels``."""
    _check_whole("max_image_patches", max_image_patches, 1)
    tok = model.tokenizer
    chat_template_kwargs = model_template_kwargs(model, chat_template_kwargs, thinking)
    images = [] if image is None else list(image) if isinstance(image, (list, tuple)) else [image]
    videos = _as_videos(video)
    if isinstance(prompt, str):
        if not prompt.strip():
            raise EdgevlError("the prompt is empty; pass some text")
        if raw or not tok.chat_template:
            if images or videos:
                raise EdgevlError("images and videos need the chat template; do not combine them with raw=True")
            text = prompt
        else:
            media = [{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos]
            content = media + [{"type": "text", "text": prompt}] if media else prompt
            messages = [{"role": "user", "content": content}]
            text = None
    else:
        if isinstance(prompt, list):
            _check_tool_turns(model, prompt)
            prompt = tool_calls.pair_results(tool_calls.template_messages(prompt))
        _validate_messages(prompt)
        for kind, given, what in (("image", images, "images"), ("video", videos, "videos")):
            parts = _image_parts(prompt, (kind, kind + "_url"))
            payloads = [_payload(p, kind) for p in parts]
            if given and any(x is not None for x in payloads):
                raise EdgevlError(f"give {what} either inside the messages or with {kind}=, not both")
            if not given:
                given += [x for x in payloads if x is not None]
            if len(given) != len(parts):
                raise EdgevlError(f"the messages have {len(parts)} {kind} parts but {len(given)} {what} were given; "
                                  f"put each in its part ({{'type': '{kind}', '{kind}': PATH}}) or pass {kind}=")
        messages, text = prompt, None
    if images and model.vision is None:
        raise EdgevlError("this model has no vision tower; it cannot take images (use a vision-language model)")

    if video_options is not None or videos:
        from .processing.video import check_options

        video_options = check_options(video_options)   # one line for a list, an unknown key, inf ...
    if videos:   # the prompt without its videos' placeholders bounds the rest from below
        base = encode_messages(tok, messages, allow_special_in_content, chat_template_kwargs)
        held = (video_placeholder_tokens(tok, model, tok.decode(base, skip_special_tokens=False))
                if model.takes_video else len(videos))      # (a model without video says so below)
        _check_video_tokens(model, videos, video_options, len(base) - held)
    vids = [model.encode_video(v, **video_options) for v in videos]   # timestamps go in the prompt
    ids = (tok.encode(text) if text is not None
           else encode_messages(tok, messages, allow_special_in_content, chat_template_kwargs,
                                _video_groups(tok, model, [info for _, info in vids]) if vids else None))
    prep = Prepared(input_ids=[])
    pad, vpad = model.image_token_id, model.video_token_id if vids else None
    n_pads = sum(1 for t in ids if t == pad) if pad is not None else 0
    if n_pads != len(images):
        raise EdgevlError(f"the prompt has {n_pads} image placeholders but {len(images)} images were given")
    encoded = [model.encode_image(im, max_image_patches) for im in images]
    k = v = patch = 0
    for t in ids:
        if pad is not None and t == pad:
            rows, info = encoded[k]
            prep.image_rows.append(rows)
            prep.images.append(info)
            prep.input_ids += [pad] * int(rows.shape[0])
            k += 1
        elif vpad is not None and t == vpad:
            rows, info = vids[v]
            if patch == 0:
                prep.image_rows.append(rows)
                prep.images.append(info)
            prep.input_ids += [vpad] * info["tokens_per_frame"]
            patch += 1
            if patch == info["grid_thw"][0]:
                v, patch = v + 1, 0
        else:
            prep.input_ids.append(t)
    return prep


def _check_whole(name: str, value, minimum: int) -> None:
    """``value`` is None or an integer >= ``minimum`` (2.9 and "3" are mistakes), else one line."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum):
        raise EdgevlError(f"{name} must be a whole number >= {minimum}, got {value!r:.40}")


def stop_strings(stop) -> list[str]:
    """``stop`` (a string, a list of strings or None) as a list; empty strings stop nothing."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
        raise EdgevlError(f"stop must be a string or a list of strings, got {stop!r:.60}")
    return [x for x in stop if x]


def default_max_new_tokens(model) -> int:
    """The checkpoint's ``max_new_tokens`` (generation_config.json), else 256."""
    n = model.generation_config.get("max_new_tokens")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 256


def check_generation_options(names, what: str = "generation", exclude=("n", "engine")) -> None:
    """Options meant for ``stream_choices``: a misspelt one is one line naming the nearest option,
    not a TypeError naming a function the caller never called."""
    import difflib
    import inspect

    known = set(inspect.signature(stream_choices).parameters) - {"model", "prompt", "image", *exclude}
    for k in names:
        if k not in known:
            near = difflib.get_close_matches(k, sorted(known), 1)
            raise EdgevlError(f"{what} has no option {k!r}" + (f"; did you mean {near[0]}?" if near else ""))


def stream_events(model, prompt, image=None, **kwargs) -> Iterator[Event]:
    """One answer's events as they are generated (the options: ``stream_choices``)."""
    check_generation_options(kwargs, exclude=("n",))
    (events,) = stream_choices(model, prompt, 1, image=image, **kwargs)
    with closing(events):   # a consumer that stops early (a client gone) stops the generation now
        yield from events


# answers to one request at most (OpenAI's ``n``): each is a request of its own in the engine
MAX_CHOICES = 16


def stream_choices(model, prompt, n: int = 1, image=None, max_new_tokens: int | None = None,
                   temperature: float | None = None,
                  top_k: int | None = None, top_p: float | None = None, repetition_penalty: float | None = None,
                  seed: int | None = None, stop=None, raw: bool = False, max_image_patches: int | None = None,
                  reuse_cache: bool = True, postprocess: bool = True,
                  allow_special_in_content: bool = False, chat_template_kwargs=None,
                  thinking: bool | None = None, video=None, video_options: dict | None = None,
                  response_format=None, json_schema=None, tools=None, tool_choice=None,
                  parallel_tool_calls: bool | None = None, engine=None, presence_penalty: float = 0.0,
                  frequency_penalty: float = 0.0, logprobs: bool = False,
                  top_logprobs: int | None = None, logit_bias: dict | None = None,
                  split_reasoning: bool = True, min_p: float | None = None) -> list[Iterator[Event]]:
    """``n`` answers to one prompt (OpenAI's ``n``), each an iterator of its events. The prompt,
    its images and any grammar are prepared once. With an ``engine`` the answers decode together,
    each a request of its own, the others going on from a copy of the first's state at the
    prompt's end; without, one after the other as they are read (the later ones start from the
    first's prompt in the cache). Answer i samples with ``seed + i`` where a seed is given,
    so sampled answers differ and each is reproducible.

    ``postprocess=False`` shows the text as generated (e.g. grounding coordinates in pixels of
    the resized image the model saw) and finds no boxes. Reasoning (models that declare reasoning
    markers) comes in ``Event.reasoning``; stop strings and post-processing apply to the answer.
    ``response_format`` / ``json_schema``: the answer's structure (``structured.parse``; checked
    and compiled before any work). ``tools`` / ``tool_choice`` / ``parallel_tool_calls``: OpenAI's
    (``edgevl.tools``); the tools reach the chat template, "required" and a named function
    constrain the answer to calls; ``complete`` reads the calls into ``Completion.tool_calls``.
    ``engine``: an ``edgevl.engine.Engine`` over ``model`` decodes the request beside others.
    ``presence_penalty`` / ``frequency_penalty``: OpenAI's (-2 to 2), over the tokens generated so far.
    ``logprobs`` / ``top_logprobs`` (0-20): OpenAI's; each answer token's entry comes in
    ``Event.logprobs`` (``{"token", "logprob", "bytes", "top_logprobs"}``) of the event that gives
    the first of its text (a token whose text a stop string cut has none), the model's own
    log-probabilities (before penalties, temperature and constraints). The reasoning's tokens
    have none, nor has the end-of-answer token. ``logit_bias``: OpenAI's, {token id: -100 to 100}
    added to the logits before sampling (-100 in effect bans a token, 100 forces it). ``min_p``: drop
    tokens less likely than min_p times the likeliest (after top-p; None: the checkpoint's, else off).
    ``split_reasoning=False``: the reasoning stays in the text as written, markers included (a raw
    continuation), and a constraint applies from the first token."""
    check_model(model)
    if engine is not None and getattr(engine, "model", None) is not model:
        raise EdgevlError("this engine decodes another model: pass the Engine made over this model "
                          "(Engine(model)), or none")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise EdgevlError(f"n (answers to the prompt) must be from 1 to {MAX_CHOICES}, got {n!r:.40}")
    if top_logprobs and not logprobs:
        raise EdgevlError("top_logprobs needs logprobs=True")
    if not isinstance(logprobs, bool):
        raise EdgevlError(f"logprobs must be true or false, got {logprobs!r}")
    bias = check_logit_bias(logit_bias, model.vocab_size)
    stop = stop_strings(stop)
    check_seed(seed)     # before ``seed + i`` makes a TypeError of a string
    _check_whole("max_new_tokens", max_new_tokens, 0)
    structure = structured.parse(response_format, json_schema)
    spec = tool_calls.prepare(model, tools, tool_choice, parallel_tool_calls)
    if spec is not None and spec.structure is not None:
        # forced calls: the answer is only calls, and a format for its text has nothing to apply to
        # (OpenAI takes the pair)
        structure = spec.structure
        # an answer of calls only has no text for stop strings to end: they would cut a call, which
        # is then no call at all
        stop = []
    elif spec is not None and spec.parses and structure is not None:
        plain = getattr(structure, "structure", structure)     # a Compiled's own Structure
        if not plain.calls:   # "auto" with a format: the text answer follows it, or the answer is calls
            structure = tool_calls.with_calls(model, plain, spec)
    if structure is not None and structure.kind in ("json_object", "json_schema"):
        # the grammar ends a JSON answer: a stop string could only cut it short of its schema
        stop = []
    if spec is not None and spec.render:
        chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": spec.render}
    compiled = structured.compiled(model, structure) if structure is not None else None
    settings = resolve_sampling(model.generation_config, temperature, top_k, top_p, repetition_penalty, min_p)
    if max_new_tokens is None:
        max_new_tokens = default_max_new_tokens(model)
    t0 = time.perf_counter()
    prep = prepare(model, prompt, image=image, raw=raw, max_image_patches=max_image_patches,
                   allow_special_in_content=allow_special_in_content, chat_template_kwargs=chat_template_kwargs,
                   thinking=thinking, video=video, video_options=video_options)
    # architecture-specific post-processing of the answer text (e.g. grounding coordinates)
    videos = [i for i in prep.images if isinstance(i, dict) and i.get("kind") == "video"]
    images = [i for i in prep.images if not (isinstance(i, dict) and i.get("kind") == "video")]

    def choice(i: int, t0: float, after=None) -> Iterator[Event]:
        noted = Logprobs(top_logprobs or 0) if logprobs else None
        extra = {"logprobs": noted} if noted is not None else {}
        if after is not None:   # the engine's: go on from the first answer's prompt
            extra["after"] = after
        if bias is not None:
            extra["logit_bias"] = bias
        post = model.arch.output_processor(images) if postprocess else None
        split = ReasoningSplitter(model.tokenizer, model.arch.reasoning_tokens if split_reasoning else None,
                                  prep.input_ids)
        constraint = (compiled.constraint((split.start, split.end) if split.active else None, split.thinking)
                      if compiled is not None else None)
        gen = (engine or model).generate_tokens(prep.input_ids, max_new_tokens, image=prep.encoded,
                                                seed=None if seed is None else seed + i, reuse_cache=reuse_cache,
                                                constraint=constraint, **settings.kwargs(),
                                                presence_penalty=presence_penalty,
                                                frequency_penalty=frequency_penalty, **extra)
        return _Choice(gen, _events(model, gen, prep, t0, stop, post, split, videos, noted))

    if engine is not None:   # every answer queued now: they decode together, from one prompt
        first = choice(0, t0)
        return [first] + [choice(i, t0, first.gen) for i in range(1, n)]
    # one model decodes one answer at a time: an answer read before the ones ahead of it ended
    # first runs those to their end (their events kept for their reader)
    answers: list = [_Buffered(choice(0, t0))]
    for i in range(1, n):
        answers.append(_Buffered(_later(choice, i, answers[:i])))
    return answers


class _Choice:
    """One answer's events; ``close()`` ends its generation whether or not it was read yet (an
    engine's request runs from the moment it is queued)."""

    def __init__(self, gen, events: Iterator[Event]):
        self.gen, self.events = gen, events

    def __iter__(self):
        return self

    def __next__(self) -> Event:
        return next(self.events)

    def close(self) -> None:
        self.events.close()
        if hasattr(self.gen, "close"):
            self.gen.close()


class _Buffered:
    """An answer's events, with those run ahead of its reader kept (``drain``)."""

    def __init__(self, events: Iterator[Event]):
        self.events, self.kept = events, deque()

    def __iter__(self):
        return self

    def __next__(self) -> Event:
        return self.kept.popleft() if self.kept else next(self.events)

    def drain(self) -> None:
        self.kept.extend(self.events)

    def close(self) -> None:
        self.events.close()


def _later(choice, i: int, ahead: list) -> Iterator[Event]:
    """Answer i, started when first read, once the answers ahead of it ended (its time to first
    token counted from then)."""
    for a in ahead:
        a.drain()
    yield from choice(i, time.perf_counter())


def _events(model, gen, prep, t0, stop, post, split, videos, noted=None):
    n_prompt, n_gen, n_think = len(prep.input_ids), 0, 0
    pending = ""            # text held back because it may start a stop string
    shown = 0               # characters yielded so far
    t_first = None
    finish = "length"
    hold = max((len(s) for s in stop), default=0) - 1
    # (where a token's text starts in the answer, its logprob entry): an entry goes out with the
    # first of its token's text, so one whose text a stop string cut is never given
    held: deque = deque()

    def release(upto: float) -> list:
        out = []
        while held and held[0][0] < upto:
            out.append(held.popleft()[1])
        return out

    def stats(text, token, reason=None, reasoning="", lp=()):
        nonlocal shown
        shown += len(text)
        now = time.perf_counter()
        pt = (t_first or now) - t0
        gt = now - (t_first or now)
        computed = getattr(gen, "prefill_tokens", model.last_prefill_tokens)
        drafts = (0, 0)
        if reason and model.mtp is not None:   # an engine's stream counts its own request's drafts
            drafts = (gen.drafted, gen.accepted) if hasattr(gen, "drafted") else (model.mtp.drafted,
                                                                                  model.mtp.accepted)
        return Event(text, token, reason, n_prompt, n_gen, computed, computed / pt if pt > 0 else 0.0,
                     (n_gen - 1) / gt if gt > 0 and n_gen > 1 else 0.0,
                     post.boxes(shown) if post and reason else [], reasoning=reasoning,
                     videos=videos if reason else [], drafted=drafts[0], accepted=drafts[1], logprobs=list(lp),
                     reasoning_tokens=n_think if reason else 0)

    for token in gen:
        if t_first is None:
            t_first = time.perf_counter()
        n_gen += 1
        if token in model.eos_ids:
            finish = "stop"
            break
        was = split.thinking
        piece, thought = split.add(token)
        if thought:
            yield stats("", token, reasoning=thought)
        # the answer's tokens only: not the reasoning's, nor its markers
        thinking = was or split.thinking
        n_think += thinking
        if noted is not None and not thinking:
            held.append((shown + len(pending), logprob_entry(model.tokenizer, noted.entries[n_gen - 1])))
        pending += post.feed(piece) if post else piece
        if stop:
            hit = min((i for i in (pending.find(s) for s in stop) if i >= 0), default=-1)
            if hit >= 0:
                yield stats(pending[:hit], token, "stop", lp=release(shown + hit))
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
        lp = release(shown + len(out) if stop else float("inf"))   # (a token of part of a character has no text yet)
        yield stats(out, None if thought else token, lp=lp)   # a token its reasoning event gave is not given twice
    tail, thought = split.flush()
    tail = pending + (post.feed(tail) + post.flush() if post else tail)
    cut = float("inf")
    if stop:
        hit = min((i for i in (tail.find(s) for s in stop) if i >= 0), default=-1)
        if hit >= 0:
            tail, finish, cut = tail[:hit], "stop", shown + hit
    yield stats(tail, None, finish, thought, lp=release(cut))


def logprob_entry(tokenizer, entry: tuple) -> dict:
    """``Logprobs``' (token, logprob, top) in OpenAI's shape."""
    def one(t, lp):
        b = tokenizer.token_bytes(t)
        return {"token": tokenizer.decode([t], skip_special_tokens=False), "logprob": lp,
                "bytes": list(b) if b is not None else None}

    tok, lp, top = entry
    return {**one(tok, lp), "top_logprobs": [one(t, v) for t, v in top]}


def with_reasoning(events, markers) -> Iterator[tuple[str, Event]]:
    """(text to show, event) with the reasoning shown between the model's own ``markers``
    (``Architecture.reasoning_tokens``, e.g. ``<think>``...``</think>``) on lines of their own."""
    start, end = markers or ("", "")
    inside = False
    for ev in events:
        out = ""
        if ev.reasoning:
            out += ("" if inside else f"{start}\n") + ev.reasoning
            inside = True
        if inside and (ev.text or ev.finish_reason):
            out += f"\n{end}\n\n"
            inside = False
        yield out + ev.text, ev


def stream_generate(model, prompt, image=None, show_reasoning: bool = False, **kwargs) -> Iterator[str]:
    """Yield text pieces as they are generated (see ``stream_events`` for the options);
    ``show_reasoning`` includes the model's thinking, between its reasoning markers."""
    events = stream_events(model, prompt, image=image, **kwargs)
    for text, _ in (with_reasoning(events, model.arch.reasoning_tokens) if show_reasoning
                    else ((ev.text, ev) for ev in events)):
        if text:
            yield text


def generate(model, prompt, image=None, **kwargs) -> str:
    """Generate a whole answer. ``prompt`` is a string (chat-templated) or a list of messages."""
    return "".join(stream_generate(model, prompt, image=image, **kwargs))


def complete(model, prompt, image=None, **kwargs) -> Completion:
    """Generate a whole answer and return it with the boxes it names and the reasoning
    (``stream_events`` options; ``Completion.json`` parses an answer constrained to JSON)."""
    structure = structured.parse(kwargs.pop("response_format", None), kwargs.pop("json_schema", None))
    if structure is not None:
        kwargs["response_format"] = structured.compiled(model, structure)
    spec = tool_calls.prepare(model, kwargs.pop("tools", None), kwargs.pop("tool_choice", None),
                              kwargs.pop("parallel_tool_calls", None))
    kwargs["tools"] = spec
    text, thought, last, lps = [], [], None, []
    for ev in stream_events(model, prompt, image=image, **kwargs):
        text.append(ev.text)
        thought.append(ev.reasoning)
        lps += ev.logprobs
        last = ev
    answer, calls, finish = "".join(text), [], last.finish_reason
    if spec is not None and spec.parses:
        answer, calls = tool_calls.parse(answer, spec)
        finish = "tool_calls" if calls and finish == "stop" else finish
    return Completion(answer, last.boxes, finish, last.prompt_tokens, last.generation_tokens,
                      "".join(thought), structure.kind if structure is not None else None, calls,
                      lps if kwargs.get("logprobs") else None)
