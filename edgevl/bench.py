"""``edgevl bench``: prefill/decode speed, time to first token, peak memory — side by side.

Each measurement runs in its own subprocess (clean peak RSS, no shared thread pools), and
repeats are interleaved A/B/C so that machine drift hits every system alike; the report takes
medians. ``--compare torch`` runs the same Hugging Face checkpoint through transformers (eager;
fp32 against an fp32 package, else bf16: ``torch_precision``); ``--compare llamacpp`` through
llama-cpp-python after converting it with the ``convert_hf_to_gguf.py`` shipped in
llama-cpp-python's source distribution.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .errors import EdgevlError
from .metrics import peak_rss

KEYS = ("load_s", "prefill_tok_s", "ttft_s", "decode_tok_s", "peak_rss_bytes", "kv_bytes_per_token")


def _prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, min(vocab, 30000), n).tolist()


# ---------------------------------------------------------------------------------------------
# workers (run in a subprocess: ``python -m edgevl.bench WORKER JSON_ARGS``)


def worker_edgevl(a: dict) -> dict:
    from .model import Model

    t0 = time.perf_counter()
    m = Model(a["model"], threads=a["threads"], verify=False, low_memory=a.get("low_memory", False),
              options=a.get("options")).preload()   # loaded as for serving (all-resident experts too)
    load = time.perf_counter() - t0
    ids = _prompt_ids(a["prompt_tokens"], m.vocab_size)
    m.prefill(ids[:4], reuse_cache=False)  # warm-up: first-run allocations
    # greedy, past any end token: the first token ends the prompt's time, the others are decoding
    # (speculative decoding's drafts included)
    t0 = time.perf_counter()
    gen = m.generate_tokens(ids, a["gen_tokens"] + 1, reuse_cache=False, ignore_eos=True)
    next(gen)
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    n = sum(1 for _ in gen)
    dec = time.perf_counter() - t1
    if n != a["gen_tokens"]:
        raise EdgevlError(f"decoded {n} tokens instead of {a['gen_tokens']} (the context is too short?)")
    return {"load_s": load, "prefill_tok_s": len(ids) / ttft, "ttft_s": ttft,
            "decode_tok_s": a["gen_tokens"] / dec, "peak_rss_bytes": peak_rss(),
            "kv_bytes_per_token": m.cache.bytes() / max(1, m.cache.length),
            "dtype": m.dtype, "options": m.manifest.get("options", {}), "load_options": m.options,
            "llamacpp_type": m.arch.bench.type_of(m.manifest), "runtime": m.runtime_stats()}


def worker_torch(a: dict) -> dict:
    """The checkpoint's PyTorch reference (the architecture's: transformers' class where one
    exists) in ``a["dtype"]`` (default bf16); ``dtype`` in the result is what its weights were
    in, which names the row."""
    import torch

    from . import models
    from .weights import Checkpoint

    torch.set_num_threads(a["threads"])
    from .verification import get

    arch = models.resolve(Checkpoint(a["reference"]).config)
    t0 = time.perf_counter()
    ref = get(arch.name).reference(a["reference"], dtype=a.get("dtype", "bf16"))
    load = time.perf_counter() - t0
    dtypes = sorted({TORCH_NAMES.get(str(p.dtype), str(p.dtype)) for p in ref.model.parameters()})
    ids = _prompt_ids(a["prompt_tokens"], a["vocab"])
    ref.start(ids[:4])
    t0 = time.perf_counter()
    logits, state = ref.start(ids)
    tok = int(np.argmax(logits))
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(a["gen_tokens"]):
        logits, state = ref.step(tok, state)
        tok = int(np.argmax(logits))
    dec = time.perf_counter() - t1
    n = len(ids) + a["gen_tokens"]
    return {"load_s": load, "prefill_tok_s": len(ids) / ttft, "ttft_s": ttft,
            "decode_tok_s": a["gen_tokens"] / dec, "peak_rss_bytes": peak_rss(),
            "kv_bytes_per_token": ref.state_bytes(state) / n, "dtype": "+".join(dtypes)}


TORCH_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def torch_precision(package_dtype: str | None) -> str:
    """The reference's precision against an edgevl package of ``package_dtype``: fp32 for fp32
    (like for like), else bf16 (how checkpoints ship; torch has no int8 path of q8's kind)."""
    return "fp32" if package_dtype == "fp32" else "bf16"


def worker_llamacpp(a: dict) -> dict:
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(a["gguf"], n_ctx=a["prompt_tokens"] + a["gen_tokens"] + 16, n_threads=a["threads"],
                          n_threads_batch=a["threads"], n_batch=512, verbose=False, logits_all=False)
    load = time.perf_counter() - t0
    ids = _prompt_ids(a["prompt_tokens"], llm.n_vocab())
    llm.eval(ids[:4])
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(a["gen_tokens"]):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    dec = time.perf_counter() - t1
    return {"load_s": load, "prefill_tok_s": len(ids) / ttft, "ttft_s": ttft,
            "decode_tok_s": a["gen_tokens"] / dec, "peak_rss_bytes": peak_rss(), "kv_bytes_per_token": None}


def bench_image(width: int, height: int, seed: int = 0):
    """The synthetic image every system encodes: smooth random colours (an RGB uint8 array)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 255, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8))
    return np.asarray(small.resize((width, height), Image.BICUBIC))


def _timed(fn):
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def worker_edgevl_image(a: dict) -> dict:
    """Encode each image size once (preprocessing + vision tower + merger), after a warm-up."""
    from PIL import Image

    from .model import Model

    m = Model(a["model"], threads=a["threads"], verify=False, options=a.get("options"))
    if m.vision is None:
        raise RuntimeError(f"{a['model']} has no vision tower")
    m.image_cache.limit = 0     # every image encoded: the tower's time, never a cache hit
    m.encode_image(Image.fromarray(bench_image(256, 256, 1)))  # warm-up: first-run allocations
    out = {}
    for w, h in a["images"]:
        img = Image.fromarray(bench_image(w, h))
        (rows, _), wall, cpu = _timed(lambda img=img: m.encode_image(img))
        out[f"{w}x{h}"] = {"encode_s": wall, "encode_cpu_s": cpu, "tokens": int(rows.shape[0])}
    return {"images": out, "peak_rss_bytes": peak_rss(), "dtype": m.dtype}


def worker_llamacpp_image(a: dict) -> dict:
    """The same through llama.cpp's mtmd (its own preprocessing + encoder), after a warm-up."""
    import ctypes

    import llama_cpp
    from llama_cpp import mtmd_cpp as M

    llm = llama_cpp.Llama(a["gguf"], n_ctx=512, n_threads=a["threads"], n_threads_batch=a["threads"], verbose=False)
    p = M.mtmd_context_params_default()
    p.use_gpu, p.n_threads, p.print_timings, p.warmup = False, a["threads"], False, False
    ctx = M.mtmd_init_from_file(a["mmproj"].encode(), llm.model, p)
    if not ctx:
        raise RuntimeError(f"mtmd could not load {a['mmproj']}")

    def encode(pixels):
        h, w = pixels.shape[:2]
        data = np.ascontiguousarray(pixels, np.uint8)
        bitmap = M.mtmd_bitmap_init(w, h, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
        chunks = M.mtmd_input_chunks_init()
        prompt = M.mtmd_default_marker()
        text = M.mtmd_input_text()
        text.text, text.text_len, text.add_special, text.parse_special = prompt, len(prompt), False, True
        try:
            if M.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) != 0:
                raise RuntimeError("mtmd_tokenize failed")
            for i in range(M.mtmd_input_chunks_size(chunks)):
                chunk = M.mtmd_input_chunks_get(chunks, i)
                if M.mtmd_input_chunk_get_type(chunk) == 1:  # MTMD_INPUT_CHUNK_TYPE_IMAGE
                    if M.mtmd_encode_chunk(ctx, chunk) != 0:
                        raise RuntimeError("mtmd_encode_chunk failed")
                    return int(M.mtmd_input_chunk_get_n_tokens(chunk))
            raise RuntimeError("mtmd produced no image chunk")
        finally:
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bitmap)

    encode(bench_image(256, 256, 1))
    out = {}
    for w, h in a["images"]:
        img = bench_image(w, h)
        tokens, wall, cpu = _timed(lambda img=img: encode(img))  # mtmd_tokenize preprocesses the image
        out[f"{w}x{h}"] = {"encode_s": wall, "encode_cpu_s": cpu, "tokens": tokens}
    return {"images": out, "peak_rss_bytes": peak_rss()}


WORKERS = {"edgevl": worker_edgevl, "torch": worker_torch, "llamacpp": worker_llamacpp,
           "edgevl-image": worker_edgevl_image, "llamacpp-image": worker_llamacpp_image}


def _run_worker(kind: str, args: dict, timeout: int = 3600) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    r = subprocess.run([sys.executable, "-m", "edgevl.bench", kind, json.dumps(args)],
                       capture_output=True, text=True, timeout=timeout, env=env)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0:
        try:  # the worker reports its exception as one JSON line (see __main__ below)
            err = json.loads(lines[-1])["error"]
        except (IndexError, ValueError, KeyError, TypeError):
            err = (r.stderr.strip().splitlines() or ["?"])[-1]
        what = {"torch": f"the PyTorch reference ({args.get('reference')})", "edgevl": f"edgevl ({args.get('model')})",
                "llamacpp": f"llama.cpp ({args.get('gguf')})", "edgevl-image": f"edgevl ({args.get('model')})",
                "llamacpp-image": f"llama.cpp mtmd ({args.get('mmproj')})"}.get(kind, kind)
        import tempfile

        with tempfile.NamedTemporaryFile("w", prefix=f"edgevl-bench-{kind}-", suffix=".log", delete=False) as f:
            f.write(r.stderr)  # libraries often put the detail in a report above their exception
        raise EdgevlError(f"the {kind} benchmark failed: {what} could not run: {err} (its full output: {f.name})")
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------------------------
# llama.cpp: GGUF conversion with the converter shipped in llama-cpp-python's sdist


# the head (with the embedding, which a tied model's head is), by llama.cpp's tensor names: a
# part every model has, which a GGUF type like "bf16+q8_0-head" stores apart from the rest; an
# architecture's benchmark profile adds its own parts (e.g. an MoE's routed experts)
GGUF_HEAD = {"head": r"^(output|token_embd)\.weight$"}
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")


def parse_gguf_type(outtype: str, parts: dict) -> tuple[str, dict]:
    """``BASE[+TYPE-PART[-PART...]]...`` -> (base type, {tensor-name pattern: type}); e.g.
    ``bf16+q8_0-experts``: routed experts in q8_0, every other weight bf16, as llama-quantize's
    ``--tensor-type`` would make it. ``parts``: part name -> tensor-name pattern."""
    base, *overrides = outtype.split("+")
    forced = {}
    for o in overrides:
        t, _, named = o.partition("-")
        names = named.split("-") if named else []
        if t not in GGUF_TYPES or not names or any(p not in parts for p in names):
            raise EdgevlError(f"GGUF type {outtype!r}: write BASE+TYPE-PART, TYPE one of {', '.join(GGUF_TYPES)}, "
                              f"PART one of {', '.join(parts)} (e.g. bf16+q8_0-head)")
        forced.update({parts[p]: t for p in names})
    if base not in GGUF_TYPES:
        raise EdgevlError(f"GGUF type {outtype!r}: the base type must be one of {', '.join(GGUF_TYPES)}")
    return base, forced


def forced_quant(forced: dict, own, types):
    """A replacement for the converter's ``ModelBase.tensor_force_quant``: weights (2-D and up)
    whose GGUF name matches a pattern of ``forced`` get its type (``types``: gguf-py's
    GGMLQuantizationType); the rest what the converter's own rule (``own``) says."""
    import re

    def force(self, name, new_name, bid, n_dims):
        for pattern, t in forced.items():
            if n_dims >= 2 and re.search(pattern, new_name):
                return types[t.upper()]
        return own(self, name, new_name, bid, n_dims)
    return force


def gguf_for(hf_dir: Path, work: Path, outtype: str = "bf16", profile=None, mmproj: bool = False) -> Path:
    """The checkpoint as a GGUF file (``mmproj``: its vision projector, for llama.cpp's mtmd;
    ``profile``: the architecture's ``BenchProfile``, for its converter arguments and parts;
    ``outtype`` as :func:`parse_gguf_type` reads it)."""
    import tarfile

    from .models.protocol import BenchProfile

    profile = profile or BenchProfile()
    extra_args = tuple(profile.convert_args)
    if profile.convert_args_of is not None and not mmproj:     # they are the language model's
        from .weights import Checkpoint

        extra_args += tuple(profile.convert_args_of(Checkpoint(hf_dir).config))
    base, forced = parse_gguf_type(outtype, {**GGUF_HEAD, **profile.parts})
    out = work / f"{hf_dir.name}{'-mmproj' if mmproj else ''}-{outtype}.gguf"
    if out.exists():
        return out
    sdist = sorted(Path(os.environ.get("EDGEVL_LLAMACPP_SDIST", work / "sdist")).glob("llama_cpp_python-*.tar.gz"))
    if not sdist:
        raise EdgevlError("--compare llamacpp needs llama-cpp-python's source archive for convert_hf_to_gguf.py: "
                          f"pip download --no-deps --no-binary :all: llama-cpp-python -d {work / 'sdist'}")
    src = work / "llamacpp-src"
    if not src.exists():
        with tarfile.open(sdist[-1]) as t:
            members = [m for m in t.getmembers() if "/vendor/llama.cpp/" in m.name and
                       ("convert_hf_to_gguf" in m.name or "/gguf-py/" in m.name or "/conversion/" in m.name)]
            t.extractall(src, members=members, filter="data")
    script = next(src.rglob("convert_hf_to_gguf.py"))
    argv = [str(script), str(hf_dir), "--outfile", str(out), "--outtype", base, *extra_args,
            *(["--mmproj"] if mmproj else [])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(script.parent / "gguf-py"), str(script.parent),
                                                       str(Path(__file__).resolve().parent.parent)]))
    # Benchmark checkpoints carry a stand-in tokenizer whose pre-tokenizer hash llama.cpp does not
    # know; the benchmark feeds token ids, so any pre-tokenizer name will do.
    # Mixed types go through the converter's own per-tensor override (tensor_force_quant), so
    # the quantization is llama.cpp's (gguf-py) and the rest of the file is as it would be.
    run = ("import runpy, sys, gguf, conversion.base as b; from edgevl.bench import forced_quant; "
           "b.TextModel.get_vocab_base_pre = lambda self, tok: 'llama-bpe'; "
           f"b.ModelBase.tensor_force_quant = forced_quant({forced!r}, b.ModelBase.tensor_force_quant, "
           "gguf.GGMLQuantizationType); "
           f"sys.argv = {argv!r}; "
           f"runpy.run_path({str(script)!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise EdgevlError(f"convert_hf_to_gguf.py failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return out


# ---------------------------------------------------------------------------------------------
# the command


def check_counts(**counts) -> None:
    """Each count (prompt_tokens, gen_tokens, repeats) is an integer >= 1: 0 runs have no median,
    0 or negative tokens no speed."""
    for name, n in counts.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise EdgevlError(f"--{name.replace('_', '-')} must be an integer >= 1, got {n!r:.40}")


def bench(systems: dict, prompt_tokens: int, gen_tokens: int, threads: int, repeats: int, progress=True) -> dict:
    """``systems``: name -> (worker kind, args). Runs are interleaved; returns medians per system."""
    from .progress import Progress

    check_counts(prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeats=repeats)
    runs = {name: [] for name in systems}
    names = list(systems)
    bar = Progress(repeats * len(names), desc="bench", unit="runs", enabled=progress)
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate: drift cancels
        for name in order:
            kind, args = systems[name]
            args = dict(args, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, threads=threads)
            runs[name].append(_run_worker(kind, args))
            bar.update(1, name)
    bar.close()
    results = {}
    for name, rs in runs.items():
        results[name] = {k: (statistics.median(x[k] for x in rs) if rs[0].get(k) is not None else None)
                         for k in KEYS}
        # single runs swing a lot on a shared machine: keep the spread next to the median
        results[name]["spread"] = {k: [min(x[k] for x in rs), max(x[k] for x in rs)]
                                   for k in KEYS if rs[0].get(k) is not None}
        results[name].update({k: v for k, v in rs[0].items() if k not in KEYS})
    return {"results": results, "runs": runs}


def bench_images(systems: dict, sizes: list, threads: int, repeats: int, progress=True) -> dict:
    """Image encoding: ``systems`` name -> (worker kind, args); each run encodes every size once.
    Runs are interleaved like ``bench``; returns per system and size the median and spread."""
    from .progress import Progress

    check_counts(repeats=repeats)
    runs = {name: [] for name in systems}
    names = list(systems)
    bar = Progress(repeats * len(names), desc="bench images", unit="runs", enabled=progress)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            kind, args = systems[name]
            runs[name].append(_run_worker(kind, dict(args, images=sizes, threads=threads)))
            bar.update(1, name)
    bar.close()
    results = {}
    for name, rs in runs.items():
        results[name] = {"peak_rss_bytes": statistics.median(x["peak_rss_bytes"] for x in rs), "images": {}}
        for w, h in sizes:
            key = f"{w}x{h}"
            cell = {}
            for k in ("encode_s", "encode_cpu_s"):
                vals = [x["images"][key][k] for x in rs]
                cell[k] = statistics.median(vals)
                cell.setdefault("spread", {})[k] = [min(vals), max(vals)]
            cell["tokens"] = rs[0]["images"][key]["tokens"]
            results[name]["images"][key] = cell
    return {"results": results, "runs": runs}


def images_table(results: dict, sizes: list) -> str:
    keys = [f"{w}x{h}" for w, h in sizes]
    lines = ["| system | " + " | ".join(f"{k} s (CPU-s)" for k in keys) + " | image tokens | peak RSS GiB |",
             "|---" * (len(keys) + 3) + "|"]
    for name, r in results.items():
        cells = [f"{_cell(r['images'][k], 'encode_s', '%.2f')} ({_cell(r['images'][k], 'encode_cpu_s', '%.1f')})"
                 for k in keys]
        tokens = "/".join(str(r["images"][k]["tokens"]) for k in keys)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {tokens} | {r['peak_rss_bytes'] / 2 ** 30:.2f} |")
    lines.append("")
    lines.append("Each cell: median wall seconds (min–max) per image, then CPU seconds of the process "
                 "(all threads), over the interleaved runs.")
    return "\n".join(lines)


def _cell(r: dict, key: str, fmt: str, scale: float = 1.0) -> str:
    """median, with (min–max) when several runs differ."""
    med = fmt % (r[key] / scale)
    lo, hi = (fmt % (v / scale) for v in r.get("spread", {}).get(key, [r[key], r[key]]))
    return med if lo == hi else f"{med} ({lo}–{hi})"


def markdown_table(results: dict) -> str:
    lines = ["| system | prefill tok/s | decode tok/s | TTFT s | load s | peak RSS GiB | KV bytes/token |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        kv = "—" if r.get("kv_bytes_per_token") is None else f"{r['kv_bytes_per_token']:,.0f}"
        lines.append(f"| {name} | {_cell(r, 'prefill_tok_s', '%.1f')} | {_cell(r, 'decode_tok_s', '%.2f')} | "
                     f"{_cell(r, 'ttft_s', '%.2f')} | {_cell(r, 'load_s', '%.1f')} | "
                     f"{_cell(r, 'peak_rss_bytes', '%.2f', 2 ** 30)} | {kv} |")
    lines.append("")
    lines.append("Each cell: median (min–max) over the interleaved runs.")
    ratios = same_precision_ratios(results)
    if ratios:
        lines += ["", "Against llama.cpp at the same precision (ratios of the medians):", ""]
        lines += [f"- {ours} / {theirs}: decode {d:.2f}×, prefill {p:.2f}×" for ours, theirs, d, p in ratios]
    return "\n".join(lines)


def same_precision_ratios(results: dict) -> list[tuple[str, str, float, float]]:
    """(edgevl variant, llama.cpp variant, decode ratio, prefill ratio) for every edgevl variant
    whose llama.cpp counterpart (its ``bench.type_of``: q8 against q8_0, an MoE package's q8
    experts against q8_0 experts) ran in the same run."""
    from .models.protocol import GGUF_OF_DTYPE

    out = []
    for name, r in results.items():
        theirs = f"llama.cpp {r.get('llamacpp_type') or GGUF_OF_DTYPE.get(r.get('dtype'), '')}"
        if not name.startswith("edgevl") or theirs not in results:
            continue
        t = results[theirs]
        out.append((name, theirs, r["decode_tok_s"] / t["decode_tok_s"], r["prefill_tok_s"] / t["prefill_tok_s"]))
    return out


def plot(results: dict, path, title: str = "") -> None:
    """Horizontal bars for prefill and decode tok/s, drawn with Pillow (no plotting dependency)."""
    from PIL import Image, ImageDraw

    names = list(results)
    row, pad = 22, 16
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    label_w = max(190, pad + 8 + max(int(probe.textlength(n)) for n in names))   # long labels are not cut
    panel_h = 24 + row * len(names)
    W, H = label_w + 710, 40 + 2 * (panel_h + pad)
    im = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(im)
    d.text((pad, 10), title, fill="black")
    colors = {"edgevl": "#4363d8", "torch": "#f58231", "llama": "#3cb44b"}
    for p, (key, label) in enumerate((("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s"))):
        y0 = 40 + p * (panel_h + pad)
        d.text((pad, y0), label, fill="black")
        top = max(results[n][key] for n in names) or 1.0
        span = W - label_w - 2 * pad - 50
        for i, n in enumerate(names):
            y = y0 + 20 + i * row
            v = results[n][key]
            color = next((c for k, c in colors.items() if n.startswith(k)), "#911eb4")
            d.text((pad, y + 4), n, fill="black")
            d.rectangle((label_w, y + 2, label_w + span * v / top, y + row - 4), fill=color)
            d.text((label_w + span * v / top + 6, y + 4), f"{v:.1f}", fill="black")
    im.save(path)


def llamacpp_types(packages) -> list[str]:
    """The GGUF types llama.cpp runs at without ``--gguf-types``: each package's precision
    (its architecture's ``bench.type_of``), bf16 where none has a counterpart."""
    from . import models
    from .package import read_manifest

    types = []
    for p in packages:
        m = read_manifest(p)
        types.append(models.get(m["architecture"]).bench.type_of(m))
    return [t for t in dict.fromkeys(types) if t] or ["bf16"]


COMPARE = ("torch", "llamacpp")


def check_args(a) -> None:
    """The values of ``edgevl bench`` that need no model, checked before any work (a checkpoint
    given here is converted first, and the runs take minutes)."""
    check_counts(prompt_tokens=a.prompt_tokens, gen_tokens=a.gen_tokens, repeats=a.repeats)
    if getattr(a, "images", None) and getattr(a, "plot", None):
        raise EdgevlError("--plot draws the text runs' tokens/s; with --images give --json or --markdown")
    for c in (c.strip() for c in (a.compare or "").split(",")):
        if c and c not in COMPARE and not c.startswith("llamacpp"):
            raise EdgevlError(f"unknown --compare system {c!r}; choose {' and/or '.join(COMPARE)}")
    if getattr(a, "images", None):
        parse_sizes(a.images)


def bench_cli(a) -> int:
    from . import models
    from .model import check_load_options
    from .package import read_manifest
    from .runtime import check_threads, default_threads

    check_args(a)
    threads = default_threads() if a.threads is None else check_threads(a.threads, "--threads")
    target = Path(a.model)
    systems = {}

    def label(m):  # every conversion option (e.g. the KV cache layout) is named
        opts = models.get(m["architecture"]).options
        extra = [opts[k].label.format(value=v, name=k.replace("_", "-")) for k, v in (m.get("options") or {}).items()
                 if k in opts and not (opts[k].quiet_default and v == opts[k].default)]
        return " ".join([f"edgevl {m['dtype']}"] + extra)

    opts = dict(getattr(a, "model_options", None) or {})   # load-time options (e.g. --expert-cache-mb)
    for p in [target, *(getattr(a, "extra_model", None) or [])]:   # before a checkpoint is converted
        if (Path(p) / "manifest.json").is_file():
            check_load_options(p, options=opts, images=bool(getattr(a, "images", None)))
            context = int(read_manifest(p).get("context") or 0)
            if not getattr(a, "images", None) and context and a.prompt_tokens + a.gen_tokens >= context:
                raise EdgevlError(f"--prompt-tokens {a.prompt_tokens} + --gen-tokens {a.gen_tokens} do not fit {p}'s "
                                  f"context of {context} tokens; ask for fewer")
            if getattr(a, "low_memory", False) and p == target:   # its low-memory row, refused before any run
                check_load_options(p, low_memory=True, options=opts)
    main_dtype = "bf16"   # the first package's, which the torch row matches
    tag = "".join(f" {k.replace('_', '-')} {format(v, 'g') if isinstance(v, (int, float)) else v}"
                  for k, v in opts.items())
    if (target / "manifest.json").is_file():
        m = read_manifest(target)
        ref = Path(a.reference or m["source"]["path"])
        main_dtype = m["dtype"]
        systems[label(m) + tag] = ("edgevl", {"model": str(target), "options": opts})
    elif (target / "config.json").is_file():
        ref = target
        src = target.resolve()   # `bench .` names the package after the folder, not "."
        pkg = src.parent / f"{src.name}-edgevl-bf16"
        if pkg.exists() and not (pkg / "manifest.json").is_file():
            raise EdgevlError(f"{pkg} is there and is not an edgevl package; bench converts the checkpoint into that "
                              "folder: move it away, or run `edgevl convert` yourself and bench the package")
        changed = _converted_from_other(pkg, src) if pkg.exists() else None
        if changed:
            print(f"bench: {changed} since {pkg.name} was converted; converting it again", file=sys.stderr)
        if not pkg.exists() or changed:
            from .convert import convert

            convert(target, pkg, dtype="bf16", overwrite=pkg.exists())
        systems["edgevl bf16" + tag] = ("edgevl", {"model": str(pkg), "options": opts})
    else:
        read_manifest(target)  # raises the clear error
    for extra in getattr(a, "extra_model", None) or []:
        name = label(read_manifest(extra)) + tag
        if name in systems:  # two packages of the same dtype and options: tell them apart by folder
            name = f"{name} ({Path(extra).name})"
        systems[name] = ("edgevl", {"model": str(extra), "options": opts})
    if getattr(a, "low_memory", False):
        name, (kind, args) = next(iter(systems.items()))
        systems[f"{name} low-memory"] = (kind, dict(args, low_memory=True))
    compare = [c.strip() for c in (a.compare or "").split(",") if c.strip()]
    if getattr(a, "images", None):
        return _bench_images_cli(a, systems, compare, ref, threads)
    for c in compare:
        if c == "torch":
            from .weights import Checkpoint

            if a.reference and (target / "manifest.json").is_file():   # the package's own checkpoint only
                from .verification.verify import check_reference

                check_reference(target, ref)
            cfg = Checkpoint(ref).config
            vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size") or 30000
            precision = torch_precision(main_dtype)
            systems[f"torch {precision}"] = ("torch", {"reference": str(ref), "vocab": int(vocab),
                                                       "dtype": precision})
        elif c.startswith("llamacpp"):
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                raise EdgevlError("--compare llamacpp needs llama-cpp-python "
                                  "(pip install 'edgevl[llamacpp]')") from None
            from .weights import Checkpoint

            work = ref.resolve().parent  # GGUF files (GBs) go beside the checkpoint
            profile = models.resolve(Checkpoint(ref).config).bench
            packages = [args["model"] for kind, args in systems.values() if kind == "edgevl"]
            for outtype in (a.gguf_types.split(",") if a.gguf_types else llamacpp_types(packages)):
                systems[f"llama.cpp {outtype}"] = ("llamacpp", {"gguf": str(gguf_for(ref, work, outtype, profile))})
        else:
            raise EdgevlError(f"unknown --compare system {c!r}; choose torch and/or llamacpp")
    res = bench(systems, a.prompt_tokens, a.gen_tokens, threads, a.repeats)
    for name, (kind, _) in list(systems.items()):
        ran = res["results"][name].get("dtype") if kind == "torch" else None
        if ran and name != f"torch {ran}":   # a model may keep some weights in fp32: say so
            for part in ("results", "runs"):
                res[part] = {f"torch {ran}" if k == name else k: v for k, v in res[part].items()}
            systems[f"torch {ran}"] = systems.pop(name)
    # ``results`` holds one object per system (the first variant of each); ``variants`` all runs
    res["variants"] = res.pop("results")
    res["results"] = {}
    for name, r in res["variants"].items():
        res["results"].setdefault(systems[name][0], r)
    res["config"] = {"prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens, "threads": threads,
                     "repeats": a.repeats, "cpu_count": os.cpu_count()}
    table = markdown_table(res["variants"])
    print(table)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    if a.markdown:
        Path(a.markdown).write_text(table + "\n")
    if a.plot:
        plot(res["variants"], a.plot, f"{target.name}: {a.prompt_tokens}-token prompt, {a.gen_tokens} new tokens, "
                                      f"{threads} thread(s), median of {a.repeats}")
    return 0


def parse_sizes(text: str) -> list:
    sizes = []
    for part in text.split(","):
        try:
            w, h = (int(x) for x in part.strip().lower().split("x"))
        except ValueError:
            raise EdgevlError(f"--images takes sizes like 640x480,1024x768; got {part.strip()!r}") from None
        if not (16 <= w <= 8192 and 16 <= h <= 8192):
            raise EdgevlError(f"--images: {w}x{h} is outside 16..8192 pixels per side")
        sizes.append((w, h))
    return sizes


def _converted_from_other(pkg: Path, checkpoint: Path) -> str | None:
    """What changed in ``checkpoint`` since bench converted it into ``pkg`` (None: nothing): its
    config, its weight files' names, or the bytes of a weight file written since (hashed only
    then, so an unchanged checkpoint costs a few stats)."""
    from .package import read_manifest, source_file_changed
    from .weights import Checkpoint

    if (pkg / "config.json").read_bytes() != (checkpoint / "config.json").read_bytes():
        return "the checkpoint's config.json changed"
    recorded = (read_manifest(pkg).get("source") or {}).get("files") or {}
    if {p.name for p in Checkpoint(checkpoint).files} != set(recorded):
        return "the checkpoint's weight files changed"
    changed = source_file_changed(pkg, checkpoint, newer_than=(pkg / "manifest.json").stat().st_mtime)
    return f"the checkpoint's {changed[0]} changed" if changed else None


def _bench_images_cli(a, systems: dict, compare: list, ref: Path, threads: int) -> int:
    sizes = parse_sizes(a.images)
    systems = {name: ("edgevl-image", args) for name, (kind, args) in systems.items() if kind == "edgevl"}
    for c in compare:
        if not c.startswith("llamacpp"):
            raise EdgevlError(f"--images compares with llamacpp only, not {c!r}")
        try:
            from llama_cpp import mtmd_cpp  # noqa: F401
        except (ImportError, OSError):
            raise EdgevlError("--images --compare llamacpp needs llama-cpp-python built with its multimodal "
                              "library: CMAKE_ARGS=\"-DLLAVA_BUILD=ON\" pip install --no-binary :all: "
                              "llama-cpp-python") from None
        from . import models
        from .weights import Checkpoint

        work = ref.resolve().parent
        profile = models.resolve(Checkpoint(ref).config).bench
        for outtype in (a.gguf_types or "bf16").split(","):
            systems[f"llama.cpp mtmd {outtype}"] = ("llamacpp-image", {
                "gguf": str(gguf_for(ref, work, outtype, profile)),
                "mmproj": str(gguf_for(ref, work, outtype, profile, mmproj=True))})
    res = bench_images(systems, sizes, threads, a.repeats)
    res["config"] = {"images": [f"{w}x{h}" for w, h in sizes], "threads": threads, "repeats": a.repeats,
                     "cpu_count": os.cpu_count()}
    table = images_table(res["results"], sizes)
    print(table)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    if a.markdown:
        Path(a.markdown).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    kind, args = sys.argv[1], json.loads(sys.argv[2])
    try:
        result = WORKERS[kind](args)
    except Exception as e:  # noqa: BLE001 - reported whole to the parent, which prints one line
        import traceback

        traceback.print_exc()
        msg = " ".join(str(e).split()) or "(no message)"
        print(json.dumps({"error": f"{type(e).__name__}: {msg}"}))
        sys.exit(1)
    print(json.dumps(result))
