"""Interactive terminal chat (``edgevl chat MODEL``) on top of the model's KV-cache prefix reuse.

Every turn renders the whole conversation with the chat template, but the model's cache already
holds the conversation up to the previous answer, so only the new tokens are prefilled
(``model.last_prefill_tokens``). Re-tokenizing an answer can split it differently from how it was
generated; the cache is then reused up to that point.

Context policy: a turn needs ``prompt tokens + max_new_tokens <= model.max_context`` (room for a
full answer). When the history makes the prompt too long, the oldest whole turns (a user message
and its answer) are dropped, as many as leave a quarter of the room free (or, failing that, as
few as fit), the system message is kept, and a one-line notice is printed; the next prefill then
recomputes the cache once, and the turns after it reuse it until the context is full again. A
message that does not fit even alone is refused with a message, and the chat goes on.

    /image PATH   attach an image to the next message      /reset       forget the conversation
    /video PATH   attach a video to the next message
    /save FILE    write the transcript as JSON              /help, /quit (or Ctrl-D)
    /schema FILE  answer in JSON following a schema (/schema off: free text again)

Ctrl-C stops an answer, or clears the line at the prompt; a second Ctrl-C at the prompt within
``LEAVE_WINDOW`` seconds leaves. ``/image demo`` (and ``--image demo``) attach a random demo scene.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

from .errors import ContextOverflow, EdgevlError
from .generate import (
    Event,
    _image_parts,
    default_max_new_tokens,
    model_template_kwargs,
    prepare,
    stream_events,
    with_reasoning,
)
from .model import Model, load
from .sample import resolve

LEAVE_WINDOW = 2.0  # seconds: a second Ctrl-C at the prompt within this leaves


def no_image_note(model, how: str) -> str | None:
    """The note for a prompt without images to a model whose package says it needs one (the
    demo model, trained on images only: its text-only answers are confident and meaningless);
    None for every other model. ``how``: how to give an image (e.g. ``--image``)."""
    if model.manifest.get("needs_image") is True:
        return f"note: this model was trained on images only; its answer without {how} is not meaningful"
    return None


HELP = """commands:
  /image PATH   attach an image to your next message ('demo': a random demo scene)
  /video PATH   attach a video (file, animated GIF/WebP, folder of frames) to your next message
  /reset        forget the conversation (and the KV cache); attached images stay
  /save FILE    write the whole conversation as JSON
  /schema FILE  answer in JSON that follows the JSON schema in FILE (constrained); /schema off: free text
  /help         this list
  /quit         leave (Ctrl-D, or Ctrl-C twice, works too); Ctrl-C stops an answer or clears the line"""


class _Attached(str):
    """A path as one message holds it: the file may be overwritten and attached again (a camera's
    latest.jpg), and each message keeps the pixels it was sent with."""

    serial = 0


def _key(path) -> tuple:
    return path, getattr(path, "serial", 0)


class _ImageMemo:
    """The model, with image encodings remembered by attachment: each turn re-renders the whole
    conversation, and re-running the vision tower on every old image would dominate a turn."""

    def __init__(self, model: Model):
        self._model = model
        self.rows: dict = {}

    def __getattr__(self, name):
        return getattr(self._model, name)

    def keep(self, attached) -> None:
        """Let go of the encodings of attachments no longer in ``attached`` (turns dropped from
        the context, files attached again): a camera's latest.jpg sent every turn would grow it."""
        held = {_key(p) for p in attached if isinstance(p, str)}    # (images in memory are not kept here)
        self.rows = {k: v for k, v in self.rows.items() if k[1:3] in held}

    def _memo(self, key, compute):
        if key not in self.rows:
            self.rows[key] = compute()
        return self.rows[key]

    def encode_image(self, image, max_image_patches=None):
        if not isinstance(image, str):
            return self._model.encode_image(image, max_image_patches)
        return self._memo(("image", *_key(image), max_image_patches),
                          lambda: self._model.encode_image(image, max_image_patches))

    def encode_video(self, video, **options):
        if not isinstance(video, str):
            return self._model.encode_video(video, **options)
        return self._memo(("video", *_key(video), tuple(sorted(options.items()))),
                          lambda: self._model.encode_video(video, **options))

    def video_tokens(self, video, **options):
        if not isinstance(video, str):
            return self._model.video_tokens(video, **options)
        return self._memo(("video tokens", *_key(video), tuple(sorted(options.items()))),
                          lambda: self._model.video_tokens(video, **options))


class ChatSession:
    """A conversation: ``send(text)`` fits the context and returns an iterator of answer pieces.

    ``messages`` holds the history (image parts as ``{"type": "image", "image": path}``);
    ``dropped`` is how many old turns the last ``send`` dropped; ``last_tokens`` and
    ``last_event`` describe the last answer.
    """

    def __init__(self, model: Model, system: str | None = None, max_new_tokens: int | None = None,
                 max_image_patches: int | None = None, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, repetition_penalty: float | None = None, seed: int | None = None,
                 stop=None, allow_special_in_content: bool = False, chat_template_kwargs=None,
                 show_reasoning: bool = False, thinking: bool | None = None, video_options: dict | None = None,
                 min_p: float | None = None):
        # unset values come from the model's generation_config.json; bad ones fail now, not per turn
        resolve(model.generation_config, temperature, top_k, top_p, repetition_penalty, min_p)
        # typed text is plain text: "<|end_of_text|>" in a message does not end the turn
        self.allow_special_in_content = allow_special_in_content
        self.chat_template_kwargs = model_template_kwargs(model, chat_template_kwargs, thinking)
        self.show_reasoning = show_reasoning  # the history keeps only answers either way
        if max_new_tokens is None:   # a small context keeps half of itself for the conversation
            max_new_tokens = min(default_max_new_tokens(model), max(1, model.max_context // 2))
        if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                or not 0 < max_new_tokens < model.max_context):
            raise EdgevlError(f"max_new_tokens must be between 1 and {model.max_context - 1} (the model's "
                              f"context is {model.max_context} tokens), got {max_new_tokens!r:.40}")
        self.model = _ImageMemo(model)
        self._serial = 0
        self.system = system
        self.max_new_tokens = int(max_new_tokens)
        self.max_image_patches = max_image_patches
        self.video_options = {}
        if video_options is not None:   # bad options fail now, not at the first video
            from .processing.video import check_options

            self.video_options = check_options(video_options)
        # one sampler seed for the whole chat would repeat the same draws every turn: advance it
        self.seed = seed
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             repetition_penalty=repetition_penalty, stop=stop)
        self.response_format = None   # the answers' structure (/schema), compiled
        self.reset()

    def set_schema(self, path) -> None:
        """Constrain the next answers to the JSON schema in the file at ``path`` (None: free text)."""
        from . import structured

        self.response_format = None if path is None else structured.compiled(
            self.model, structured.parse(structured.schema_file(path, "/schema")))

    def reset(self, keep_attached: bool = False) -> None:
        """Forget the conversation; ``keep_attached`` keeps images attached for the next message."""
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.earlier: list[dict] = []    # turns dropped from the context, oldest first (kept for /save)
        self.pending_images: list[str] = list(self.pending_images) if keep_attached else []
        self.pending_videos: list[str] = list(self.pending_videos) if keep_attached else []
        self.dropped = 0
        self.turns = 0
        self.last_tokens: list[int] = []
        self.last_event: Event | None = None
        self.model.keep(self.pending_images + self.pending_videos)   # (kept attachments keep their pixels)
        self.model.reset()

    def attach(self, image) -> None:
        """Queue an image (a path, a PIL image or an image file's bytes) for the next message; it
        is encoded now so a bad file fails here."""
        if isinstance(image, (str, os.PathLike)):
            image = self._attached(image)
        if self.model.vision is None:
            raise EdgevlError("this model has no vision tower; it cannot take images (use a vision-language model)")
        self.model.encode_image(image, self.max_image_patches)
        self._check_fits(self.pending_images + [image], self.pending_videos, "image")
        self.pending_images.append(image)

    def _attached(self, path) -> _Attached:
        """``path`` for one message: read now, and what it held now is what that message keeps."""
        self._serial += 1
        p = _Attached(str(Path(path).expanduser()))
        p.serial = self._serial
        return p

    def _check_fits(self, images: list, videos: list, what: str) -> None:
        """The attached images and videos must leave room for a message beside the answer with no
        history at all: else every message after would be refused, and no command takes one back."""
        media = ([{"type": "image", "image": p} for p in images]
                 + [{"type": "video", "video": p} for p in videos])
        head = self.messages[:1] if self.system else []
        need = self._count(head + [{"role": "user", "content": media + [{"type": "text", "text": ""}]}])
        if self._overflow is not None:
            raise EdgevlError(f"{what} refused: {self._overflow}")
        room = self.model.max_context - self.max_new_tokens
        if need >= room:    # a message needs one token at least
            n = len(media)
            raise EdgevlError(f"{what} refused: {'it' if n == 1 else f'the {n} attached images and videos'} would "
                              f"take {need} prompt tokens and leave no room for a message ({room} fit: the "
                              f"{self.model.max_context}-token context minus {self.max_new_tokens} for the answer); "
                              f"attach a smaller or shorter {what}, or lower --max-image-patches or --max-new-tokens")

    def attach_video(self, path) -> None:
        """Queue a video for the next message; it is decoded and encoded now so a bad file fails
        here, unless its header already says that it cannot fit (then nothing is decoded)."""
        path = self._attached(path)
        room = self.model.max_context - self.max_new_tokens
        need = self.model.video_tokens(path, **self.video_options)
        if need >= room:
            raise EdgevlError(f"the video takes {need} tokens but only {room} fit (the {self.model.max_context}-"
                              f"token context minus {self.max_new_tokens} for the answer); send a shorter video or "
                              "lower --fps, --max-frames or --video-max-pixels")
        self.model.encode_video(path, **self.video_options)
        self._check_fits(self.pending_images, self.pending_videos + [path], "video")
        self.pending_videos.append(path)

    def _count(self, messages) -> int:
        """Prompt tokens of ``messages``; past the context (``_overflow`` says why) where their
        videos alone overflow it, counted from their headers."""
        self._overflow = None
        try:
            return len(prepare(self.model, messages, max_image_patches=self.max_image_patches,
                               video_options=self.video_options,
                               allow_special_in_content=self.allow_special_in_content,
                               chat_template_kwargs=self.chat_template_kwargs).input_ids)
        except ContextOverflow as e:     # the conversation's videos alone overflow: older turns go first
            self._overflow = e
            return self.model.max_context + 1

    def _pairs_to_drop(self, msgs: list, head: int, room: int) -> int:
        """How many of the oldest turns (user/assistant pairs after ``head``) go: the fewest that
        leave a quarter of ``room`` free, else the fewest that fit (the prompt then starts anew,
        and its whole prefill is paid once per quarter of the context, not on every turn). The
        count falls as turns go, so a binary search renders the conversation a few times, not
        once per turn dropped. Refuses a message that does not fit alone."""
        pairs = (len(msgs) - head - 1) // 2

        def count(k: int) -> int:
            return self._count(msgs[:head] + msgs[head + 2 * k:])

        n = count(pairs)      # the message alone
        if n > room:
            if n > self.model.max_context and self._overflow is not None:
                raise self._overflow
            raise EdgevlError(f"message refused: it needs {n} prompt tokens but only {room} fit (the "
                              f"{self.model.max_context}-token context minus {self.max_new_tokens} for the "
                              "answer); shorten it or lower --max-new-tokens")
        limit = room - room // 4 if n <= room - room // 4 else room
        lo, hi = 1, pairs          # the fewest k in [lo, hi] that fit the limit
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if count(mid) <= limit else (mid + 1, hi)
        return lo

    def send(self, text: str) -> Iterator[str]:
        """Fit the context (module doc), then stream the answer. Refusals raise EdgevlError at once;
        the history gets the message and its answer (partial if interrupted) once streaming ends."""
        media = ([{"type": "image", "image": p} for p in self.pending_images]
                 + [{"type": "video", "video": p} for p in self.pending_videos])
        content = media + [{"type": "text", "text": text}] if media else text
        msgs = self.messages + [{"role": "user", "content": content}]
        head = 1 if self.system else 0  # the system message is never dropped
        room = self.model.max_context - self.max_new_tokens
        dropped = []
        if self._count(msgs) > room:
            k = self._pairs_to_drop(msgs, head, room)
            dropped, msgs = msgs[head:head + 2 * k], msgs[:head] + msgs[head + 2 * k:]
        # attached images stay for the next message until one is taken (a refusal keeps them)
        self.pending_images, self.pending_videos = [], []
        self.messages, self.dropped = msgs[:-1], len(dropped) // 2
        self.earlier += dropped
        self.model.keep([p.get(p["type"]) for p in _image_parts(msgs, ("image", "video"))])
        return self._stream(msgs)

    def _stream(self, msgs) -> Iterator[str]:
        text, tokens = [], []
        seed = None if self.seed is None else self.seed + self.turns
        self.turns += 1

        def record():
            self.messages = msgs + [{"role": "assistant", "content": "".join(text)}]
            self.last_tokens = tokens

        try:
            events = stream_events(self.model, msgs, max_new_tokens=self.max_new_tokens, seed=seed,
                                   max_image_patches=self.max_image_patches, video_options=self.video_options,
                                   allow_special_in_content=self.allow_special_in_content,
                                   chat_template_kwargs=self.chat_template_kwargs,
                                   response_format=self.response_format, **self.sampling)
            for shown, ev in (with_reasoning(events, self.model.arch.reasoning_tokens) if self.show_reasoning
                              else ((e.text, e) for e in events)):
                if ev.token is not None:
                    tokens.append(ev.token)
                if ev.finish_reason:
                    self.last_event = ev
                if ev.text:
                    text.append(ev.text)
                if shown:
                    yield shown
        except KeyboardInterrupt:  # the model keeps its cache whole (Model: whole or nothing)
            record()
            raise
        except GeneratorExit:  # the caller stopped reading: keep what was shown
            record()
            raise
        record()

    def save(self, path) -> Path:
        """Write the whole conversation: ``messages`` holds every turn, those dropped from the
        context too (``dropped_from_context``: how many of the first turns the model no longer sees)."""
        path = Path(path).expanduser()
        head = 1 if self.system else 0
        data = {"model": str(self.model.path),
                "messages": self.messages[:head] + self.earlier + self.messages[head:]}
        if self.earlier:
            data["dropped_from_context"] = len(self.earlier) // 2
        path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        return path


def chat_loop(model_path, image=None, threads: int | None = None, max_image_patches: int | None = None,
              max_new_tokens: int | None = None, temperature: float | None = None, top_k: int | None = None,
              top_p: float | None = None, repetition_penalty: float | None = None, seed: int | None = None,
              stop=None, system: str | None = None, input_fn=input, out=None,
              allow_special_in_content: bool = False, chat_template_kwargs=None, show_reasoning: bool = False,
              thinking: bool | None = None, video=None, video_options: dict | None = None,
              min_p: float | None = None) -> int:
    """Run the terminal chat until /quit or EOF; ``model_path`` may also be a loaded Model.

    ``input_fn`` (called with the prompt "> ") and ``out`` make the loop scriptable in tests.
    Errors inside the chat print one ``error: ...`` line and the chat goes on; bad startup
    settings raise EdgevlError (the CLI exits 2).
    """
    out = out or sys.stdout
    if threads is not None:  # 0 is a mistake here too, not "the default"
        from .runtime import check_threads

        check_threads(threads)
    model = model_path if isinstance(model_path, Model) else load(model_path, threads=threads)
    session = ChatSession(model, system=system, max_new_tokens=max_new_tokens, max_image_patches=max_image_patches,
                          temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                          seed=seed, stop=stop, allow_special_in_content=allow_special_in_content,
                          chat_template_kwargs=chat_template_kwargs, show_reasoning=show_reasoning, thinking=thinking,
                          video_options=video_options, min_p=min_p)
    demo_scenes = attached = 0
    noted = False  # the no-image note, once per conversation

    def attach(arg: str) -> str:
        """Attach an image (``demo``: a fresh demo scene, saved beside the others); returns its name."""
        nonlocal demo_scenes, attached
        from .demo.scene_file import demo_images, is_demo_image

        if is_demo_image(arg) and model.vision is not None:
            demo_scenes += 1
            # a new file per scene: earlier turns keep showing their own picture; the k-th image
            # of the chat is scene seed + k, as the k-th --image of run
            (path,), _ = demo_images([arg], seed, "demo_scene.png" if demo_scenes == 1 else
                                     f"demo_scene-{demo_scenes}.png", first=attached)
            session.attach(path)
            attached += 1
            return f"a random demo scene, saved to {path}"
        session.attach(arg)
        attached += 1
        return arg

    if image:
        image = attach(image)
    if video:
        session.attach_video(video)
    if input_fn is input and sys.stdin.isatty():
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass

    def say(line=""):
        print(line, file=out, flush=True)

    say(f"edgevl chat: {model.path.name} ({model.max_context}-token context). /help lists commands; "
        "/quit, Ctrl-D or Ctrl-C twice leaves.")
    if image:
        say(f"[image attached to your first message: {image}]")
    if video:
        say(f"[video attached to your first message: {video}]")
    last_interrupt = None
    while True:
        try:
            line = input_fn("> ").strip()
        except EOFError:
            say()
            return 0
        except KeyboardInterrupt:
            now = time.monotonic()
            if last_interrupt is not None and now - last_interrupt <= LEAVE_WINDOW:
                say()
                return 0
            last_interrupt = now
            try:
                say(f"\n[line cleared; the conversation is kept. Ctrl-C again within {LEAVE_WINDOW:g} s, "
                    "/quit or Ctrl-D leaves]")
            except KeyboardInterrupt:  # the second one came before the prompt was back
                say()
                return 0
            continue
        last_interrupt = None
        if not line:
            continue
        if line.startswith("/"):
            cmd, _, arg = line.partition(" ")
            arg = arg.strip().strip("'\"")  # paths dropped into a terminal come quoted
            try:
                if cmd in ("/quit", "/exit"):
                    return 0
                elif cmd == "/help":
                    say(HELP)
                elif cmd == "/reset":
                    session.reset(keep_attached=True)
                    noted = False
                    n = len(session.pending_images) + len(session.pending_videos)
                    what = "image(s)/video(s)" if session.pending_videos else "image(s)"
                    say("[conversation cleared" + (f"; the {n} attached {what} stay for your next message]"
                                                   if n else "]"))
                elif cmd == "/image":
                    if not arg:
                        raise EdgevlError("usage: /image PATH (or /image demo)")
                    say(f"[image attached to your next message: {attach(arg)}]")
                elif cmd == "/video":
                    if not arg:
                        raise EdgevlError("usage: /video PATH (a video file, animated GIF/WebP or folder of frames)")
                    session.attach_video(arg)
                    say(f"[video attached to your next message: {arg}]")
                elif cmd == "/schema":
                    if not arg:
                        raise EdgevlError("usage: /schema FILE (a JSON schema file) or /schema off")
                    session.set_schema(None if arg == "off" else arg)
                    say("[answers are free text again]" if arg == "off" else
                        f"[answers follow the JSON schema in {arg}]")
                elif cmd == "/save":
                    if not arg:
                        raise EdgevlError("usage: /save FILE")
                    saved = session.save(arg)
                    gone = len(session.earlier) // 2
                    say(f"[transcript saved to {saved}" + (f"; its first {gone} turn(s) are no longer in the model's "
                                                           "context]" if gone else "]"))
                else:
                    raise EdgevlError(f"unknown command {cmd}; /help lists the commands")
            except EdgevlError as e:
                say(f"error: {e}")
            except OSError as e:  # /save into a missing folder, a full disk, ...
                say(f"error: {e.strerror or e}" + (f" ({e.filename})" if e.filename else ""))
            continue
        if not noted and not session.pending_images and not any(
                isinstance(m["content"], list) for m in session.messages):
            note = no_image_note(model, "an image (--image, /image)")
            if note:
                print(note, file=sys.stderr, flush=True)
                noted = True
        try:
            with closing(session.send(line)) as pieces:
                if session.dropped:
                    say(f"[context full: dropped the {session.dropped} oldest turn(s) to make room]")
                shown = False
                for piece in pieces:
                    out.write(piece)
                    out.flush()
                    shown = shown or bool(piece.strip())
            say()
            ev = session.last_event
            if not shown and ev is not None and ev.finish_reason == "length" and ev.reasoning_tokens:
                say("[the token limit ran out inside the thinking, before any answer; raise --max-new-tokens or "
                    "start the chat with --no-thinking]")
            elif ev is not None and ev.finish_reason == "length" and session.response_format is not None:
                say("[the token limit cut this answer before its JSON was complete; raise --max-new-tokens]")
        except EdgevlError as e:
            say(f"error: {e}")
        except KeyboardInterrupt:
            say(" [interrupted]")
