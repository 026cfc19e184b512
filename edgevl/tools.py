"""Tool (function) calling the way each model was trained: the tools rendered by the model's own
chat template, its calls parsed from its own call format into OpenAI's ``tool_calls``.

Qwen3.5's format (its template's tools section) is XML-like, one block per call::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is written raw: strings as they are, other types as JSON; the parsed
``arguments`` are typed by the function's parameter schema. ``tool_choice`` "auto" lets the model
answer or call; "none" renders no tools; "required" and a named function constrain the answer
with a grammar of that format built from the tools' parameter schemas (``edgevl.structured``),
so the call always parses and its arguments validate.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from . import structured
from .errors import EdgevlError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TAGS = (CALL_OPEN, CALL_CLOSE)
MAX_CALLS = 16      # parallel calls in one forced answer: a model that repeats itself still ends
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@dataclass
class ToolSpec:
    """Tools checked for one request: what the template renders and how the answer is read."""
    tools: list                       # OpenAI tool objects, as the template takes them
    choice: str                       # "auto" | "none" | "required" | "function"
    name: str | None = None           # the named function
    parallel: bool = True
    structure: structured.Structure | None = None   # the call grammar ("required" / named)
    schemas: dict = field(default_factory=dict)     # function name -> parameters schema
    # "auto" whose answer a format holds (with_calls): calls are held to the call grammar too
    constrained: bool = False

    @property
    def held(self) -> bool:
        """Whether a grammar holds the calls (forced, or "auto" beside a format): what the model
        writes of a call is a call's text, never the answer's."""
        return self.structure is not None or self.constrained

    @property
    def render(self) -> list | None:
        """The tools for the chat template (None: none rendered)."""
        return None if self.choice == "none" else self.tools

    @property
    def parses(self) -> bool:
        return self.choice != "none"


def call_format(model) -> str | None:
    """The model's tool-call format, read from its chat template (None: it has none)."""
    t = model.tokenizer.chat_template or ""
    if CALL_OPEN in t and "<function=" in t and "<parameter=" in t:
        return "qwen_xml"
    return None


def prepare(model, tools, tool_choice=None, parallel_tool_calls=None) -> ToolSpec | None:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` as OpenAI's API takes them, checked;
    None when no tools were given."""
    if isinstance(tools, ToolSpec):
        return tools
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise EdgevlError("tool_choice needs tools; send the tools the choice names")
        return None
    if call_format(model) is None:
        raise EdgevlError(f"this model ({model.arch.name}) has no tool-call format in its chat template; send the "
                          "request without tools")
    if not isinstance(tools, list):
        raise EdgevlError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    out, schemas = [], {}
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"),
                                                                                               dict):
            raise EdgevlError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", \"parameters\"}}}}")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise EdgevlError(f"{where}.function.name must be 1-64 ASCII letters, digits, _ . : or -, got {name!r:.40}")
        if name in schemas:
            raise EdgevlError(f"{where}: two tools are named {name!r}; give each function its own name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object" or not isinstance(
                params.get("properties", {}), dict):
            raise EdgevlError(f"{where}.function.parameters must be a JSON schema of type object with properties")
        for p in params.get("properties", {}):
            if not NAME.fullmatch(p):
                raise EdgevlError(f"{where}: parameter name {p!r:.40} cannot be written in the call format; use "
                                  "ASCII letters, digits, _ . : or -")
        # whatever the choice: an agent that sends "auto" most turns must not meet its first 400 on the
        # turn it asks for "required"
        error = structured.schema_problem(params)
        if error:
            raise EdgevlError(f"{where}.function.parameters is not a valid JSON schema ({error}); fix it")
        schemas[name] = params
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if not isinstance(parallel, bool):
        raise EdgevlError("parallel_tool_calls must be true or false")
    choice, named = _choice(tool_choice, schemas)
    spec = ToolSpec(out, choice, named, parallel, schemas=schemas)
    if choice in ("required", "function"):   # the named one: one call of that function, as OpenAI's
        chosen = schemas if choice == "required" else {named: schemas[named]}
        spec.structure = _call_structure(model, chosen, parallel and choice == "required")
    return spec


def with_calls(model, answer: structured.Structure, spec: ToolSpec) -> structured.Structure:
    """``tool_choice`` "auto" with an answer format (``response_format``): the answer follows that
    format or is calls to the tools, as OpenAI applies a format to the text answer only. The calls
    are then held to the call grammar too (so they parse and validate)."""
    calls = _call_structure(model, spec.schemas, spec.parallel,
                            "simplify that schema, or drop response_format (the calls are then read unconstrained)")
    spec.constrained = True
    try:
        return structured.either(answer, calls)
    except ValueError as e:
        raise EdgevlError(f"response_format cannot be combined with tools ({e}); drop one of them") from None


def _call_structure(model, chosen: dict, parallel: bool,
                    fix: str = "simplify that schema or use tool_choice \"auto\""):
    """The grammar of calls to ``chosen``, checked now (before a request queues); parameters that
    cannot be constrained are one line naming their function."""
    tags = _tags(model)

    def build(lark: str):
        try:
            s = structured.grammar_structure(lark, "tool_choice")
        except ValueError as e:    # the engine refuses the grammar itself (a bad pattern)
            return None, " ".join(str(e).split())
        return s, structured.problem(s)

    for f, params in chosen.items():   # the grammar writes the listed parameters: keywords about the
        other = sorted(set(params) - TOP_LEVEL)   # object as a whole cannot be held
        if other:
            raise EdgevlError(f"tools: the parameters of function {f!r:.60} cannot be constrained (top-level "
                              f"keywords {', '.join(map(repr, other))[:200]} are not held by the call format); {fix}")
    try:
        whole = call_grammar(chosen, parallel, tags)
    except ValueError:   # a string format no regex is known for: whose, each function alone
        for f, params in chosen.items():
            try:
                call_grammar({f: params}, False, tags)
            except ValueError as e:
                raise EdgevlError(f"tools: the parameters of function {f!r:.60} cannot be constrained ({e}); "
                                  f"{fix}") from None
        raise
    # before any compiling: thousands of tools cost minutes
    structured.check_size(whole, f"tools: the grammar of calls to {len(chosen)} functions",
                          "send fewer tools (or smaller parameter schemas) with this tool_choice, or use tool_choice "
                          "\"auto\"")
    structure, error = build(whole)
    if error is None:
        return structure
    if len(chosen) > 1 and structured.too_large(error):   # the whole list's fault, no one function's
        raise EdgevlError(f"tools: the grammar of calls to {len(chosen)} functions is too large to compile in "
                          f"bounded time and memory ({error[:300]}); send fewer tools with this tool_choice, "
                          "or use tool_choice \"auto\"")
    # the function at fault, each alone (the whole grammar's error does not say whose), and its parameter
    fn = next((f for f, params in chosen.items() if build(call_grammar({f: params}, False, tags))[1]),
              next(iter(chosen)))
    params = chosen[fn]
    where = next((f" (parameter {p!r:.40})" for p, s in params.get("properties", {}).items()
                  if build(call_grammar({fn: {**params, "properties": {p: s}, "required": [p]}}, False, tags))[1]), "")
    raise EdgevlError(f"tools: the parameters of function {fn!r:.60}{where} cannot be constrained "
                      f"({structured.plainly(error)[:300]}); {fix}")


# the keywords of a parameters object the call grammar holds (or that say nothing to hold)
TOP_LEVEL = {"type", "properties", "required", "additionalProperties", "$defs", "definitions", "title",
             "description", "$schema", "$id", "$comment", "examples", "default", "strict"}


def _choice(tool_choice, schemas) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("auto", "none", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice.get("function"), dict) \
            else None
        if not isinstance(name, str):
            flat = " ({\"type\": \"function\", \"name\": ...} is the Responses API's form)" if isinstance(
                tool_choice.get("name"), str) else ""
            raise EdgevlError("tool_choice.function.name must be a string: {\"type\": \"function\", \"function\": "
                              f"{{\"name\": ...}}}}{flat}")
        if name not in schemas:
            raise EdgevlError(f"tool_choice names the function {name!r:.60}, which is not among the tools ("
                              f"{', '.join(sorted(schemas))}); name one of them")
        return "function", name
    raise EdgevlError("tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                      "\"function\": {\"name\": ...}}")


# -- the call grammar (Lark, with inline JSON schemas for typed values) ---------------------------------

def _lit(s: str) -> str:
    return json.dumps(s)


CLOSE_TAG = "</parameter>"
# a raw string parameter's keywords the regex holds, and annotations that hold nothing
STRING_KEYWORDS = {"type", "enum", "const", "minLength", "maxLength", "format", "pattern", "title", "description",
                   "default", "examples", "$comment"}


def _is_string(schema: dict) -> bool:
    t = schema.get("type")
    return t == "string" or (isinstance(t, list) and t == ["string"]) or (
        t is None and "enum" in schema and all(isinstance(v, str) for v in schema["enum"]))


def _raw(schema: dict) -> bool:
    """Whether a parameter's value is written raw (a plain string), not as JSON: the grammar,
    the template and the call's reader agree on it."""
    return _is_string(schema) and "$ref" not in schema


def _value(rule: str, schema: dict) -> list[str]:
    """Rules for one parameter's value followed by its closing tag: a raw string for string
    parameters (the template writes them unquoted), JSON for the rest."""
    close = _lit("\n</parameter>\n")
    if _raw(schema):
        # a raw value ends at the first closing tag: a string an enum or const fixes that holds
        # one could not be read back (a JSON value is read as JSON, its strings may hold it)
        held = next((v for v in _fixed_strings(schema) if CLOSE_TAG in v), None)
        if held is not None:
            raise ValueError(f"the value {held!r:.60} holds {CLOSE_TAG}, which ends a string value in this "
                             "model's call format; the call could not be read back")
        # written raw, held by the regex below: a keyword the engine would refuse in a JSON answer
        # ("not", "if") is refused here too, not dropped (the engine is asked only past the usual ones)
        if set(schema) - STRING_KEYWORDS:
            error = structured.problem(structured.json_schema(schema, where="a string parameter"))
            if error:
                raise ValueError(error)
        if "enum" in schema:
            return [f"{rule}: ({' | '.join(_lit(v) for v in schema['enum'])}) {close}"]
        if "const" in schema and isinstance(schema["const"], str):
            return [f"{rule}: {_lit(schema['const'])} {close}"]
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        fmt = schema.get("format")
        if fmt is not None and fmt not in FORMATS:
            raise ValueError(f"Unknown format: {fmt}")
        pattern = schema.get("pattern") or FORMATS.get(fmt)
        if pattern:
            body = pattern.removeprefix("^").removesuffix("$")
            term = rule.upper()
            # the lengths too: the value is in both languages (a terminal's & in the engine's Lark)
            length = f" & /(.|\\n){{{lo},{'' if hi is None else int(hi)}}}/" if lo or hi is not None else ""
            return [f"{term}: /{_regex_escape(body)}/{length} & ~/(.|\\n)*<\\/parameter>(.|\\n)*/",
                    f"{rule}: {term} {close}"]
        # lazy: the value ends at the first closing tag; any characters, newlines included, but
        # never the closing tag itself (the call's reader ends the value at the first one)
        reps = f"{{{lo},{int(hi)}}}" if hi is not None else ("+" if lo else "*")
        term = rule.upper()
        return [f"{term}: /(.|\\n){reps}\\n<\\/parameter>\\n/ & ~/(.|\\n)*<\\/parameter>(.|\\n){{2,}}/",
                f"{rule}[lazy]: {term}"]
    # compact JSON, as the answers constrained by a schema (bounded whitespace)
    return [f"{rule}: %json {json.dumps({**structured.held_dates(schema), 'x-guidance': structured.JSON_OPTIONS})} "
            f"{close}"]


def _fixed_strings(schema):
    """Every string an ``enum`` or ``const`` anywhere in ``schema`` fixes (nested ones too)."""
    stack = [schema]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("enum", "const"):
                    yield from _strings_in(v if k == "enum" and isinstance(v, list) else [v])
                else:
                    stack.append(v)
        elif isinstance(x, list):
            stack.extend(x)


def _strings_in(x):
    """The strings inside a fixed JSON value (an enum's object or list)."""
    stack = [x]
    while stack:
        y = stack.pop()
        if isinstance(y, str):
            yield y
        elif isinstance(y, dict):
            stack += list(y.keys()) + list(y.values())
        elif isinstance(y, list):
            stack += y


def _regex_escape(body: str) -> str:
    """A regex for Lark's /.../: each slash not yet escaped gets a backslash (``a\\/b`` stays)."""
    out, escaped = [], False
    for c in body:
        if c == "/" and not escaped:
            out.append("\\")
        out.append(c)
        escaped = c == "\\" and not escaped
    return "".join(out)


# string formats a raw (unquoted) parameter value is held to, as JSON Schema defines them
FORMATS = {
    "uuid": "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    **structured.DATE_FORMATS,      # days that exist, seconds to 59
    "email": "[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(\\.[A-Za-z0-9-]{1,63})+",
    "ipv4": "((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
    # the usual compressed forms (no embedded IPv4, no zone)
    "ipv6": "(H:){7}H|(H:){1,7}:|(H:){1,6}:H|(H:){1,5}(:H){1,2}|(H:){1,4}(:H){1,3}|(H:){1,3}(:H){1,4}"
            "|(H:){1,2}(:H){1,5}|H:(:H){1,6}|:((:H){1,7}|:)".replace("H", "[0-9a-fA-F]{1,4}"),
    # labels of letters, digits and inner hyphens, dot-separated
    "hostname": "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*",
    # an absolute URI: a scheme, then URI characters (a % always followed by two hex digits)
    "uri": "[A-Za-z][A-Za-z0-9+.-]*:([A-Za-z0-9._~:/?#\\[\\]@!$&'()*+,;=-]|%[0-9A-Fa-f]{2})+",
    # ISO 8601 as RFC 3339 spells it: weeks, or date and time parts, none empty
    "duration": "P([0-9]+W|([0-9]+Y([0-9]+M)?([0-9]+D)?|[0-9]+M([0-9]+D)?|[0-9]+D)(T(TIME))?|T(TIME))".replace(
        "TIME", "[0-9]+H([0-9]+M)?([0-9]+S)?|[0-9]+M([0-9]+S)?|[0-9]+S"),
}


def _tags(model) -> set:
    """The call tags the tokenizer has as tokens of their own (Qwen's ``<tool_call>``): the
    grammar engine never spells such a token from text, and the model was trained to write it."""
    return {t for t in TAGS if model.tokenizer.token_to_id(t) is not None}


def call_grammar(schemas: dict, parallel: bool = True, tags=()) -> str:
    """A Lark grammar of one call (or several, ``parallel``) to the functions in ``schemas``, in
    the Qwen XML format, each function's required parameters present, in its schema's order.
    ``tags``: the call tags to write as the tokenizer's own tokens (``<tool_call>`` unquoted is the
    engine's syntax for a token)."""
    def tag(t: str) -> str:
        return t if t in tags else _lit(t)

    lines, calls = [], []
    for i, (name, params) in enumerate(schemas.items()):
        props = dict(params.get("properties", {}))
        required = set(params.get("required", []))
        for p in params.get("required", []):   # required but not described: any JSON value
            props.setdefault(p, {})
        # the definitions a parameter's $ref points into travel with its schema
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        parts = []
        for j, (p, ps) in enumerate(props.items()):
            rule = f"v{i}_{j}"
            ps = ps if isinstance(ps, dict) else {}
            lines += _value(rule, {**ps, **defs} if defs and not _raw(ps) else ps)
            item = f"{_lit(f'<parameter={p}>' + chr(10))} {rule}"
            parts.append(f"({item})" if p in required else f"({item})?")
        body = " ".join(parts)
        calls.append(f"c{i}")
        lines.append(f"c{i}: {tag(CALL_OPEN)} {_lit(f'{chr(10)}<function={name}>{chr(10)}')} {body} "
                     f"{_lit(f'</function>{chr(10)}')} {tag(CALL_CLOSE)}")
    lines.insert(0, "call: " + " | ".join(calls))
    lines.insert(0, f"start: call (\"\\n\" call){{0,{MAX_CALLS - 1}}}" if parallel else "start: call")
    return "\n".join(lines)


# -- reading the model's calls --------------------------------------------------------------------------

JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (type(None), "null"),
              (list, "array"), (dict, "object"))


def _types(schema, root: dict, depth: int = 0) -> set | None:
    """The JSON types a parameter's schema allows (through $ref, anyOf/oneOf, type lists, enum and
    const values); None where it does not say."""
    if not isinstance(schema, dict) or depth > 16:
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target = root
        for key in ref[2:].split("/"):
            target = target.get(key) if isinstance(target, dict) else None
        return _types(target, root, depth + 1)
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list) and t:
        return set(t)
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if isinstance(values, list):
            return {next(n for k, n in JSON_TYPES if isinstance(v, k)) for v in values}
    options = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(options, list) and options:
        each = [_types(o, root, depth + 1) for o in options]
        return None if any(x is None for x in each) else set().union(*each)
    return None


def _typed(value: str, schema: dict, root: dict | None = None, as_json: bool = False):
    """A parameter's value as written (strings raw, the rest JSON), typed by its schema.
    ``as_json``: a call grammar held the value (a plain string raw, any other schema as JSON)."""
    schema = schema if isinstance(schema, dict) else {}
    if _raw(schema):
        return value
    types = _types(schema, root or {})
    if as_json or types is None or "string" not in types:
        try:
            return json.loads(value)
        except ValueError:
            return value
    # a string among other types (an optional string, a $ref enum of strings): raw text is the
    # string, unless it is JSON of another type the schema allows (null for an optional one)
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    kind = next(n for k, n in JSON_TYPES if isinstance(parsed, k))
    if kind == "string":     # written raw, quotes and all, as a plain string's would be kept
        return value
    return parsed if kind in types or (kind == "integer" and "number" in types) else value


def new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class CallStream:
    """Reads an answer as it streams: content text before the calls, and each call as it
    completes its parts (name first, then argument fragments that join into the JSON object)."""

    HEAD = re.compile(r"<parameter=([^>\n]+)>\n?")
    PARAM = re.compile(HEAD.pattern + r"(.*?)\n?</parameter>", re.S)

    def __init__(self, spec: ToolSpec):
        self.spec = spec
        self.buf = ""
        self.in_calls = False
        self.calls: list[dict] = []
        self._args: dict | None = None    # the current call's arguments so far
        # A call may never close: in "auto" a small model drops a tag or a stop string cuts it, and
        # any call (forced ones too) may meet the token limit. Its events are held until it closes,
        # so a client never gets half a call (which it would send back in its history); the text of
        # one that never does is the answer's content in "auto", and nothing where calls are forced
        self._held: list = []
        self._raw = ""
        self._gap = ""      # the blank between the text and the call being read

    def feed(self, text: str, end: bool = False) -> list[tuple]:
        """Events the text completes: ("content", str), ("name", index, id, name),
        ("args", index, fragment)."""
        self.buf += text
        out = []
        if not self.in_calls:
            i = self.buf.find(CALL_OPEN)
            if i < 0:
                if self.spec.structure is not None:
                    # an answer constrained to calls has no text of its own: what it wrote before
                    # the token limit cut it is the start of a call (or the blank before one)
                    if end:
                        self.buf = ""
                    return out
                keep = 0 if end else _partial(self.buf, CALL_OPEN)
                if self.spec.held and not end and not self.buf[:len(self.buf) - keep].strip():
                    keep = len(self.buf)   # blank text before what may be a call: not the answer's yet
                elif not end:   # nor the blank at the end of the text: a call may follow it
                    body = self.buf[:len(self.buf) - keep]
                    keep += len(body) - len(body.rstrip())
                text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                if end and self.spec.held and text.strip() and CALL_OPEN.startswith(text.strip()):
                    text = ""    # the start of a call the token limit cut (the grammar held it to one)
                if text:
                    out.append(("content", text))
                return out
            body = self.buf[:i].rstrip()
            if body:    # the text before the calls, without the blank before them
                out.append(("content", body))
            # ... which is the answer's again if the call never closes
            self._gap, self.buf, self.in_calls = self.buf[len(body):i], self.buf[i:], True
        while True:
            before = self.buf
            ev = self._step()
            if not ev:
                break
            self._raw += before[:len(before) - len(self.buf)]
            self._held += ev
            if self._args is None:     # the call closed
                if self.spec.parallel or len(self.calls) == 1:
                    out += self._held
                else:                  # one call at most (parallel_tool_calls false): later ones dropped
                    self.calls.pop()
                self._held, self._raw, self._gap = [], "", ""
        if end and self.open:   # a call that never closed: its text, not half a call
            self.calls.pop()
            self._args, self._held = None, []
            self.buf, self._raw, self._gap = self._gap + self._raw + self.buf, "", ""
        if end and self.buf.strip():
            # text that is no call: content (with the blank before it, when no call closed since);
            # but a constrained answer's rest is a call the token limit cut, never shown as half a call
            if not self.spec.held:
                out.append(("content", self._gap + self.buf))
            self.buf = self._gap = ""
        return out

    @property
    def open(self) -> bool:
        """A call has begun and not closed yet."""
        return self._args is not None

    @property
    def whole(self) -> list[dict]:
        """The calls that closed: calls close in order, so only the last can be open (cut by the
        token limit; its arguments may end in "}" all the same, an object value's)."""
        return self.calls[:-1] if self.open else self.calls

    def _param(self, text: str, function: str) -> tuple | None:
        """The parameter ``text`` begins with, once its closing tag is in: (name, value as
        written, end, its schema, the function's parameters schema)."""
        head = self.HEAD.match(text)
        if not head:
            return None
        params = self.spec.schemas.get(function, {})
        name = head.group(1).strip()
        schema = params.get("properties", {}).get(name, {})
        schema = schema if isinstance(schema, dict) else {}
        if self.spec.held and not _raw(schema):
            # a grammar wrote this value as JSON: it ends where the JSON does, and a string
            # inside it may hold the closing tag (the first tag after the JSON closes it)
            at = head.end() + len(text[head.end():]) - len(text[head.end():].lstrip())
            try:
                _, end = _DECODER.raw_decode(text, at)
            except ValueError:     # not whole yet
                return None
            close = _CLOSE.match(text, end)
            return (name, text[at:end], close.end(), schema, params) if close else None
        m = self.PARAM.match(text)
        return (name, m.group(2), m.end(), schema, params) if m else None

    def _step(self) -> list[tuple]:
        b = self.buf
        if self._args is None:
            m = re.match(r"\s*<tool_call>\s*<function=([^>\n]+)>\n?", b)
            if not m:
                return []
            name = m.group(1).strip()
            self.calls.append({"id": new_id(), "type": "function", "function": {"name": name, "arguments": ""}})
            self._args, self.buf = {}, b[m.end():]
            k = len(self.calls) - 1
            return [("name", k, self.calls[k]["id"], name)]
        k = len(self.calls) - 1
        fn = self.calls[k]["function"]
        b = b.lstrip("\n")
        got = self._param(b, fn["name"])
        if got:
            p, raw, end, schema, params = got
            self._args[p] = _typed(raw, schema, params, self.spec.held)
            try:
                value = json.dumps(self._args[p], ensure_ascii=False, allow_nan=False)
            except ValueError:   # a number past float's range: the model's own JSON text, not Infinity
                value = " ".join(raw.split())
            frag = ("{" if len(self._args) == 1 else ", ") + json.dumps(p) + ": " + value
            fn["arguments"] += frag
            self.buf = b[end:]
            return [("args", k, frag)]
        m = re.match(r"\s*</function>\s*</tool_call>", b)
        if m:
            frag = "{}" if not self._args else "}"
            fn["arguments"] += frag
            self._args, self.buf = None, b[m.end():]
            return [("args", k, frag)]
        return []


_DECODER = json.JSONDecoder()
_CLOSE = re.compile(r"\s*</parameter>")


def _partial(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that begins ``tag`` (held back while streaming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def parse(text: str, spec: ToolSpec) -> tuple[str, list[dict]]:
    """(content, tool_calls) of a whole answer: the content as a stream of it joins (blank text
    beside the calls is none of it)."""
    s = CallStream(spec)
    content = "".join(e[1] for e in s.feed(text, end=True) if e[0] == "content")
    return content, s.whole


def template_messages(messages: list) -> list:
    """Messages for the chat template: an assistant turn's ``tool_calls`` arguments (a JSON
    string in OpenAI's API) become the mapping the template iterates."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                      for c in calls):
                raise EdgevlError('an assistant message\'s tool_calls must be a list of {"id", "type": "function", '
                                  '"function": {"name", "arguments"}}')
            fixed = []
            for c in calls:
                fn = dict(c["function"])
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise EdgevlError(f"a tool call's arguments are not JSON ({args!r:.60}); send them as "
                                          "the JSON object the call returned") from None
                if not isinstance(args, dict):
                    raise EdgevlError("a tool call's arguments must be a JSON object")
                try:    # an escaped lone surrogate ("\\ud83d") parses, and no tokenizer takes it
                    json.dumps(args, ensure_ascii=False).encode("utf-8")
                except UnicodeEncodeError:
                    raise EdgevlError("a tool call's arguments contain invalid Unicode (a lone surrogate such as "
                                      "\\ud800); send valid UTF-8 text") from None
                fixed.append({**c, "function": {**fn, "arguments": args}})
            m = {**m, "tool_calls": fixed}
            if m.get("content") is None:
                m["content"] = ""
        out.append(m)
    return out


def _turn_error(i: int, msg: str) -> EdgevlError:
    e = EdgevlError(msg)
    e.param = f"messages[{i}]"      # the server's 400 names the message
    return e


def pair_results(messages: list) -> list:
    """The messages with each assistant turn's tool results (the role "tool" messages right after
    it) put in the order of its calls. Chat templates pair a result with a call by position (the
    ids are not rendered), so results sent in another order (tools run concurrently) would answer the
    wrong calls. Refused, naming the message, as OpenAI's API refuses them: a result with no call
    before it, one whose id names no call of the turn or a call already answered, calls that share
    an id, a call left without a result. Calls without ids (the Python API) pair by position."""
    out, i, n = [], 0, len(messages)
    while i < n:
        m = messages[i]
        role = m.get("role") if isinstance(m, dict) else None
        if role == "tool":
            raise _turn_error(i, f"messages[{i}] is a tool result with no assistant tool call before it; send the "
                                 "assistant message whose tool_calls it answers just before it")
        out.append(m)
        at, i = i, i + 1
        calls = m.get("tool_calls") if role == "assistant" else None
        if not calls:
            continue
        ids = [c.get("id") if isinstance(c, dict) else None for c in calls]
        odd = next((k for k, x in enumerate(ids) if x is not None and not isinstance(x, str)), None)
        if odd is not None:
            raise _turn_error(at, f"messages[{at}].tool_calls[{odd}].id must be a string, got {ids[odd]!r:.40}")
        named = [x for x in ids if x]
        if named and len(named) != len(ids):
            raise _turn_error(at, f"messages[{at}].tool_calls: some calls have an id and some do not; give each "
                                  "call the id its result's tool_call_id names")
        twice = next((x for k, x in enumerate(named) if x in named[:k]), None)
        if twice is not None:
            raise _turn_error(at, f"messages[{at}].tool_calls: two calls have the id {twice!r:.60}; give each call "
                                  "its own id")
        results = []
        while i < n and isinstance(messages[i], dict) and messages[i].get("role") == "tool":
            results.append((i, messages[i]))
            i += 1
        if named:
            by_id = {}
            for j, r in results:
                cid = r.get("tool_call_id")
                if cid is not None and not isinstance(cid, str):
                    raise _turn_error(j, f"messages[{j}].tool_call_id must be a string, got {cid!r:.40}")
                if not cid:
                    raise _turn_error(j, f"messages[{j}] needs a tool_call_id: the id of the call it answers "
                                         f"({', '.join(ids)[:200]})")
                if cid not in ids:
                    raise _turn_error(j, f"messages[{j}].tool_call_id {cid!r:.60} names no call of messages[{at}] "
                                         f"({', '.join(ids)[:200]}); send the id of the call it answers")
                if cid in by_id:
                    raise _turn_error(j, f"messages[{j}] answers the call {cid!r:.60} again (messages[{by_id[cid][0]}] "
                                         "did); send one result per call")
                by_id[cid] = (j, r)
            missing = [x for x in ids if x not in by_id]
            out.extend(by_id[x][1] for x in ids if x in by_id)
        else:
            if len(results) > len(calls):
                j = results[len(calls)][0]
                raise _turn_error(j, f"messages[{j}] is one tool result more than the {len(calls)} calls of "
                                     f"messages[{at}]; send one result per call")
            missing = [c["function"]["name"] if isinstance(c.get("function"), dict) else "?"
                       for c in calls[len(results):]]
            out.extend(r for _, r in results)
        if missing:
            raise _turn_error(at, f"messages[{at}] makes {len(ids)} tool call(s), and {len(missing)} of them "
                                  f"({', '.join(map(str, missing))[:200]}) have no tool result after it; send a role "
                                  "\"tool\" message for each call (its tool_call_id) right after the assistant message")
    return out
