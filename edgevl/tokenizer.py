"""The checkpoint's own tokenizer (``tokenizer.json`` via `tokenizers`) and chat template (jinja2).

Chat templates render the way transformers renders them (sandboxed jinja, trim_blocks,
lstrip_blocks, ``raise_exception``), from ``chat_template.jinja``, ``chat_template.json`` or
``tokenizer_config.json``; a checkpoint without one gets its architecture's built-in template.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from .errors import EdgevlError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.json", "chat_template.jinja", "generation_config.json")

def _raise(msg):
    raise EdgevlError(f"chat template error: {msg}")


def _load_template(folder: Path, tok_cfg: dict) -> str | None:
    p = folder / "chat_template.jinja"
    if p.is_file():
        return p.read_text()
    p = folder / "chat_template.json"
    if p.is_file():
        t = json.loads(p.read_text()).get("chat_template")
        if t:
            return t
    t = tok_cfg.get("chat_template")
    if isinstance(t, list):  # named templates: take "default"
        t = next((x["template"] for x in t if x.get("name") == "default"), None)
    return t or None


def _token_text(v):
    if isinstance(v, dict):
        return v.get("content")
    return v


class Tokenizer:
    def __init__(self, folder, fallback_template: str | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        self.folder = Path(folder)
        path = self.folder / "tokenizer.json"
        if not path.is_file():
            raise EdgevlError(f"{self.folder} has no tokenizer.json; edgevl needs the checkpoint's "
                              "fast tokenizer file next to config.json")
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise EdgevlError(f"{path} could not be read ({e}); re-download it") from None
        cfg_path = self.folder / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template = _load_template(self.folder, self.config) or fallback_template
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self._env = None

    # -- ids ----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(int(i))

    def encode(self, text: str) -> list[int]:
        # Templates already carry BOS (spec §9): never add special tokens here.
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- chat ---------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise EdgevlError("this checkpoint has no chat template; pass a plain prompt with raw=True "
                              "(or add chat_template.jinja to the model folder)")
        if self._env is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
            self._env = env.from_string(self.chat_template)
        try:
            return self._env.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except EdgevlError:
            raise
        except Exception as e:
            raise EdgevlError(f"the chat template failed to render these messages ({e})") from None


class StreamDecoder:
    """Incremental detokenizer: emits text only once it is complete UTF-8.

    Byte-level BPE splits multi-byte characters (CJK, emoji) across tokens; decoding a token
    alone gives U+FFFD. We re-decode a short window and hold back text ending in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.t, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0   # start of the decode window
        self.read = 0     # ids before this are already emitted

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prev = self.t.decode(self.ids[self.prefix:self.read], self.skip)
        cur = self.t.decode(self.ids[self.prefix:], self.skip)
        if len(cur) > len(prev) and not cur.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return cur[len(prev):]
        return ""

    def flush(self) -> str:
        """The rest; a character cut off by the end of generation is dropped, not shown as U+FFFD."""
        prev = self.t.decode(self.ids[self.prefix:self.read], self.skip)
        cur = self.t.decode(self.ids[self.prefix:], self.skip)
        self.prefix = self.read = len(self.ids)
        return cur[len(prev):].rstrip("\ufffd")
