"""Constrained decoding: answers that follow a JSON schema, a regular expression, a choice among
strings or a grammar, through llguidance (a Rust grammar engine; token masks, rollback).

The parts:

- :func:`parse` turns what a caller asks for (``response_format`` as OpenAI's API takes it, the
  ``json_schema=`` shortcut, edgevl's regex / choice / grammar extension) into a
  :class:`Structure`: the kind of answer and its llguidance grammar text. Nothing model-specific.
- :func:`compiled` checks a structure against a loaded model's tokenizer (once per tokenizer and
  grammar, cached): a bad schema, an unsupported keyword or a grammar too large fails here, in one
  line, before any generation.
- :class:`Constraint` is the state of ONE sequence: the generation loop (or a batching engine,
  once per row) asks it for the allowed tokens of that sequence's next logits row
  (:meth:`Constraint.allowed` / :meth:`Constraint.apply`), tells it each token taken
  (:meth:`Constraint.advance`) and takes tokens back (:meth:`Constraint.rollback`, speculative
  decoding). Models that think first (reasoning markers) get the constraint after the reasoning
  block; the reasoning itself is free text.

JSON is written compactly, with ``", "`` and ``": "`` as the only whitespace, so whitespace can
never make an answer run on.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import EdgevlError

INSTALL = "pip install 'llguidance>=1.9'"
# grammar text beyond this is refused before compiling (a schema is a few KB; a grammar that
# needs MBs is an attack or a mistake), and the engine's own limits bound the compile itself
MAX_GRAMMAR_CHARS = 256 << 10
# the engine's bounds on compiling (its defaults, ~20 ms of lexer work at most; named so they show)
GRAMMAR_LIMITS = {"initial_lexer_fuel": 1_000_000, "max_grammar_size": 500_000}
COMPILED_CACHE = 64          # compiled grammars kept per process (least recently used dropped)
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# separators of constrained JSON: the formatting models saw most, and no other whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llg():
    try:
        import llguidance
    except ImportError:
        raise EdgevlError(f"constrained output (JSON schemas, regex, grammars, tool choice) needs llguidance; {INSTALL}"
                          ) from None
    return llguidance


@dataclass(frozen=True)
class Structure:
    """What an answer must look like: ``kind`` (one of KINDS) and the llguidance grammar text.
    ``json``: the answer is one JSON value (``Completion.json`` parses it)."""
    kind: str
    grammar: str
    schema: dict | None = None
    name: str | None = None
    calls: bool = False      # the answer may instead be tool calls (tools.with_calls)

    @property
    def json(self) -> bool:
        return self.kind in ("json_object", "json_schema")


def _one_line(msg: str) -> str:
    """llguidance's messages span lines (a caret under the place); keep the line that says what."""
    lines = [x.strip() for x in str(msg).splitlines() if x.strip()]
    said = [x[len("error:"):].strip() for x in lines if x.startswith("error:")]
    head = lines[0] if lines else "unknown error"
    return (f"{head.rstrip(':')}: {said[0]}" if said and said[0] not in head else head)[:300]


def _wrapper(value) -> str | None:
    """What to pass instead, when ``value`` is not a schema but what holds one: OpenAI's
    ``{"name", "schema", "strict"}`` or a whole ``response_format`` (copied from a request, they
    would be read as a schema of unknown keywords that any value matches)."""
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("schema"), (dict, bool)) and set(value) <= {"name", "schema", "strict", "description"}:
        return "OpenAI's json_schema wrapper ({name, schema, strict}), not a schema; pass its schema"
    if value.get("type") in ("json_schema", "json_object") and set(value) <= {"type", "json_schema"}:
        return "a response_format object, not a schema; pass response_format.json_schema.schema"
    return None


def _schema_of(value, where: str) -> dict:
    """A JSON schema given as a dict, a JSON string or a pydantic model class."""
    if isinstance(value, type) and hasattr(value, "model_json_schema"):   # pydantic v2 model class
        value = value.model_json_schema()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise EdgevlError(f"{where} is not valid JSON ({e}); send a JSON schema object") from None
    wrapper = _wrapper(value)
    if wrapper:
        raise EdgevlError(f"{where} is {wrapper}")
    if value is False:              # JSON Schema's schema that nothing matches
        raise EdgevlError(f"{where} is false, a schema no answer can match; send the schema the answer must follow")
    if value is True:               # ... and the one that everything matches
        value = {}
    if not isinstance(value, dict):
        raise EdgevlError(f"{where} must be a JSON schema object (or a pydantic model class), got "
                          f"{type(value).__name__}")
    return value


# RFC 3339's dates and times as JSON Schema's format checkers and pydantic read them: days that
# exist (February 29 in leap years only), years from 0001, seconds to 59 (they refuse a leap
# second), "T" and "Z" upper case, at most 6 digits of a second. The grammar engine's own formats
# take 2023-02-30 and 12:00:60.
_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|([2468][048]|[13579][26]|0[48])00)"
DATE = (f"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
        f"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)")
TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
DATE_FORMATS = {"date": DATE, "time": TIME, "date-time": f"{DATE}T{TIME}"}

# the keywords whose values are schemas (one, a list, or a mapping of names to schemas)
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _subschemas(node: dict):
    """(path step, schema) of each schema directly inside ``node`` (never an enum's or a const's
    values, which are data)."""
    for k in _ONE:
        if isinstance(node.get(k), dict):
            yield k, node[k]
    for k in _LIST:
        if isinstance(node.get(k), list):
            yield from ((f"{k}/{i}", x) for i, x in enumerate(node[k]) if isinstance(x, dict))
    for k in _MAP:
        if isinstance(node.get(k), dict):
            yield from ((f"{k}/{n.replace('~', '~0').replace('/', '~1')}", x) for n, x in node[k].items()
                        if isinstance(x, dict))


def held_dates(schema):
    """``schema`` with the date formats as the patterns above (where no pattern is given)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    fmt = out.get("format")
    if isinstance(fmt, str) and fmt in DATE_FORMATS and "pattern" not in out:
        del out["format"]
        out["pattern"] = f"^{DATE_FORMATS[fmt]}$"
    for k in _ONE:
        if isinstance(out.get(k), dict):
            out[k] = held_dates(out[k])
    for k in _LIST:
        if isinstance(out.get(k), list):
            out[k] = [held_dates(x) for x in out[k]]
    for k in _MAP:
        if isinstance(out.get(k), dict):
            out[k] = {n: held_dates(x) for n, x in out[k].items()}
    return out


# $ref targets in one chain, at most (``_deepest``): the grammar engine compiles such a chain
# recursively, and a thousand $defs each holding the next (or a ring of a thousand types) overflowed
# its stack and killed the process; 800 did not
MAX_DEPTH = 400


def _ref(node: dict) -> str | None:
    ref = node.get("$ref")
    return ("#" if ref == "#/" else ref) if isinstance(ref, str) and ref.startswith("#") else None


def _nodes(schema: dict) -> dict:
    """Every schema in ``schema`` by its JSON pointer ("#", "#/$defs/A", ...)."""
    nodes, todo = {}, [("#", schema)]
    while todo:
        at, node = todo.pop()
        if at not in nodes:
            nodes[at] = node
            todo.extend((f"{at}/{step}", x) for step, x in _subschemas(node))
    return nodes


def _deepest(nodes: dict) -> int:
    """A bound on how many $ref targets a compile that follows the schemas inside schemas can have
    open at once, whatever order it takes them in: the most targets on a path through the groups of
    schemas that refer to each other (strongly connected components, each counted at the targets
    in it). The engine bounds plain nesting itself; the chains it overflows on go through $refs.
    Linear time."""
    targets = {_ref(n) for n in nodes.values()} & set(nodes)
    inside = {at: [f"{at}/{step}" for step, _ in _subschemas(node)] + ([_ref(node)] if _ref(node) in nodes else [])
              for at, node in nodes.items()}
    index, low, comp, on, stack, groups = {}, {}, {}, set(), [], []
    for root in nodes:       # Tarjan's algorithm, without recursion
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        work = [(root, iter(inside[root]))]
        while work:
            at, rest = work[-1]
            nxt = next(rest, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(inside[nxt])))
                elif nxt in on:
                    low[at] = min(low[at], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[at])
            if low[at] == index[at]:
                members = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp[x] = len(groups)
                    members.append(x)
                    if x == at:
                        break
                groups.append(members)
    # a group comes out after every group it reaches: the deepest path from each, in that order
    best = []
    for g, members in enumerate(groups):
        below = {comp[y] for x in members for y in inside[x]} - {g}
        best.append(len(set(members) & targets) + max((best[c] for c in below), default=0))
    return max(best, default=0)


def _endless(nodes: dict) -> str | None:
    """Where a schema admits no finite value, or None. A value of a schema needs one of each
    $ref target, allOf member, required property and array item (up to minItems) in it, and one of
    its anyOf/oneOf branches: a $ref cycle through them (A -> B -> A, a required property that is
    the object itself) asks for an endless value. The grammar engine compiles such a schema to no
    value at all: an empty answer that "stopped", or a failure mid-answer. What has a finite value
    is found from the leaves up (each schema waits for a count of needs; linear time)."""
    need, waits_all, waits_some, ready = {}, {}, {}, []
    for at, node in nodes.items():
        every = [_ref(node)] if _ref(node) in nodes else []
        if isinstance(node.get("allOf"), list):
            every += [f"{at}/allOf/{i}" for i, x in enumerate(node["allOf"]) if isinstance(x, dict)]
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if isinstance(node.get("required"), list):
            every += [f"{at}/properties/{n.replace('~', '~0').replace('/', '~1')}" for n in node["required"]
                      if isinstance(n, str) and isinstance(props.get(n), dict)]
        lo = node.get("minItems")
        lo = lo if isinstance(lo, int) and not isinstance(lo, bool) else 0
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        every += [f"{at}/prefixItems/{i}" for i in range(min(lo, len(prefix))) if isinstance(prefix[i], dict)]
        if lo > len(prefix) and isinstance(node.get("items"), dict):
            every.append(f"{at}/items")
        groups = 0
        for k in ("anyOf", "oneOf"):
            branches = node.get(k)
            if not isinstance(branches, list) or True in branches:   # a `true` branch takes any value
                continue
            ids = [f"{at}/{k}/{i}" for i, x in enumerate(branches) if isinstance(x, dict)]
            if ids:
                groups += 1
                for x in ids:
                    waits_some.setdefault(x, []).append((at, k))
        for x in every:
            waits_all.setdefault(x, []).append(at)
        need[at] = len(every) + groups
        if need[at] == 0:
            ready.append(at)
    finite, met = set(), set()
    while ready:
        x = ready.pop()
        if x in finite:
            continue
        finite.add(x)
        for at in waits_all.get(x, ()):
            need[at] -= 1
            if need[at] == 0:
                ready.append(at)
        for at, k in waits_some.get(x, ()):
            if (at, k) not in met:
                met.add((at, k))
                need[at] -= 1
                if need[at] == 0:
                    ready.append(at)
    if "#" in finite:
        return None
    stuck = sorted(at for at in nodes if at not in finite and _ref(nodes[at]) is not None)
    return stuck[-1] if stuck else "#"


@functools.lru_cache(maxsize=256)
def _shape(text: str) -> str | None:
    """What no grammar could be built from in a schema's JSON text (the words after "the
    schema"), or None: too deep for the engine, or no finite value. Cached: an agent sends the
    same tools every turn."""
    try:
        schema = json.loads(text)
    except RecursionError:
        return "is nested too deeply to use; simplify it"
    if not isinstance(schema, dict):
        return None
    nodes = _nodes(schema)
    deep = _deepest(nodes)
    if deep > MAX_DEPTH:
        return (f"chains {deep} $ref targets one inside another, past the {MAX_DEPTH} the grammar engine takes "
                "safely; flatten it")
    stuck = _endless(nodes)
    if stuck is not None:
        return (f"admits no finite value (a $ref cycle through what a value must hold, at {stuck[:80]}); make one "
                "step of the cycle optional")
    return None


def json_schema(schema, name: str | None = None, where: str = "json_schema") -> Structure:
    schema = _schema_of(schema, where)
    try:
        text = json.dumps(schema, allow_nan=False)
    except RecursionError:
        raise EdgevlError(f"{where} is nested too deeply to be a usable schema; simplify it") from None
    except (TypeError, ValueError) as e:    # a set, a NaN: not JSON
        raise EdgevlError(f"{where} is not JSON ({e}); send a JSON schema") from None
    check_size(text, where)
    shape = _shape(text)
    if shape is not None:
        raise EdgevlError(f"{where} {shape}")
    try:
        text = json.dumps(held_dates(schema))
    except RecursionError:
        raise EdgevlError(f"{where} is nested too deeply to be a usable schema; simplify it") from None
    try:
        grammar = _llg().LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
    except ValueError as e:   # the engine's own limits (a schema nested past its depth), bad text
        raise EdgevlError(f"{where} cannot be compiled ({_one_line(e)}); simplify it") from None
    return Structure("json_schema", grammar, schema, name)


@functools.lru_cache(maxsize=256)
def _schema_problem(text: str) -> str | None:
    """``schema_problem`` of a schema's JSON text (an agent sends the same tools every turn)."""
    shape = _shape(text)
    if shape is not None:
        return f"it {shape}"

    # patterns are not judged: JSON Schema's are ECMA-262 (\p{Lu}, lookaround, \b), which neither the
    # engine's dialect nor Python's re takes whole, and under "auto" nothing holds a value to them
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()
                    if not (k == "pattern" and isinstance(v, str) or k == "patternProperties")}
        return [strip(v) for v in x] if isinstance(x, list) else x
    llg = _llg()
    try:
        lenient = {**strip(json.loads(text)), "x-guidance": {"lenient": True}}   # keywords it cannot hold: ignored
    except RecursionError:    # data nested deep (a default, an enum) where the schemas themselves are not
        return "it is nested too deeply to use; simplify it"
    try:
        error = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_json_schema(json.dumps(lenient)), None)
    except ValueError as e:
        error = str(e)
    return _one_line(error) if error else None


def schema_problem(schema: dict) -> str | None:
    """What makes ``schema`` not a usable JSON schema (an unknown type, a $ref to nothing, a
    property schema that is not a schema, no finite value), in one line; None when it is one.
    Keywords constrained output cannot hold, and patterns, are no problem here: a tool's parameters
    under tool_choice "auto" are rendered for the model, not held to a grammar."""
    try:
        text = json.dumps(schema, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError, RecursionError) as e:
        return f"not JSON ({e})"
    if len(text) > MAX_GRAMMAR_CHARS:
        return f"too large ({len(text)} characters, limit {MAX_GRAMMAR_CHARS})"
    return _schema_problem(text)


def check_size(text: str, where: str, fix: str = "send a smaller schema or grammar") -> None:
    """Grammar text past ``MAX_GRAMMAR_CHARS`` refused before anything compiles."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise EdgevlError(f"{where} is too large to compile ({len(text)} characters, limit {MAX_GRAMMAR_CHARS}); {fix}")


def regex(pattern, where: str = "regex") -> Structure:
    if not isinstance(pattern, str) or not pattern:
        raise EdgevlError(f"{where} must be a non-empty regular expression string")
    check_size(pattern, where)
    return Structure("regex", _llg().LLMatcher.grammar_from_regex(pattern))


def choice(options, where: str = "choice") -> Structure:
    if (not isinstance(options, (list, tuple)) or not options
            or not all(isinstance(o, str) and o for o in options)):
        raise EdgevlError(f"{where} must be a non-empty list of non-empty strings")
    text = "start: " + " | ".join(json.dumps(o) for o in options)
    check_size(text, where)
    return Structure("choice", _llg().LLMatcher.grammar_from_lark(text))


def grammar(text, where: str = "grammar") -> Structure:
    """A Lark grammar (llguidance's dialect) or a GBNF grammar (llama.cpp's, ``root ::= ...``)."""
    if not isinstance(text, str) or not text.strip():
        raise EdgevlError(f"{where} must be a non-empty Lark or GBNF grammar string")
    check_size(text, where)
    llg = _llg()
    try:
        g = llg.grammar_from("grammar", text)
    except ValueError as e:
        raise EdgevlError(f"{where} does not parse ({_one_line(e)}); fix the grammar") from None
    return Structure("grammar", g)


def grammar_structure(lark: str, kind: str = "grammar") -> Structure:
    """A Structure from a Lark grammar edgevl builds itself (the tool-call grammar)."""
    return Structure(kind, _llg().LLMatcher.grammar_from_lark(lark))


def _grammars(structure: Structure) -> list:
    """The grammar entries of ``structure``'s text (llguidance's JSON form, or Lark)."""
    text = structure.grammar
    if text.lstrip().startswith("{"):
        top = json.loads(text)
        entries = top.get("grammars")
        if not isinstance(entries, list) or not entries or set(top) - {"grammars", "max_tokens"} \
                or top.get("max_tokens") is not None:
            raise ValueError(f"a {structure.kind} grammar of an unexpected form")
        return entries
    return [{"lark_grammar": text}]


def either(first: Structure, second: Structure) -> Structure:
    """An answer that is ``first`` or ``second`` (kind, schema and name of ``first``): the two
    grammars side by side in one, under a start rule that refers to each by name."""
    parts = []
    for tag, s in (("first", first), ("second", second)):
        entries = _grammars(s)
        if len(entries) > 1:   # references by index inside it would move
            raise ValueError(f"a {s.kind} grammar made of several grammars")
        parts.append({**entries[0], "name": f"edgevl_{tag}"})
    top = {"grammars": [{"name": "edgevl_either", "lark_grammar": "start: @edgevl_first | @edgevl_second"}, *parts]}
    return Structure(first.kind, json.dumps(top), first.schema, first.name, calls=True)


def parse(response_format=None, json_schema_=None, where: str = "response_format") -> Structure | None:
    """The structure asked for, or None for free text. ``response_format``: OpenAI's
    ``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}}``, and edgevl's ``{"type": "regex", "regex": ...}``, ``{"type": "choice",
    "choice": [...]}``, ``{"type": "grammar", "grammar": ...}``; a :class:`Structure` passes through.
    ``json_schema_``: a schema dict or a pydantic model class (the API's ``json_schema=``)."""
    if json_schema_ is not None:
        if response_format is not None:
            raise EdgevlError("give either json_schema or response_format, not both")
        return json_schema(json_schema_)
    if response_format is None or isinstance(response_format, (Structure, Compiled)):
        return response_format
    if not isinstance(response_format, dict):
        raise EdgevlError(f"{where} must be an object such as {{\"type\": \"json_object\"}}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structure("json_object", _llg().LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                                  overrides=JSON_OPTIONS))
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise EdgevlError(f"{where}.json_schema must be an object with a schema, e.g. {{\"name\": \"x\", "
                              "\"schema\": {...}}")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise EdgevlError(f"{where}.json_schema.name must be a string")
        return json_schema(spec["schema"], name, f"{where}.json_schema.schema")
    if kind == "regex":
        return regex(response_format.get("regex"), f"{where}.regex")
    if kind == "choice":
        return choice(response_format.get("choice"), f"{where}.choice")
    if kind == "grammar":
        return grammar(response_format.get("grammar"), f"{where}.grammar")
    raise EdgevlError(f"{where}.type must be one of text, {', '.join(KINDS)}; got {kind!r:.40}")


def schema_file(path, flag: str = "--json-schema") -> dict:
    """A JSON schema read from a file (the command line's ``--json-schema FILE``, chat's
    ``/schema FILE``), as a ``response_format``; one line when missing or not JSON."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EdgevlError(f"{flag} {path}: no such file; give a JSON schema file") from None
    except (OSError, ValueError) as e:
        raise EdgevlError(f"{flag} {path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise EdgevlError(f"{flag} {path} is not valid JSON ({e}); give a JSON schema file") from None
    if not isinstance(schema, (dict, bool)):
        raise EdgevlError(f"{flag} {path} must hold a JSON schema object, got a {type(schema).__name__}")
    if schema is False:
        raise EdgevlError(f"{flag} {path} holds false, a schema no answer can match; give the schema the answer "
                          "must follow")
    wrapper = _wrapper(schema)
    if wrapper:
        raise EdgevlError(f"{flag} {path} holds {wrapper}")
    return {"type": "json_schema", "json_schema": {"name": p.stem, "schema": schema}}


def cli_format(json_schema_path=None, any_json: bool = False) -> dict | None:
    """``response_format`` from ``--json-schema FILE`` / ``--json``."""
    if json_schema_path is not None and any_json:
        raise EdgevlError("give --json-schema FILE or --json, not both")
    if json_schema_path is not None:
        return schema_file(json_schema_path)
    return {"type": "json_object"} if any_json else None


# -- per tokenizer: the adapter and compiled grammars (cached) ---------------------------------------

_lock = threading.Lock()
_tokenizers: dict = {}
_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # a loaded tokenizer -> its file's key
_compiled: OrderedDict = OrderedDict()


def vocabulary(model) -> int:
    """Rows of the model's logits (a checkpoint may have more than its tokenizer has tokens)."""
    return max(int(getattr(model, "vocab_size", 0) or 0), model.tokenizer.vocab_size)


def tokenizer_for(model):
    """llguidance's view of the model's tokenizer, built from the package's own tokenizer.json once
    per file (content hash), vocabulary size and end tokens."""
    llg = _llg()
    known = _keys.get(model.tokenizer)
    if known is not None:
        key = known[0]
        with _lock:
            tok = _tokenizers.get(key)
        if tok is not None:
            return key, tok
    text = (Path(model.tokenizer.folder) / "tokenizer.json").read_bytes()
    key = (hashlib.sha256(text).hexdigest(), vocabulary(model), tuple(sorted(model.eos_ids)))
    _keys[model.tokenizer] = (key,)
    with _lock:
        tok = _tokenizers.get(key)
    if tok is None:
        try:
            tok = llg.LLTokenizer(_unnormalized(text), n_vocab=key[1], eos_token=list(key[2]) or None)
        except (ValueError, RuntimeError) as e:
            raise EdgevlError(f"constrained output cannot use this tokenizer ({_one_line(e)})") from None
        with _lock:
            _tokenizers[key] = tok
    return key, tok


_UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")


def _unnormalized(text: bytes) -> str:
    """tokenizer.json without its Unicode normalization, for llguidance: it tokenizes the bytes a
    grammar forces, and an NFC normalizer turned a forced "u" + combining mark into "\u00fc"
    (other bytes than the grammar allows: a valid NFD enum or pattern failed mid-answer). Other
    normalizers (a space replaced by a marker) stay: they make the vocabulary's own spelling."""
    spec = json.loads(text)
    norm = spec.get("normalizer") if isinstance(spec, dict) else None
    if not isinstance(norm, dict):
        return text.decode()
    if norm.get("type") in _UNICODE_FORMS:
        spec["normalizer"] = None
    elif norm.get("type") == "Sequence" and isinstance(norm.get("normalizers"), list):
        rest = [n for n in norm["normalizers"] if not (isinstance(n, dict) and n.get("type") in _UNICODE_FORMS)]
        if len(rest) == len(norm["normalizers"]):
            return text.decode()
        spec["normalizer"] = {**norm, "normalizers": rest} if rest else None
    else:
        return text.decode()
    return json.dumps(spec)


@dataclass
class Compiled:
    """A structure compiled for one tokenizer: makes a fresh :class:`Constraint` per sequence."""
    structure: Structure
    template: object          # an LLMatcher at the start of the grammar (copied per sequence)
    vocab: int
    eos: tuple

    @property
    def kind(self) -> str:
        return self.structure.kind

    def constraint(self, reasoning=None, thinking: bool = False) -> Constraint:
        return Constraint(self.template.deep_copy(), self.vocab, self.eos, reasoning, thinking)


def compiled(model, structure: Structure, where: str | None = None) -> Compiled:
    """``structure`` checked and compiled for ``model``'s tokenizer (cached); a grammar the engine
    refuses (bad schema, unsupported keyword, too large) is an EdgevlError naming the problem."""
    if isinstance(structure, Compiled):
        return structure
    llg = _llg()
    key, tok = tokenizer_for(model)
    ck = (key, structure.grammar)
    with _lock:
        template = _compiled.get(ck)
        if template is not None:
            _compiled.move_to_end(ck)
    if template is None:
        template = llg.LLMatcher(tok, structure.grammar, log_level=0, limits=llg.LLParserLimits(**GRAMMAR_LIMITS))
        if template.is_error():
            raise EdgevlError(_describe(structure, template.get_error(), where))
        with _lock:
            _compiled[ck] = template
            while len(_compiled) > COMPILED_CACHE:
                _compiled.popitem(last=False)
    return Compiled(structure, template, key[1], key[2])


def problem(structure: Structure) -> str | None:
    """What ``compiled`` would refuse in ``structure`` regardless of the tokenizer (a bad schema,
    an unsupported keyword), found without a model, in the grammar engine's words (one line)."""
    error = _llg().LLMatcher.validate_grammar(structure.grammar, None)
    return _one_line(error) if error else None


def check(structure: Structure, where: str | None = None) -> None:
    """``problem`` as an EdgevlError naming it."""
    error = problem(structure)
    if error:
        raise EdgevlError(_describe(structure, error, where))


def _describe(structure: Structure, error: str, where: str | None) -> str:
    what = where or {"json_object": "response_format", "json_schema": "the JSON schema", "regex": "the regex",
                     "choice": "the choice", "grammar": "the grammar"}.get(structure.kind, "the grammar")
    msg = _one_line(error)
    if msg.startswith("Unimplemented keys"):
        keys = msg.split(":", 1)[1].strip()
        return f"{what} uses JSON Schema keywords constrained output does not support ({keys}); remove them"
    if too_large(msg):
        return f"{what} is too large to compile in bounded time and memory ({msg}); simplify it"
    if "coerce_one_of" in msg:    # the engine's option, which would let an answer match two branches
        return (f"{what} has oneOf branches that one value can match both of, which the grammar cannot keep apart "
                "(an answer must match exactly one); use anyOf, or make the branches exclusive (a const or enum "
                "field that tells them apart)")
    return f"{what} cannot be used ({msg}); fix it"


def plainly(error: str) -> str:
    """The grammar engine's message without its places in the grammar text ("at 4(7): failed to
    compile JSON schema:"), unimplemented keywords said in our words."""
    msg = re.sub(r"^(at \d+\(\d+\): )?(failed to compile JSON schema: )?", "", _one_line(error))
    if msg.startswith("Unimplemented keys"):
        keys = ", ".join(re.findall(r'"([^"]+)"', msg.split(":", 1)[1])) or msg.split(":", 1)[1].strip()
        return f"uses JSON Schema keywords constrained output does not support: {keys}"
    return msg


def too_large(error: str) -> bool:
    """Whether the grammar engine's error says a grammar passed its size or time limits."""
    return "too big" in error or "too large" in error or "too complex" in error.lower()


# -- one sequence --------------------------------------------------------------------------------------

# masks a sequence keeps (a verify pass's rows: at most the drafts and the token after them) and
# the most tokens a mask's key spans before a new base is taken
MASKS_KEPT = 10
MASK_KEY = 64


class Constraint:
    """The grammar state of one sequence. ``reasoning``: the model's (start, end) reasoning marker
    ids; while the sequence is inside a reasoning block (``thinking``: the prompt left one open)
    every token but an end token is allowed, and the grammar starts after the end marker."""

    def __init__(self, matcher, vocab: int, eos, reasoning=None, thinking: bool = False):
        self.matcher, self.vocab, self.eos = matcher, int(vocab), tuple(eos)
        self.end = reasoning[1] if reasoning and None not in reasoning else None
        # the markers route text to the reasoning: inside the answer (a JSON string may spell
        # "<think>") one would move the rest of the answer out of it
        self.markers = [int(t) for t in reasoning if t is not None and t < vocab] if self.end is not None else []
        self.thinking = bool(thinking and self.end is not None)
        self.log: list[str] = []      # per advanced token: "r" reasoning, "e" end marker, "m" matcher
        self._bits = np.empty((self.vocab + 31) // 32, np.int32)
        self.path: list[int] = []     # the tokens advanced, in order
        # masks of recent states, keyed by the tokens taken since path[:_base] (a prefix no
        # rollback has gone below since): drafting computes the masks of the states its drafts
        # lead to, and the verify pass that follows finds them here
        self._base: int | None = None
        self._masks: dict = {}

    @property
    def free(self) -> bool:
        """Inside the reasoning block: no grammar yet."""
        return self.thinking

    @property
    def done(self) -> bool:
        """The grammar is complete: only an end token may follow."""
        return not self.thinking and self.matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """A bool mask over the vocabulary: the tokens the next position may take."""
        key = None if self._base is None or len(self.path) < self._base else tuple(self.path[self._base:])
        if key in self._masks:
            return self._masks[key]
        if self.thinking:
            mask = np.ones(self.vocab, bool)
            mask[[e for e in self.eos if e < self.vocab]] = False   # the answer must still come
        else:
            if self.matcher.is_error():
                raise EdgevlError(f"constrained decoding failed ({_one_line(self.matcher.get_error())})")
            self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab].astype(bool)
            mask[self.markers] = False
            if not mask.any():
                raise EdgevlError("constrained decoding reached a state no token can continue; the grammar "
                                  "cannot be completed with this tokenizer")
        if key is None or len(key) > MASK_KEY:     # start a new base here
            self._masks, self._base, key = {}, len(self.path), ()
        self._masks[key] = mask
        if len(self._masks) > MASKS_KEPT:
            del self._masks[next(iter(self._masks))]
        return mask

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar forces next, each the only one it allows after those before it
        (a key's name, the punctuation between fields), up to ``limit``; none inside the reasoning
        block, none past the grammar's end. The state is left as it was; the masks met on the way
        stay kept (:meth:`allowed`), so the pass that takes the tokens reads them again for free."""
        out: list[int] = []
        if self.thinking:
            return out
        try:
            while len(out) < limit and not self.matcher.is_stopped():
                mask = self.allowed()
                if np.count_nonzero(mask) != 1:
                    break
                tok = int(np.argmax(mask))
                if tok in self.eos:
                    break
                self.advance(tok)
                out.append(tok)
        finally:
            self.rollback(len(out))
        return out

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` (one row) with the disallowed tokens at -inf: sampling then sees only the
        allowed ones (penalties, temperature, top-k/top-p included)."""
        x = np.asarray(logits, np.float32)
        if self.thinking:    # free text but the end: no whole-vocabulary mask per reasoning token
            out = x.copy()
            out[[e for e in self.eos if e < len(out)]] = -np.inf
            return out
        mask = self.allowed()
        n = min(len(mask), x.shape[-1])
        out = np.full(x.shape, -np.inf, np.float32)
        out[:n] = np.where(mask[:n], x[:n], -np.inf)
        return out

    def advance(self, token: int) -> None:
        token = int(token)
        if self.thinking:
            if token in self.eos:
                raise EdgevlError("constrained decoding: an end token inside the reasoning block")
            if token == self.end:
                self.thinking = False
                self.log.append("e")
            else:
                self.log.append("r")
            self.path.append(token)
            return
        if not self.matcher.consume_token(token):
            raise EdgevlError(f"constrained decoding: token {token} is not allowed here "
                              f"({_one_line(self.matcher.get_error())})")
        self.log.append("m")
        self.path.append(token)

    def rollback(self, n: int) -> None:
        """Take back the last ``n`` tokens advanced."""
        if n <= 0:
            return
        if n > len(self.log):
            raise EdgevlError(f"cannot roll back {n} tokens; only {len(self.log)} were taken")
        gone = self.log[-n:]
        del self.log[-n:]
        del self.path[-n:]
        if self._base is not None and len(self.path) < self._base:
            self._masks, self._base = {}, None
        m = gone.count("m")
        if m and not self.matcher.rollback(m):
            raise EdgevlError(f"constrained decoding could not roll back ({_one_line(self.matcher.get_error())})")
        if "e" in gone:
            self.thinking = True

    def valid_prefix(self, tokens) -> int:
        """How many of ``tokens`` (drafts, in order) the constraint allows, without taking them."""
        tokens = [int(t) for t in tokens]
        taken = 0
        try:
            while taken < len(tokens) and self.thinking:
                if tokens[taken] in self.eos:
                    return taken
                self.advance(tokens[taken])
                taken += 1
            return taken + (self.matcher.validate_tokens(tokens[taken:]) if taken < len(tokens) else 0)
        finally:
            self.rollback(taken)
