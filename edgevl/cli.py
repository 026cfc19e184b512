"""Command line: a thin layer over the Python API.

    edgevl convert HF_DIR OUT_DIR [--dtype fp32|fp16|bf16|q8]
    edgevl run [MODEL] --prompt "..." [--image PATH|demo] [sampling flags]
    edgevl verify [MODEL] [--reference HF_DIR] [--prompt ...] [--image PATH|demo]
    edgevl chat [MODEL] [--image PATH|demo]
    edgevl serve [MODEL] [--host 127.0.0.1] [--port 8080]
    edgevl bench [MODEL] [--compare torch,llamacpp] [--images 1024x768]
    edgevl cache [list|clear]
    edgevl check MODEL
    edgevl random-model FAMILY OUT_DIR [--seed N] [--clip CLIP.gif]
    edgevl batch [MODEL] --input SRC --prompt "..." --output OUT.jsonl|.parquet [--workers N] [--ray [ADDRESS]]

MODEL is a package folder; left out (or ``demo``) it is the shipped demo model. Every user
error prints one line ``error: ...`` and exits with status 2 (``batch``: 1 when some rows failed;
they carry an error field).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .errors import EdgevlError, os_error_line


def _int_at_least(name, minimum: int):
    """An argparse type: an integer >= minimum, else the one-line ``error: ...`` of every user
    mistake (raised through parse_args into main, before any work)."""
    def parse(v):
        try:
            n = int(v)
        except ValueError:
            raise EdgevlError(f"{name} must be an integer, got {v!r}") from None
        if n < minimum:
            raise EdgevlError(f"{name} must be >= {minimum}, got {n}")
        return n
    return parse


def _positive_int(name):
    return _int_at_least(name, 0)


def _integer(name):
    """An argparse type: any integer (its range is checked where it is used), else one line."""
    return _int_at_least(name, -(1 << 63))


def _number(name):
    """An argparse type: a number (its range is checked where it is used), else one line."""
    def parse(v):
        try:
            return float(v)
        except ValueError:
            raise EdgevlError(f"{name} must be a number, got {v!r}") from None
    return parse


def _positive_float(name):
    def parse(v):
        try:
            x = float(v)
        except ValueError:
            raise EdgevlError(f"{name} must be a number, got {v!r}") from None
        if not 0 < x < float("inf"):
            raise EdgevlError(f"{name} must be a positive number, got {v}")
        return x
    return parse


def _threads(name):
    """An argparse type: a thread count under the one rule of ``runtime.check_threads`` (0 and
    negatives are mistakes, not "the default"), in every command."""
    def parse(v):
        from .runtime import check_threads

        try:
            n = int(v)
        except ValueError:
            raise EdgevlError(f"{name} must be an integer, got {v!r}") from None
        return check_threads(n, name)
    return parse


class _Help(argparse.RawDescriptionHelpFormatter):
    """Help lines end with the default, unless it is None/False or the line already says it."""

    def _get_help_string(self, action):
        h = action.help or ""
        required = action.required or (not action.option_strings and action.nargs is None)
        if "default" in h or required or action.default in (False, argparse.SUPPRESS) or action.nargs == 0:
            return h
        if action.default is None or action.default == []:
            return f"{h} (default: none)"
        return f"{h} (default: %(default)s)"


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    cfg = "default: the model's generation_config.json"
    p.add_argument("--max-new-tokens", type=_int_at_least("--max-new-tokens", 1), default=None,
                   help=f"most tokens to generate ({cfg} max_new_tokens, else 256)")
    p.add_argument("--temperature", type=_number("--temperature"), default=None,
                   help=f"0 = plain greedy, ignoring the model's sampling defaults ({cfg}, else greedy)")
    p.add_argument("--top-k", type=_integer("--top-k"), default=None,
                   help=f"keep the k likeliest tokens, 0 = off ({cfg}, else 0)")
    p.add_argument("--top-p", type=_number("--top-p"), default=None, help=f"nucleus sampling mass ({cfg}, else 1.0)")
    p.add_argument("--min-p", type=_number("--min-p"), default=None,
                   help=f"drop tokens less likely than min-p times the likeliest, 0 = off ({cfg}, else 0)")
    p.add_argument("--repetition-penalty", type=_number("--repetition-penalty"), default=None,
                   help=f"1 = off ({cfg}, else 1.0)")
    p.add_argument("--seed", type=_integer("--seed"), default=None, help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable; default: none)")


def add_structure_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="answer with JSON that follows the JSON schema in FILE (constrained; default: free text)")
    p.add_argument("--json", action="store_true", help="answer with a JSON object (constrained; default: free text)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=_threads("--threads"), default=None,
                   help="CPU threads (default: physical cores, or EDGEVL_THREADS; at most 4 x the CPU count)")
    p.add_argument("--max-image-patches", type=_integer("--max-image-patches"), default=None,
                   help="patch budget per image; bigger images are downscaled to fit (default: the model's "
                        "own, from its preprocessor_config.json (max_image_patches, or max_pixels) as its "
                        "processor reads it, capped where docs/models says; at most 65536; run --verbose shows it)")
    p.add_argument("--low-memory", action="store_true",
                   help="keep no weights resident: load each layer while it runs (slow; for models "
                        "that do not fit in RAM)")
    add_runtime_option_args(p)


def _runtime_options() -> dict:
    """name -> (RuntimeOption, architectures offering it), over every registered architecture."""
    from . import models
    from .models.protocol import COMMON_RUNTIME_OPTIONS

    out: dict = {name: (opt, ["all"]) for name, opt in COMMON_RUNTIME_OPTIONS.items()}
    for arch in models.all_architectures():
        for name, opt in arch.runtime_options.items():
            out.setdefault(name, (opt, []))[1].append(arch.name)
    return out


def add_runtime_option_args(p: argparse.ArgumentParser) -> None:
    """The load-time options as flags: speculative decoding's and the architectures' own (e.g.
    --expert-cache-mb)."""
    p.add_argument("--speculative", choices=["none", "mtp"], default=None,
                   help="speculative decoding: mtp drafts tokens with the package's multi-token-prediction block "
                        "and checks them in one decoder pass (same output, faster when drafts are accepted; it "
                        "turns itself off for a generation whose drafts are mostly rejected); none decodes one "
                        "token per pass (default: mtp where the package has the block)")
    p.add_argument("--draft-tokens", type=_int_at_least("--draft-tokens", 1), default=None, metavar="K",
                   help="tokens the MTP block drafts per decoder pass, always K (default: up to 3, as many as "
                        "are being accepted often enough to pay; at most 7, or 2 for a package converted by an "
                        "older edgevl)")
    p.add_argument("--draft-vocab", type=_int_at_least("--draft-vocab", 0), default=None, metavar="N",
                   help="draft among the first N vocabulary entries only (BPE vocabularies put the frequent tokens "
                        "first): a cheaper draft, slightly fewer drafts accepted (default 65536; 0: the whole "
                        "vocabulary)")
    for name, (opt, archs) in _runtime_options().items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=_runtime_option(name, archs), default=None,
                       metavar=opt.metavar,
                       help=f"{opt.help} ({', '.join(archs)} models)")


def _runtime_option(name: str, archs: list):
    """An argparse type: the value checked by the architecture's own rule (type, range), so a
    mistake fails before the demo is converted or anything is read."""
    def parse(v):
        from . import models

        own = [x for x in archs if x != "all"]
        arch = models.get(own[0]) if own else models.all_architectures()[0]
        return arch.resolve_runtime_options({name: v})[name]
    return parse


def load_for(a, path):
    """The model a command runs, loaded with the command's options; a thinking switch the model
    lacks is said, not silently ignored."""
    from . import load

    model = load(path, threads=a.threads, low_memory=a.low_memory, options=runtime_option_values(a))
    if getattr(a, "thinking", None) is not None and not model.arch.thinking_args(True):
        print(f"note: this model ({model.arch.name}) has no thinking switch in its chat template; "
              f"--{'' if a.thinking else 'no-'}thinking changes nothing", file=sys.stderr)
    return model


def runtime_option_values(a) -> dict:
    """The load-time options given on the command line (for ``load(..., options=)``)."""
    from .blocks.vocabulary import SPECULATIVE_OPTIONS

    names = [*SPECULATIVE_OPTIONS, *_runtime_options()]
    return {name: getattr(a, name) for name in names if getattr(a, name, None) is not None}


def _video_fps(name):
    """An argparse type: a sampling rate by the API's own rule for video_options (a positive
    number, at most 1000: an absurd one overflowed the frame count)."""
    def parse(v):
        from .processing.video import check_options

        try:
            x = float(v)
        except ValueError:
            raise EdgevlError(f"{name} must be a number, got {v!r}") from None
        return check_options({"fps": x}, names={"fps": name})["fps"]
    return parse


def add_video_args(p: argparse.ArgumentParser, many: bool | None = True) -> None:
    """--video and how clips are sampled (models whose vision encoder takes video); ``many=None``:
    the sampling flags only (batch takes its videos from a table's video column)."""
    if many:
        p.add_argument("--video", action="append", default=None,
                       help="video: a file (MP4/WebM/MOV... need PyAV: pip install 'edgevl[video]'), an animated "
                            "GIF/WebP or a folder of frames; repeat for several (default: none)")
    elif many is not None:
        p.add_argument("--video", default=None, help="video for your first message (a file, animated GIF/WebP or "
                                                      "folder of frames; default: none)")
    p.add_argument("--fps", type=_video_fps("--fps"), default=None,
                   help="frames sampled per second of video (default: the checkpoint's video processor, 2)")
    p.add_argument("--max-frames", type=_int_at_least("--max-frames", 2), default=None,
                   help="most frames sampled from one video (default: the checkpoint's, 768)")
    p.add_argument("--video-max-pixels", type=_int_at_least("--video-max-pixels", 1), default=None,
                   help="pixel budget of one video over all its sampled frames (default: the checkpoint's "
                        "size.longest_edge)")


def video_options(a) -> dict:
    return {"fps": a.fps, "max_frames": a.max_frames, "max_pixels": a.video_max_pixels}


def add_content_args(p: argparse.ArgumentParser, show: bool = True) -> None:
    p.add_argument("--allow-special-in-content", action="store_true",
                   help="let special-token text in messages (e.g. <|end_of_text|>) act as control tokens; by "
                        "default message contents are plain text and only the chat template adds control tokens")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="models that can think before answering: --no-thinking asks the chat template for a "
                        "direct answer (through the template's own switch); default: the template's own, "
                        "often on)")
    if show:
        p.add_argument("--show-thinking", action="store_true",
                       help="also print the model's thinking, between its reasoning markers such as "
                            "<think>...</think> (default: answer only)")


def check_model_args(a) -> None:
    """Absurd values fail before anything is loaded (ncnn crashed on some instead of refusing)."""
    from .processing.image import MAX_IMAGE_PATCHES
    from .runtime import check_threads, default_threads

    if a.threads is not None:
        check_threads(a.threads, "--threads")
    else:
        default_threads()  # a bad EDGEVL_THREADS fails now, not after the demo model is converted
    n = getattr(a, "max_image_patches", None)
    if n is not None and not 4 <= n <= MAX_IMAGE_PATCHES:
        raise EdgevlError(f"--max-image-patches must be between 4 and {MAX_IMAGE_PATCHES} (a 4096x4096 image), "
                          f"got {n}")
    if hasattr(a, "temperature"):
        from .sample import Sampler

        # the sampler's own rules, now rather than at the first token (after the scene and the model)
        Sampler(0.0 if a.temperature is None else a.temperature, a.top_k or 0, 1.0 if a.top_p is None else a.top_p,
                1.0 if a.repetition_penalty is None else a.repetition_penalty, a.seed, min_p=a.min_p or 0.0)


def check_media(a) -> None:
    """--image and --video name files that are there (``demo`` draws a scene; a video may also be a
    folder of frames)."""
    from .demo.scene_file import is_demo_image
    from .processing.image import is_data_url, local_path, shorten, url_scheme

    images = a.image if isinstance(a.image, list) else [a.image] if a.image else []
    video = getattr(a, "video", None)
    videos = video if isinstance(video, list) else [video] if video else []
    for im in images:
        if not im.strip():
            raise EdgevlError("--image is empty; give an image file's path")
        if is_data_url(im):   # an image inline, as the API takes it
            continue
        shown = shorten(im)
        if (scheme := url_scheme(im)) and scheme.lower() != "file":
            raise EdgevlError(f"--image {shown}: {scheme}:// URLs are not read; download the image and give its path")
        p = Path(local_path(im))
        try:
            there, folder, exists = p.is_file(), p.is_dir(), p.exists()
        except OSError:   # a name too long to be a file's
            there = folder = exists = False
        if not is_demo_image(im) and not there:
            raise EdgevlError(f"--image {shown} is a folder; give an image file" if folder else
                              f"--image {shown} is not a regular file (a FIFO or a device); give an image file"
                              if exists else f"image not found: {shown} (--image); check the path")
    for v in videos:
        if not v.strip():
            raise EdgevlError("--video is empty; give a video file's (or a folder of frames') path")
        if not Path(v).exists():
            raise EdgevlError(f"video not found: {v} (--video); check the path")


def check_package(path: str, a, video: bool = False) -> None:
    """What loading ``path`` with the command's options would refuse, from its manifest alone:
    before a scene is drawn, an output written or the model loaded."""
    from .model import check_load_options

    check_load_options(path, low_memory=getattr(a, "low_memory", False), options=runtime_option_values(a),
                       video=video, images=bool(getattr(a, "image", None)))


def check_image_out(path: str | None, flag: str) -> None:
    """An image output path must be a writable file name with an image extension (checked before
    the model runs, so a typo does not cost a generation)."""
    if path is None:
        return
    from PIL import Image

    check_file_out(path, flag, "out.png")
    if Path(path).suffix.lower() not in Image.registered_extensions():
        raise EdgevlError(f"{flag} {path} has no image extension Pillow knows (.png, .jpg, ...); add one")


def check_not_inputs(images: list, draw_boxes, demo_out) -> None:
    """--draw-boxes and --demo-out never write over an --image they read (by any spelling)."""
    from .boxes import box_image_paths
    from .demo.scene_file import demo_paths, is_demo_image
    from .processing.image import is_data_url, local_path

    inputs = [Path(local_path(im)) for im in images
              if not is_demo_image(im) and not is_data_url(im)]
    outputs = [("--draw-boxes", p) for p in (box_image_paths(draw_boxes, len(images)) if draw_boxes else [])]
    outputs += [("--demo-out", p) for p in demo_paths(images, demo_out).values()]   # its default too
    for flag, out in outputs:
        for src in inputs:
            try:
                same = os.path.samefile(out, src)
            except OSError:   # not there yet
                same = os.path.realpath(out) == os.path.realpath(src)
            if same:
                raise EdgevlError(f"{flag} {out} is the input image {src}: writing it would replace that image; "
                                  f"choose another {flag}")


def check_file_out(path, flag: str, example: str) -> None:
    """An output file name in a folder that exists (checked before the work that fills it)."""
    if path is None:
        return
    path = str(path)
    p = Path(path)
    if p.is_dir() or path.endswith(("/", "\\")):
        raise EdgevlError(f"{flag} {path} is a folder; give a file name such as {p / example}")
    if not p.parent.is_dir():
        raise EdgevlError(f"{flag} {path}: the folder {p.parent} does not exist; create it first")


def sampling_kwargs(a) -> dict:
    return dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                repetition_penalty=a.repetition_penalty, seed=a.seed, stop=a.stop, min_p=a.min_p)


MODEL_HELP = "a package folder; 'demo' or none: the shipped demo model (converted once into the cache; default)"


def resolve_model(path: str | None) -> str:
    """A package folder, or (no argument, or ``demo``) the shipped demo model converted into the
    user cache (a folder named ``demo`` holding a package wins)."""
    from .demo import demo_package, demo_package_path, names_demo

    if not names_demo(path or None):
        return path

    out = demo_package_path()
    if not (out / "manifest.json").is_file():
        print(f"[converting the demo model into {out} (once)]", file=sys.stderr, flush=True)
    return str(demo_package())


# ---------------------------------------------------------------------------------------------


def _stoppable(work, kept) -> int:
    """``work()``, which SIGTERM (``timeout``, ``kill``, ``docker stop``, schedulers) stops as
    Ctrl-C does, cleaning up: either stop ends with one line, ``kept()`` saying what stands and how
    to go on, and exit 143 or 130."""
    import signal
    import threading

    termed = []

    def on_term(signum, frame):
        termed.append(signum)
        raise KeyboardInterrupt

    installed = threading.current_thread() is threading.main_thread()   # signals reach only that thread
    previous = signal.signal(signal.SIGTERM, on_term) if installed else None
    try:
        return work()
    except KeyboardInterrupt:
        print(f"\n{'stopped (SIGTERM)' if termed else 'interrupted'}; {kept()}", file=sys.stderr)
        return 128 + signal.SIGTERM if termed else 130
    finally:
        if installed:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def cmd_convert(a) -> int:
    import time

    from .convert import convert

    options = {name: getattr(a, name) for name in _convert_options()}
    t0, started = time.perf_counter(), time.time()

    def work() -> int:
        out = convert(a.hf_dir, a.out_dir, dtype=a.dtype, overwrite=a.force, progress=not a.quiet, **options)
        size = sum(f.stat().st_size for f in Path(out).iterdir() if f.is_file())
        print(f"wrote {out} ({a.dtype}, {size / 2 ** 20:,.1f} MiB, {time.perf_counter() - t0:.1f} s)")
        return 0

    def kept() -> str:
        # its temporary folder is gone, and an old package there is as it was; unless the stop
        # came while the new package was swapped in (it waits for that): then the package is whole
        out = " ".join(str(a.out_dir).splitlines())
        if _converted_since(a.out_dir, a.hf_dir, started):
            return f"{out} was written whole before the stop"
        return f"nothing was written to {out}: run the command again to convert"

    return _stoppable(work, kept)


def _converted_since(out_dir, hf_dir, started: float) -> bool:
    """Whether ``out_dir`` holds a package of ``hf_dir`` written since ``started``."""
    import calendar
    import json
    import time

    try:
        m = json.loads((Path(out_dir) / "manifest.json").read_text())
        created = calendar.timegm(time.strptime(m["created"], "%Y-%m-%dT%H:%M:%SZ"))
        return m["source"]["path"] == str(Path(hf_dir).resolve()) and created >= int(started)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def resolve_images(a) -> list:
    """The --image values of run and verify, ``demo`` drawn as a saved demo scene
    (``demo.scene_file.demo_images``: --seed picks the scenes as in chat)."""
    from .demo.scene_file import demo_images

    images, saved = demo_images(a.image or [], a.seed, a.demo_out)
    for path in saved:
        print(f"[demo scene saved to {path}]", file=sys.stderr)
    return images


def cmd_run(a) -> int:
    from .chat import no_image_note
    from .generate import default_max_new_tokens, stream_events, with_reasoning
    from .sample import resolve

    check_model_args(a)
    check_image_out(a.demo_out, "--demo-out")
    check_image_out(a.draw_boxes, "--draw-boxes")
    images = list(a.image or [])
    if a.raw and (images or a.video):
        raise EdgevlError("--raw cannot be combined with --image or --video: they need the chat template")
    if not a.prompt.strip():
        raise EdgevlError("--prompt is empty; pass some text")
    if a.draw_boxes and not images:
        raise EdgevlError("--draw-boxes needs --image")
    check_media(a)
    check_not_inputs(images, a.draw_boxes, a.demo_out)
    from .structured import cli_format, parse

    response_format = parse(cli_format(a.json_schema, a.json))   # a bad schema fails before the model loads
    model_path = resolve_model(a.model)
    check_package(model_path, a, video=bool(a.video))
    images = resolve_images(a)
    model = load_for(a, model_path)
    if not images and not a.video and (note := no_image_note(model, "--image")):
        print(note, file=sys.stderr)
    if not a.raw and not model.tokenizer.chat_template:
        print("note: this model has no chat template, so the prompt goes to it as plain text (as --raw sends it); "
              "if the checkpoint has one, add it to its folder and convert again", file=sys.stderr)
    kwargs = sampling_kwargs(a)
    if a.verbose:
        settings = resolve(model.generation_config, a.temperature, a.top_k, a.top_p, a.repetition_penalty, a.min_p)
        budget = a.max_image_patches or getattr(model.vision, "default_max_patches", None)
        threads = f"{model.threads} thread{'s' if model.threads != 1 else ''}"
        print(f"[model {model.path} ({model.arch.name}, {model.dtype}, {threads}); "
              f"{settings.describe()}; max_new_tokens {a.max_new_tokens or default_max_new_tokens(model)}"
              + (f"; image patch budget {budget}" + (" (--max-image-patches)" if a.max_image_patches else
                                                       " (the model's own)") if images and budget else "")
              + "]", file=sys.stderr)
    text, boxes = [], []
    events = stream_events(model, a.prompt, image=images or None, raw=a.raw, max_image_patches=a.max_image_patches,
                           video=a.video, video_options=video_options(a),
                           allow_special_in_content=a.allow_special_in_content,
                           thinking=a.thinking, response_format=response_format, **kwargs)
    finish, thought = None, False
    for shown, ev in (with_reasoning(events, model.arch.reasoning_tokens) if a.show_thinking
                      else ((e.text, e) for e in events)):
        thought = thought or bool(ev.reasoning)
        if shown:
            sys.stdout.write(shown)
            sys.stdout.flush()
            text.append(ev.text)
        if ev.finish_reason:
            boxes, finish = ev.boxes, ev.finish_reason
            if a.verbose:
                print(f"\n[{ev.prompt_tokens} prompt tokens, {ev.prompt_tps:.1f} tok/s; {ev.generation_tokens} "
                      f"generated, {ev.generation_tps:.1f} tok/s; finish: {ev.finish_reason}]", file=sys.stderr)
                for k, v in enumerate(ev.videos):
                    h, w = v["resized_size"]
                    fps = f"{v['source_fps']:g} fps" if v.get("source_fps") else "frame rate unknown"
                    print(f"[video {k + 1}: {len(v['frame_indices'])} frames sampled ({fps} source), {w}x{h}, "
                          f"{v['grid_thw'][0]} temporal patches, {v['num_video_tokens']} tokens, encoded in "
                          f"{v['seconds']:.1f} s]", file=sys.stderr)
                for stat in model.runtime_stats().values():
                    print(f"[{stat['summary']}]", file=sys.stderr)
    sys.stdout.write("\n")
    if finish == "length" and thought and not "".join(text).strip():
        why = "the token limit ran out inside the thinking, before any answer; raise --max-new-tokens or pass " \
              "--no-thinking"
        if response_format is not None:
            raise EdgevlError(why)
        if not a.show_thinking:     # nothing was shown: an empty answer would pass for the model's
            print(f"[{why} (--show-thinking shows the thinking)]", file=sys.stderr)
    if response_format is not None and finish != "stop":
        raise EdgevlError("the answer was cut by the token limit before it was complete; raise --max-new-tokens")
    if a.draw_boxes:
        from .boxes import box_image_paths, draw_boxes
        from .processing.image import load_image

        for k, (im, out) in enumerate(zip(images, box_image_paths(a.draw_boxes, len(images)))):
            mine = [b for b in boxes if b.image == k]
            draw_boxes(load_image(im), mine).save(out)
            print(f"[{len(mine)} box(es) drawn to {out}]", file=sys.stderr)
    return 0


def cmd_verify(a) -> int:
    from .verification.verify import verify

    check_model_args(a)
    check_image_out(a.demo_out, "--demo-out")
    check_media(a)
    check_not_inputs(list(a.image or []), None, a.demo_out)
    model_path = resolve_model(a.model)
    check_package(model_path, a)
    ok = verify(model_path, a.reference, prompt=a.prompt, image=resolve_images(a) or None,
                max_new_tokens=a.max_new_tokens, max_image_patches=a.max_image_patches, threads=a.threads,
                options=runtime_option_values(a))
    return 0 if ok else 1


def cmd_chat(a) -> int:
    from .chat import chat_loop

    check_model_args(a)
    check_media(a)
    path = resolve_model(a.model)
    check_package(path, a, video=bool(a.video))
    model = load_for(a, path)
    return chat_loop(model, image=a.image, max_image_patches=a.max_image_patches,
                     video=a.video, video_options=video_options(a),
                     allow_special_in_content=a.allow_special_in_content, thinking=a.thinking,
                     show_reasoning=a.show_thinking, **sampling_kwargs(a))


def cmd_serve(a) -> int:
    from .server import api_keys_from, check_options, serve

    check_model_args(a)
    check_options(a.max_tokens, a.allow_origin, a.shutdown_grace, a.max_video_decode)   # before a model loads
    keys = api_keys_from(a.api_key, a.api_key_file, os.environ.get("EDGEVL_API_KEY"))
    path = resolve_model(a.model)
    model = load_for(a, path)
    name = a.model_name or ("demo" if path != a.model else None)  # not the cache folder's hash
    return serve(model, host=a.host, port=a.port, api_key=keys, image_dir=a.allow_image_dir,
                 max_queue=a.max_queue, model_name=name, strict_model=a.strict_model,
                 max_image_patches=a.max_image_patches, allow_special_in_content=a.allow_special_in_content,
                 thinking=a.thinking, parallel=a.parallel, shutdown_grace=a.shutdown_grace,
                 allow_origins=a.allow_origin, max_tokens=a.max_tokens, max_video_decode=a.max_video_decode)


def cmd_check(a) -> int:
    from .package import check_package

    path = resolve_model(a.model)   # `check` alone or `check demo`: the demo package in the cache
    n, size = check_package(path)
    print(f"ok: all {n} files of {path} ({size} bytes) match manifest.json")
    return 0


def cmd_bench(a) -> int:
    from .bench import bench_cli, check_args

    check_model_args(a)
    check_file_out(a.json, "--json", "bench.json")
    check_file_out(a.markdown, "--markdown", "bench.md")
    check_image_out(a.plot, "--plot")
    check_args(a)
    a.model = resolve_model(a.model)
    a.model_options = runtime_option_values(a)
    return bench_cli(a)


def cmd_cache(a) -> int:
    from .package import cache_dir, cache_entries, clear_cache

    root = cache_dir()
    entries = cache_entries()
    if a.action == "clear":
        freed = clear_cache(entries)
        print(f"removed {len(entries)} item(s), {_size(freed)}, from {root}")
        return 0
    print(f"edgevl cache: {root} (set EDGEVL_CACHE to move it)")
    if not entries:
        print("  (empty)")
    for e in entries:
        print(f"  {_size(e.bytes):>9}  {e.path.name}  {e.what}")
    if entries:
        print(f"  {_size(sum(e.bytes for e in entries)):>9}  in all; 'edgevl cache clear' removes them")
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _convert_options() -> dict:
    """name -> (Option, architectures offering it), over every registered architecture."""
    from . import models

    out: dict = {}
    for arch in models.all_architectures():
        for name, opt in arch.options.items():
            out.setdefault(name, (opt, []))[1].append(arch.name)
    return out


def cmd_random_model(a) -> int:
    from .random_model import write

    out = write(a.family, a.out_dir, seed=a.seed, clip=a.clip)
    print(f"wrote {out} (random weights: its answers are noise)" + (f" and {a.clip}" if a.clip else ""))
    return 0


def cmd_batch(a) -> int:
    from .batch import batch_cli

    check_model_args(a)  # as in run: before the demo model is converted or anything is read
    if a.prompt is not None and not a.prompt.strip():
        raise EdgevlError("--prompt is empty; pass some text")

    def work() -> int:
        path = resolve_model(a.model)
        check_package(path, a)   # before the output is opened
        sampling, clips = sampling_kwargs(a), video_options(a)
        if any(v is not None for v in clips.values()):
            sampling["video_options"] = clips
        return batch_cli(a, path, sampling, runtime_option_values(a))

    def kept() -> str:
        # every finished row is already on disk: say how to go on (--overwrite again would start over)
        out = " ".join(str(a.output).splitlines())
        return (f"rerun the same command{' without --overwrite' if a.overwrite else ''} to resume (the rows "
                f"already in {out} are kept)")

    return _stoppable(work, kept)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .random_model import WRITERS

    p = argparse.ArgumentParser(prog="edgevl", description="Run multimodal LLMs on CPUs through ncnn.",
                                formatter_class=_Help)
    p.add_argument("--version", action="version", version=f"edgevl {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    p.commands = {}

    def command(name, help):
        p.commands[name] = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                                          formatter_class=_Help)
        return p.commands[name]

    c = command("convert", "convert a Hugging Face checkpoint folder to an edgevl package")
    c.add_argument("hf_dir", help="the checkpoint folder (config.json, *.safetensors, tokenizer.json)")
    c.add_argument("out_dir", help="the package folder to write (must not exist unless --force)")
    c.add_argument("--dtype", default="bf16", choices=["fp32", "fp16", "bf16", "q8"],
                   help="weight format: fp32 (exact parity), bf16, fp16, or q8: int8 weights (one scale per "
                        "output row) with activations quantized per row at run time (ncnn's int8 Gemm): the "
                        "fastest; the architecture keeps some layers in bf16 (README lists them); the vision tower "
                        "is int8 too unless --vision float")
    for name, (opt, archs) in _convert_options().items():  # the architectures' own options
        if opt.flag:
            c.add_argument("--" + opt.flag, dest=name, default=None, action="store_const", const=opt.flag_value,
                           help=f"{opt.help} ({', '.join(archs)} models)")
            continue
        c.add_argument("--" + name.replace("_", "-"), dest=name, default=None, choices=list(opt.choices),
                       help=f"{opt.help} (default {opt.default}; {', '.join(archs)} models)")
    c.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(fn=cmd_convert)

    r = command("run", "generate text from a prompt (and images)")
    r.add_argument("model", nargs="?", help=MODEL_HELP)
    r.add_argument("--prompt", required=True, help="the user message (required)")
    r.add_argument("--image", action="append", default=None,
                   help="image path, or 'demo' for a random demo scene; repeat for several images (default: none)")
    r.add_argument("--demo-out", help="where --image demo saves the scene (default: demo_scene.png)")
    r.add_argument("--draw-boxes", metavar="OUT_PNG",
                   help="draw the answer's boxes on the image(s) (OUT-1.png, OUT-2.png ... for several)")
    add_video_args(r)
    r.add_argument("--raw", action="store_true", help="do not apply the chat template (text only)")
    add_structure_args(r)
    r.add_argument("-v", "--verbose", action="store_true",
                   help="print the model, the sampling settings in effect, token counts and speed")
    add_sampling_args(r)
    add_model_args(r)
    add_content_args(r)
    r.set_defaults(fn=cmd_run)

    v = command("verify", "compare a package with the PyTorch reference, layer by layer")
    v.add_argument("model", nargs="?", help=MODEL_HELP)
    v.add_argument("--reference", default=None,
                   help="the Hugging Face checkpoint folder (default: the one the package was converted from)")
    v.add_argument("--prompt", default="Describe the image in one sentence.", help="the prompt")
    v.add_argument("--image", action="append", default=None,
                   help="image path, or 'demo' for a random demo scene; repeat for several images (default: "
                        "none; text only)")
    v.add_argument("--demo-out", help="where --image demo saves the scene (default: demo_scene.png)")
    v.add_argument("--seed", type=_positive_int("--seed"), default=None,
                   help="picks the --image demo scene, as in run and chat (default: random)")
    v.add_argument("--max-new-tokens", type=_int_at_least("--max-new-tokens", 1), default=32,
                   help="greedy tokens compared")
    add_model_args(v)
    v.set_defaults(fn=cmd_verify)

    ch = command("chat", "interactive chat in the terminal")
    ch.add_argument("model", nargs="?", help=MODEL_HELP)
    ch.add_argument("--image", help="image for your first message, or 'demo' for a random demo scene (default: none)")
    add_video_args(ch, many=False)
    add_sampling_args(ch)
    add_model_args(ch)
    add_content_args(ch)
    ch.set_defaults(fn=cmd_chat)

    s = command("serve", "OpenAI-compatible HTTP server")
    s.add_argument("model", nargs="?", help=MODEL_HELP)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=_int_at_least("--port", 0), default=8080, help="port (0: any free one)")
    s.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY'; repeatable, any of them will do (default: "
                   "EDGEVL_API_KEY if set, else no key)")
    s.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="keys one per line, as --api-key (kept out of the process list, which other users see)")
    s.add_argument("--allow-image-dir", default=None,
                   help="local image paths are allowed only under this folder (default: none, data: URLs only)")
    s.add_argument("--parallel", type=_integer("--parallel"), default=4,
                   help="requests decoding together (slots; each holds one sequence's state; default 4)")
    s.add_argument("--max-queue", type=_integer("--max-queue"), default=8,
                   help="requests waiting for a slot beyond this get 429")
    s.add_argument("--model-name", default=None,
                   help="model id reported by /v1/models (default: the package folder's name; 'demo' for the demo)")
    s.add_argument("--strict-model", action="store_true",
                   help="answer 404 to requests naming another model (default: any name gets this model)")
    s.add_argument("--max-tokens", type=_integer("--max-tokens"), default=None, metavar="N",
                   help="the most tokens one answer may generate: requests that give no max_tokens get N, larger "
                   "ones are cut to N (finish_reason 'length') (default: up to the context end)")
    s.add_argument("--allow-origin", action="append", default=None, metavar="ORIGIN",
                   help="let web pages from this origin (e.g. http://localhost:3000; '*': any) call the API from "
                   "a browser (CORS); repeatable (default: same origin only, as the chat page)")
    s.add_argument("--max-video-decode", type=_number("--max-video-decode"), default=64.0, metavar="GPX",
                   help="the most decoding one request's video may take, in gigapixels of frames: sampling a "
                   "clip decodes every frame up to the last one taken, and an animation composes each onto its "
                   "whole canvas (counted 25x); longer clips get a 400 (default: 64, about a minute of decoding)")
    s.add_argument("--shutdown-grace", type=_number("--shutdown-grace"), default=30.0, metavar="SECONDS",
                   help="on SIGTERM, refuse new requests (503) and let those under way finish for up to this "
                   "long before stopping (default: 30)")
    add_model_args(s)
    add_content_args(s, show=False)  # the server returns thinking as reasoning_content
    s.set_defaults(fn=cmd_serve)

    b = command("bench", "measure prefill/decode speed and memory")
    b.add_argument("model", nargs="?",
                   help="a package folder, a Hugging Face checkpoint (converted on the fly), or 'demo' (default)")
    b.add_argument("--prompt-tokens", type=_int_at_least("--prompt-tokens", 1), default=128, help="prompt length")
    b.add_argument("--gen-tokens", type=_int_at_least("--gen-tokens", 1), default=32,
                   help="tokens decoded after the prompt")
    b.add_argument("--threads", type=_threads("--threads"), default=None,
                   help="CPU threads (default: physical cores, or EDGEVL_THREADS)")
    b.add_argument("--compare", default="", help="comma list: torch,llamacpp (default: edgevl only)")
    b.add_argument("--reference", default=None, help="HF checkpoint for --compare (default: the package's source)")
    b.add_argument("--repeats", type=_int_at_least("--repeats", 1), default=3,
                   help="interleaved runs per system; the table shows medians")
    b.add_argument("--json", default=None, help="write results to this JSON file")
    b.add_argument("--plot", default=None, help="write a PNG plot here")
    b.add_argument("--markdown", default=None, help="write a markdown table here")
    b.add_argument("--extra-model", action="append", default=[],
                   help="another package to run side by side (repeatable)")
    b.add_argument("--gguf-types", default=None,
                   help="llama.cpp GGUF types, e.g. bf16,q8_0 or bf16+q8_0-experts (routed experts in q8_0, the "
                        "rest bf16) (default: the precision of each edgevl package)")
    b.add_argument("--low-memory", action="store_true", help="also run edgevl in low-memory mode")
    b.add_argument("--images", default=None, metavar="WxH,...",
                   help="time image encoding instead, at these sizes (e.g. 640x480,1024x768); with --compare "
                        "llamacpp through llama.cpp's mtmd")
    add_runtime_option_args(b)
    b.set_defaults(fn=cmd_bench)

    kc = command("check", "re-hash every file of a package against its manifest (ignores the verified-stamp "
                          "cache: finds bit rot that kept the file time)")
    kc.add_argument("model", nargs="?", default=None, help="the package folder (default: the demo model)")
    kc.set_defaults(fn=cmd_check)

    k = command("cache", "list or clear what edgevl keeps in its cache folder")
    k.add_argument("action", nargs="?", default="list", choices=["list", "clear"], help="what to do")
    k.set_defaults(fn=cmd_cache)

    rm = command("random-model", "write a small checkpoint with random weights (its answers are noise), to try "
                                 "video, speculative decoding and the server offline")
    rm.add_argument("family", choices=list(WRITERS), help="the model family")
    rm.add_argument("out_dir", help="the checkpoint folder to write (must not exist); then: edgevl convert OUT_DIR PKG")
    rm.add_argument("--seed", type=_positive_int("--seed"), default=0, help="seed of the weights (default: 0)")
    rm.add_argument("--clip", default=None, metavar="CLIP.gif",
                    help="also write a 2-second animated GIF here, to pass to --video")
    rm.set_defaults(fn=cmd_random_model)

    bt = command("batch", "answer a prompt over a folder or table of images (resumable; local worker processes "
                          "or Ray)")
    bt.add_argument("model", nargs="?", help="package folder (default: the shipped demo model)")
    bt.add_argument("--input", required=True, metavar="SRC",
                    help="a folder of images, or a .jsonl/.csv/.parquet file with an image column")
    bt.add_argument("--prompt", help="the prompt for every row; a prompt column overrides it per row (default: "
                                     "none; needed unless the table has a prompt column)")
    bt.add_argument("--output", required=True, metavar="OUT",
                    help="results, .jsonl or .parquet; rows already there are skipped; never the input, nor a "
                         "file that is not a batch output; a thinking model's thinking goes to its 'reasoning' "
                         "field")
    bt.add_argument("--workers", type=_int_at_least("--workers", 1), default=1,
                    help="local worker processes, or Ray actors with --ray; each loads the model, so more than "
                         "the available memory holds is refused (default: 1)")
    bt.add_argument("--parallel", type=_int_at_least("--parallel", 1), default=4,
                    help="rows decoding together in this process, over one copy of the model (default: 4)")
    bt.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                    help="run on Ray Data; without ADDRESS a local Ray is started (put MODEL before --ray; "
                         "default: no Ray)")
    bt.add_argument("--overwrite", action="store_true", help="start over instead of resuming")
    bt.add_argument("--retry-errors", action="store_true", help="run rows that failed last time again")
    bt.add_argument("--repair", action="store_true",
                    help="move lines of OUT that are not result rows (a corrupt line) to OUT.rejected and keep "
                         "the good rows, instead of stopping")
    bt.add_argument("--image-column", default="image", help="a table's image path column (default: image)")
    bt.add_argument("--prompt-column", default="prompt", help="a table's per-row prompt column (default: prompt)")
    bt.add_argument("--id-column", default="id",
                    help="a table's row id column (default: id; without it the image path as written)")
    bt.add_argument("--quiet", action="store_true", help="no progress bar")
    add_sampling_args(bt)
    add_model_args(bt)
    add_structure_args(bt)
    add_content_args(bt, show=False)  # the thinking is kept in each row's 'reasoning' field
    add_video_args(bt, many=None)     # how the table's video rows are sampled
    bt.set_defaults(fn=cmd_batch)
    return p


def _tolerant_stdio() -> None:
    """Text the terminal's encoding cannot hold (PYTHONIOENCODING=ascii, a Latin-1 console) is
    escaped on output and replaced on input, never a UnicodeError after the work is done."""
    for stream, errors in ((sys.stdout, "backslashreplace"), (sys.stderr, "backslashreplace"), (sys.stdin, "replace")):
        enc = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
        if enc not in ("utf8", "utf8sig") and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors=errors)
            except (ValueError, OSError):   # a stream already closed or detached
                pass


def main(argv=None) -> int:
    _tolerant_stdio()
    parser = build_parser()
    try:
        a, extra = parser.parse_known_args(argv)  # value types raise EdgevlError (one line) as the commands do
        if extra:   # the usage of the part they were given to: the command's, or the top level's before it
            args = sys.argv[1:] if argv is None else list(argv)
            before = args[:args.index(a.cmd)] if a.cmd in args else []
            (parser if set(extra) & set(before) else parser.commands[a.cmd]).error(
                f"unrecognized arguments: {' '.join(extra)}")
        return a.fn(a)
    except EdgevlError as e:
        msg = " ".join(str(e).splitlines())  # one line, whatever text a hostile input put in it
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as e:  # disk full, permissions, ...: still one line, with the fix where one is known
        print(f"error: {os_error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
