"""transformers' side of the Qwen3.5 tests: the processor (input_ids and pixel tensors exactly as
transformers makes them) and its own greedy ``generate``. Tiny checkpoints come from the
verification wing (``edgevl.verification.families.qwen3_5``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from edgevl.verification.families.qwen3_5 import VERIFY


def make_qwen3_5(folder, seed: int = 0, dtype: str = "fp32", train_steps: int = 0, variant: str = "",
                 **overrides) -> Path:
    return VERIFY.make_tiny(Path(folder), variant, seed=seed, dtype=dtype, train_steps=train_steps, **overrides)


def load_hf(folder):
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def hf_processor(folder):
    """transformers' Qwen3VLProcessor from the checkpoint's image processor (its default
    torchvision class, rebuilt without torchvision by the verification wing) and tokenizer, with
    the checkpoint's chat template."""
    from transformers import AutoTokenizer, Qwen3VLProcessor

    from edgevl.verification.reference import qwen_image_processor

    folder = Path(folder)
    cfg = json.loads((folder / "preprocessor_config.json").read_text())
    ip = qwen_image_processor(**{k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")})
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
    model.model.rope_deltas = None
    with torch.no_grad():
        out = model.generate(**enc, generation_config=gc, max_new_tokens=n, do_sample=False, num_beams=1)
    toks = out[0, enc["input_ids"].shape[1]:].tolist()
    assert len(toks) == n, f"transformers stopped after {len(toks)} of {n} tokens"
    return toks
