"""Tool calling on Qwen3.5 (its own template's tools section and XML call format): calls forced
by tool_choice "required" / a named function always parse and validate against their parameters;
"auto" parses what the model writes; the call → result → answer round trip through the openai
client, plain and streamed; families without a call format and bad choices are one-line 400s."""

import json
import re

import jsonschema
import pytest

import edgevl
from edgevl import tools
from edgevl.errors import EdgevlError
from support.server import post

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["C", "F"]}, "hourly": {"type": "boolean"}},
        "required": ["city", "days"]}}}
COUNT = {"type": "function", "function": {
    "name": "count_items", "description": "Count things on a shelf",
    "parameters": {"type": "object", "properties": {
        "labels": {"type": "array", "items": {"enum": ["can", "box", "jar"]}, "minItems": 1, "maxItems": 3},
        "area": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                                  "y": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["x", "y"], "additionalProperties": False},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
        "required": ["labels", "area", "code"]}}}
TOOLS = [WEATHER, COUNT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]


def check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c["type"] == "function" and re.fullmatch(r"call_[0-9a-f]{24}", c["id"])
        name = c["function"]["name"]
        assert names is None or name in names
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[name])


def test_the_template_renders_the_tools_and_the_calls_back(qwen):
    spec = tools.prepare(qwen, TOOLS)
    ids = edgevl.generate.__globals__["prepare"](qwen, ASK, chat_template_kwargs={"tools": spec.render}).input_ids
    text = qwen.tokenizer.decode(ids, skip_special_tokens=False)
    assert "<tools>" in text and '"name": "get_weather"' in text
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 3}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    ids = edgevl.generate.__globals__["prepare"](qwen, turn, chat_template_kwargs={"tools": spec.render}).input_ids
    text = qwen.tokenizer.decode(ids, skip_special_tokens=False)
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>") in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


@pytest.mark.parametrize("choice, names", [
    ("required", None),
    ({"type": "function", "function": {"name": "count_items"}}, {"count_items"}),
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
])
def test_forced_calls_always_parse_and_validate(qwen, choice, names):
    for opts in (dict(temperature=0), dict(temperature=1.0, seed=1), dict(temperature=0.9, top_p=0.9, seed=2)):
        c = edgevl.complete(qwen, ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, thinking=False,
                            max_new_tokens=200, **opts)
        assert c.finish_reason == "tool_calls", c
        assert len(c.tool_calls) == 1 and c.text == ""
        check_calls(c.tool_calls, names)


def test_parallel_calls_where_allowed(qwen):
    """The call grammar takes a second call after the first only with parallel_tool_calls."""
    from edgevl import structured

    one = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n"
           "</parameter>\n</function>\n</tool_call>")
    ids = qwen.tokenizer.encode(one + "\n" + one)
    for parallel, want in ((True, len(ids)), (False, len(qwen.tokenizer.encode(one)))):
        spec = tools.prepare(qwen, TOOLS, "required", parallel)
        c = structured.compiled(qwen, spec.structure).constraint()
        assert c.valid_prefix(ids) == want
        content, calls = tools.parse(one + "\n" + one, spec)   # a second call read only where allowed
        assert len(calls) == (2 if parallel else 1) and content == ""


def test_forced_call_with_drafting_is_the_plain_one(qwen, qwen_plain):
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, thinking=False, temperature=0,
              max_new_tokens=200)
    a, b = edgevl.complete(qwen, ASK, **kw), edgevl.complete(qwen_plain, ASK, **kw)
    assert [c["function"] for c in a.tool_calls] == [c["function"] for c in b.tool_calls]


def test_auto_parses_what_the_model_writes():
    spec = tools.ToolSpec(TOOLS, "auto", schemas=SCHEMAS)
    text = ("Let me look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n<parameter=hourly>\ntrue\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=count_items>\n<parameter=labels>\n[\"can\"]\n</parameter>\n<parameter=area>\n"
            "{\"x\": 1, \"y\": 2}\n</parameter>\n<parameter=code>\nAB12\n</parameter>\n</function>\n</tool_call>")
    content, calls = tools.parse(text, spec)
    assert content == "Let me look."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "New York", "days": 2, "hourly": True}, {"labels": ["can"], "area": {"x": 1, "y": 2}, "code": "AB12"}]
    # streamed in any pieces: the same content, names first, fragments that join to the same arguments
    s = tools.CallStream(spec)
    events = [e for i in range(0, len(text), 7) for e in s.feed(text[i:i + 7])] + s.feed("", end=True)
    assert "".join(e[1] for e in events if e[0] == "content").strip() == content
    for k, c in enumerate(calls):
        mine = [e for e in events if e[0] != "content" and e[1] == k]
        assert mine[0][0] == "name" and mine[0][3] == c["function"]["name"]
        assert "".join(e[2] for e in mine[1:]) == json.dumps(json.loads(c["function"]["arguments"]))
    assert tools.parse("no calls at all <tool_", spec) == ("no calls at all <tool_", [])


def test_stop_strings_do_not_cut_forced_calls(qwen):
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0, max_new_tokens=200,
              thinking=False)
    want = edgevl.complete(qwen, ASK, **kw)
    assert want.finish_reason == "tool_calls"
    for stop in (["\n"], ["</tool_call>"], ["<parameter="]):
        c = edgevl.complete(qwen, ASK, stop=stop, **kw)
        assert c.finish_reason == "tool_calls" and [t["function"] for t in c.tool_calls] == [
            t["function"] for t in want.tool_calls], stop


def test_a_call_the_token_limit_cut_is_not_read_as_a_call():
    # a cut call whose last value ends in "}" must not pass for a whole one (its arguments would
    # not be JSON)
    spec = tools.ToolSpec(TOOLS, "auto", schemas=SCHEMAS)
    whole = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n"
             "2\n</parameter>\n</function>\n</tool_call>\n")
    cut = "<tool_call>\n<function=count_items>\n<parameter=area>\n{\"x\": 1, \"y\": 2}\n</parameter>\n"
    for text, names in ((cut, []), (whole + cut, ["get_weather"])):
        _, calls = tools.parse(text, spec)
        assert [c["function"]["name"] for c in calls] == names
        for c in calls:
            json.loads(c["function"]["arguments"])
        # the stream's reading (the server's finish_reason "tool_calls") counts the same calls
        stream = tools.CallStream(spec)
        stream.feed(text)
        assert [c["function"]["name"] for c in stream.whole] == names


def test_auto_and_none_leave_a_plain_answer(qwen):
    c = edgevl.complete(qwen, ASK, tools=TOOLS, thinking=False, temperature=0, max_new_tokens=12)
    assert c.tool_calls == [] and c.finish_reason == "length" and c.text
    c = edgevl.complete(qwen, ASK, tools=TOOLS, tool_choice="none", thinking=False, temperature=0, max_new_tokens=4)
    assert c.tool_calls == []


@pytest.mark.parametrize("kwargs, needle", [
    (dict(tool_choice={"type": "function", "function": {"name": "launch"}}), "names the function 'launch', which "
                                                                            "is not among the tools"),
    (dict(tool_choice="sometimes"), "tool_choice must be"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "function.name must be"),
    (dict(tools=[WEATHER, WEATHER]), "two tools are named"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
     "parameters must be a JSON schema of type object"),
])
def test_bad_tool_requests_are_one_line_errors(qwen, kwargs, needle):
    with pytest.raises(EdgevlError) as e:
        edgevl.complete(qwen, ASK, **{"tools": TOOLS, **kwargs})
    assert "\n" not in str(e.value) and needle in str(e.value), str(e.value)


def test_a_family_without_a_call_format_refuses_tools(tmp_path):
    from support.youtu import tiny_checkpoint

    pkg = edgevl.convert(tiny_checkpoint(tmp_path / "ck"), tmp_path / "pk", dtype="fp32", progress=False)
    model = edgevl.load(pkg)
    with pytest.raises(EdgevlError, match=r"this model \(youtu\S*\) has no tool-call format in its chat template"):
        edgevl.complete(model, ASK, tools=TOOLS)
    # a history with a call and its result: refused as the server does, not rendered without the call
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}
    for history, at in (([*ASK, call], 1), ([*ASK, {"role": "tool", "tool_call_id": "c1", "content": "21 C"}], 1)):
        with pytest.raises(EdgevlError, match=rf"messages\[{at}\]: a (assistant|tool) turn with tool calls or "
                           r"results needs a model whose chat template has a tool-call format; this model \(youtu"):
            edgevl.complete(model, history, max_new_tokens=2)
    from edgevl.server import make_server

    srv, _ = make_server(model, max_queue=1)
    try:
        code, reply, _ = post(srv.server_address[1], {"messages": ASK, "tools": TOOLS})
        assert code == 400 and "has no tool-call format" in reply["error"]["message"], reply
        assert reply["error"]["param"] == "tools"
        code, reply, _ = post(srv.server_address[1], {"messages": [*ASK, {"role": "tool", "content": "21 C"}]})
        assert code == 400 and "tool-call format" in reply["error"]["message"], reply
    finally:
        srv.stop()


# -- through the server and the openai client ---------------------------------------------------------

def test_round_trip_call_result_answer_plain_and_streamed(client):
    messages = list(ASK)
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    check_calls([call.model_dump()], {"get_weather"})
    # streamed: the same call, its name first, then argument fragments
    chunks = list(client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id and len(deltas) > 2
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the call and its result go back; the model answers (free text, or more calls: auto)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r2 = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0, max_tokens=16)
    assert r2.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    s2 = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0, max_tokens=16,
                                        stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in s2 if ch.choices) == (r2.choices[0].message.content
                                                                                    or "")


def test_required_choice_through_the_client_validates(client):
    for seed in (1, 2):
        r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1, seed=seed, max_tokens=200)
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls([c.model_dump() for c in r.choices[0].message.tool_calls])


def test_a_forced_call_the_token_limit_cuts_is_never_half_a_call_in_the_content(client, qwen):
    forced = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=forced, temperature=0,
                                       max_tokens=4)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert "<" not in (choice.message.content or ""), choice.message.content
    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=forced,
                                                 temperature=0, max_tokens=4, stream=True))
    assert "<" not in "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
    done = edgevl.complete(qwen, ASK, tools=TOOLS, tool_choice=forced, max_new_tokens=4, temperature=0,
                           thinking=False)
    assert done.finish_reason == "length" and not done.tool_calls and "<" not in done.text
    # streamed, a forced call the limit cuts is not announced either: a client kept the name and half
    # the arguments in its history, which then could not be sent back
    for budget in (12, 20, 28, 36):
        chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=forced,
                                                     temperature=0, max_tokens=budget, stream=True))
        if chunks[-1].choices[0].finish_reason == "length":
            assert not any(ch.choices and ch.choices[0].delta.tool_calls for ch in chunks), budget


@pytest.mark.parametrize("body, param, needle", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": TOOLS, "tool_choice": 3}, "tool_choice", "tool_choice must be"),
    ({"tools": "get_weather"}, "tools", "tools must be a list"),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated form"),
    ({"chat_template_kwargs": {"tools": TOOLS}}, "chat_template_kwargs.tools", "tools field"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[1].tool_calls", "not JSON"),
    # an escaped lone surrogate is valid JSON text and no tokenizer takes it
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                            "arguments": '{"v": "\\ud83d"}'}}]}]},
     "messages[1].tool_calls", "invalid Unicode"),
])
def test_bad_tool_requests_are_400s(server, body, param, needle):
    code, reply, _ = post(server.server_address[1], {"messages": ASK, **body})
    assert code == 400, reply
    assert reply["error"]["param"] == param and needle in reply["error"]["message"], reply
    assert "\n" not in reply["error"]["message"]


def test_call_tags_that_are_tokens_are_written_as_those_tokens(qwen_package, tmp_path):
    """Qwen's tokenizer has <tool_call> and </tool_call> as tokens of their own: a forced call
    uses them (the engine never spells an added token from text, and the model writes the token)."""
    from types import SimpleNamespace

    from edgevl import structured

    tok = tokenizer_with_tags(qwen_package, tmp_path, special=False)
    model = SimpleNamespace(tokenizer=tok, vocab_size=tok.vocab_size, eos_ids={tok.token_to_id("<|im_end|>")},
                            arch=SimpleNamespace(name="qwen3_5"))
    spec = tools.prepare(model, [WEATHER], "required", False)
    c = structured.compiled(model, spec.structure).constraint()
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n</function>\n</tool_call>")
    ids = tok.encode(call)
    assert ids[0] == tok.token_to_id("<tool_call>") and ids[-1] == tok.token_to_id("</tool_call>")
    assert c.valid_prefix(ids) == len(ids)
    assert c.valid_prefix(tok.encode("<tool_", special=False)) == 0   # not spelled out from text


def test_a_value_never_holds_the_tag_that_ends_it(qwen, server):
    """The call's reader ends a raw string value at the first </parameter>: the grammar lets no
    such value hold one (a free string, a pattern), and an enum or const that does is refused up
    front; a forced call holding one was written, then read as no call at all (an empty answer)."""
    from edgevl import structured

    tok = qwen.tokenizer
    for params in ({"city": {"type": "string"}}, {"city": {"type": "string", "pattern": "^[a-z<>/]+$"}}):
        fn = {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": params, "required": ["city"]}}}
        spec = tools.prepare(qwen, [fn], "required", False)
        c = structured.compiled(qwen, spec.structure)

        def whole(value, c=c):
            call = f"<tool_call>\n<function=f>\n<parameter=city>\n{value}\n</parameter>\n</function>\n</tool_call>"
            ids = tok.encode(call)
            return c.constraint().valid_prefix(ids) == len(ids)
        assert whole("rome"), params                       # what makes the next line prove something
        assert not whole("ro</parameter>me"), params
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "text": {"type": "string", "enum": ["ok", "x </parameter> y"]}}, "required": ["text"]}}}
    code, reply, _ = post(server.server_address[1], {"messages": ASK, "tools": [bad], "tool_choice": "required"})
    assert code == 400 and "</parameter>" in reply["error"]["message"], reply
    with pytest.raises(EdgevlError, match="</parameter>"):
        edgevl.complete(qwen, ASK, tools=[bad], tool_choice="required", max_new_tokens=8)


def test_a_json_value_may_hold_the_tag_that_ends_a_value(qwen, server):
    """A value the grammar writes as JSON (an object, an array, an optional string) is read as
    JSON: a string inside it may hold </parameter>, whole or streamed a character at a time,
    free or fixed by an enum or const (these were refused, or read as no call)."""
    from edgevl import structured

    tok = qwen.tokenizer
    cases = [({"type": "object", "properties": {"w": {"type": "string"}}, "required": ["w"]},
              {"w": "a </parameter>\n</function>\n</tool_call> b"}),
             ({"type": "array", "items": {"enum": ["ab", "a</parameter>b"]}}, ["a</parameter>b", "ab"]),
             ({"type": "object", "properties": {"w": {"const": "a</parameter>b"}}}, {"w": "a</parameter>b"}),
             ({"enum": [{"w": "a</parameter>b"}, 3]}, {"w": "a</parameter>b"}),
             ({"type": ["string", "null"]}, "x</parameter>y")]
    for schema, value in cases:
        fn = {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"v": schema, "n": {"type": "integer"}}, "required": ["v", "n"]}}}
        spec = tools.prepare(qwen, [fn], "required", False)
        text = (f"<tool_call>\n<function=f>\n<parameter=v>\n{json.dumps(value)}\n"
                "</parameter>\n<parameter=n>\n12\n</parameter>\n</function>\n</tool_call>")
        ids = tok.encode(text)
        assert structured.compiled(qwen, spec.structure).constraint().valid_prefix(ids) == len(ids), schema
        _, calls = tools.parse(text, spec)
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"v": value, "n": 12}], schema
        stream = tools.CallStream(spec)
        events = [e for ch in text for e in stream.feed(ch)] + stream.feed("", end=True)
        args = "".join(e[2] for e in events if e[0] == "args")
        assert json.loads(args) == {"v": value, "n": 12}, (schema, events)
        code, reply, _ = post(server.server_address[1], {"messages": ASK, "tools": [fn], "tool_choice": "required",
                                                         "max_tokens": 60})
        assert code == 200, reply
    # a raw string value still ends at its first closing tag, as the template writes it
    auto = tools.ToolSpec([], "auto", schemas={"f": {"properties": {"v": {"type": "object"}}}})
    _, (call,) = tools.parse("<tool_call>\n<function=f>\n<parameter=v>\n{\"w\": 1}\n</parameter>\n"
                             "</function>\n</tool_call>", auto)
    assert json.loads(call["function"]["arguments"]) == {"v": {"w": 1}}


def test_call_tags_a_tokenizer_marks_special_stay_in_the_answer(qwen_package, tmp_path):
    """Decoding skips special tokens: were a checkpoint to mark <tool_call> special, its calls
    would vanish from the text the parser reads. The answer keeps them; other specials still go."""
    from edgevl.generate import ReasoningSplitter

    tok = tokenizer_with_tags(qwen_package, tmp_path, special=True)
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n</function>\n</tool_call>")
    ids = tok.encode("Let me look.\n\n" + call) + [tok.token_to_id("<|im_end|>")]
    assert tok.token_to_id("<tool_call>") in ids and "<tool_call>" not in tok.decode(ids)
    split = ReasoningSplitter(tok, None, [])
    text = "".join(split.add(t)[0] for t in ids) + split.flush()[0]
    assert text == "Let me look.\n\n" + call
    content, calls = tools.parse(text, tools.ToolSpec(TOOLS, "auto", schemas=SCHEMAS))
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_weather"]


def tokenizer_with_tags(package, folder, special: bool):
    """The package's tokenizer with <tool_call> and </tool_call> as tokens of their own (special
    ones or plain added ones), in ``folder``."""
    import shutil

    from tokenizers import Tokenizer as HF

    from edgevl.tokenizer import Tokenizer

    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(package / f, folder / f)
    hf = HF.from_file(str(folder / "tokenizer.json"))
    (hf.add_special_tokens if special else hf.add_tokens)(["<tool_call>", "</tool_call>"])
    hf.save(str(folder / "tokenizer.json"))
    return Tokenizer(folder)


def test_tokenize_counts_the_tools_as_the_chat_endpoint_does(server):
    """POST /tokenize with messages and tools: the count is the chat request's prompt_tokens,
    tools rendered by the template included."""
    port = server.server_address[1]
    status, counted, _ = post(port, {"messages": ASK, "tools": TOOLS}, path="/tokenize")
    assert status == 200, counted
    plain = post(port, {"messages": ASK}, path="/tokenize")[1]["count"]
    status, reply, _ = post(port, {"messages": ASK, "tools": TOOLS, "max_tokens": 1})
    assert status == 200 and counted["count"] == reply["usage"]["prompt_tokens"] > plain + 20
    status, reply, _ = post(port, {"messages": ASK, "tools": [{"type": "function"}]}, path="/tokenize")
    assert status == 400 and reply["error"]["param"] == "tools", reply


PYDANTIC_LIKE = {"type": "function", "function": {"name": "GetWeather", "parameters": {
    "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                       "country": {"enum": ["FR", "DE"]}},
                      "required": ["city", "country"], "additionalProperties": False}},
    "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}, "days": {"type": "integer", "minimum": 1,
                                                                               "maximum": 7}},
    "required": ["loc", "days"], "additionalProperties": False}}}
STRINGS = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {
        "id": {"type": "string", "format": "uuid"}, "when": {"type": "string", "format": "date-time"},
        "path": {"type": "string", "pattern": "^a\\/[0-9]{2}$"}, "n": {"type": "integer"}},
    "required": ["id", "when", "path", "n", "note"]}}}    # "note": required, not described


@pytest.mark.parametrize("tool", [PYDANTIC_LIKE, STRINGS], ids=["defs-and-refs", "formats-escapes-required"])
def test_forced_calls_follow_the_whole_parameter_schema(qwen, tool):
    """Tools as openai.pydantic_function_tool writes them ($defs, $ref), string formats, an escaped
    slash in a pattern, a required parameter the properties leave out: the forced call validates."""
    from jsonschema import Draft202012Validator, FormatChecker

    params = tool["function"]["parameters"]
    for opts in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        c = edgevl.complete(qwen, ASK, tools=[tool], tool_choice="required", parallel_tool_calls=False,
                            thinking=False, max_new_tokens=300, **opts)
        assert c.finish_reason == "tool_calls", c
        (call,) = c.tool_calls
        args = json.loads(call["function"]["arguments"])
        errors = [e.message for e in Draft202012Validator(params, format_checker=FormatChecker()).iter_errors(args)]
        assert not errors, (errors, args)


def test_a_tool_schema_that_cannot_be_constrained_names_the_tool(qwen):
    bad = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}, "required": ["x"]}}}
    with pytest.raises(EdgevlError, match=r"the parameters of function 'tag' \(parameter 'x'\) cannot be constrained "
                                          r"\(uses JSON Schema keywords .*: uniqueItems\)"):
        edgevl.complete(qwen, ASK, tools=[WEATHER, bad], tool_choice="required")
    edgevl.complete(qwen, ASK, tools=[WEATHER, bad], max_new_tokens=2, thinking=False)   # auto: not constrained


@pytest.mark.parametrize("keyword", [{"not": {"const": "a"}}, {"if": {"maxLength": 2}}, {"uniqueItems": True}])
def test_a_string_parameters_unsupported_keyword_is_refused_not_dropped(qwen, keyword):
    """A string parameter is written raw and held by a regex of its pattern, format and lengths;
    another keyword the engine cannot hold was dropped without a word (a JSON answer refuses it)."""
    bad = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "maxLength": 4, **keyword}}, "required": ["x"]}}}
    key = next(iter(keyword))
    with pytest.raises(EdgevlError, match=rf"'tag' cannot be constrained \(Unimplemented keys: \[\"{key}\"\]\)"):
        edgevl.complete(qwen, ASK, tools=[bad], tool_choice="required")


def test_control_token_text_beside_a_turn_of_calls_stays_plain_text(qwen):
    """A tool result (a file, a model card) or a later question may hold ChatML text: it is plain
    text, also after an assistant turn of calls only, whose empty content the template branches on
    (it was refused: "this chat template cannot keep it as plain text")."""
    from edgevl.generate import prepare

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                            "arguments": '{"city": "Paris", "days": 2}'}}
    end = qwen.tokenizer.token_to_id("<|im_end|>")

    def turns(text, content):
        return [*ASK, {"role": "assistant", "content": content, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": f"The file says {text} here."},
                {"role": "user", "content": f"And {text}?"}]
    for content in (None, ""):
        plain = prepare(qwen, turns("X", content), chat_template_kwargs={"tools": TOOLS}).input_ids
        typed = prepare(qwen, turns("<|im_end|>", content), chat_template_kwargs={"tools": TOOLS}).input_ids
        assert typed.count(end) == plain.count(end) and len(typed) > len(plain)


def test_what_sdks_replay_in_a_history_is_taken_or_named(server):
    """An earlier answer's refusal part (the openai SDK's types) is that turn's text; a system
    message after the conversation began, which Qwen's template refuses, is named."""
    port = server.server_address[1]
    said = [*ASK, {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]}, *ASK]
    as_text = [*ASK, {"role": "assistant", "content": "I cannot."}, *ASK]
    a, b = (post(port, {"messages": m, "max_tokens": 3, "temperature": 0}) for m in (said, as_text))
    assert a[0] == b[0] == 200 and a[1]["choices"][0]["message"] == b[1]["choices"][0]["message"], a
    late = [*ASK, {"role": "assistant", "content": "Sunny."}, {"role": "system", "content": "Be brief."}, *ASK]
    code, reply, _ = post(port, {"messages": late, "max_tokens": 3})
    assert code == 400 and reply["error"]["param"] == "messages[2]", reply
    assert "messages[2] is a system message after the conversation began" in reply["error"]["message"], reply


def test_top_level_keywords_a_call_cannot_hold_are_refused_naming_the_tool(qwen):
    """The call grammar writes the listed parameters: keywords about the object as a whole
    (dependentRequired, a top-level anyOf...) would be silently ignored in a forced call."""
    for extra in ({"dependentRequired": {"days": ["city"]}}, {"anyOf": [{"required": ["city"]}]}):
        params = {**WEATHER["function"]["parameters"], **extra}
        tool = {"type": "function", "function": {"name": "weather2", "parameters": params}}
        with pytest.raises(EdgevlError, match=f"function 'weather2' cannot be constrained \\(top-level keywords "
                                              f"'{next(iter(extra))}'"):
            edgevl.complete(qwen, ASK, tools=[WEATHER, tool], tool_choice="required")
    # pydantic's and strict mode's own keywords are held (or say nothing to hold)
    strict = {**WEATHER["function"]["parameters"], "title": "W", "additionalProperties": False, "$defs": {}}
    tools.prepare(qwen, [{"type": "function", "function": {"name": "w", "parameters": strict}}], "required")


def test_thousands_of_forced_tools_are_refused_at_once_as_a_list(qwen):
    """Every tool goes into the grammar of a forced call: past the grammar size limit the list is
    refused before anything compiles (20 000 tools took a minute of CPU, then blamed the first)."""
    many = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}} for i in range(3000)]
    with pytest.raises(EdgevlError, match="the grammar of calls to 3000 functions is too large to compile "
                       r"\(\d+ characters") as e:
        tools.prepare(qwen, many, "required")
    assert "'f0'" not in str(e.value)
    assert tools.prepare(qwen, many[:3], "required").structure is not None


def test_a_call_that_never_closes_is_the_answers_text_not_half_a_call():
    """"auto": a model that drops a closing tag (or a stop string that cuts the call) leaves a call
    that never closes; its text is the answer's content as written, and no call is announced,
    streamed or not (a client was left holding a call with empty arguments)."""
    spec = tools.ToolSpec(TOOLS, "auto", schemas=SCHEMAS)
    text = "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"
    assert tools.parse(text, spec) == (text, [])
    s = tools.CallStream(spec)
    events = [e for i in range(0, len(text), 5) for e in s.feed(text[i:i + 5])] + s.feed("", end=True)
    assert all(e[0] == "content" for e in events) and "".join(e[1] for e in events) == text


def test_a_call_the_limit_cut_in_auto_beside_a_format_is_not_the_answers_text():
    """"auto" with a response_format: the grammar held the answer to the format or to calls, so a
    call's start that the token limit cut is neither (it came back as content, and streamed with
    another separator than not); a cut answer in the format stays the answer's text."""
    one = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n"
           "</parameter>\n</function>\n</tool_call>")
    held = tools.ToolSpec(TOOLS, "auto", schemas=SCHEMAS, constrained=True)
    for text, content, n in ((one + "\n<to", "", 1), ("<tool_call>\n<function=get_w", "", 0), ("\n<to", "", 0),
                             ('{"answer": "x', '{"answer": "x', 0)):
        got, calls = tools.parse(text, held)
        assert (got, len(calls)) == (content, n), text
        for step in (1, 3, 7):
            s = tools.CallStream(held)
            events = [e for i in range(0, len(text), step) for e in s.feed(text[i:i + step])] + s.feed("", end=True)
            assert "".join(e[1] for e in events if e[0] == "content") == content, (text, step)
            assert len([e for e in events if e[0] == "name"]) == n
    free = tools.ToolSpec(TOOLS, "auto", schemas=SCHEMAS)      # no format: what is written is the text
    assert tools.parse("\n<to", free) == ("\n<to", [])


def test_parallel_tool_calls_false_gives_one_call_in_auto():
    spec = tools.ToolSpec(TOOLS, "auto", parallel=False, schemas=SCHEMAS)
    one = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n{}\n</parameter>\n</function>\n</tool_call>\n")
    content, calls = tools.parse(one.format("Paris") + one.format("Rome"), spec)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
    s = tools.CallStream(spec)
    events = s.feed(one.format("Paris") + one.format("Rome"), end=True)
    assert [e[3] for e in events if e[0] == "name"] == ["get_weather"]


def test_a_number_past_floats_range_stays_json_in_the_arguments():
    """A model may write 5.8e2325 (valid JSON): the arguments keep its text, not Infinity, which
    strict JSON parsers (JSON.parse) refuse."""
    spec = tools.ToolSpec(TOOLS, "auto", schemas=SCHEMAS)
    text = ("<tool_call>\n<function=count_items>\n<parameter=area>\n{\"x\": 5.8e2325, \"y\": 1}\n</parameter>\n"
            "</function>\n</tool_call>")
    _, (call,) = tools.parse(text, spec)

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    args = json.loads(call["function"]["arguments"], parse_constant=refuse)
    assert args["area"]["y"] == 1 and "5.8e2325" in call["function"]["arguments"]


SHAPES = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "n"], "additionalProperties": False}


def test_auto_with_a_response_format_answers_in_it_or_calls(qwen, server):
    """OpenAI applies a response format to the text answer: with tools on "auto" the model may
    still call (agent frameworks send both when an agent has tools and an output type). Pushed
    towards the call tag it calls, and the call validates; pushed away it answers in the schema.
    A forced choice with a format is calls only (the format has no text to apply to)."""
    # the call tag's first token (this tokenizer spells the tag): a JSON answer starts otherwise
    tag = qwen.tokenizer.tok.encode("<tool_call>", add_special_tokens=False).ids[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "shape", "schema": SHAPES}}
    for bias, calls in (({tag: 100}, True), ({tag: -100}, False)):
        c = edgevl.complete(qwen, ASK, tools=TOOLS, response_format=fmt, logit_bias=bias, thinking=False,
                            temperature=0, max_new_tokens=200, parallel_tool_calls=False)
        if calls:
            check_calls(c.tool_calls)
            assert c.finish_reason == "tool_calls" and not c.text.strip(), c
            with pytest.raises(EdgevlError, match="the answer is tool calls"):
                print(c.json)
        else:
            assert c.tool_calls == [] and c.finish_reason == "stop", c
            jsonschema.validate(c.json, SHAPES)
    code, reply, _ = post(server.server_address[1], {"messages": ASK, "tools": TOOLS, "response_format": fmt,
                                                     "logit_bias": {str(tag): 100}, "max_tokens": 200,
                                                     "parallel_tool_calls": False,
                                                     "chat_template_kwargs": {"enable_thinking": False}})
    assert code == 200, reply
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    check_calls(choice["message"]["tool_calls"])
    for where in ("api", "server"):
        if where == "api":
            c = edgevl.complete(qwen, ASK, tools=TOOLS, tool_choice="required", response_format=fmt, thinking=False,
                                max_new_tokens=200)
            calls = c.tool_calls
        else:
            code, reply, _ = post(server.server_address[1], {"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                                             "response_format": fmt, "max_tokens": 200})
            assert code == 200, reply
            calls = reply["choices"][0]["message"]["tool_calls"]
        check_calls(calls)


HOSTS = {"type": "function", "function": {"name": "probe", "parameters": {
    "type": "object", "properties": {
        "addr": {"type": "string", "format": "ipv6"}, "host": {"type": "string", "format": "hostname", "maxLength": 40},
        "link": {"type": "string", "format": "uri", "maxLength": 40}, "every": {"type": "string", "format": "duration"},
        "code": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 5},
        "short": {"type": "string", "format": "hostname", "maxLength": 6}},
    "required": ["addr", "host", "link", "every", "code", "short"]}}}


def _well_formed(args: dict) -> list:
    """Checks of the formats written apart from edgevl's regexes (jsonschema checks ipv6 here)."""
    from urllib.parse import urlsplit

    bad = []
    for label in args["host"].split(".") + args["short"].split("."):
        if not (0 < len(label) <= 63 and re.fullmatch(r"[A-Za-z0-9-]+", label) and label[0] != "-" != label[-1]):
            bad.append(f"host label {label!r}")
    if not urlsplit(args["link"]).scheme or re.search(r"\s", args["link"]):
        bad.append(f"uri {args['link']!r}")
    if not re.fullmatch(r"P(\d+W|(?=\d|T\d)(\d+Y)?(\d+M)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+S)?)?)", args["every"]):
        bad.append(f"duration {args['every']!r}")
    return bad


def test_forced_calls_hold_string_formats_and_lengths_beside_patterns(qwen):
    """Each string format the grammar engine knows for JSON is held in a raw parameter too, and a
    length limit beside a pattern or format holds (it was dropped: a value ran to the token limit);
    a format no regex is known for is refused, naming the function, as the engine refuses it in JSON."""
    from jsonschema import Draft202012Validator, FormatChecker

    params = HOSTS["function"]["parameters"]
    for seed in range(3):
        c = edgevl.complete(qwen, ASK, tools=[HOSTS], tool_choice="required", parallel_tool_calls=False,
                            thinking=False, max_new_tokens=400, temperature=1.0, seed=seed)
        assert c.finish_reason == "tool_calls", c
        args = json.loads(c.tool_calls[0]["function"]["arguments"])
        errors = [e.message for e in Draft202012Validator(params, format_checker=FormatChecker()).iter_errors(args)]
        assert not errors and not _well_formed(args), (errors, _well_formed(args), args)
    iri = {"type": "function", "function": {"name": "visit", "parameters": {
        "type": "object", "properties": {"at": {"type": "string", "format": "iri"}}, "required": ["at"]}}}
    with pytest.raises(EdgevlError, match=r"the parameters of function 'visit' cannot be constrained "
                                          r"\(Unknown format: iri\)"):
        edgevl.complete(qwen, ASK, tools=[WEATHER, iri], tool_choice="required")


def test_optional_strings_and_string_enums_by_reference_stay_strings():
    """A model writes string values raw: an optional string (anyOf string/null, a type list) or an
    enum of strings behind $ref, written as 12 or true, is that string, not a number or boolean;
    null is null where the schema allows it, and quotes written around a string are its own."""
    params = {"$defs": {"Level": {"enum": ["1", "2"], "type": "string"}}, "type": "object", "properties": {
        "order": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "note": {"type": ["string", "null"]},
        "level": {"$ref": "#/$defs/Level"}, "count": {"type": "integer"}, "either": {"type": ["string", "integer"]}}}
    spec = tools.ToolSpec([], "auto", schemas={"f": params})

    def read(values: dict) -> dict:
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
        _, (call,) = tools.parse(f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>", spec)
        return json.loads(call["function"]["arguments"])

    assert read({"order": "12", "note": "true", "level": "2", "count": "3", "either": "4"}) == \
        {"order": "12", "note": "true", "level": "2", "count": 3, "either": 4}
    # quotes a model wrote are the string's, as a plain string's are kept
    assert read({"order": "null", "note": "x y", "level": "1"}) == {"order": None, "note": "x y", "level": "1"}
    assert read({"order": '"exact phrase"'}) == {"order": '"exact phrase"'}
    jsonschema.validate(read({"order": "12", "note": "true", "level": "2"}), params)


def _call(cid, city):
    return {"id": cid, "type": "function", "function": {"name": "get_weather",
                                                        "arguments": json.dumps({"city": city, "days": 1})}}


TWO_CALLS = {"role": "assistant", "content": None, "tool_calls": [_call("c1", "Paris"), _call("c2", "Rome")]}
PARIS, ROME = ({"role": "tool", "tool_call_id": c, "content": w} for c, w in (("c1", "rain"), ("c2", "sun")))


def test_results_answer_their_calls_by_id_in_any_order(qwen, server):
    """Qwen's template pairs results with calls by position and drops the ids: results sent in
    another order than the calls (tools run concurrently) are put in the calls' order, in the
    API and the server alike."""
    prepare = edgevl.generate.__globals__["prepare"]
    in_order, swapped = [*ASK, TWO_CALLS, PARIS, ROME], [*ASK, TWO_CALLS, ROME, PARIS]
    a, b = (prepare(qwen, m, chat_template_kwargs={"tools": TOOLS}).input_ids for m in (in_order, swapped))
    assert a == b
    text = qwen.tokenizer.decode(b, skip_special_tokens=False)
    assert text.index("<tool_response>\nrain\n") < text.index("<tool_response>\nsun\n")
    port = server.server_address[1]
    a, b = (post(port, {"messages": m, "tools": TOOLS}, path="/tokenize") for m in (in_order, swapped))
    assert a[0] == b[0] == 200 and a[1]["tokens"] == b[1]["tokens"], (a, b)


TURN_MISTAKES = [
    ([*ASK, PARIS], "messages[1]", "no assistant tool call before it"),
    ([*ASK, TWO_CALLS, {**PARIS, "tool_call_id": "c9"}, ROME], "messages[2]", "'c9' names no call of messages[1]"),
    ([*ASK, TWO_CALLS, {"role": "tool", "content": "rain"}, ROME], "messages[2]", "needs a tool_call_id"),
    ([*ASK, TWO_CALLS, PARIS, *ASK], "messages[1]", "1 of them (c2) have no tool result"),
    ([*ASK, TWO_CALLS], "messages[1]", "2 of them (c1, c2) have no tool result"),
    ([*ASK, TWO_CALLS, PARIS, PARIS], "messages[3]", "answers the call 'c1' again"),
    ([*ASK, {**TWO_CALLS, "tool_calls": [_call("c1", "Paris"), _call("c1", "Rome")]}, PARIS, PARIS],
     "messages[1].tool_calls", "two calls have the id 'c1'"),
    ([*ASK, {**TWO_CALLS, "tool_calls": [_call(1, "Paris")]}, {**PARIS, "tool_call_id": "1"}],
     "messages[1].tool_calls", "tool_calls[0].id must be a string, got 1"),
]


@pytest.mark.parametrize("messages,where,needle", TURN_MISTAKES, ids=[t[2][:20] for t in TURN_MISTAKES])
def test_tool_turns_that_do_not_pair_are_refused_naming_the_message(qwen, server, messages, where, needle):
    """What OpenAI's API refuses in a history of calls and results is a one-line 400 naming the
    message (and an EdgevlError in the API), never a prompt that pairs results with other calls."""
    code, reply, _ = post(server.server_address[1], {"messages": messages, "tools": TOOLS, "max_tokens": 2})
    assert code == 400, reply
    assert needle in reply["error"]["message"] and "\n" not in reply["error"]["message"], reply
    assert reply["error"]["param"] == where.split(".")[0], reply
    with pytest.raises(EdgevlError, match=re.escape(needle)):
        edgevl.generate(qwen, messages, tools=TOOLS, max_new_tokens=2)


def test_calls_without_ids_pair_by_position_in_the_api(qwen):
    plain = {**TWO_CALLS, "tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in TWO_CALLS["tool_calls"]]}
    results = [{"role": "tool", "content": "rain"}, {"role": "tool", "content": "sun"}]
    prepare = edgevl.generate.__globals__["prepare"]
    assert prepare(qwen, [*ASK, plain, *results]).input_ids == prepare(qwen, [*ASK, TWO_CALLS, PARIS, ROME]).input_ids
    with pytest.raises(EdgevlError, match=r"messages\[4\] is one tool result more than the 2 calls"):
        prepare(qwen, [*ASK, plain, *results, results[0]])


def test_a_tool_loops_thinking_goes_back_into_the_prompt(server):
    """An assistant turn replayed with its reasoning_content (as the openai SDK returns it) after
    the last user message: Qwen's template keeps that thinking, so the prompt holds it (and
    matches the tokens the answer was)."""
    port = server.server_address[1]
    turn = {**TWO_CALLS, "reasoning_content": "Two cities, two calls."}
    said, bare = (post(port, {"messages": [*ASK, t, PARIS, ROME], "tools": TOOLS}, path="/tokenize")
                  for t in (turn, TWO_CALLS))
    assert said[0] == bare[0] == 200
    text = server.model.tokenizer.decode(said[1]["tokens"], skip_special_tokens=False)
    assert "<think>\nTwo cities, two calls.\n</think>" in text and said[1]["count"] > bare[1]["count"]
    code, reply, _ = post(port, {"messages": [*ASK, {**turn, "reasoning_content": 3}, PARIS, ROME], "tools": TOOLS})
    assert code == 400 and reply["error"]["param"] == "messages[1].reasoning_content", reply


BAD_PARAMETERS = [
    {"type": "object", "properties": {"days": {"type": "integr"}}},
    {"type": "object", "properties": {"days": 5}},
    {"type": "object", "properties": {"days": {"type": "integer"}}, "required": "days"},
    {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}},
    {"type": "object", "properties": {"me": {"$ref": "#/properties/me"}}, "required": ["me"]},
    # a thousand $defs each holding the next: the grammar engine's compile would overflow its stack
    {"$defs": {**{f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
                  for i in range(1000)}, "d1000": {"type": "string"}},
     "type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}},
]


@pytest.mark.parametrize("params", BAD_PARAMETERS, ids=["type", "not-a-schema", "required", "ref", "endless", "deep"])
@pytest.mark.parametrize("choice", ["auto", "none", "required"])
def test_a_tool_schema_that_is_not_one_is_refused_whatever_the_choice(server, params, choice):
    """An agent that sends "auto" on most turns meets the 400 on its first turn, not on the turn
    it asks for "required"."""
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    code, reply, _ = post(server.server_address[1], {"messages": ASK, "tools": [tool], "tool_choice": choice,
                                                     "max_tokens": 2})
    assert code == 400 and reply["error"]["param"] == "tools", reply
    assert "tools[0].function.parameters is not a valid JSON schema" in reply["error"]["message"], reply


@pytest.mark.parametrize("keyword", [{"uniqueItems": True}, {"if": {"minItems": 1}, "then": {"maxItems": 2}}])
def test_valid_keywords_no_grammar_holds_are_taken_in_auto_only(qwen, keyword):
    """A valid schema the call grammar cannot hold is rendered for the model under "auto" (nothing
    constrains it there) and refused, naming the tool, where the grammar must hold it."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}, **keyword}}}}}
    assert tools.prepare(qwen, [tool], "auto").choice == "auto"
    with pytest.raises(EdgevlError, match="'f'") as e:
        tools.prepare(qwen, [tool], "required")
    # named: the parameter, and the keyword in our words (not the engine's place in its grammar text)
    assert "(parameter 'xs')" in str(e.value) and not re.search(r"at \d+\(\d+\)", str(e.value))
    # patterns are ECMA-262's (lookaround, \p{Lu}, \b), which the engine's dialect lacks in part: not
    # judged where nothing holds them, refused where the grammar must
    for pattern in ["^(?=.*\\d)(?=.*\\p{Lu}).{8,}$", "^\\b\\w+\\b$", "(("]:
        patterned = {"type": "function", "function": {"name": "g", "parameters": {
            "type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}}}
        assert tools.prepare(qwen, [patterned], "auto").choice == "auto"
        with pytest.raises(EdgevlError, match="'g'"):
            tools.prepare(qwen, [patterned], "required")
    # old drafts' `"required": true` on a property, a `true` branch beside a cycle: valid, taken
    for params in [{"type": "object", "properties": {"s": {"type": "string", "required": True}}},
                   {"type": "object", "properties": {"a": {"anyOf": [True, {"$ref": "#"}]}}, "required": ["a"]}]:
        assert tools.prepare(qwen, [{"type": "function", "function": {"name": "h", "parameters": params}}])


def test_a_forced_answer_says_content_null_streamed_and_not(client):
    """The answer of a forced choice is calls, never text: content is null, from the first
    streamed delta (the SDK's stream helper then ends with None, as the plain answer says)."""
    kw = dict(model="m", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=2)
    cut = client.chat.completions.create(**kw)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content is None
    first = next(iter(client.chat.completions.create(**kw, stream=True)))
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content is None
    assert first.choices[0].delta.model_dump()["content"] is None


def test_a_conversation_without_a_user_message_names_it(server):
    code, reply, _ = post(server.server_address[1], {"messages": [{"role": "system", "content": "Be brief."},
                                                                  TWO_CALLS, PARIS, ROME], "tools": TOOLS})
    assert code == 400 and reply["error"]["param"] == "messages", reply
    assert "no user message" in reply["error"]["message"], reply
    code, reply, _ = post(server.server_address[1], {"messages": ASK, "tools": TOOLS,
                                                     "tool_choice": {"type": "function", "name": "get_weather"}})
    assert code == 400 and "the Responses API's form" in reply["error"]["message"], reply
