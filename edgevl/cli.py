"""Command line: a thin layer over the Python API.

    edgevl convert HF_DIR OUT_DIR [--dtype fp32|fp16|bf16|q8]
    edgevl run [MODEL] --prompt "..." [--image PATH|demo] [sampling flags]
    edgevl verify MODEL --reference HF_DIR [--prompt ...] [--image PATH]
    edgevl chat MODEL [--image PATH]
    edgevl serve MODEL [--host 127.0.0.1] [--port 8080]
    edgevl bench MODEL [--compare torch,llamacpp]
    edgevl batch [MODEL] --input SRC --prompt "..." --output OUT.jsonl|.parquet [--workers N] [--ray [ADDRESS]]

Every user error prints one line ``error: ...`` and exits with status 2 (``batch``: 1 when some
rows failed; they carry an error field).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import EdgevlError


def _positive_int(name):
    def parse(v):
        try:
            n = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {v!r}") from None
        if n < 0:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {n}")
        return n
    return parse


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--max-image-patches", type=int, default=None,
                   help="patch budget per image (default 36864, the HF processor's)")
    p.add_argument("--low-memory", action="store_true",
                   help="keep no weights resident: load each layer while it runs (slow; for models "
                        "that do not fit in RAM)")


def sampling_kwargs(a) -> dict:
    return dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                repetition_penalty=a.repetition_penalty, seed=a.seed, stop=a.stop)


def resolve_model(path: str | None) -> str:
    """A package folder, or (no argument) the shipped demo model converted into the user cache."""
    if path:
        return path
    from .demo import demo_package

    return str(demo_package())


# ---------------------------------------------------------------------------------------------


def cmd_convert(a) -> int:
    from .convert import convert

    out = convert(a.hf_dir, a.out_dir, dtype=a.dtype, kv_mode=a.kv_cache, overwrite=a.force,
                  progress=not a.quiet)
    print(f"wrote {out}")
    return 0


def cmd_run(a) -> int:
    from . import load
    from .generate import stream_events

    image = a.image
    model_path = resolve_model(a.model)
    if image == "demo":
        from .demo.scenes import make_scene

        import random
        scene = make_scene(random.randrange(1 << 30) if a.seed is None else a.seed)
        out = Path(a.demo_out or "demo_scene.png")
        scene.image.save(out)
        print(f"[demo scene saved to {out}]", file=sys.stderr)
        image = scene.image
    model = load(model_path, threads=a.threads, low_memory=a.low_memory)
    text = []
    for ev in stream_events(model, a.prompt, image=image, raw=a.raw, max_image_patches=a.max_image_patches,
                            **sampling_kwargs(a)):
        if ev.text:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            text.append(ev.text)
        if ev.finish_reason and a.verbose:
            print(f"\n[{ev.prompt_tokens} prompt tokens, {ev.prompt_tps:.1f} tok/s; {ev.generation_tokens} "
                  f"generated, {ev.generation_tps:.1f} tok/s; finish: {ev.finish_reason}]", file=sys.stderr)
    sys.stdout.write("\n")
    if a.draw_boxes:
        if image is None:
            raise EdgevlError("--draw-boxes needs --image")
        from .boxes import draw_boxes, parse_boxes
        from .processing.image import load_image

        boxes = parse_boxes("".join(text))
        draw_boxes(load_image(image), boxes).save(a.draw_boxes)
        print(f"[{len(boxes)} box(es) drawn to {a.draw_boxes}]", file=sys.stderr)
    return 0


def cmd_verify(a) -> int:
    from .verify import verify

    ok = verify(a.model, a.reference, prompt=a.prompt, image=a.image, max_new_tokens=a.max_new_tokens,
                max_image_patches=a.max_image_patches, threads=a.threads)
    return 0 if ok else 1


def cmd_chat(a) -> int:
    from . import load
    from .chat import chat_loop

    model = load(resolve_model(a.model), threads=a.threads, low_memory=a.low_memory)
    return chat_loop(model, image=a.image, max_image_patches=a.max_image_patches, **sampling_kwargs(a))


def cmd_serve(a) -> int:
    from . import load
    from .server import serve

    model = load(resolve_model(a.model), threads=a.threads, low_memory=a.low_memory)
    return serve(model, host=a.host, port=a.port, api_key=a.api_key, image_dir=a.allow_image_dir,
                 max_queue=a.max_queue, model_name=a.model_name)


def cmd_bench(a) -> int:
    from .bench import bench_cli

    return bench_cli(a)


def cmd_batch(a) -> int:
    from .batch import batch_cli

    return batch_cli(a, resolve_model(a.model), sampling_kwargs(a))


def build_parser() -> argparse.ArgumentParser:
    from .convert import DEFAULT_KV_MODE, KV_MODES

    p = argparse.ArgumentParser(prog="edgevl", description="Run multimodal LLMs on CPUs through ncnn.")
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("convert", help="convert a Hugging Face checkpoint folder to an edgevl package")
    c.add_argument("hf_dir")
    c.add_argument("out_dir")
    c.add_argument("--dtype", default="bf16", choices=["fp32", "fp16", "bf16", "q8"])
    c.add_argument("--kv-cache", default=DEFAULT_KV_MODE, choices=list(KV_MODES),
                   help="MLA KV cache layout (default %(default)s, faster here; absorbed: latent cache, "
                        "4.7x smaller, for very long contexts or little RAM)")
    c.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    c.add_argument("--quiet", action="store_true")
    c.set_defaults(fn=cmd_convert)

    r = sub.add_parser("run", help="generate text from a prompt (and an image)")
    r.add_argument("model", nargs="?", help="package folder (default: the shipped demo model)")
    r.add_argument("--prompt", required=True)
    r.add_argument("--image", help="image path, or 'demo' to draw a random demo scene")
    r.add_argument("--demo-out", help="where --image demo saves the scene (default demo_scene.png)")
    r.add_argument("--draw-boxes", metavar="OUT_PNG", help="draw <box> answers on the image")
    r.add_argument("--raw", action="store_true", help="do not apply the chat template")
    r.add_argument("-v", "--verbose", action="store_true", help="print token counts and speed")
    add_sampling_args(r)
    add_model_args(r)
    r.set_defaults(fn=cmd_run)

    v = sub.add_parser("verify", help="compare a package with the PyTorch reference, layer by layer")
    v.add_argument("model")
    v.add_argument("--reference", required=True, help="the Hugging Face checkpoint folder")
    v.add_argument("--prompt", default="Describe the image in one sentence.")
    v.add_argument("--image")
    v.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=32)
    add_model_args(v)
    v.set_defaults(fn=cmd_verify)

    ch = sub.add_parser("chat", help="interactive chat in the terminal")
    ch.add_argument("model", nargs="?")
    ch.add_argument("--image")
    add_sampling_args(ch)
    add_model_args(ch)
    ch.set_defaults(fn=cmd_chat)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("model", nargs="?")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--api-key", default=None)
    s.add_argument("--allow-image-dir", default=None, help="local image paths are allowed only under this folder")
    s.add_argument("--max-queue", type=int, default=8, help="requests waiting beyond this get 429")
    s.add_argument("--model-name", default=None, help="model id reported by /v1/models")
    add_model_args(s)
    s.set_defaults(fn=cmd_serve)

    b = sub.add_parser("bench", help="measure prefill/decode speed and memory")
    b.add_argument("model", help="a package folder, or a Hugging Face checkpoint (converted on the fly)")
    b.add_argument("--prompt-tokens", type=int, default=128)
    b.add_argument("--gen-tokens", type=int, default=32)
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--compare", default="", help="comma list: torch,llamacpp")
    b.add_argument("--reference", default=None, help="HF checkpoint for --compare (default: the package's source)")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--json", default=None, help="write results to this JSON file")
    b.add_argument("--plot", default=None, help="write a PNG plot here")
    b.add_argument("--markdown", default=None, help="write a markdown table here")
    b.add_argument("--extra-model", action="append", default=[], help="another package to run side by side")
    b.add_argument("--gguf-types", default="bf16", help="llama.cpp GGUF types, e.g. bf16,q8_0")
    b.add_argument("--low-memory", action="store_true", help="also run edgevl in low-memory mode")
    b.set_defaults(fn=cmd_bench)

    bt = sub.add_parser("batch", help="answer a prompt over a folder or table of images (resumable; local "
                                      "worker processes or Ray)")
    bt.add_argument("model", nargs="?", help="package folder (default: the shipped demo model)")
    bt.add_argument("--input", required=True, metavar="SRC",
                    help="a folder of images, or a .jsonl/.csv/.parquet file with an image column")
    bt.add_argument("--prompt", help="the prompt for every row; a prompt column overrides it per row (default: "
                                     "none; needed unless the table has a prompt column)")
    bt.add_argument("--output", required=True, metavar="OUT",
                    help="results, .jsonl or .parquet; rows already there are skipped")
    bt.add_argument("--workers", type=int, default=1,
                    help="local worker processes, or Ray actors with --ray (default: 1)")
    bt.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                    help="run on Ray Data; without ADDRESS a local Ray is started (put MODEL before --ray; "
                         "default: no Ray)")
    bt.add_argument("--overwrite", action="store_true", help="start over instead of resuming")
    bt.add_argument("--retry-errors", action="store_true", help="run rows that failed last time again")
    bt.add_argument("--image-column", default="image", help="a table's image path column (default: image)")
    bt.add_argument("--prompt-column", default="prompt", help="a table's per-row prompt column (default: prompt)")
    bt.add_argument("--id-column", default="id",
                    help="a table's row id column (default: id; without it the image path as written)")
    bt.add_argument("--quiet", action="store_true", help="no progress bar")
    add_sampling_args(bt)
    add_model_args(bt)
    bt.set_defaults(fn=cmd_batch)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        return a.fn(a)
    except EdgevlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as e:  # disk full, permissions, ...: still one line
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
