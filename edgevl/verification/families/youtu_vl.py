"""Youtu-VL's verification: no transformers class exists, so the reference is the project's own
PyTorch model written from the model's description (``edgevl/verification/references/youtu_vl.py``),
with images resized by torch's own path (not the package's processor)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import EdgevlError
from ...models.youtu_vl import processing
from ...processing.image import load_image
from ..reference import FamilyVerification, Reference, torch_dtype
from ..tiny import tiny_tokenizer, train_briefly
from ..tokenizers import save_tokenizer


def torch_pixel_values(image, max_image_patches, patch: int, merge: int) -> np.ndarray:
    """The HF processor path in torch (uint8 antialiased resize, fused normalisation, patchify)."""
    import torch
    import torch.nn.functional as F

    im = load_image(image)
    th, tw = processing.target_size(im.height, im.width, max_image_patches, patch, merge)
    x = torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1)[None]
    x = F.interpolate(x, size=(th, tw), mode="bilinear", antialias=True, align_corners=False)[0]
    x = (x.float() - 127.5) / 127.5
    gh, gw = th // patch, tw // patch
    x = x.reshape(3, gh // merge, merge, patch, gw // merge, merge, patch).permute(1, 4, 2, 5, 3, 6, 0)
    return x.reshape(gh * gw, patch * patch * 3).numpy()


class YoutuVLReference(Reference):
    has_vision = True

    def __init__(self, model):
        self.model = model
        self.v = model.vision_config

    def prepare_images(self, images, infos):
        """[(pixel_values, spatial_shapes)] through torch's own resize path (not ours)."""
        out = []
        for im, info in zip(images, infos):
            n = info["max_image_patches"]
            out.append((torch_pixel_values(im, n, self.v.patch_size, self.v.spatial_merge_size),
                        tuple(info["spatial_shapes"])))
        return out

    def processor_diff(self, images, infos):
        return max(float(np.abs(pv - info["pixel_values"]).max())
                   for (pv, _), info in zip(self.prepare_images(images, infos), infos)
                   if "pixel_values" in info)

    def vision_states(self, images):
        import torch

        out = []
        with torch.no_grad():
            for pv, ss in images:
                merged, states = self.model.vision_features(torch.from_numpy(pv), ss, output_hidden_states=True)
                out.append((merged.numpy(), [s.numpy() for s in states[1:-1]]))
        return out

    def _pv(self, images):
        import torch

        if not images:
            return None, None
        if len(images) > 1:  # the merger rows of several images, fused in prompt order
            raise EdgevlError("the Youtu-VL reference takes one image per prompt")
        pv, ss = images[0]
        return torch.from_numpy(pv), ss

    def text_states(self, ids, images=None):
        import torch

        pv, ss = self._pv(images)
        t = torch.tensor([list(ids)])
        with torch.no_grad():
            states = [(s[0] if s.dim() == 3 else s).numpy() for s in self.model.text_hidden_states(t, pv, ss)]
            logits = self.model(t, pv, ss).logits
        return states, (logits[0] if logits.dim() == 3 else logits).float().numpy()

    def start(self, ids, images=None):
        import torch
        from transformers import DynamicCache

        pv, ss = self._pv(images)
        m = self.model
        emb = m._inputs_embeds(torch.tensor([list(ids)]), pv, ss)
        cache = DynamicCache(config=m.text_config)
        with torch.no_grad():
            out = m.model(inputs_embeds=emb, cache=cache, use_cache=True)
            return m.lm_head(out.last_hidden_state[0, -1]).float().numpy(), out.cache

    def step(self, token, state):
        import torch

        m = self.model
        with torch.no_grad():
            out = m.model(inputs_embeds=m.model.embed_tokens(torch.tensor([[int(token)]])), cache=state,
                          use_cache=True)
            return m.lm_head(out.last_hidden_state[0, -1]).float().numpy(), out.cache


class YoutuVLVerification(FamilyVerification):
    tiny_variants = {
        # real window size (256 px): several windows only for large images
        "default": dict(),
        # full attention where the default pattern has window layers, small windows, odd text sizes
        "custom_full": dict(hidden_size=40, num_attention_heads=5, num_key_value_heads=5, qk_nope_head_dim=6,
                            v_head_dim=10, q_lora_rank=None,
                            vision_config={"fullatt_block_indexes": [0], "num_hidden_layers": 3,
                                           "window_size": 64, "hidden_size": 48, "num_attention_heads": 3}),
    }

    def reference(self, ref_dir, dtype="fp32"):
        from ..references.youtu_vl import YoutuVLForConditionalGeneration

        model = YoutuVLForConditionalGeneration.from_pretrained(ref_dir, dtype=torch_dtype(dtype))
        return YoutuVLReference(model.eval())

    def make_tiny(self, folder, variant=None, seed=0, dtype="fp32", train_steps=0, n_coordinates: int = 64,
                  **overrides) -> Path:
        """A random Youtu-VL checkpoint in the real layout (the project's reference writes it);
        ``train_steps`` trains its language model briefly on text."""
        import torch

        from ..references.youtu_vl import make_config, make_random

        tok = tiny_tokenizer(400, True, n_coordinates)
        ids = save_tokenizer(tok, folder)
        ids.pop("pad_token_id")
        overrides = {**self.variant(variant), **overrides}
        cfg = make_config(vocab_size=tok.get_vocab_size(), pad_token_id=None, **ids, **overrides)
        model = make_random(cfg, seed=seed)
        if train_steps:
            model = train_briefly(model, tok, train_steps, seed)
        model.save_pretrained(folder, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
        return Path(folder)


VERIFY = YoutuVLVerification()
