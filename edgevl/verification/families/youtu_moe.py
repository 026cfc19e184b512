"""The Youtu MoE's verification: no modeling code is public, so the reference is the project's own
PyTorch model in the assumed layout (``edgevl/verification/references/youtu_moe.py``: transformers'
``kimi_linear``, ``youtu`` and ``qwen3_vl`` blocks with the changes the llama.cpp patch describes).
Tiny checkpoints are written by it, with a small Youtu-style tokenizer (plus <think>/</think>) and
Youtu-VL's chat template."""

from __future__ import annotations

import json
from pathlib import Path

from ...models.youtu_vl.model import CHAT_TEMPLATE as YOUTU_VL_TEMPLATE
from ..reference import FamilyVerification, QwenImagesReference, torch_dtype
from ..tiny import chat_ids, tiny_tokenizer
from ..tokenizers import save_tokenizer


class YoutuMoeReference(QwenImagesReference):
    """The project's reference model (``edgevl/verification/references/youtu_moe.py``)."""

    def __init__(self, model, folder):
        self.model, self.folder = model, Path(folder)
        self.vl = self.has_vision = True

    @staticmethod
    def _cat(images):
        import torch

        if not images:
            return None, None
        return torch.cat([pv for pv, _ in images]), torch.cat([g for _, g in images])

    def _vision_blocks(self):
        return self.model.visual.blocks

    def _image_features(self, pixel_values, grid):
        return self.model.vision_features(pixel_values, grid)[0]

    def text_states(self, ids, images=None):
        states, logits = self.model.text_states(list(ids), *self._cat(images))
        return [s.float().numpy() for s in states], logits.float().numpy()

    def start(self, ids, images=None):
        logits, state = self.model.start(list(ids), *self._cat(images))
        return logits.numpy(), state

    def step(self, token, state):
        logits, state = self.model.step(int(token), state)
        return logits.numpy(), state

    def state_bytes(self, state) -> int:
        return super().state_bytes(state.cache)

    def state_arrays(self, state):
        """Per KDA layer: the conv window's last K-1 columns and the delta-rule matrix."""
        out = {}
        k = self.model.tc.kimi.linear_conv_kernel_dim
        for i, layer in enumerate(state.cache.layers):
            conv, rec = getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)
            if not conv or not rec:
                continue
            conv = conv[0] if isinstance(conv, (list, tuple, dict)) else conv
            rec = rec[0] if isinstance(rec, (list, tuple, dict)) else rec
            out[(i, "conv")] = conv[0, :, -(k - 1):].float().numpy()
            out[(i, "recurrent")] = rec[0].float().numpy()
        return out


class YoutuMoeVerification(FamilyVerification):
    # bf16/q8 rounding of the router's input flips near-tied expert choices (top-4 of 16 on the
    # tiny models, one flip replaces a quarter of the routed output): teacher-forced on three
    # trained tiny models (seeds 11-13), 6-14 of 192 rows fell below 0.99 logit cosine in bf16
    # (5-13 in q8, 1-4 below 0.97), each a routing flip — with the fp32 package's routing forced,
    # every bf16 row is >= 0.9986
    precision_outlier_rows = 0.1
    tiny_variants = {
        # 8 layers (L L L F x 2), q_lora, 4 KDA heads of 16, 4 MLA heads, headwise gate, 16 experts top-4
        "qlora-h4": dict(),
        # no q_lora, 2 KDA heads of 32, 3 MLA heads with wider rope, per-channel gate, 20 experts top-3,
        # 6 layers (L F L L L F), untied head, deeper vision
        "noqlora-h2": dict(num_hidden_layers=6, q_lora_rank=None, linear_num_heads=2, linear_head_dim=32,
                           num_attention_heads=3, num_key_value_heads=3, qk_nope_head_dim=8, qk_rope_head_dim=24,
                           v_head_dim=20, kv_lora_rank=16, mla_output_gate="elementwise", num_experts=20,
                           num_experts_per_token=3, moe_intermediate_size=24,
                           layer_types=["linear_attention", "full_attention", "linear_attention",
                                        "linear_attention", "linear_attention", "full_attention"],
                           rope_parameters={"mrope_section": [4, 4, 4]},
                           vision_config={"depth": 3, "hidden_size": 48, "num_heads": 3, "intermediate_size": 80}),
    }

    def reference(self, ref_dir, dtype="fp32"):
        from ..references.youtu_moe import YoutuVLMoEForConditionalGeneration

        model = YoutuVLMoEForConditionalGeneration.from_pretrained(ref_dir, dtype=torch_dtype(dtype))
        return YoutuMoeReference(model, ref_dir)

    def make_tiny(self, folder, variant=None, seed=0, dtype="fp32", train_steps=0, **overrides) -> Path:
        """A random (or briefly trained) checkpoint in the assumed layout; overrides are
        ``references.youtu_moe.make_config`` keys."""
        return make_tiny(folder, seed, dtype, train_steps, **{**self.variant(variant), **overrides})


def make_tiny(folder, seed: int = 0, dtype: str = "fp32", train_steps: int = 0, **overrides) -> Path:
    import torch
    from tokenizers import AddedToken

    from ..references.youtu_moe import make_config, make_preprocessor_config, make_random

    folder = Path(folder)
    tok = tiny_tokenizer(400, True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    ids = save_tokenizer(tok, folder, chat_template=YOUTU_VL_TEMPLATE)
    ids.pop("pad_token_id")
    cfg = make_config(vocab_size=tok.get_vocab_size(), pad_token_id=None, **ids, **overrides)
    model = make_random(cfg, seed=seed)
    if train_steps:
        model = train_chat(model, tok, train_steps, seed)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["eos_token_id"]}))
    model.save_pretrained(folder, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
                          preprocessor=make_preprocessor_config(cfg))
    return folder


def train_chat(model, tok, steps: int, seed: int = 0, window: int = 32, lr: float = 1e-2):
    """Brief training of the language model on chat-formatted CORPUS turns (text positions,
    modality 0): peaked logits on the prompts the tests render. Windows of 32 tokens and KDA
    chunks of 16 keep it ~4x faster than 64/64 (transformers' chunked KDA loops over every
    row of a chunk): 0.16 s a step. One torch thread: the same weights on every machine (and on
    a busy 2-core one, 2 threads were several times slower)."""
    import functools

    import torch
    import torch.nn.functional as F
    import transformers.models.kimi_linear.modeling_kimi_linear as kimi

    ids = chat_ids(tok, "<|begin_of_text|>user\n{user}<|end_of_text|>\n<|begin_of_text|>assistant\n</think>"
                        "{answer}<|end_of_text|>\n")
    data = torch.tensor(ids)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    pos = torch.arange(window)[None].expand(3, window)
    chunked = kimi.chunk_kimi_delta_attention
    kimi.chunk_kimi_delta_attention = functools.partial(chunked, chunk_size=16)   # same math, fewer loop rows
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model.train()
    try:
        for _ in range(steps):
            starts = torch.randint(0, len(data) - window - 1, (8,), generator=g)
            x = torch.stack([data[s:s + window + 1] for s in starts])
            h = model.model(model.model.embed_tokens(x[:, :-1]), pos, modality=torch.zeros_like(x[:, :-1]))
            loss = F.cross_entropy(model.lm_head(h).reshape(-1, model.lm_head.out_features), x[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        kimi.chunk_kimi_delta_attention = chunked
        torch.set_num_threads(threads)
    return model.eval()


VERIFY = YoutuMoeVerification()
