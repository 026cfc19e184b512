"""Checkpoint -> package conversion, for any registered architecture.

The architecture (``edgevl.models.resolve`` on config.json) writes the graphs, streaming tensors
from the checkpoint as it emits layers; this module adds what every package has: the folder
handling, progress, source hashes, tokenizer files and the manifest.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from . import models, processing
from .errors import EdgevlError
from .models.protocol import VISION_OPTION
from .package import check_output, finalize, temp_dir_for
from .progress import Progress
from .tokenizer import TOKENIZER_FILES, Tokenizer, read_json_object
from .weights import Checkpoint, sha256_file

DTYPES = ("fp32", "fp16", "bf16", "q8")


def check_token_ids(cfg: dict, where: str) -> None:
    """Every ``*_token_id`` is null, a token id or a list of them (the runtime trusts them)."""
    for k, v in cfg.items():
        if not k.endswith("_token_id"):
            continue
        ids = v if isinstance(v, list) else [v]
        if v is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise EdgevlError(f"{where} field {k} must be a token id (an integer >= 0), a list of them or null, "
                              f"got {v!r:.60}; fix the checkpoint's {where}")


def check_image_token(cfg: dict, tokenizer: Tokenizer) -> None:
    """The image placeholder id must be a token of the tokenizer: prompts find images by it, so
    any other id makes every image prompt count 0 placeholders at run time."""
    i = cfg.get("image_token_id")
    if i is None:
        return
    if isinstance(i, list):
        raise EdgevlError(f"config.json image_token_id must be one token id, got the list {i!r:.60}; fix the "
                          "checkpoint's config.json")
    try:
        known = tokenizer.id_to_token(i) is not None
    except OverflowError:  # beyond any token id the tokenizer can hold
        known = False
    if not known:
        raise EdgevlError(f"config.json image_token_id {i} is not a token of tokenizer.json ({tokenizer.vocab_size} "
                          "tokens), so no prompt could hold an image; fix image_token_id or the tokenizer")


def check_vision_option(arch, config: dict, options: dict) -> dict:
    """``vision`` (the tower's precision) checked here for every family alike: a precision for a
    tower the checkpoint lacks is refused (it would be ignored without a word); ``auto`` is what
    any checkpoint gets, so it is accepted even by a family that never has a tower."""
    v = options.get("vision")
    if v is None or v not in VISION_OPTION.choices:
        return options  # not given, or not a value at all: resolve_options says so
    if arch.has_vision_tower(config):
        return options
    if v != "auto":
        raise EdgevlError(f"--vision {v} sets the precision of a vision tower, and this checkpoint has no vision "
                          "tower (config.json has no vision_config); leave --vision out")
    return options if "vision" in arch.options else {k: x for k, x in options.items() if k != "vision"}


def convert(hf_path, out_path, dtype: str = "bf16", overwrite: bool = False, progress: bool = True,
            needs_image: bool = False, **options) -> Path:
    """Convert a Hugging Face checkpoint folder into an edgevl package folder.

    ``options`` are the architecture's own conversion options (``edgevl convert --help`` lists
    them), e.g. a KV cache layout. ``needs_image``: the model was trained on images only, so
    the package says that an answer without one is not meaningful (``run`` and ``chat`` note it)."""
    if dtype not in DTYPES:
        raise EdgevlError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    ckpt = Checkpoint(hf_path)
    arch = models.resolve(ckpt.config)
    options = arch.resolve_options(check_vision_option(arch, ckpt.config, options))
    check_token_ids(ckpt.config, "config.json")
    if isinstance(ckpt.config.get("text_config"), dict):
        check_token_ids(ckpt.config["text_config"], "config.json text_config")
    gen = ckpt.folder / "generation_config.json"
    if gen.is_file():
        check_token_ids(read_json_object(gen), "generation_config.json")
    # the tokenizer and chat template must work now, not first at run time
    tokenizer = Tokenizer(ckpt.folder, fallback_template=arch.chat_template,
                          processor=arch.has_vision_tower(ckpt.config))
    tokenizer.compile_template()
    if not tokenizer.chat_template and progress:   # a base model has none; a partial download lacks it
        print(f"note: {ckpt.folder} has no chat template (chat_template.jinja, or one in tokenizer_config.json): "
              "prompts will go to the model as plain text and chat cannot be rendered; if the model has one, "
              "add it to the folder and convert again", file=sys.stderr)
    check_image_token(ckpt.config, tokenizer)
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
        parts = arch.convert(ckpt, tmp, dtype, options, on_tensor)
        bar.update(max(0, src_bytes - bar.n), "hashing source")
        source_hashes = {}
        for p in ckpt.files:
            source_hashes[p.name] = sha256_file(p, lambda n, p=p: bar.update(n, f"hashing {p.name}"))
        for name in TOKENIZER_FILES + ("config.json",):
            if (ckpt.folder / name).is_file():
                shutil.copy2(ckpt.folder / name, tmp / name)
        processing.write_settings(ckpt.folder, tmp)
        manifest = {
            "architecture": arch.name,
            "model_type": ckpt.config.get("model_type"),
            "dtype": dtype,
            "options": options,
            "config": ckpt.config,
            "source": {"path": str(Path(hf_path).resolve()), "files": source_hashes},
            **parts,
        }
        if needs_image:
            manifest["needs_image"] = True
        finalize(tmp, out_dir, manifest, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return out_dir
