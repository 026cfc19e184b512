"""What verification asks of a model family: its PyTorch reference behind a small interface
(:class:`Reference`) and its tiny random checkpoints (:class:`FamilyVerification`).

``verify``, ``bench --compare torch`` and the conformance tests use these; every family has one
module in ``edgevl/verification/families/`` (found by the family's name) exporting ``VERIFY``.
Needs PyTorch and transformers (``pip install edgevl[verify]``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from ..errors import EdgevlError
from ..processing import qwen_vl
from ..processing.image import load_image


class FamilyVerification:
    """A family's verification: ``reference(checkpoint)`` and ``make_tiny(folder, variant, ...)``.

    ``tiny_variants``: name -> overrides for ``make_tiny`` (the first is the conformance suite's);
    ``precision_outlier_rows``: the share of teacher-forced rows the reduced-precision tests let
    fall below their logit-cosine bar — 0 for smooth models; a model with discrete per-token
    choices (mixture-of-experts routing) flips a near-tied choice under bf16/q8 rounding now and
    then, which moves that one row's logits far while the others stay close."""

    tiny_variants: dict = {}
    precision_outlier_rows: float = 0.0

    def reference(self, ref_dir, dtype: str = "fp32") -> Reference:
        raise EdgevlError("this family has no PyTorch reference to verify against")

    def make_tiny(self, folder, variant: str | None = None, seed: int = 0, dtype: str = "fp32",
                  train_steps: int = 0, **overrides) -> Path:
        raise NotImplementedError

    def variant(self, variant: str | None) -> dict:
        """The overrides of ``variant`` (None or "": none, the family's base tiny config)."""
        if not variant:
            return {}
        if variant not in self.tiny_variants:
            raise EdgevlError(f"no tiny variant {variant!r}; there are: {', '.join(self.tiny_variants)}")
        return dict(self.tiny_variants[variant])


class Reference:
    """A PyTorch model behind the interface verify, bench and the conformance suite use.

    ``images`` are what ``prepare_images`` returns for the package's processor infos;
    states are [input embeddings, after each decoder layer ..., after the final norm]."""

    has_vision = False

    def prepare_images(self, images: list, infos: list):
        """Reference-side image inputs for ``images`` (paths/PIL), given the package's infos."""
        raise EdgevlError("this reference takes no images")

    def processor_diff(self, images, infos) -> float | None:
        """max |pixel difference| of the package's processor vs the reference one, if any."""
        return None

    def vision_states(self, images) -> tuple:
        """(merger rows, [after each vision layer ..., post norm]) for each image, in order."""
        raise NotImplementedError

    def text_states(self, ids, images=None) -> tuple[list, np.ndarray]:
        """(states, logits [len(ids), V])."""
        raise NotImplementedError

    def start(self, ids, images=None):
        """Prefill: (last-position logits [V], state)."""
        raise NotImplementedError

    def step(self, token: int, state):
        """One decode step: (logits [V], state)."""
        raise NotImplementedError

    def state_bytes(self, state) -> int:
        return _tensor_bytes(state)

    def state_arrays(self, state) -> dict:
        """{(layer, name): array} of a prefilled state's fixed-size parts (conv windows, recurrent
        matrices), named as the package's manifest names them (``Cache.state_arrays``)."""
        return {}

    def greedy(self, ids, n: int, eos=(), images=None) -> list[int]:
        out = []
        logits, state = self.start(ids, images)
        for _ in range(n):
            t = int(np.argmax(logits))
            out.append(t)
            if t in eos:
                break
            logits, state = self.step(t, state)
        return out


def module_outputs(modules, run):
    """(``run()``, the output of each of ``modules`` while it ran, in call order), without gradients:
    the hidden states after each decoder layer or vision block."""
    import torch

    outs = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: outs.append(o[0] if isinstance(o, tuple) else o))
             for m in modules]
    try:
        with torch.no_grad():
            return run(), outs
    finally:
        for h in hooks:
            h.remove()


def _tensor_bytes(obj, seen=None) -> int:
    """Bytes of the tensors a transformers cache holds (keys, values, conv/recurrent states)."""
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(x, seen) for x in obj.values())
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("transformers"):
        return sum(_tensor_bytes(x, seen) for x in vars(obj).values())
    return 0


class TransformersCausalLM(Reference):
    """A transformers decoder-only model (``model.model.layers``, ``model.model.norm``)."""

    def __init__(self, model):
        self.model = model

    def _layers(self):
        return self.model.model.layers

    def _norm(self):
        return self.model.model.norm

    def text_states(self, ids, images=None):
        import torch

        ids = torch.tensor([list(ids)])
        r, outs = module_outputs(self._layers(), lambda: self.model(ids, output_hidden_states=True))
        with torch.no_grad():
            final = self._norm()(outs[-1])
        states = [r.hidden_states[0][0].numpy()] + [o[0].numpy() for o in outs] + [final[0].numpy()]
        return states, r.logits[0].float().numpy()

    def start(self, ids, images=None):
        import torch

        with torch.no_grad():
            r = self.model(torch.tensor([list(ids)]), use_cache=True)
        return r.logits[0, -1].float().numpy(), _cache_of(r)

    def step(self, token, state):
        import torch

        with torch.no_grad():
            r = self.model(torch.tensor([[int(token)]]), cache=state, use_cache=True)
        return r.logits[0, -1].float().numpy(), _cache_of(r)


def _cache_of(r):
    return r.cache if hasattr(r, "cache") else r.past_key_values


class QwenImagesReference(Reference):
    """A reference whose images go through transformers' Qwen2-VL image processor (its default,
    torchvision class, as :func:`qwen_image_processor` rebuilds it) with the checkpoint's
    preprocessor_config.json and the package's patch budget (the Qwen3.5 family and the Youtu
    MoE: Qwen3-VL's vision tower)."""

    has_vision = True
    folder: Path

    def _vision_blocks(self):
        raise NotImplementedError

    def _image_features(self, pixel_values, grid):
        """The merger rows of one image (a tensor)."""
        raise NotImplementedError

    def vision_states(self, images):
        out = []
        for pv, grid in images:
            merged, outs = module_outputs(self._vision_blocks(),
                                          lambda pv=pv, grid=grid: self._image_features(pv, grid))
            out.append((merged.float().numpy(), [o.float().numpy().reshape(-1, o.shape[-1]) for o in outs]))
        return out

    def _processor(self, max_image_patches: int):
        from transformers.image_processing_base import ImageProcessingMixin

        try:   # transformers' own lookup (processor_config.json's entry first, then the file)
            raw = ImageProcessingMixin.get_image_processor_dict(str(self.folder))[0]
        except OSError:
            raw = {}
        cfg = qwen_vl.ProcessorConfig.from_dict(raw)
        cap = max_image_patches * cfg.patch_size ** 2
        kw = {k: v for k, v in raw.items() if k not in ("image_processor_type", "processor_class", "min_pixels",
                                                        "max_pixels", "size")}
        kw["size"] = {"shortest_edge": min(cfg.min_pixels, cap), "longest_edge": min(cfg.max_pixels, cap)}
        return qwen_image_processor(**kw)

    def prepare_images(self, images, infos):
        """[(pixel_values, image_grid_thw)] from transformers' processor (not ours)."""
        out = []
        for im, info in zip(images, infos):
            enc = self._processor(int(info["max_image_patches"]))(images=[load_image(im)], return_tensors="pt")
            out.append((enc["pixel_values"], enc["image_grid_thw"]))
        return out

    def processor_diff(self, images, infos):
        return max(float(np.abs(pv.numpy() - info["pixel_values"]).max())
                   for (pv, _), info in zip(self.prepare_images(images, infos), infos) if "pixel_values" in info)


def qwen_image_processor(**kwargs):
    """transformers' default Qwen2-VL image processor (``Qwen2VLImageProcessor``, torchvision
    backend) built without torchvision, which cannot be installed beside a CPU build of torch.

    Its PIL class ``Qwen2VLImageProcessorPil`` shares everything with it (config, smart_resize,
    patchify) except two steps, which are put back as the torchvision class runs them: the resize
    is ``torch.nn.functional.interpolate`` on the uint8 tensor (what torchvision's resize calls on
    CPU), and rescale and normalize are one float32 step, mean and std first multiplied by
    1 / rescale_factor (transformers' ``TorchvisionBackend.rescale_and_normalize``).
    """
    return _qwen_torchvision_class()(**kwargs)


@functools.cache
def _qwen_torchvision_class():
    import torch
    from transformers.image_processing_utils import BatchFeature
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

    def resize_like_torchvision(chw, height, width, resample):
        """torchvision's ``resize`` of a uint8 (C, H, W) tensor on CPU, antialias on."""
        if tuple(chw.shape[-2:]) == (height, width):
            return chw
        x = torch.from_numpy(np.ascontiguousarray(chw))[None]
        code = int(resample)
        if code == 0:       # transformers maps Pillow's NEAREST to NEAREST_EXACT
            return torch.nn.functional.interpolate(x, size=(height, width), mode="nearest-exact")[0].numpy()
        if code not in (2, 3):
            raise NotImplementedError(f"resample {code}: torchvision has no uint8 tensor kernel for it here")
        mode = "bilinear" if code == 2 else "bicubic"
        if code == 2 and "AVX2" not in torch.backends.cpu.get_cpu_capability():
            # torchvision resizes bilinear in uint8 only where torch reports AVX2, else via float32
            y = torch.nn.functional.interpolate(x.float(), size=(height, width), mode=mode, antialias=True,
                                                align_corners=False)
            return y.round_().to(torch.uint8)[0].numpy()
        return torch.nn.functional.interpolate(x, size=(height, width), mode=mode, antialias=True,
                                               align_corners=False)[0].numpy()

    def rescale_and_normalize(x, do_rescale, rescale_factor, do_normalize, mean, std):
        if do_rescale and do_normalize:     # fused: mean and std scaled in float32, x never rescaled
            mean = torch.tensor(mean) * (1.0 / rescale_factor)
            std = torch.tensor(std) * (1.0 / rescale_factor)
            do_rescale = False
        if do_normalize:
            mean = torch.as_tensor(mean, dtype=torch.float32)
            std = torch.as_tensor(std, dtype=torch.float32)
            if mean.ndim == 1:
                mean, std = mean.view(-1, 1, 1), std.view(-1, 1, 1)
            return x.to(torch.float32).sub_(mean).div_(std)
        return x * rescale_factor if do_rescale else x

    class Qwen2VLImageProcessorTorchvision(Qwen2VLImageProcessorPil):
        def resize(self, image, size, resample, factor, **kwargs):
            if not size.shortest_edge or not size.longest_edge:
                raise ValueError(f"`size` must have 'shortest_edge' and 'longest_edge', got {size}")
            h, w = image.shape[-2:]
            th, tw = smart_resize(h, w, factor=factor, min_pixels=size.shortest_edge, max_pixels=size.longest_edge)
            return resize_like_torchvision(image, th, tw, resample)

        def _preprocess(self, images, do_resize, size, resample, do_rescale, rescale_factor, do_normalize,
                        image_mean, image_std, patch_size, temporal_patch_size, merge_size, return_tensors,
                        **kwargs):
            patches, grids = [], []
            for image in images:
                if do_resize:
                    image = self.resize(image, size=size, resample=resample, factor=patch_size * merge_size)
                x = rescale_and_normalize(torch.from_numpy(np.ascontiguousarray(image)), do_rescale, rescale_factor,
                                          do_normalize, image_mean, image_std)
                rows, gh, gw = self.patchify(x.numpy(), patch_size=patch_size, merge_size=merge_size,
                                             temporal_patch_size=temporal_patch_size)
                patches.append(rows)
                grids.append([1, gh, gw])
            return BatchFeature(data={"pixel_values": np.concatenate(patches, axis=0),
                                      "image_grid_thw": np.array(grids, dtype=np.int64)}, tensor_type=return_tensors)

    return Qwen2VLImageProcessorTorchvision


TORCH_DTYPES = ("fp32", "bf16")


def torch_dtype(name: str):
    import torch

    if name not in TORCH_DTYPES:
        raise EdgevlError(f"reference dtype must be one of {', '.join(TORCH_DTYPES)}, got {name!r}")
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
