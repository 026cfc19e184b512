"""Layer-by-layer comparison of a converted package with its PyTorch reference.

The reference is the architecture's (``Architecture.reference``): transformers' own class where
one exists, else a small faithful PyTorch model the project keeps. Needs ``pip install edgevl[verify]``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import EdgevlError


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    den = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / den) if den > 0 else float(np.array_equal(a, b))


@dataclass
class Report:
    rows: list = field(default_factory=list)     # (section, name, cosine, max_abs_diff)
    ours: list = field(default_factory=list)
    reference: list = field(default_factory=list)
    processor_max_diff: float | None = None
    dtype: str = "fp32"
    mtp_top1: tuple | None = None                # (rows whose MTP draft matches the reference's, rows)

    def add(self, section, name, a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if a.shape != b.shape:
            raise RuntimeError(f"{section} {name}: shape {a.shape} vs reference {b.shape}")
        self.rows.append((section, name, cosine(a, b), float(np.abs(a - b).max()) if a.size else 0.0))

    @property
    def agreement(self) -> int:
        n = 0
        for x, y in zip(self.ours, self.reference):
            if x != y:
                break
            n += 1
        return n

    @property
    def identical(self) -> bool:
        return self.ours == self.reference

    @property
    def ok(self) -> bool:
        if self.dtype == "fp32":   # the MTP block's drafts too, where the package has it
            return self.identical and (self.mtp_top1 is None or self.mtp_top1[0] == self.mtp_top1[1])
        # reduced precision drifts eventually: require the first token and close logits
        logits = [r for r in self.rows if r[1] == "logits"]
        return self.agreement >= 1 and all(r[2] >= 0.99 for r in logits)

    def min_cosine(self, section: str) -> float:
        vals = [r[2] for r in self.rows if r[0] == section]
        return min(vals) if vals else float("nan")

    THRESHOLDS = {"fp32": "fp32: the greedy tokens must be identical to the reference's (and the MTP block's drafts, "
                     "where the package has one)",
                  "reduced": "reduced precision: the first greedy token must match and the logits cosine "
                             "be >= 0.99"}

    def threshold(self) -> str:
        return self.THRESHOLDS["fp32" if self.dtype == "fp32" else "reduced"]

    def print(self, out=None):
        out = out or sys.stdout
        if self.processor_max_diff is not None:
            print(f"processor pixel_values max |diff| vs the reference processor: {self.processor_max_diff:.3g}",
                  file=out)
        print(f"{'section':<8} {'tensor':<28} {'cosine':>12} {'max|diff|':>12}", file=out)
        for sec, name, c, d in self.rows:
            print(f"{sec:<8} {name:<28} {c:>12.8f} {d:>12.4g}", file=out)
        if self.mtp_top1 is not None:
            print(f"MTP drafts (top-1 of the block's logits): {self.mtp_top1[0]} of {self.mtp_top1[1]} rows equal to "
                  "the reference's", file=out)
        n = len(self.reference)
        state = "identical" if self.identical else f"first {self.agreement} of {n} agree"
        print(f"greedy tokens ({n} new): {state}", file=out)
        if not self.identical:
            print(f"  ours:      {self.ours}", file=out)
            print(f"  reference: {self.reference}", file=out)
        print(f"{'PASS' if self.ok else 'FAIL'} ({self.threshold()})", file=out)


def _require_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        raise EdgevlError("verify needs PyTorch and transformers: pip install 'edgevl[verify]' "
                          "(install the CPU torch first: pip install torch --index-url "
                          "https://download.pytorch.org/whl/cpu)") from None
    try:
        import transformers  # noqa: F401
    except ImportError:   # torch is there: installing the extra adds transformers
        raise EdgevlError("verify needs transformers beside PyTorch: pip install 'edgevl[verify]'") from None


def source_of(package) -> Path:
    """The checkpoint folder a package was converted from (recorded in its manifest)."""
    from ..package import read_manifest

    src = (read_manifest(package).get("source") or {}).get("path")
    if not src or not (Path(src) / "config.json").is_file():
        raise EdgevlError(f"the checkpoint {package} was converted from ({src or 'unknown'}) is not there any more; "
                          "pass --reference HF_DIR")
    return Path(src)


SIZES = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "intermediate_size")


def check_reference(package, reference_dir) -> None:
    """A reference folder given by hand must be a Hugging Face checkpoint of the package's family
    and sizes: one line before anything loads, not a traceback from a shape compared later."""
    import json

    from .. import models
    from ..package import read_manifest

    ref = Path(reference_dir)
    if not ref.is_dir():
        raise EdgevlError(f"--reference {ref} {'is not a folder' if ref.exists() else 'does not exist'}; pass the "
                          "Hugging Face checkpoint folder the package was converted from")
    if (ref / "manifest.json").is_file():
        raise EdgevlError(f"--reference {ref} is an edgevl package; pass the Hugging Face checkpoint folder it was "
                          "converted from")
    try:
        cfg = json.loads((ref / "config.json").read_text())
    except (OSError, ValueError):
        raise EdgevlError(f"--reference {ref} has no readable config.json: it is not a Hugging Face checkpoint "
                          "folder") from None
    if not isinstance(cfg, dict):
        raise EdgevlError(f"--reference {ref}: config.json is not a JSON object")
    m = read_manifest(package)
    arch = models.resolve(cfg).name
    if arch != m["architecture"]:
        raise EdgevlError(f"--reference {ref} is a {arch} checkpoint but the package is {m['architecture']}; pass the "
                          "checkpoint the package was converted from")
    ours = m.get("config") or {}
    for part in (None, "text_config"):
        a = ours.get(part) if part else ours
        b = cfg.get(part) if part else cfg
        if not isinstance(a, dict) or not isinstance(b, dict):
            continue
        for k in SIZES:
            if k in a and k in b and a[k] != b[k]:
                name = f"{part}.{k}" if part else k
                raise EdgevlError(f"--reference {ref} has {name} {b[k]!r:.20} but the package was converted with "
                                  f"{a[k]!r:.20}; pass the checkpoint the package was converted from")


def source_changed(package, reference_dir) -> str | None:
    """What differs between ``reference_dir`` and the checkpoint ``package`` was converted from,
    by the sha256 of the weight files its manifest recorded (None: the same files, or nothing
    recorded): another checkpoint written to the same folder would fail the comparison, and
    the package would take the blame."""
    from ..package import source_file_changed

    changed = source_file_changed(package, reference_dir)
    if changed is None:
        return None
    name, there = changed
    return f"{name} differs from the file converted" if there else f"{name} is not there"


def compare(package, reference_dir, prompt: str, image=None, max_new_tokens: int = 32,
            max_image_patches=None, threads=None, log=None, options=None) -> Report:
    """``log`` (a callable taking one line) hears what is being compared and each step."""
    if not prompt.strip():   # before torch and both models load
        raise EdgevlError("the prompt is empty; pass some text")
    _require_torch()
    from ..generate import prepare
    from ..model import Model
    from . import get

    log = log or (lambda line: None)
    if threads is not None:  # 0 is a mistake, not "the default"
        from ..runtime import check_threads

        check_threads(threads)
    given = bool(reference_dir)
    if not given:   # the folder converted from, which may hold another checkpoint since
        reference_dir = source_of(package)
    else:
        check_reference(package, reference_dir)
    changed = source_changed(package, reference_dir)   # given or not: the weights the manifest recorded
    if changed:
        log(f"warning: {reference_dir} is not the checkpoint this package was converted from ({changed}); a "
            "FAIL may be that difference, not the package: " + ("pass the original as --reference" if given else
                                                                 "convert it again or pass the original with "
                                                                 "--reference"))
    reference_dir = Path(reference_dir)
    images = [] if image is None else list(image) if isinstance(image, (list, tuple)) else [image]
    steps = 5 if images else 4
    step = iter(range(1, steps + 1))
    log(f"[{next(step)}/{steps}] loading the package {package}")
    model = Model(package, threads=threads, light_mode=False, options=options)
    if images and model.vision is None:
        raise EdgevlError("--image given but this is a text-only model")
    # parts stored in int8 beside an fp32 package (--experts q8, --dense q8, --vision q8) round: the
    # reduced-precision rule applies, not token-exactness
    int8 = sorted(k for k, v in (model.manifest.get("options") or {}).items() if v == "q8")
    stored = model.dtype + "".join(f", {k} q8" for k in int8) if model.dtype != "q8" else model.dtype
    rep = Report(dtype=model.dtype if not int8 else f"{model.dtype} with q8 parts")
    log(f"verify: {model.arch.name} package ({stored}) against {reference_dir} (PyTorch fp32); "
        f"prompt {prompt!r}" + (f", image {', '.join(str(i) for i in images)}" if images else ", no image")
        + f", {max_new_tokens} greedy tokens; pass if {rep.threshold()} (layer cosines are shown, not judged)")
    log(f"[{next(step)}/{steps}] loading the PyTorch reference")
    ref = get(model.arch.name).reference(reference_dir)
    prep = prepare(model, prompt, image=images or None, max_image_patches=max_image_patches)
    ref_images = None
    if images:
        log(f"[{next(step)}/{steps}] vision tower, layer by layer")
        infos = [model.vision(im, max_image_patches, extract_layers=True)[1] for im in images]
        ref_images = ref.prepare_images(images, infos)
        rep.processor_max_diff = ref.processor_diff(images, infos)
        for k, (info, (merged, states)) in enumerate(zip(infos, ref.vision_states(ref_images))):
            tag = f"image {k} " if len(images) > 1 else ""
            labels = info.get("layer_names") or [f"layer {i}" for i in range(len(info["layers"]) - 1)] + ["post norm"]
            for label, ours, theirs in zip(labels, info["layers"], states):
                rep.add("vision", f"{tag}{label}", ours, theirs)
            rep.add("vision", f"{tag}merger", prep.image_rows[k], merged)
    ids = prep.input_ids
    room = model.max_context - len(ids)
    if room <= 0:
        raise EdgevlError(f"the prompt ({len(ids)} tokens) fills the model's context ({model.max_context}); give a "
                          "shorter prompt")
    if max_new_tokens > room:   # ours stop at the context's end; the reference would go on past it
        log(f"note: the model's context ({model.max_context}) holds {room} new tokens after the {len(ids)}-token "
            f"prompt; comparing {room}, not {max_new_tokens}")
        max_new_tokens = room
    log(f"[{next(step)}/{steps}] language model, layer by layer ({len(ids)} prompt tokens)")
    embeds = model.embed(ids, prep.image_rows)    # a token past the embedding: our one line, before torch's
    states, ref_logits = _reference(ref.text_states, ids, ref_images)
    rep.add("text", "embeddings", embeds, states[0])
    names = model.decoder.info["outputs"]["layers"]
    cache = model.decoder.new_cache()
    hidden, extra = model.decoder.forward(embeds, cache, model.positions(ids, prep.images), extract=names,
                                           ids=ids)
    # fixed-size states (conv windows, recurrent matrices) after the prefill, against the reference's cache
    ours_state = cache.state_arrays()
    ref_state = ref.state_arrays(_reference(ref.start, ids, ref_images)[1]) if ours_state else {}
    for i, name in enumerate(names):
        rep.add("text", f"layer {i}", extra[name], states[i + 1])
        for key in sorted(k for k in ours_state if k[0] == i):
            if key in ref_state:
                rep.add("state", f"layer {i} {key[1]}", ours_state[key], ref_state[key])
    rep.add("text", "final norm", hidden, states[-1])
    rep.add("text", "logits", model.logits(hidden), ref_logits)
    if "mtp" in model.manifest["graphs"] and len(ids) > 1:
        from .. import speculative

        log("   the multi-token-prediction block (row i: token i+1's embedding and the hidden state at i)")
        mtp = model.mtp or speculative.Mtp(model)
        out = speculative.block_outputs(mtp, embeds[1:], hidden[:-1], model.positions(ids, prep.images)[:, :-1])
        ref_out, ref_mtp_logits = ref.mtp_states(ids, ref_images)
        rep.add("mtp", "block output", out, ref_out)
        mtp_logits = model.logits(out)
        rep.add("mtp", "logits", mtp_logits, ref_mtp_logits)
        rep.mtp_top1 = (int((mtp_logits.argmax(-1) == np.asarray(ref_mtp_logits).argmax(-1)).sum()), len(out))
    log(f"[{next(step)}/{steps}] {max_new_tokens} greedy tokens, ours and the reference's")
    rep.ours = list(model.generate_tokens(ids, max_new_tokens, image=prep.encoded, reuse_cache=False))
    rep.reference = _reference(ref.greedy, ids, max_new_tokens, model.eos_ids, ref_images)
    return rep


def _reference(fn, *args):
    """A call of the PyTorch reference; its failure (a config transformers cannot run) is one line."""
    try:
        return fn(*args)
    except (EdgevlError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - whatever transformers raises, said in one line
        said = " ".join(str(e).split())[:200]
        raise EdgevlError(f"the PyTorch reference failed on this checkpoint ({type(e).__name__}: {said}); the "
                          "package cannot be compared with it") from None


def verify(package, reference_dir=None, prompt: str = "Describe the image in one sentence.", image=None,
           max_new_tokens: int = 32, max_image_patches=None, threads=None, out=None, options=None) -> bool:
    """Print the comparison (progress on stderr); ``reference_dir`` None: the package's source.
    ``options``: the architecture's load-time options (e.g. an expert cache size)."""
    rep = compare(package, reference_dir, prompt, image, max_new_tokens, max_image_patches, threads,
                  log=lambda line: print(line, file=sys.stderr, flush=True), options=options)
    rep.print(out or sys.stdout)
    return rep.ok
