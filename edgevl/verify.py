"""Layer-by-layer comparison of a converted package with its PyTorch reference.

Text models compare against transformers' own ``YoutuForCausalLM``; Youtu-VL against the
project's reference (``edgevl.reference.youtu_vl``), which reads the real checkpoint layout.
Needs ``pip install edgevl[verify]``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np

from .errors import EdgevlError


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
        if self.dtype == "fp32":
            return self.identical
        # reduced precision drifts eventually: require the first token and close logits
        logits = [r for r in self.rows if r[1] == "logits"]
        return self.agreement >= 1 and all(r[2] >= 0.99 for r in logits)

    def min_cosine(self, section: str) -> float:
        vals = [r[2] for r in self.rows if r[0] == section]
        return min(vals) if vals else float("nan")

    def print(self, out=sys.stdout):
        if self.processor_max_diff is not None:
            print(f"processor pixel_values max |diff| vs torch uint8 path: {self.processor_max_diff:.3g}", file=out)
        print(f"{'section':<8} {'tensor':<28} {'cosine':>12} {'max|diff|':>12}", file=out)
        for sec, name, c, d in self.rows:
            print(f"{sec:<8} {name:<28} {c:>12.8f} {d:>12.4g}", file=out)
        n = len(self.reference)
        state = "identical" if self.identical else f"first {self.agreement} of {n} agree"
        print(f"greedy tokens ({n} new): {state}", file=out)
        if not self.identical:
            print(f"  ours:      {self.ours}", file=out)
            print(f"  reference: {self.reference}", file=out)
        print("PASS" if self.ok else "FAIL", file=out)


def _require_torch():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise EdgevlError("verify needs PyTorch and transformers: pip install 'edgevl[verify]' "
                          "(install the CPU torch first: pip install torch --index-url "
                          "https://download.pytorch.org/whl/cpu)") from None


def torch_pixel_values(image, max_image_patches, patch: int, merge: int) -> np.ndarray:
    """The HF processor path in torch (uint8 antialiased resize, fused normalisation, patchify)."""
    import torch
    import torch.nn.functional as F

    from .processing.image import load_image, target_size

    im = load_image(image)
    th, tw = target_size(im.height, im.width, max_image_patches, patch, merge)
    x = torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1)[None]
    x = F.interpolate(x, size=(th, tw), mode="bilinear", antialias=True, align_corners=False)[0]
    x = (x.float() - 127.5) / 127.5
    gh, gw = th // patch, tw // patch
    x = x.reshape(3, gh // merge, merge, patch, gw // merge, merge, patch).permute(1, 4, 2, 5, 3, 6, 0)
    return x.reshape(gh * gw, patch * patch * 3).numpy()


def _reference(model, ref_dir):
    import torch

    if model.family == "youtu_vl":
        from .reference.youtu_vl import YoutuVLForConditionalGeneration

        return YoutuVLForConditionalGeneration.from_pretrained(ref_dir, dtype=torch.float32).eval()
    from transformers import YoutuForCausalLM

    return YoutuForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()


def _ref_text_states(ref, family, ids, pv=None, ss=None):
    """[embeddings, after each decoder layer, after final norm] and last-position logits."""
    import torch

    t = torch.tensor([ids])
    with torch.no_grad():
        if family == "youtu_vl":
            states = [(s[0] if s.dim() == 3 else s).numpy() for s in ref.text_hidden_states(t, pv, ss)]
            logits = ref(t, pv, ss).logits
            logits = (logits[0] if logits.dim() == 3 else logits).numpy()
            return states, logits
        outs = []
        hooks = [layer.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o))
                 for layer in ref.model.layers]
        try:
            r = ref(t, output_hidden_states=True)
        finally:
            for h in hooks:
                h.remove()
        states = [r.hidden_states[0][0].numpy()] + [o[0].numpy() for o in outs]
        with torch.no_grad():
            final = ref.model.norm(outs[-1])[0].numpy()
        return states + [final], r.logits[0].numpy()


def reference_greedy(ref, family, ids, n, eos, pv=None, ss=None) -> list[int]:
    import torch

    if family == "youtu_vl":
        with torch.no_grad():
            return list(ref.greedy_generate(torch.tensor([ids]), pv, ss, max_new_tokens=n, eos_token_id=eos))
    out, cache, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            r = ref(x, cache=cache, use_cache=True)
            cache = r.cache
            t = int(r.logits[0, -1].argmax())
            out.append(t)
            if t in eos:
                break
            x = torch.tensor([[t]])
    return out


def compare(package, reference_dir, prompt: str, image=None, max_new_tokens: int = 32,
            max_image_patches=None, threads=None) -> Report:
    _require_torch()
    import torch

    from .generate import prepare
    from .model import Model

    model = Model(package, threads=threads, light_mode=False)
    if image is not None and model.vision is None:
        raise EdgevlError("--image given but this is a text-only model")
    ref = _reference(model, reference_dir)
    rep = Report(dtype=model.dtype)
    prep = prepare(model, prompt, image=image, max_image_patches=max_image_patches)
    pv = ss = None
    if prep.images:
        rows, info = model.vision(image, max_image_patches, extract_layers=True)
        v = model.vision.v
        n = max_image_patches or model.vision.default_max_patches
        rep.processor_max_diff = float(np.abs(
            torch_pixel_values(image, n, v.patch_size, v.spatial_merge_size) - info["pixel_values"]).max())
        pv, ss = torch.from_numpy(info["pixel_values"]), info["spatial_shapes"]
        with torch.no_grad():
            merged, states = ref.vision_features(pv, ss, output_hidden_states=True)
        for i, ours in enumerate(info["layers"][:-1]):
            rep.add("vision", f"layer {i}", ours, states[i + 1].numpy())
        rep.add("vision", "post_layernorm", info["layers"][-1], states[-2].numpy())
        rep.add("vision", "merger", rows, merged.numpy())
    ids = prep.input_ids
    states, ref_logits = _ref_text_states(ref, model.family, ids, pv, ss)
    embeds = model.embed(ids, prep.image_rows)
    rep.add("text", "embeddings", embeds, states[0])
    names = model.decoder.info["outputs"]["layers"]
    hidden, extra = model.decoder.forward(embeds, model.decoder.new_cache(), extract=names)
    for i, name in enumerate(names):
        rep.add("text", f"layer {i}", extra[name], states[i + 1])
    rep.add("text", "final norm", hidden, states[-1])
    rep.add("text", "logits", model.logits(hidden), ref_logits)
    rep.ours = list(model.generate_tokens(ids, max_new_tokens, image=prep.image_rows, reuse_cache=False))
    rep.reference = reference_greedy(ref, model.family, ids, max_new_tokens, model.eos_ids, pv, ss)
    return rep


def verify(package, reference_dir, prompt: str, image=None, max_new_tokens: int = 32,
           max_image_patches=None, threads=None, out=sys.stdout) -> bool:
    rep = compare(package, reference_dir, prompt, image, max_new_tokens, max_image_patches, threads)
    rep.print(out)
    return rep.ok
