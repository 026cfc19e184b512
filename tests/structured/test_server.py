"""Structured output through `edgevl serve`: OpenAI's response_format and vLLM's extension, plain
and streamed, through the openai client; every bad structure a one-line 400 before it queues."""

import json
import re

import jsonschema
import pytest

from support.schemas import SCHEMAS
from support.server import post

MSGS = [{"role": "user", "content": "Read the meter."}]


def test_json_schema_response_format_through_the_openai_client(client):
    schema = SCHEMAS["camera_event"]
    rf = {"type": "json_schema", "json_schema": {"name": "event", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model="m", messages=MSGS, response_format=rf, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=MSGS, response_format=rf, temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == r.choices[0].message.content and len([p for p in pieces if p]) > 1


def test_json_object_and_sampling(client):
    done = 0
    for seed in range(6):   # keys of any length: a random model may run on with one (finish "length")
        r = client.chat.completions.create(model="m", messages=MSGS, response_format={"type": "json_object"},
                                           temperature=0.7, seed=seed, max_tokens=200)
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
            done += 1
    assert done >= 2


def test_pydantic_parse_helper(client):
    pydantic = pytest.importorskip("pydantic")

    class Reading(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        value: int = pydantic.Field(ge=0, le=99)
        ok: bool

    r = client.beta.chat.completions.parse(model="m", messages=MSGS, response_format=Reading, temperature=1, seed=2)
    assert isinstance(r.choices[0].message.parsed, Reading)


@pytest.mark.parametrize("body, check", [
    ({"structured_outputs": {"regex": r"[0-9]{3}-[A-Z]{2}"}}, lambda t: re.fullmatch(r"[0-9]{3}-[A-Z]{2}", t)),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"grammar": 'root ::= ("on" | "off") " " [0-9]'}},
     lambda t: re.fullmatch(r"(on|off) \d", t)),
    ({"structured_outputs": {"json": SCHEMAS["meter"]}}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS["meter"])
     or True),
    ({"guided_choice": ["a1", "b2"]}, lambda t: t in ("a1", "b2")),
    ({"response_format": {"type": "regex", "regex": "[a-c]{4}"}}, lambda t: re.fullmatch("[a-c]{4}", t)),
])
def test_extension_regex_choice_grammar(server, body, check):
    for seed in (1, 2):
        code, reply, _ = post(server.server_address[1], {"messages": MSGS, "temperature": 1.0, "seed": seed, **body})
        assert code == 200, reply
        text = reply["choices"][0]["message"]["content"]
        assert check(text), text


@pytest.mark.parametrize("body, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
     "response_format", "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                        "if": {}}}}},
     "response_format", r"does not support \(.*if"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "with a schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type must be one of"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"enum": [f"a long enumeration value {i}" for i in range(100_000)]}}}}, "response_format",
     "too large to compile"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "unclosed group"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs", "does not parse"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of json"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "not several"),
    # named as the request names them (not as the response_format they are read into)
    ({"guided_json": "not json"}, "guided_json", "^guided_json is not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "^guided_choice must be a non-empty list"),
    ({"structured_outputs": {"json": {"type": "strnig"}}}, "structured_outputs",
     r"^structured_outputs cannot be used \(Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}}}},
     "response_format", "admits no finite value"),
])
def test_bad_structures_are_400s_in_one_line(server, body, param, needle):
    code, reply, _ = post(server.server_address[1], {"messages": MSGS, **body})
    assert code == 400, reply
    err = reply["error"]
    assert err["param"] == param and err["code"] == "invalid_response_format", err
    assert "\n" not in err["message"] and re.search(needle, err["message"]), err["message"]
    code, reply, _ = post(server.server_address[1], {"messages": MSGS, "max_tokens": 2})
    assert code == 200     # the server goes on


def test_text_response_format_is_free_text(server):
    code, reply, _ = post(server.server_address[1], {"messages": MSGS, "max_tokens": 8, "temperature": 0,
                                                      "response_format": {"type": "text"}})
    assert code == 200 and reply["choices"][0]["finish_reason"] == "length"


def test_thinking_stays_free_and_apart_the_answer_follows_the_schema(server):
    schema = SCHEMAS["meter"]
    code, reply, _ = post(server.server_address[1], {
        "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 300,
        "chat_template_kwargs": {"enable_thinking": True},
        "response_format": {"type": "json_schema", "json_schema": {"name": "meter", "schema": schema}}})
    assert code == 200, reply
    msg = reply["choices"][0]["message"]
    assert reply["choices"][0]["finish_reason"] == "stop" and msg["reasoning_content"]
    with pytest.raises(ValueError):
        json.loads(msg["reasoning_content"])
    jsonschema.validate(json.loads(msg["content"]), schema)


def test_legacy_text_offsets_count_characters_as_the_stream_does(server):
    """/v1/completions' text_offset: where each token's text starts, in characters. Tokens that
    hold part of a character (byte-level BPE) add nothing until it is whole, unstreamed as streamed."""
    port = server.server_address[1]
    body = {"prompt": "p", "max_tokens": 20, "logprobs": 0, "response_format": {"type": "regex", "regex": "你好 ok"}}
    code, reply, _ = post(port, body, path="/v1/completions")
    assert code == 200, reply
    text, offsets = reply["choices"][0]["text"], reply["choices"][0]["logprobs"]["text_offset"]
    assert text == "你好 ok" and len(offsets) > len(text)     # bytes of a character in tokens of their own
    code, raw, _ = post(port, {**body, "stream": True}, path="/v1/completions")
    chunks = [json.loads(line[6:])["choices"][0] for line in raw.decode().split("\n")
              if line.startswith("data: {") and json.loads(line[6:]).get("choices")]
    streamed = [o for c in chunks if c.get("logprobs") for o in c["logprobs"]["text_offset"]]
    assert offsets == streamed
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    # a special token the text leaves out adds nothing (its 13 characters ran every later offset past the text)
    tok = server.model.tokenizer
    special = next(tok.token_to_id(t) for t in tok.special_tokens
                   if tok.token_to_id(t) not in server.model.eos_ids and "pad" in t)
    body = {"prompt": "p", "max_tokens": 6, "logprobs": 0, "temperature": 1.0, "seed": 3,
            "logit_bias": {str(special): 30}}
    code, reply, _ = post(port, body, path="/v1/completions")
    choice = reply["choices"][0]
    assert tok.id_to_token(special) in choice["logprobs"]["tokens"], choice          # the test's premise
    assert max(choice["logprobs"]["text_offset"]) <= len(choice["text"]), choice
