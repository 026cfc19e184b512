"""Checkpoint -> package conversion: the architecture registry and the shared LM writer.

A registry keyed by ``model_type`` (and the HF ``architectures`` string) maps each checkpoint
to a converter; each converter streams tensors from the checkpoint as it emits layers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from . import ncnn_graph as G
from .errors import EdgevlError
from .models import youtu
from .models.base import Ctx
from .package import check_output, finalize, temp_dir_for
from .progress import Progress
from .tokenizer import TOKENIZER_FILES, Tokenizer
from .weights import Checkpoint, sha256_file

DTYPES = ("fp32", "fp16", "bf16", "q8")
KV_MODES = ("absorbed", "expanded")
# Expanded is the default because it measured faster on the 2-core machine in every case we ran
# (2 threads: decode 8.3 vs 7.5 tok/s at a 128-token prompt, 6.2 vs 5.4 at 2048; prefill 100 vs
# 86 and 75 vs 50): the absorbed step's per-head Gemms do not scale with threads. Absorbed keeps
# a 4.7x smaller KV cache, the choice for very long contexts or little RAM.
DEFAULT_KV_MODE = "expanded"
# q8 block size. Larger blocks run faster in this ncnn wheel (a one-row 6144x2048 Gemm: 2.2 / 2.0
# / 1.6 ms at block 32 / 64 / 128, bf16 1.1 ms) but lost 4 points of top-1 agreement on the test
# models; 32 is llama.cpp q8_0's block too. q8 saves memory; bf16 decodes faster.
Q8_BLOCK = 32


def storage_dtype(dtype: str) -> str:
    """The float format of weights that are not block-quantized."""
    return "bf16" if dtype == "q8" else dtype


def write_language_model(ckpt: Checkpoint, out: Path, a: youtu.ModelArgs, dtype: str, kv_mode: str,
                         prefix: str, on_tensor) -> dict:
    """decoder.param/.bin, lm_head.param/.bin and the host-side embedding table."""
    sd = storage_dtype(dtype)
    quant = (8, Q8_BLOCK) if dtype == "q8" else None
    g = G.Graph(out / "decoder.bin")
    dec = youtu.build_decoder(Ctx(ckpt, g, sd, quant, on_tensor), a, prefix, absorbed=(kv_mode == "absorbed"))
    dec = save_graph(g, out / "decoder.param", dec)

    head_name = youtu.lm_head_name(ckpt, a, prefix)
    g = G.Graph(out / "lm_head.bin")
    head = save_graph(g, out / "lm_head.param", youtu.build_lm_head(Ctx(ckpt, g, sd, quant, on_tensor), a, head_name))

    embed_name = f"{prefix}.embed_tokens.weight"
    if head_name == embed_name and quant is None:
        # Tied float head: its Gemm shards *are* the embedding table; read rows from lm_head.bin
        # (each shard's data follows its 4-byte type tag) instead of storing the table twice.
        embedding = {"file": "lm_head.bin", "dtype": sd,
                     "segments": [{"rows": s["rows"], "offset": s["offset"] + 4} for s in head["extra"]["shards"]]}
    else:
        t = ckpt.get(embed_name, (a.vocab_size, a.hidden_size))
        on_tensor(t)
        with open(out / "embed.bin", "wb") as f:
            for chunk in G.iter_row_chunks(t):
                f.write(G.encode(chunk, sd).tobytes())
        embedding = {"file": "embed.bin", "dtype": sd, "segments": [{"rows": [0, a.vocab_size], "offset": 0}]}
    embedding.update(rows=a.vocab_size, dim=a.hidden_size)
    return {"graphs": {"decoder": dec, "lm_head": head}, "embedding": embedding}


def save_graph(g: G.Graph, param_path: Path, info) -> dict:
    """Write the graph (and its per-section params for low-memory mode); returns the manifest entry."""
    outs = [v for v in info.outputs.values() for v in (v if isinstance(v, list) else [v])]
    keep = outs + [n for c in info.cache for n in c[2:]]
    info.extra["sections"] = g.save(param_path, keep=keep)
    return vars(info)


def _convert_youtu(ckpt: Checkpoint, out: Path, dtype: str, kv_mode: str, on_tensor) -> dict:
    a = youtu.ModelArgs.from_config(ckpt.config)
    return write_language_model(ckpt, out, a, dtype, kv_mode, "model", on_tensor)


def _convert_youtu_vl(ckpt: Checkpoint, out: Path, dtype: str, kv_mode: str, on_tensor) -> dict:
    from .models import youtu_vl

    return youtu_vl.convert(ckpt, out, dtype, kv_mode, on_tensor, write_language_model)


# model_type -> (family, converter); architectures strings map onto the same entries
REGISTRY = {
    "youtu": ("youtu", _convert_youtu),
    "youtu_vl": ("youtu_vl", _convert_youtu_vl),
}
ARCHITECTURES = {
    "YoutuForCausalLM": "youtu",
    "YoutuVLForConditionalGeneration": "youtu_vl",
}


def resolve_architecture(cfg: dict) -> str:
    mt = cfg.get("model_type")
    if isinstance(mt, str) and mt in REGISTRY:
        return mt
    archs = cfg.get("architectures")
    for arch in archs if isinstance(archs, list) else []:
        if isinstance(arch, str) and arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    supported = ", ".join(sorted(REGISTRY))
    raise EdgevlError(f"model_type {mt!r} (architectures {cfg.get('architectures')}) is not supported; "
                      f"edgevl converts: {supported}")


def _json_object(path: Path) -> dict:
    try:
        v = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:
        raise EdgevlError(f"{path} is not valid JSON ({e}); fix or re-download it") from None
    if not isinstance(v, dict):
        raise EdgevlError(f"{path} must be a JSON object, got {type(v).__name__}; fix or re-download it")
    return v


def check_token_ids(cfg: dict, where: str) -> None:
    """Every ``*_token_id`` is null, a token id or a list of them (the runtime trusts them)."""
    for k, v in cfg.items():
        if not k.endswith("_token_id"):
            continue
        ids = v if isinstance(v, list) else [v]
        if v is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise EdgevlError(f"{where} field {k} must be a token id (an integer >= 0), a list of them or null, "
                              f"got {v!r:.60}; fix the checkpoint's {where}")


def convert(hf_path, out_path, dtype: str = "bf16", kv_mode: str = DEFAULT_KV_MODE,
            overwrite: bool = False, progress: bool = True) -> Path:
    """Convert a Hugging Face checkpoint folder into an edgevl package folder."""
    if dtype not in DTYPES:
        raise EdgevlError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if kv_mode not in KV_MODES:
        raise EdgevlError(f"unsupported kv cache mode {kv_mode!r}; choose one of {', '.join(KV_MODES)}")
    ckpt = Checkpoint(hf_path)
    arch = resolve_architecture(ckpt.config)
    family, fn = REGISTRY[arch]
    check_token_ids(ckpt.config, "config.json")
    gen = ckpt.folder / "generation_config.json"
    if gen.is_file():
        check_token_ids(_json_object(gen), "generation_config.json")
    # the tokenizer and chat template must work now, not first at run time
    Tokenizer(ckpt.folder, family=family).compile_template()
    out_dir = Path(out_path)
    # never replace anything but an old package, nor a folder holding (or inside) the checkpoint
    check_output(out_dir, overwrite, protected=[ckpt.folder, *ckpt.files])

    src_bytes = sum(p.stat().st_size for p in ckpt.files)
    bar = Progress(2 * src_bytes, desc=f"convert {Path(hf_path).name}", enabled=progress)
    seen = set()

    def on_tensor(t):
        if t.name not in seen:
            seen.add(t.name)
            bar.update(t.end - t.start, t.name)

    tmp = temp_dir_for(out_dir)
    try:
        parts = fn(ckpt, tmp, dtype, kv_mode, on_tensor)
        bar.update(max(0, src_bytes - bar.n), "hashing source")
        source_hashes = {}
        for p in ckpt.files:
            source_hashes[p.name] = sha256_file(p, lambda n, p=p: bar.update(n, f"hashing {p.name}"))
        for name in TOKENIZER_FILES + ("config.json", "preprocessor_config.json"):
            if (ckpt.folder / name).is_file():
                shutil.copy2(ckpt.folder / name, tmp / name)
        manifest = {
            "architecture": arch,
            "family": family,
            "model_type": ckpt.config.get("model_type"),
            "dtype": dtype,
            "kv_mode": kv_mode,
            "config": ckpt.config,
            "source": {"path": str(Path(hf_path).resolve()), "files": source_hashes},
            **parts,
        }
        finalize(tmp, out_dir, manifest, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return out_dir

