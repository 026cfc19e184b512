"""Small checkpoints with random weights in a family's real layout, written without torch (numpy,
tokenizers, Pillow): to try what the shipped demo model cannot show, offline — video, speculative
decoding with an MTP block, the server — on a plain ``pip install edgevl``. Their answers are noise.

    edgevl random-model qwen3_5 OUT [--seed N] [--clip CLIP.gif]

A Qwen3.5 checkpoint here is what ``Qwen3_5ForConditionalGeneration.save_pretrained`` writes for a
tiny config (tests/cli/test_random_model.py compares the two), plus the ``mtp.*`` block a real
checkpoint carries: config.json, bf16 model.safetensors, a byte-level tokenizer with Qwen's special
tokens and pre-tokenizer, the real chat template, generation and (video) preprocessor configs.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path

import numpy as np

from .errors import EdgevlError

# ---------------------------------------------------------------------------------------------
# files


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounded to nearest even as torch rounds."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path: Path, tensors: dict) -> None:
    """``tensors`` (name -> float32 array) as one bf16 safetensors file, names sorted as
    safetensors writes them."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        data = to_bf16(tensors[name]).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)   # the format pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for b in blobs:
            f.write(b)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# Qwen's pre-tokenizer pattern (its tokenizer.json, and transformers' Qwen3_5Tokenizer)
QWEN_PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]
QWEN_NOT_SPECIAL = ["<think>", "</think>"]   # Qwen decodes these even when skipping special tokens


# what the tokenizer is trained on: its merges make the (random) answers mostly words
CORPUS = [
    "A red disc moves from the left of the frame to the right over a pale background.",
    "The video shows a small circle crossing the picture; nothing else changes in the scene.",
    "What happens in this video? Describe the image in one sentence. How many shapes are there?",
    "There are two blue squares at the top and a green triangle below them, next to a yellow star.",
    "The camera follows a person walking along the street, then turns towards the old stone bridge.",
    "Count the objects on the table: three cups, a plate, one bottle of water and some bread.",
    "It is a sunny day in the park; children are playing football while their parents watch.",
    "First the light turns green, then the cars start moving and a bus stops at the corner.",
    "The answer is noise: these weights are random, so the words follow no meaning at all.",
    "Numbers like 12, 345 and 2026 are split into single digits; code such as print(x) too.",
]


def byte_level_tokenizer(pattern: str, specials: list, added: list, vocab_size: int):
    """A byte-level BPE (any text encodes) trained on ``CORPUS`` up to ``vocab_size`` entries or
    as many merges as it has, then the special and the added tokens. Training is deterministic."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tok


# ---------------------------------------------------------------------------------------------
# Qwen3.5

# the shape: 4 decoder layers (3 Gated DeltaNet, 1 gated attention), a 2-block vision tower, one MTP
# layer; every head count and ratio of the real models (GQA, value heads = 2 x key heads, partial
# rotary with M-RoPE sections), at widths that convert and run in a second
QWEN_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4,
                 max_position_embeddings=4096, full_attention_interval=4)
QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
                   spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                   hidden_act="gelu_pytorch_tanh")
# the real processors' keys and mean/std, with pixel budgets that keep the tiny tower fast
QWEN_IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True, "resample": 3,
    "rescale_factor": 1 / 255, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "size": {"shortest_edge": 4096, "longest_edge": 131072},
}
QWEN_VIDEO_PROCESSOR = {
    "video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor",
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True, "resample": 3,
    "rescale_factor": 1 / 255, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "fps": 2, "min_frames": 4, "max_frames": 768,
    "size": {"shortest_edge": 4096, "longest_edge": 65536},
}


def _qwen_config(ids: dict, vocab_size: int) -> dict:
    t = dict(QWEN_TEXT, vocab_size=vocab_size)
    interval = t.pop("full_attention_interval")
    n_rot = int(t["head_dim"] * 0.25) // 2            # rotary frequencies, split T/H/W as the real 11/11/10
    hw = n_rot * 11 // 32 or 1
    text = {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": ids["im_end"],
            "hidden_act": "silu", "initializer_range": 0.02,
            "layer_types": ["linear_attention" if (i + 1) % interval else "full_attention"
                            for i in range(t["num_hidden_layers"])],
            "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1, "pad_token_id": None, "rms_norm_eps": 1e-6,
            "rope_parameters": {"mrope_interleaved": True, "mrope_section": [n_rot - 2 * hw, hw, hw],
                                "partial_rotary_factor": 0.25, "rope_theta": 10000000.0, "rope_type": "default"},
            "tie_word_embeddings": True, "use_cache": True, **t}
    vision = {"initializer_range": 0.02, "model_type": "qwen3_5_vision", "out_hidden_size": t["hidden_size"],
              "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"}, **QWEN_VISION}
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "dtype": "bfloat16", "model_type": "qwen3_5",
            "image_token_id": ids["image"], "video_token_id": ids["video"],
            "vision_start_token_id": ids["vision_start"], "vision_end_token_id": ids["vision_end"],
            "tie_word_embeddings": True, "text_config": dict(sorted(text.items())),
            "vision_config": dict(sorted(vision.items()))}


def _qwen_shapes(cfg: dict) -> dict:
    """name -> shape of every tensor: transformers' names for the model, ``mtp.*`` for the block."""
    t, v = cfg["text_config"], cfg["vision_config"]
    H, I, hd = t["hidden_size"], t["intermediate_size"], t["head_dim"]
    nh, nkv = t["num_attention_heads"], t["num_key_value_heads"]
    hk, hv, dk, dv = (t["linear_num_key_heads"], t["linear_num_value_heads"], t["linear_key_head_dim"],
                      t["linear_value_head_dim"])
    conv = 2 * hk * dk + hv * dv

    def mlp_and_norms(p):
        return {f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,),
                f"{p}.mlp.gate_proj.weight": (I, H), f"{p}.mlp.up_proj.weight": (I, H),
                f"{p}.mlp.down_proj.weight": (H, I)}

    def attention(p):
        return {f"{p}.self_attn.q_proj.weight": (2 * nh * hd, H), f"{p}.self_attn.k_proj.weight": (nkv * hd, H),
                f"{p}.self_attn.v_proj.weight": (nkv * hd, H), f"{p}.self_attn.o_proj.weight": (H, nh * hd),
                f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,)}

    lm = "model.language_model"
    s = {f"{lm}.embed_tokens.weight": (t["vocab_size"], H), f"{lm}.norm.weight": (H,)}
    for i, kind in enumerate(t["layer_types"]):
        p = f"{lm}.layers.{i}"
        s.update(mlp_and_norms(p))
        if kind == "full_attention":
            s.update(attention(p))
        else:
            a = f"{p}.linear_attn"
            s.update({f"{a}.A_log": (hv,), f"{a}.dt_bias": (hv,),
                      f"{a}.conv1d.weight": (conv, 1, t["linear_conv_kernel_dim"]),
                      f"{a}.in_proj_qkv.weight": (conv, H), f"{a}.in_proj_z.weight": (hv * dv, H),
                      f"{a}.in_proj_b.weight": (hv, H), f"{a}.in_proj_a.weight": (hv, H),
                      f"{a}.norm.weight": (dv,), f"{a}.out_proj.weight": (H, hv * dv)})
    W, VI, m2 = v["hidden_size"], v["intermediate_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2
    vis = "model.visual"
    s.update({f"{vis}.patch_embed.proj.weight": (W, v["in_channels"], v["temporal_patch_size"], v["patch_size"],
                                                 v["patch_size"]),
              f"{vis}.patch_embed.proj.bias": (W,), f"{vis}.pos_embed.weight": (v["num_position_embeddings"], W),
              f"{vis}.merger.norm.weight": (W,), f"{vis}.merger.norm.bias": (W,),
              f"{vis}.merger.linear_fc1.weight": (m2, m2), f"{vis}.merger.linear_fc1.bias": (m2,),
              f"{vis}.merger.linear_fc2.weight": (v["out_hidden_size"], m2),
              f"{vis}.merger.linear_fc2.bias": (v["out_hidden_size"],)})
    for j in range(v["depth"]):
        b = f"{vis}.blocks.{j}"
        for name, shape in (("attn.qkv", (3 * W, W)), ("attn.proj", (W, W)), ("mlp.linear_fc1", (VI, W)),
                            ("mlp.linear_fc2", (W, VI))):
            s[f"{b}.{name}.weight"], s[f"{b}.{name}.bias"] = shape, shape[:1]
        for norm in ("norm1", "norm2"):
            s[f"{b}.{norm}.weight"], s[f"{b}.{norm}.bias"] = (W,), (W,)
    # the multi-token-prediction block: fc over [embedding | hidden], one attention layer, norms
    s.update({"mtp.fc.weight": (H, 2 * H), "mtp.norm.weight": (H,), "mtp.pre_fc_norm_embedding.weight": (H,),
              "mtp.pre_fc_norm_hidden.weight": (H,)})
    s.update(mlp_and_norms("mtp.layers.0"))
    s.update(attention("mtp.layers.0"))
    return s


def _random_weights(shapes: dict, seed: int) -> dict:
    """Seeded, well-conditioned random values: norm gains near 1 (not exactly, so a misread shows),
    small biases, the delta rule's decays spread from slow to fast as trained models have them."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("A_log"):
            x = np.log(rng.uniform(0.05, 2.0, shape))
        elif name.endswith("dt_bias"):
            x = 0.5 * rng.standard_normal(shape)
        elif "norm" in name and name.endswith("weight"):
            x = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("bias"):
            x = 0.05 * rng.standard_normal(shape)
        else:
            x = 0.15 * rng.standard_normal(shape)
        out[name] = x.astype(np.float32)
    return out


def write_qwen3_5(out: Path, seed: int) -> None:
    from .models.qwen3_5.model import CHAT_TEMPLATE

    tok = byte_level_tokenizer(QWEN_PRETOKENIZE, QWEN_SPECIALS, QWEN_NOT_SPECIAL, 1024)
    tok.save(str(out / "tokenizer.json"))
    ids = {k: tok.token_to_id(t) for k, t in (("image", "<|image_pad|>"), ("video", "<|video_pad|>"),
                                              ("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>"),
                                              ("im_end", "<|im_end|>"), ("endoftext", "<|endoftext|>"))}
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": QWEN_TEXT["max_position_embeddings"], "errors": "replace", "split_special_tokens": False})
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    write_json(out / "generation_config.json", {"eos_token_id": [ids["im_end"], ids["endoftext"]],
                                                "pad_token_id": ids["endoftext"]})
    write_json(out / "preprocessor_config.json", QWEN_IMAGE_PROCESSOR)
    write_json(out / "video_preprocessor_config.json", QWEN_VIDEO_PROCESSOR)
    # rows up to a multiple of 8 (real checkpoints pad theirs too); few, as no token reaches them
    cfg = _qwen_config(ids, -(-tok.get_vocab_size() // 8) * 8)
    write_json(out / "config.json", cfg)
    weights = _random_weights(_qwen_shapes(cfg), seed)
    # A random head ends a turn or opens <think> anywhere, often within a few tokens, and lone
    # UTF-8 fragments print as U+FFFD: those rows of the tied embedding are made small, so the
    # noise is words and runs long enough to draft.
    n_text = min(ids.values())    # the special and added tokens follow the trained ones
    quiet = [i for i in range(cfg["text_config"]["vocab_size"]) if i >= n_text or "\ufffd" in tok.decode([i])]
    weights["model.language_model.embed_tokens.weight"][quiet] *= 0.05
    write_safetensors(out / "model.safetensors", weights)
    n = sum(math.prod(s) for s in _qwen_shapes(cfg).values())
    (out / "README.md").write_text(
        f"# Random Qwen3.5 ({n / 1e6:.2f} M parameters)\n\nRandom weights (seed {seed}) in Qwen3.5's checkpoint "
        "layout, with a vision tower and a multi-token-prediction block, written by `edgevl random-model`. Its "
        "answers are noise: it is for trying edgevl's pipeline (video, speculative decoding, the server) offline.\n")


WRITERS = {"qwen3_5": write_qwen3_5}


# ---------------------------------------------------------------------------------------------
# a clip to go with it


def write_clip(path: Path, frames: int = 8, size: int = 128, frame_ms: int = 250) -> None:
    """An animated GIF of a disc crossing a plain background (2 s at the defaults)."""
    from PIL import Image, ImageDraw

    images = []
    for k in range(frames):
        im = Image.new("RGB", (size, size), (235, 235, 225))
        x = 8 + (size - 48) * k // max(1, frames - 1)
        ImageDraw.Draw(im).ellipse((x, size // 2 - 16, x + 32, size // 2 + 16), fill=(200, 40, 40))
        images.append(im)
    images[0].save(path, save_all=True, append_images=images[1:], duration=frame_ms, loop=0)


def check_clip_path(clip) -> None:
    if clip is None:
        return
    p = Path(clip)
    if p.suffix.lower() != ".gif":
        raise EdgevlError(f"--clip {clip}: the clip is an animated GIF; name it with .gif")
    if p.exists():
        raise EdgevlError(f"--clip {clip} already exists; remove it or pick another name")
    if not p.parent.is_dir():
        raise EdgevlError(f"--clip {clip}: the folder {p.parent} does not exist; create it first")


def write(family: str, out, seed: int = 0, clip=None) -> Path:
    """Write a random checkpoint of ``family`` to the new folder ``out`` (and a clip to ``clip``);
    returns ``out``. Written beside it first: an interrupted run leaves no half checkpoint."""
    if family not in WRITERS:
        raise EdgevlError(f"no random checkpoint for {family!r}; there is one for: {', '.join(WRITERS)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise EdgevlError(f"seed must be an integer >= 0, got {seed!r:.40}")
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise EdgevlError(f"{out} already exists; remove it or pick another folder (nothing is overwritten)")
    if not out.absolute().parent.is_dir():
        raise EdgevlError(f"{out}: the folder {out.absolute().parent} does not exist; create it first")
    check_clip_path(clip)
    part = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir()
    try:
        WRITERS[family](part, seed)
        part.rename(out)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    if clip is not None:
        write_clip(Path(clip))
    return out
