"""Tiny random Qwen3.5 checkpoints with the real layout: transformers' own
``Qwen3_5ForConditionalGeneration``, a small byte-level BPE with Qwen's special tokens and
pre-tokenizer, the real Qwen3.5 chat template (tests/data, byte-identical to the checkpoints'
``chat_template.jinja``), generation and preprocessor configs — saved with save_pretrained."""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path

import numpy as np

from helpers import CORPUS, init_random, train_briefly

DATA = Path(__file__).parent / "data"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
NOT_SPECIAL = ["<think>", "</think>"]   # Qwen decodes these even with skip_special_tokens
# transformers' Qwen3_5Tokenizer pre-tokenizer pattern
PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# preprocessor_config.json of the tiny checkpoints: CLIP mean/std (not 0.5, so a processor that
# ignores the file shows), and a pixel budget that keeps the tiny vision towers fast.
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    "resample": 3, "rescale_factor": 1 / 255,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "size": {"shortest_edge": 4096, "longest_edge": 131072},
}


@lru_cache(maxsize=2)
def qwen_tokenizer(vocab_size: int = 400):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NOT_SPECIAL])
    return tok


def save_qwen_tokenizer(tok, folder) -> dict:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>", "add_bos_token": False, "clean_up_tokenization_spaces": False,
           "model_max_length": 262144, "errors": "replace", "split_special_tokens": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "chat_template.jinja").write_bytes((DATA / "qwen3_5_chat_template.jinja").read_bytes())
    ids = {name: tok.token_to_id(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("im_end", "<|im_end|>"), ("endoftext", "<|endoftext|>"))}
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids["im_end"], ids["endoftext"]], "pad_token_id": ids["endoftext"]}))
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
    return ids


def _mrope_section(head_dim: int, partial: float = 0.25) -> list[int]:
    """Split the rotary frequencies over T/H/W like the real [11, 11, 10] (sum = rotary dim / 2)."""
    n = int(head_dim * partial) // 2
    h = w = n * 11 // 32 or 1
    return [n - h - w, h, w]


def text_config(vocab_size: int, **overrides) -> dict:
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


VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
              hidden_act="gelu_pytorch_tanh")


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


def train_chat(model, tok, steps: int, seed: int = 0):
    """Brief training on chat-formatted CORPUS turns (user: a sentence; assistant: the next one):
    peaked logits on the prompts the tests render (a model trained on plain text stays flat
    after the template's tokens, where bf16 rounding then flips near-ties in transformers too)."""
    sents = CORPUS[: len(CORPUS) // 4]
    ids = []
    for i, s in enumerate(sents):
        ids += tok.encode(f"<|im_start|>user\n{s}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
                          f"{sents[(i + 1) % len(sents)]}<|im_end|>\n").ids
    return train_briefly(model, tok, steps, seed, ids=ids, lr=1e-2)


def make_qwen3_5(folder, seed: int = 0, dtype: str = "fp32", init_scale: float = 0.15, train_steps: int = 0,
                 vision: dict | None = None, tie_word_embeddings: bool = True, **text_overrides) -> Path:
    """A random (or briefly trained) Qwen3_5ForConditionalGeneration; overrides are text_config
    kwargs (plus ``full_attention_interval``), ``vision`` overrides vision_config."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    folder = Path(folder)
    tok = qwen_tokenizer()
    ids = save_qwen_tokenizer(tok, folder)
    tc = text_config(tok.get_vocab_size(), tie_word_embeddings=tie_word_embeddings, **text_overrides)
    tc["eos_token_id"] = ids["im_end"]
    vc = dict(VISION, out_hidden_size=tc["hidden_size"], **(vision or {}))
    cfg = Qwen3_5Config(text_config=tc, vision_config=vc, tie_word_embeddings=tie_word_embeddings,
                        **{k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                               "vision_end_token_id")})
    torch.manual_seed(seed)
    model = init_random(Qwen3_5ForConditionalGeneration(cfg).eval(), seed, init_scale)
    _init_gdn(model, seed)
    if train_steps:
        model = train_chat(model, tok, train_steps, seed)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def load_hf(folder):
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def hf_processor(folder):
    """transformers' Qwen3VLProcessor from the checkpoint's image processor (PIL backend: no
    torchvision here) and tokenizer, with the checkpoint's chat template."""
    from transformers import AutoTokenizer, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = Path(folder)
    cfg = json.loads((folder / "preprocessor_config.json").read_text())
    ip = Qwen2VLImageProcessorPil(**{k: v for k, v in cfg.items()
                                      if k not in ("image_processor_type", "processor_class")})
    tok = AutoTokenizer.from_pretrained(folder)

    class Processor(Qwen3VLProcessor):
        # the class check looks up the video processor mapping, which needs torchvision
        def check_argument_for_proper_class(self, name, arg):
            return None

    return Processor(image_processor=ip, tokenizer=tok, chat_template=(folder / "chat_template.jinja").read_text())


def hf_inputs(processor, messages, images=None, enable_thinking=None):
    """input_ids (list) and the processor's tensors, exactly as transformers makes them."""
    kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    enc = processor(text=[text], images=images or None, return_tensors="pt")
    return enc["input_ids"][0].tolist(), enc


def hf_greedy(model, enc, n: int) -> list[int]:
    """transformers' greedy tokens (its own generate: chunked prefill, recurrent decode, M-RoPE
    deltas), no early stop."""
    import torch

    gc = copy.deepcopy(model.generation_config)
    # no early stop and no eos suppression: an eos id no model can produce (None falls back to
    # the config's eos, an empty list fails inside generate)
    gc.eos_token_id = [10 ** 9]
    with torch.no_grad():
        out = model.generate(**enc, generation_config=gc, max_new_tokens=n, do_sample=False, num_beams=1)
    toks = out[0, enc["input_ids"].shape[1]:].tolist()
    assert len(toks) == n, f"transformers stopped after {len(toks)} of {n} tokens"
    return toks


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


# ---------------------------------------------------------------------------------------------
# package side: conversion and a small test-side runner (the Model wiring comes with the protocol)


def convert_package(ck, out, dtype: str = "fp32") -> Path:
    """qwen3_5.convert into ``out`` with the checkpoint's tokenizer/config files and a manifest."""
    import shutil

    from edgevl.models import qwen3_5
    from edgevl.tokenizer import TOKENIZER_FILES
    from edgevl.weights import Checkpoint

    out = Path(out)
    if (out / "manifest.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpoint(ck)
    parts = qwen3_5.convert(ckpt, out, dtype, lambda t: None)
    for name in TOKENIZER_FILES + ("config.json", "preprocessor_config.json"):
        if (Path(ck) / name).is_file():
            shutil.copy2(Path(ck) / name, out / name)
    (out / "manifest.json").write_text(json.dumps({"architecture": "qwen3_5", "dtype": dtype,
                                                   "config": ckpt.config, **parts}))
    return out


class Runner:
    """Embedding + vision + decoder driver + lm_head of a converted package, and a greedy loop."""

    def __init__(self, pk, threads: int = 1, light_mode: bool = True):
        from edgevl.models import gated_delta as gd
        from edgevl.models import qwen3_5 as q
        from edgevl.runtime import Embedding, LMHead, Net

        pk = Path(pk)
        self.path = pk
        m = self.manifest = json.loads((pk / "manifest.json").read_text())
        gr = m["graphs"]
        dt = "bf16" if m["dtype"] in ("bf16", "q8") else m["dtype"]

        def net(name, dtype=dt, light=True):
            return Net(str(pk / f"{name}.param"), str(pk / f"{name}.bin"), threads, dtype, light)

        core = gd.DeltaRuleCore.open(pk, gr["gdn_step"], gr["gdn_chunk"], threads)
        self.decoder = q.Decoder(net("decoder", light=light_mode), gr["decoder"], core)
        self.head = LMHead(net("lm_head"), gr["lm_head"])
        e = m["embedding"]
        self.embedding = Embedding(str(pk / e["file"]), e["segments"], e["rows"], e["dim"], e["dtype"])
        self.vision = q.VisionEncoder(net("vision", light=light_mode), gr["vision"], pk) if "vision" in gr else None
        self.image_token_id = m.get("image_token_id")

    def encode_images(self, images):
        rows, infos = [], []
        for im in images or []:
            r, info = self.vision(im)
            rows.append(r)
            infos.append(info)
        return rows, infos

    def embed(self, ids, rows=()):
        x = self.embedding(ids)
        if rows:
            x[np.asarray(ids) == self.image_token_id] = np.concatenate(rows, 0)
        return x

    def positions(self, ids, infos=()):
        from edgevl.models import qwen3_5 as q

        merge = self.vision.v.spatial_merge_size if self.vision else 2
        return q.rope_positions(ids, [i["grid_thw"] for i in infos], self.image_token_id, merge)

    def prefill(self, ids, images=(), cache=None, start: int = 0, extract=()):
        """Prefill ``ids[start:]`` on top of ``cache`` (positions from the whole prompt)."""
        rows, infos = self.encode_images(images)
        cache = cache if cache is not None else self.decoder.new_cache()
        x = self.embed(ids, rows)
        pos = self.positions(ids, infos)
        hidden, extras = self.decoder.forward(x[start:], cache, pos[:, start:], extract)
        return self.head(hidden[-1:])[0], cache, extras

    def step(self, token, cache):
        from edgevl.models import qwen3_5 as q

        hidden, _ = self.decoder.forward(self.embedding([token]), cache, q.decode_positions(cache))
        return self.head(hidden)[0]

    def greedy(self, ids, n, images=(), cache=None, start: int = 0) -> list[int]:
        logits, cache, _ = self.prefill(ids, images, cache, start)
        out = []
        for i in range(n):
            out.append(int(np.argmax(logits)))
            if i + 1 < n:
                logits = self.step(out[-1], cache)
        self.last_cache = cache
        return out
