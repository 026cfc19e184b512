"""Qwen3.5's verification: transformers' ``Qwen3_5ForConditionalGeneration`` (or ``ForCausalLM``) is
the reference; tiny checkpoints are those classes with random (or briefly trained) weights, a small
byte-level BPE with Qwen's special tokens and pre-tokenizer, the real chat template, and generation
and preprocessor configs; with ``mtp=True`` they also hold the multi-token-prediction block
(``references/qwen3_5_mtp.py``), which the reference runs beside transformers' model."""

from __future__ import annotations

import json
from pathlib import Path

from ...models.qwen3_5.model import CHAT_TEMPLATE, TextArgs
from ..reference import FamilyVerification, QwenImagesReference, module_outputs, torch_dtype
from ..tiny import CORPUS, chat_ids, init_random, train_briefly

# transformers' classes of the family (the reference and the tiny checkpoints)
HF_CLASSES = {"vlm": "Qwen3_5ForConditionalGeneration", "causal_lm": "Qwen3_5ForCausalLM",
              "config": "Qwen3_5Config", "text_config": "Qwen3_5TextConfig"}


class Qwen3_5Reference(QwenImagesReference):
    """transformers' model (ForConditionalGeneration, or ForCausalLM for a text-only checkpoint)."""

    def __init__(self, model, folder):
        self.model, self.folder = model, Path(folder)
        self.vl = hasattr(model.model, "visual")
        self.has_vision = self.vl
        self.mtp_block = None   # the checkpoint's MTP block once loaded (``mtp``); a test may set its own

    def _lm(self):
        return self.model.model.language_model if self.vl else self.model.model

    def _vision_blocks(self):
        return self.model.model.visual.blocks

    def _image_features(self, pixel_values, grid):
        merged = self.model.model.get_image_features(pixel_values, grid, return_dict=True).pooler_output
        return merged[0] if isinstance(merged, (list, tuple)) else merged

    def _inputs(self, ids, images):
        import torch

        t = torch.tensor([list(ids)])
        kw = {"input_ids": t}
        if images:
            cfg = self.model.config
            kw["pixel_values"] = torch.cat([pv for pv, _ in images])
            kw["image_grid_thw"] = torch.cat([g for _, g in images])
            kw["mm_token_type_ids"] = (t == cfg.image_token_id).int() + 2 * (t == cfg.video_token_id).int()
        if self.vl:
            self.model.model.rope_deltas = None     # positions of a new prompt, not the last one's
        return kw

    def text_states(self, ids, images=None):
        import torch

        r, outs = module_outputs(self._lm().layers,
                                 lambda: self.model(**self._inputs(ids, images), output_hidden_states=True))
        with torch.no_grad():
            final = self._lm().norm(outs[-1])
        states = ([r.hidden_states[0][0].float().numpy()] + [o[0].float().numpy() for o in outs]
                  + [final[0].float().numpy()])
        return states, r.logits[0].float().numpy()

    def start(self, ids, images=None):
        import torch

        with torch.no_grad():
            r = self.model(**self._inputs(ids, images), use_cache=True)
        return r.logits[0, -1].float().numpy(), r.cache if hasattr(r, "cache") else r.past_key_values

    def step(self, token, state):
        import torch

        with torch.no_grad():
            r = self.model(input_ids=torch.tensor([[int(token)]]), cache=state, use_cache=True)
        return r.logits[0, -1].float().numpy(), r.cache if hasattr(r, "cache") else r.past_key_values

    # ---- multi-token prediction ---------------------------------------------------------------

    def mtp(self):
        """The checkpoint's MTP block (``qwen3_5_mtp.Qwen3_5Mtp``), loaded on first use."""
        if self.mtp_block is None:
            from ..references import qwen3_5_mtp

            self.mtp_block = qwen3_5_mtp.load_mtp(self.folder, self._lm().config, dtype=self.model.dtype)
        return self.mtp_block

    def _main_rows(self, ids, images=None):
        """The main model over ``ids``: (inputs_embeds [n, H] with the images' merged rows, last
        hidden states after the final norm [n, H], M-RoPE positions [3, n]), the embeddings and
        positions taken where its decoder layers receive them (its text rotary embedding)."""
        import torch

        seen = {}

        def grab(_module, args, kwargs):
            seen["embeds"] = args[0] if args else kwargs["x"]
            seen["positions"] = args[1] if len(args) > 1 else kwargs["position_ids"]

        hook = self._lm().rotary_emb.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.no_grad():
                out = self.model.model(**self._inputs(ids, images))
        finally:
            hook.remove()
        return seen["embeds"][0], out.last_hidden_state[0], seen["positions"][:, 0]

    def mtp_states(self, ids, images=None, drafts: int = 0):
        """(MTP outputs after ``mtp.norm`` [n-1+drafts, H], their logits [n-1+drafts, V]) as float32
        numpy: row i (0..n-2) pairs ids[i+1] (its merged embedding) with the main model's hidden state
        at i and predicts ids[i+2]; ``drafts`` more rows follow recursively (row n-1+j takes the
        argmax of the row before and that row's output, at the next position)."""
        import torch

        from ..references import qwen3_5_mtp

        embeds, hidden, pos = self._main_rows(ids, images)
        n = len(ids)
        with torch.no_grad():
            out, logits = self.mtp().recursive(embeds[1:], hidden[:-1],
                                               qwen3_5_mtp.extend_positions(pos, drafts)[:, :n - 1 + drafts],
                                               self._lm().embed_tokens, self.model.lm_head, drafts)
        return out.float().numpy(), logits.float().numpy()

    def _mtp_drafter(self, tokens, images, draft_tokens: int):
        """``draft(p, m)`` over a known sequence: m tokens drafted from row p-1 (tokens[p] and the
        main model's hidden state at p-1), recursively after the first."""
        import torch

        from ..references import qwen3_5_mtp

        embeds, hidden, pos = self._main_rows(tokens, images)
        e, h = embeds[1:], hidden[:-1]
        pos = qwen3_5_mtp.extend_positions(pos, draft_tokens)
        mtp, embed, head = self.mtp(), self._lm().embed_tokens, self.model.lm_head
        with torch.no_grad():
            first = mtp.logits(mtp(e, h, pos[:, :len(tokens) - 1]), head).argmax(-1).tolist()

        def draft(p, m):
            if m == 1:
                return [first[p - 1]]
            with torch.no_grad():
                _, logits = mtp.recursive(e[:p], h[:p], pos[:, :p + m - 1], embed, head, m - 1)
            return logits[p - 1:].argmax(-1).tolist()

        return draft, first

    def speculative_counts(self, prompt_ids, generated_ids, draft_tokens: int = 1, images=None,
                           adaptive: bool = False) -> dict:
        """``{"drafted": D, "accepted": A}`` of greedy MTP speculative decoding over the main model's
        known greedy continuation ``generated_ids`` of ``prompt_ids`` (``qwen3_5_mtp.count_speculative``):
        ``draft_tokens`` drafts per step (recursive after the first; ``adaptive``: at most that
        many, by edgevl's draft-length rule), the longest matching prefix accepted."""
        from ... import speculative
        from ..references import qwen3_5_mtp

        if not prompt_ids:
            raise ValueError("speculative_counts needs a prompt")
        tokens = list(prompt_ids) + list(generated_ids)
        draft, _ = self._mtp_drafter(tokens, images, draft_tokens)
        return qwen3_5_mtp.count_speculative(tokens, len(prompt_ids), draft, draft_tokens,
                                             speculative.Trial() if adaptive else None)

    def draft_agreement(self, prompt_ids, generated_ids, images=None) -> float:
        """The share of the rows that draft inside the continuation (i = L-1 .. n-3 for a prompt of L
        and n tokens in all: tokens[i+1] and tokens[i+2] generated) whose MTP argmax equals
        tokens[i+2]: how often one draft would be accepted, wherever it is made."""
        tokens = list(prompt_ids) + list(generated_ids)
        _, first = self._mtp_drafter(tokens, images, 1)
        rows = range(len(prompt_ids) - 1, len(tokens) - 2)
        return sum(first[i] == tokens[i + 2] for i in rows) / max(1, len(rows))

    def state_arrays(self, state):
        """Per linear-attention layer: the conv window's last K-1 columns (the ones the conv
        reads; transformers keeps K) and the delta-rule matrix."""
        out = {}
        for i, layer in enumerate(state.layers):
            conv, rec = getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)
            if conv is None or rec is None:
                continue
            conv = conv[0] if isinstance(conv, (list, tuple, dict)) else conv   # one state per layer
            rec = rec[0] if isinstance(rec, (list, tuple, dict)) else rec
            k = self._lm().config.linear_conv_kernel_dim
            out[(i, "conv")] = conv[0, :, -(k - 1):].float().numpy()
            out[(i, "recurrent")] = rec[0].float().numpy()
        return out


def load_reference(ref_dir, dtype: str, classes: dict, text_model_types: tuple) -> Qwen3_5Reference:
    """transformers' model of the checkpoint: ``classes["causal_lm"]`` for a text-only one."""
    import transformers

    cfg = json.loads((Path(ref_dir) / "config.json").read_text())
    cls = getattr(transformers, classes["causal_lm" if cfg.get("model_type") in text_model_types else "vlm"])
    return Qwen3_5Reference(cls.from_pretrained(ref_dir, dtype=torch_dtype(dtype)).eval(), ref_dir)


TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]
TINY_NOT_SPECIAL = ["<think>", "</think>"]   # Qwen decodes these even with skip_special_tokens
# transformers' Qwen3_5Tokenizer pre-tokenizer pattern
PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# CLIP mean/std (not 0.5, so a processor that ignores the file shows), and a pixel budget that
# keeps the tiny vision towers fast
TINY_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    "resample": 3, "rescale_factor": 1 / 255,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "size": {"shortest_edge": 4096, "longest_edge": 131072},
}
# the real file's keys (Qwen3VLVideoProcessor) with a small pixel budget over all sampled frames
TINY_VIDEO_PREPROCESSOR = {
    "video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor",
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    "resample": 3, "rescale_factor": 1 / 255, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "fps": 2, "min_frames": 4, "max_frames": 768,
    "size": {"shortest_edge": 4096, "longest_edge": 16 * 64 * 64},
}
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
                   spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                   hidden_act="gelu_pytorch_tanh")


def qwen_tokenizer(vocab_size: int = 400):
    """A small byte-level BPE with Qwen's special tokens and pre-tokenizer, trained on CORPUS."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=TINY_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TINY_NOT_SPECIAL])
    return tok


def save_qwen_tokenizer(tok, folder) -> dict:
    """tokenizer.json, tokenizer_config.json, the chat template, generation and preprocessor configs;
    returns the special token ids."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>", "add_bos_token": False, "clean_up_tokenization_spaces": False,
           "model_max_length": 262144, "errors": "replace", "split_special_tokens": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    ids = {name: tok.token_to_id(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("im_end", "<|im_end|>"), ("endoftext", "<|endoftext|>"))}
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids["im_end"], ids["endoftext"]], "pad_token_id": ids["endoftext"]}))
    (folder / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=1))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(TINY_VIDEO_PREPROCESSOR, indent=1))
    return ids


def _mrope_section(head_dim: int, partial: float = 0.25) -> list[int]:
    """Split the rotary frequencies over T/H/W like the real [11, 11, 10] (sum = rotary dim / 2)."""
    n = int(head_dim * partial) // 2
    h = w = n * 11 // 32 or 1
    return [n - h - w, h, w]


def tiny_text_config(vocab_size: int, **overrides) -> dict:
    hd = overrides.get("head_dim", 64)
    interval = overrides.pop("full_attention_interval", 4)
    cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=2, num_key_value_heads=1, head_dim=hd,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=24, linear_conv_kernel_dim=4, max_position_embeddings=4096,
               rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=None,
               rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                "mrope_section": _mrope_section(hd), "mrope_interleaved": True,
                                "partial_rotary_factor": 0.25})
    cfg.update(overrides)
    n = cfg["num_hidden_layers"]
    cfg.setdefault("layer_types", ["linear_attention" if (i + 1) % interval else "full_attention"
                                   for i in range(n)])
    return cfg


def _init_gdn(model, seed: int):
    """Decays from slow to fast (A in [0.05, 2], dt_bias around 0), as trained models have them;
    the generic init would give every head about the same decay."""
    import torch

    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 2.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


# one chat turn of the tiny trainers: a user sentence answered by the next, after an empty think block
CHAT_TURN = "<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n{answer}<|im_end|>\n"


def train_chat(model, tok, steps: int, seed: int = 0):
    """Brief training on chat-formatted CORPUS turns (user: a sentence; assistant: the next one,
    after an empty think block): peaked logits on the prompts the tests render."""
    ids = chat_ids(tok, CHAT_TURN)
    return train_briefly(model, tok, steps, seed, ids=ids, lr=1e-2)


def train_mtp(model, block, tok, steps: int, seed: int = 0, lr: float = 1e-2, window: int = 64):
    """Brief training of the MTP ``block`` alone (the main model frozen) on the chat turns
    ``train_chat`` uses: row i of a window predicts token i+2 from token i+1 and the main model's
    final hidden state at i. Seeded and on one torch thread: the same weights every run."""
    import torch
    import torch.nn.functional as F

    data = torch.tensor(chat_ids(tok, CHAT_TURN))
    base, embed, head = model.model, model.get_input_embeddings(), model.lm_head.weight.detach()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed + 3000)
    opt = torch.optim.AdamW(block.parameters(), lr=lr)
    block.train()
    try:
        for _ in range(steps):
            starts = torch.randint(0, len(data) - window - 1, (8,), generator=g)
            x = torch.stack([data[s:s + window + 2] for s in starts])
            with torch.no_grad():
                if hasattr(base, "rope_deltas"):
                    base.rope_deltas = None
                hidden = base(input_ids=x[:, :window]).last_hidden_state
                e = embed(x[:, 1:window + 1])
            pos = torch.arange(window)[None, None].expand(3, x.shape[0], window)
            logits = F.linear(block(e, hidden, pos), head)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 2:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return block.eval()


def _add_tensors(folder: Path, tensors: dict):
    """Write ``tensors`` into the checkpoint's model.safetensors beside the model's own."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    if not path.is_file():
        raise ValueError(f"{folder}: no single model.safetensors to add the MTP tensors to")
    t = load_file(str(path))
    t.update(tensors)
    save_file(t, str(path), metadata={"format": "pt"})


def make_tiny(folder, seed: int = 0, dtype: str = "fp32", init_scale: float = 0.15, train_steps: int = 0,
              vision: dict | None = None, tie_word_embeddings: bool = True, text_only: bool = False,
              classes: dict | None = None, mtp: bool = False, mtp_train_steps: int = 0, **text_overrides) -> Path:
    """``classes``: the transformers class names (``HF_CLASSES``) of the model to build. ``mtp``:
    the checkpoint also holds a multi-token-prediction block (``mtp.*`` in model.safetensors,
    ``mtp_num_hidden_layers: 1``; transformers ignores it), random, or trained for
    ``mtp_train_steps`` steps on the main model's hidden states (``train_mtp``; implies ``mtp``).
    The main model's weights do not depend on ``mtp``."""
    import torch
    import transformers

    names = classes or HF_CLASSES
    (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig) = (
        getattr(transformers, names[k]) for k in ("config", "causal_lm", "vlm", "text_config"))

    folder = Path(folder)
    tok = qwen_tokenizer()
    ids = save_qwen_tokenizer(tok, folder)
    # a bigger vocabulary than the tokenizer's (a real model's shape): rows no token reaches
    vocab = text_overrides.pop("vocab_size", tok.get_vocab_size())
    tc = tiny_text_config(vocab, tie_word_embeddings=tie_word_embeddings, **text_overrides)
    tc["eos_token_id"] = ids["im_end"]
    mtp = mtp or mtp_train_steps > 0
    if mtp:
        tc["mtp_num_hidden_layers"] = 1
    torch.manual_seed(seed)
    if text_only:
        (folder / "preprocessor_config.json").unlink()
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**tc)).eval()
    else:
        vc = dict(TINY_VISION, out_hidden_size=tc["hidden_size"], **(vision or {}))
        cfg = Qwen3_5Config(text_config=tc, vision_config=vc, tie_word_embeddings=tie_word_embeddings,
                            **{k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                   "vision_end_token_id")})
        model = Qwen3_5ForConditionalGeneration(cfg).eval()
    model = init_random(model, seed, init_scale)
    _init_gdn(model, seed)
    if train_steps:
        model = train_chat(model, tok, train_steps, seed)
    block = None
    if mtp:
        from ..references import qwen3_5_mtp

        text_config = getattr(model.config, "text_config", model.config)
        block = qwen3_5_mtp.init_random(qwen3_5_mtp.Qwen3_5Mtp(text_config, qwen3_5_mtp.is_moe(text_config)),
                                        seed + 2000, init_scale)
        if mtp_train_steps:
            block = train_mtp(model, block, tok, mtp_train_steps, seed)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
        block = block.to(torch.bfloat16) if block is not None else None
    model.save_pretrained(folder)
    if block is not None:
        _add_tensors(folder, block.state_dict_for_checkpoint())
    return folder


class Qwen3_5Verification(FamilyVerification):
    tiny_variants = {
        # Hv = 2 Hk, tied, L L L F, attention head 64, GQA 2:1
        "hv2hk-tied-i4-hd64": dict(),
        # Hv = Hk, untied, L F L F, head 128, Dk = Dv, deeper vision
        "hvhk-untied-i2-hd128": dict(linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
                                     head_dim=128, num_attention_heads=4, num_key_value_heads=2,
                                     full_attention_interval=2, tie_word_embeddings=False,
                                     vision=dict(depth=3, hidden_size=48, num_heads=3, intermediate_size=80)),
        # head 256, L L F, Dk > Dv, no GQA, wider hidden
        "hd256-i3": dict(head_dim=256, num_hidden_layers=3, full_attention_interval=3, hidden_size=96,
                         intermediate_size=128, num_key_value_heads=2, linear_key_head_dim=32,
                         linear_value_head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2),
    }

    def reference(self, ref_dir, dtype="fp32"):
        return load_reference(ref_dir, dtype, HF_CLASSES, TextArgs.text_model_types)

    def make_tiny(self, folder, variant=None, seed=0, dtype="fp32", train_steps=0, mtp=False, mtp_train_steps=0,
                  **overrides) -> Path:
        """A random (or briefly trained) Qwen3_5ForConditionalGeneration with the real chat template;
        overrides are text_config kwargs (plus ``full_attention_interval``, ``vision`` for the
        vision_config, ``text_only`` for a Qwen3_5ForCausalLM checkpoint); ``mtp``/``mtp_train_steps``
        add the multi-token-prediction block (``make_tiny``)."""
        return make_tiny(folder, seed, dtype, train_steps=train_steps, classes=HF_CLASSES, mtp=mtp,
                         mtp_train_steps=mtp_train_steps, **{**self.variant(variant), **overrides})


VERIFY = Qwen3_5Verification()
