"""The checkpoint's own tokenizer (``tokenizer.json`` via `tokenizers`) and chat template (jinja2).

Chat templates render the way transformers renders them (sandboxed jinja, trim_blocks,
lstrip_blocks, ``raise_exception``), from the file transformers takes it from: ``chat_template.jinja``
first, then for a vision model (its processor's template) ``chat_template.json`` before
``tokenizer_config.json``, for a text model (its tokenizer's) the other way round; a checkpoint
without one gets its architecture's built-in template.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from .errors import EdgevlError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.json", "chat_template.jinja", "generation_config.json")


def one_system(messages: list) -> list:
    """Leading system (or developer) messages as one, their texts apart by a blank line: clients
    send several (an agent's instructions and the caller's; the Responses API's instructions and a
    developer item), which OpenAI takes, and some models' templates refuse a second one."""
    k = 0
    while k < len(messages) and isinstance(messages[k], dict) and messages[k].get("role") in ("system", "developer"):
        k += 1
    if k < 2:
        return messages
    texts = [m.get("content") for m in messages[:k]]
    if all(isinstance(t, str) for t in texts):
        content = "\n\n".join(texts)
    else:
        content = []
        for t in texts:
            if content:
                content.append({"type": "text", "text": "\n\n"})
            content += [{"type": "text", "text": t}] if isinstance(t, str) else list(t or [])
    return [{"role": "system", "content": content}, *messages[k:]]


def _raise(msg):
    raise EdgevlError(f"chat template error: {msg}")


def read_json_object(path: Path) -> dict:
    """A checkpoint JSON file that must hold an object, or a one-line error naming the file."""
    try:
        v = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:
        raise EdgevlError(f"{path} is not valid JSON ({e}); fix or re-download it") from None
    if not isinstance(v, dict):
        raise EdgevlError(f"{path} must be a JSON object, got a {type(v).__name__}; fix or re-download it")
    return v


def _load_template(folder: Path, tok_cfg: dict, processor: bool = True) -> str | None:
    """The checkpoint's template; ``processor``: read as a processor reads it (vision models'
    chat_template.json before tokenizer_config.json), else as a tokenizer does."""
    p = folder / "chat_template.jinja"
    if p.is_file():
        try:
            return p.read_text()
        except ValueError:
            raise EdgevlError(f"{p} is not UTF-8 text; fix or re-download it") from None

    def from_json():
        p = folder / "chat_template.json"
        t = read_json_object(p).get("chat_template") if p.is_file() else None
        if t and not isinstance(t, str):
            raise EdgevlError(f"{p}: chat_template must be a string; fix or re-download it")
        return t or None

    def from_config():
        t = tok_cfg.get("chat_template")
        if isinstance(t, list):  # named templates: take "default"
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        if t and not isinstance(t, str):
            raise EdgevlError(f"{folder / 'tokenizer_config.json'}: chat_template must be a string; fix or "
                              "re-download it")
        return t or None
    first, then = (from_json, from_config) if processor else (from_config, from_json)
    return first() or then()


def _token_text(v):
    if isinstance(v, dict):
        return v.get("content")
    return v


class Tokenizer:
    def __init__(self, folder, fallback_template: str | None = None, processor: bool = True):
        from tokenizers import Tokenizer as HFTokenizer

        self.folder = Path(folder)
        path = self.folder / "tokenizer.json"
        if not path.is_file():
            raise EdgevlError(f"{self.folder} has no tokenizer.json; edgevl needs the checkpoint's "
                              "fast tokenizer file next to config.json")
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception subclasses
            raise EdgevlError(f"{path} could not be read ({e}); re-download it") from None
        cfg_path = self.folder / "tokenizer_config.json"
        self.config = read_json_object(cfg_path) if cfg_path.is_file() else {}
        self.chat_template = _load_template(self.folder, self.config, processor) or fallback_template
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        for name in ("bos_token", "eos_token"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise EdgevlError(f"{cfg_path}: {name} must be a string; fix or re-download it")
        self._env = None
        self._plain = None  # a copy that reads special-token text as plain text (message contents)
        self._specials = None

    # -- ids ----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(int(i))

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of ``text``; ``special=False`` reads special-token text such as
        ``<|end_of_text|>`` as plain characters (for message contents: no forged turns)."""
        # Chat templates already carry BOS (the model docs' tokenizer sections): never add special tokens here.
        _check_text(text)
        if special:
            return self.tok.encode(text, add_special_tokens=False).ids
        if self._plain is None:
            from tokenizers import Tokenizer as HFTokenizer

            plain = HFTokenizer.from_str(self.tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids

    @property
    def special_tokens(self) -> list[str]:
        """The text of every special (control) token."""
        if self._specials is None:
            self._specials = [t.content for t in self.tok.get_added_tokens_decoder().values() if t.special]
        return self._specials

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, i: int) -> bytes | None:
        """The bytes token ``i`` stands for: its text, or, for a token that holds part of a
        character (byte-level BPE splits CJK and emoji), its bytes read from the vocabulary
        (the byte-level alphabet, or sentencepiece's ``<0xNN>``); None where neither gives them."""
        text = self.decode([i], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        piece = self.id_to_token(i) or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                return None
        table = _byte_decoder()
        return bytes(table[c] for c in piece) if piece and all(c in table for c in piece) else None

    # -- chat ---------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise EdgevlError("this checkpoint has no chat template, so chat messages cannot be rendered: send a "
                              "plain prompt (raw=True in the API, run --raw, POST /v1/completions), or add the "
                              "checkpoint's chat_template.jinja to its folder and convert again")
        self.compile_template()
        messages = one_system(messages)
        try:
            return self._env.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except EdgevlError:
            raise
        except Exception as e:  # noqa: BLE001 - a template can raise anything jinja2 or its code does
            raise EdgevlError(f"the chat template failed to render these messages ({e})") from None


    def compile_template(self) -> None:
        """Parse the chat template once (a broken one fails here: at convert time, not per request)."""
        if self._env is not None or not self.chat_template:
            return
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        try:
            self._env = env.from_string(self.chat_template)
        except TemplateError as e:
            where = f" at line {e.lineno}" if getattr(e, "lineno", None) else ""
            raise EdgevlError(f"the chat template of {self.folder} does not parse ({e.message}{where}); fix "
                              "chat_template.jinja (or tokenizer_config.json)") from None


_BYTES = None


def _byte_decoder() -> dict:
    """Byte-level BPE's alphabet read back: each of the 256 bytes is written as one printable
    character (the printable Latin-1 ones as themselves, the rest as U+0100 onwards, in order)."""
    global _BYTES
    if _BYTES is None:
        shown = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
        extra = iter(range(256, 512))
        _BYTES = {(chr(b) if b in shown else chr(next(extra))): b for b in range(256)}
    return _BYTES


def _check_text(text) -> None:
    if not isinstance(text, str):
        raise EdgevlError(f"text to tokenize must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise EdgevlError(f"the text contains invalid Unicode ({text[e.start]!r} at position {e.start}, a lone "
                          "surrogate); send valid UTF-8 text") from None


def _cut_character(b: bytes) -> bool:
    """Whether ``b`` ends in the first bytes of a UTF-8 character still missing its last ones
    (a lead byte and fewer continuation bytes than it announces)."""
    n = 0
    while n < min(3, len(b)) and 0x80 <= b[-1 - n] <= 0xBF:
        n += 1
    if n == len(b):
        return False
    lead = b[-1 - n]
    need = 2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF else 4 if 0xF0 <= lead <= 0xF4 else 0
    if n and not _SECOND.get(lead, (0x80, 0xBF))[0] <= b[-n] <= _SECOND.get(lead, (0x80, 0xBF))[1]:
        return False    # no character starts so (an overlong form, a surrogate): each byte is U+FFFD
    return n + 1 < need


# the second byte's range after the lead bytes that narrow it (UTF-8, RFC 3629)
_SECOND = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


class StreamDecoder:
    """Incremental detokenizer: emits text only once it is complete UTF-8.

    Byte-level BPE splits multi-byte characters (CJK, emoji) across tokens; decoding a token
    alone gives U+FFFD. We re-decode a short window and hold back text ending in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, keep=()):
        self.t, self.skip = tokenizer, skip_special_tokens
        # special tokens written out all the same (call tags a checkpoint marks special: the
        # answer's parser reads them from the text)
        self.drop = None
        keep = {int(i) for i in keep}
        if skip_special_tokens and keep:
            ids = {tokenizer.token_to_id(t) for t in tokenizer.special_tokens}
            if ids & keep:
                self.drop = ids - keep
        self.ids: list[int] = []
        self.prefix = 0   # start of the decode window
        self.read = 0     # ids before this are already emitted

    def _decode(self, ids) -> str:
        if self.drop is None:
            return self.t.decode(ids, self.skip)
        return self.t.decode([i for i in ids if i not in self.drop], False)

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prev = self._decode(self.ids[self.prefix:self.read])
        cur = self._decode(self.ids[self.prefix:])
        if len(cur) > len(prev) and not cur.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return cur[len(prev):]
        return ""

    def flush(self) -> str:
        """The rest; a character cut off by the end of generation is dropped, not shown as U+FFFD.
        Bytes that could never have become one (a stray continuation byte) stay U+FFFD, as a
        whole decode shows them: an answer of such tokens is not an empty text."""
        pending = self.ids[self.read:]
        prev = self._decode(self.ids[self.prefix:self.read])
        cur = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        text = cur[len(prev):]
        if not text.endswith("\ufffd"):
            return text
        raw = [self.t.token_bytes(i) for i in pending]
        if any(b is None for b in raw):     # bytes unknown: drop what looks cut off
            return text.rstrip("\ufffd")
        return text[:-1] if _cut_character(b"".join(raw)) else text
