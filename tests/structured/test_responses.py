"""`POST /v1/responses` (OpenAI's Responses API) through the openai client: each request answers as
its chat completion does (text, instructions, images, JSON schemas, tool calls and their results,
thinking), streamed as the typed events that build the same response; what it cannot take is a
one-line 400."""

import base64
import io
import json
import re

import jsonschema
import numpy as np
import pytest
from PIL import Image

import edgevl
from edgevl.server import make_server
from support.schemas import SCHEMAS
from support.server import post

ASK = "Read the meter."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
FLAT_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
             "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in FLAT_TOOL.items() if k != "type"}}


def chat(client, messages, **kw):
    return client.chat.completions.create(model="m", messages=messages, temperature=0, **kw)


def streamed(client, **kw) -> list:
    return list(client.responses.create(model="m", temperature=0, stream=True, **kw))


def check_sequence(events):
    """Numbered in order; each item added, then done, at its own index."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done == list(range(len(added)))


def test_text_and_instructions_answer_as_the_chat_endpoint(client):
    r = client.responses.create(model="m", input=ASK, max_output_tokens=10, temperature=0)
    c = chat(client, [{"role": "user", "content": ASK}], max_tokens=10)
    assert r.object == "response" and r.output_text == c.choices[0].message.content
    assert r.status == ("incomplete" if c.choices[0].finish_reason == "length" else "completed")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    r = client.responses.create(model="m", instructions="Answer in French.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": ASK}]}], max_output_tokens=10, temperature=0)
    c = chat(client, [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": ASK}],
             max_tokens=10)
    assert r.output_text == c.choices[0].message.content
    events = streamed(client, input=ASK, max_output_tokens=10)
    check_sequence(events)
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.incomplete" and events[-1].response.incomplete_details.reason == \
        "max_output_tokens"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        client.responses.create(model="m", input=ASK, max_output_tokens=10, temperature=0).output_text


def test_json_schema_text_format_plain_and_streamed(client):
    schema = SCHEMAS["camera_event"]
    fmt = {"format": {"type": "json_schema", "name": "event", "schema": schema, "strict": True}}
    r = client.responses.create(model="m", input=ASK, text=fmt, temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    events = streamed(client, input=ASK, text=fmt)
    check_sequence(events)
    assert events[-1].type == "response.completed" and events[-1].response.output_text == r.output_text
    with client.responses.stream(model="m", input=ASK, text=fmt, temperature=0) as s:
        final = s.get_final_response()
    assert final.output_text == r.output_text


def test_a_tool_call_and_its_result_round_trip(client):
    r = client.responses.create(model="m", input="Weather in Paris?", tools=[FLAT_TOOL], tool_choice="required",
                                parallel_tool_calls=False, temperature=0, max_output_tokens=200)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # the same call as the chat endpoint makes it
    c = chat(client, [{"role": "user", "content": "Weather in Paris?"}], tools=[CHAT_TOOL], tool_choice="required",
             parallel_tool_calls=False, max_tokens=200)
    assert c.choices[0].message.tool_calls[0].function.arguments == call.arguments
    # streamed: the arguments come in fragments that join to the call's
    events = streamed(client, input="Weather in Paris?", tools=[FLAT_TOOL], parallel_tool_calls=False,
                      tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200)
    check_sequence(events)
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    assert events[-1].response.output[0].arguments == call.arguments
    # the result goes back as an item; the answer is the chat endpoint's to the same turns
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    r2 = client.responses.create(model="m", input=items, tools=[FLAT_TOOL], max_output_tokens=12, temperature=0)
    c2 = chat(client, [{"role": "user", "content": "Weather in Paris?"},
                       {"role": "assistant", "content": "", "tool_calls": [
                           {"id": call.call_id, "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}}]},
                       {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}],
              tools=[CHAT_TOOL], max_tokens=12)
    assert r2.output_text == (c2.choices[0].message.content or "")
    assert r2.usage.input_tokens == c2.usage.prompt_tokens


def test_thinking_comes_as_a_reasoning_item(client):
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    r = client.responses.create(model="m", input=ASK, max_output_tokens=16, temperature=0, extra_body=think)
    c = chat(client, [{"role": "user", "content": ASK}], max_tokens=16, extra_body=think)
    assert r.output[0].type == "reasoning"
    assert r.output[0].content[0].text == c.choices[0].message.reasoning_content
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    events = streamed(client, input=ASK, max_output_tokens=16, extra_body=think)
    check_sequence(events)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        r.output[0].content[0].text
    # the reasoning's part is announced before its deltas and closed after them, as a message's is
    # (openai-node's accumulator adds each delta to the part and throws without it)
    kinds = [(e.type, getattr(getattr(e, "part", None), "type", None)) for e in events]
    first = kinds.index(("response.reasoning_text.delta", None))
    done = kinds.index(("response.reasoning_text.done", None))
    assert ("response.content_part.added", "reasoning_text") in kinds[:first]
    assert kinds[done + 1] == ("response.content_part.done", "reasoning_text")
    assert events[done + 1].part.text == r.output[0].content[0].text
    # the chat endpoint counts the reasoning tokens as the Responses API does
    assert c.usage.completion_tokens_details.reasoning_tokens == r.usage.output_tokens_details.reasoning_tokens


def test_reasoning_effort_switches_thinking(client):
    """A model's thinking is on or off: effort "none" switches it off, any other effort on (the
    Responses API's reasoning.effort and the chat endpoint's reasoning_effort alike);
    chat_template_kwargs still decide over it."""
    msgs = [{"role": "user", "content": ASK}]
    on = chat(client, msgs, max_tokens=12, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    off = chat(client, msgs, max_tokens=12, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert on.choices[0].message.reasoning_content and not getattr(off.choices[0].message, "reasoning_content", None)
    for effort, want in (("high", on), ("minimal", on), ("none", off)):
        c = chat(client, msgs, max_tokens=12, reasoning_effort=effort)
        assert c.choices[0].message == want.choices[0].message, effort
        r = client.responses.create(model="m", input=ASK, max_output_tokens=12, temperature=0,
                                    reasoning={"effort": effort})
        assert [o.type for o in r.output][0] == ("reasoning" if want is on else "message"), effort
        assert r.output_text == (want.choices[0].message.content or "")
    c = chat(client, msgs, max_tokens=12, reasoning_effort="none",
             extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert c.choices[0].message == on.choices[0].message


def test_an_image_input_answers_as_in_chat(qwen_vl_package):
    from openai import OpenAI

    srv, _ = make_server(edgevl.load(qwen_vl_package), thinking=False)
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(3).integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(buf, "PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        r = client.responses.create(model="m", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": url}, {"type": "input_text", "text": "What is this?"}]}],
            max_output_tokens=8, temperature=0)
        c = chat(client, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                       {"type": "text", "text": "What is this?"}]}], max_tokens=8)
        assert r.output_text == c.choices[0].message.content
        assert r.usage.input_tokens == c.usage.prompt_tokens
        # a tool that returns an image (a screenshot, a camera's frame): the model sees it, as in chat
        looked = [{**x, "output": [{"type": "input_text", "text": "here"}, {"type": "input_image", "image_url": url}]}
                  if x.get("type") == "function_call_output" else x for x in _loop(False)]
        r = client.responses.create(model="m", input=looked, tools=[FLAT_TOOL], max_output_tokens=1, temperature=0)
        bare = client.responses.create(model="m", input=_loop(False), tools=[FLAT_TOOL], max_output_tokens=1,
                                       temperature=0)
        c = chat(client, [{"role": "user", "content": "Weather in Paris?"},
                          {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                          {"role": "tool", "tool_call_id": "c1", "content": [
                              {"type": "text", "text": "here"}, {"type": "image_url", "image_url": {"url": url}}]}],
                 tools=[CHAT_TOOL], max_tokens=1)
        assert r.usage.input_tokens == c.usage.prompt_tokens > bare.usage.input_tokens + 2
    finally:
        srv.stop()


BAD = [
    ({"input": "hi", "previous_response_id": "resp_1"}, "responses are not stored here", "previous_response_id"),
    ({}, "input must be a string or a non-empty list", "input"),
    ({"input": []}, "input must be a string or a non-empty list", "input"),
    ({"input": [{"type": "file_search_call"}]}, "input[0] is a 'file_search_call' item", "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "must be an input_text or input_image part, or a video_url part for a video", "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "file ids are not supported", "input[0].content[0]"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "only function tools are supported", "tools[0]"),
    ({"input": "hi", "tools": [FLAT_TOOL], "tool_choice": {"type": "allowed_tools"}}, "tool_choice of type",
     "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format must be", "text.format"),
    ({"input": "hi", "instructions": ["a"]}, "instructions must be a string", "instructions"),
    # the chat reading's errors name the request's own fields (instructions make messages[0] here)
    ({"instructions": "Be brief.", "input": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]},
     "input[1].role must be system (or developer), user, assistant or tool", "input[1].role"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens must be >= 1", "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": "4"}, "max_output_tokens must be an integer", "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "text.format"),
    ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name", "tools"),
    ({"input": "hi", "tools": [FLAT_TOOL], "tool_choice": {"type": "function"}}, "tool_choice.name",
     "tool_choice"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort must be one of none, minimal",
     "reasoning.effort"),
    ({"input": "hi", "reasoning": "high"}, "reasoning must be an object", "reasoning"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "name": "get_weather",
                                                     "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_file", "file_id": "f"}]}],
      "tools": [FLAT_TOOL]}, "must be an input_text or input_image part", "input[2].output[0]"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "name": "get_weather",
                                                     "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": None}]}],
      "tools": [FLAT_TOOL]}, "input[2].output[0] needs its text as a string", "input[2].output[0]"),
    ({"input": "hi", "tools": [FLAT_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "nope",
     "tool_choice"),
]


@pytest.mark.parametrize("body,message,param", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_what_it_cannot_take_is_a_400(server, body, message, param):
    status, reply, _ = post(server.server_address[1], body, path="/v1/responses")
    assert status == 400, reply
    assert message in reply["error"]["message"] and reply["error"]["param"] == param, reply
    assert "\n" not in reply["error"]["message"]
    # named as a Responses request names them, not as its chat reading does
    assert not re.search(r"messages\[|response_format|\bmax_tokens\b|\.function\.", reply["error"]["message"]), reply


def test_logprobs_when_included(client):
    kw = dict(input=ASK, max_output_tokens=8, include=["message.output_text.logprobs"], top_logprobs=2)
    r = client.responses.create(model="m", temperature=0, **kw)
    c = chat(client, [{"role": "user", "content": ASK}], max_tokens=8, logprobs=True, top_logprobs=2)
    got = r.output[0].content[0].logprobs
    want = c.choices[0].logprobs.content
    assert [e.token for e in got] == [e.token for e in want] and len(got) == c.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 for e in got)
    events = streamed(client, **kw)
    assert [e.token for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs] == \
        [e.token for e in got]
    # the text's done event carries them all too (the openai types require the field)
    (done,) = [ev for ev in events if ev.type == "response.output_text.done"]
    assert [e.token for e in done.logprobs] == [e.token for e in got]
    assert client.responses.create(model="m", input=ASK, max_output_tokens=4).output[0].content[0].logprobs == []


def test_earlier_answers_items_by_reference_and_cut_calls(client, server):
    """Clients that store (the AI SDK's default) send an earlier answer back as item_reference ids:
    this server keeps recent answers' items and reads them as the items themselves; one it does not
    hold is a 400 saying to send the item. A call the token limit cut (incomplete, arguments not
    JSON) is left out with its output; a whole call whose arguments are not JSON is a 400 naming it.
    Instructions and a developer item together are one system message (Qwen's template refuses two)."""
    port = server.server_address[1]
    r = client.responses.create(model="m", input=ASK, max_output_tokens=6, temperature=0,
                                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    (msg,) = [o for o in r.output if o.type == "message"]
    turns = [{"role": "user", "content": ASK}, {"type": "item_reference", "id": msg.id},
             {"role": "user", "content": "And again?"}]
    whole = [{"role": "user", "content": ASK}, {"role": "assistant", "content": msg.content[0].text},
             {"role": "user", "content": "And again?"}]
    again = dict(max_output_tokens=6, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    by_reference = client.responses.create(model="m", input=turns, **again)
    assert by_reference.output_text == client.responses.create(model="m", input=whole, **again).output_text
    status, reply, _ = post(port, {"input": [{"type": "item_reference", "id": "msg_nothere"}]}, path="/v1/responses")
    assert status == 400 and reply["error"]["param"] == "input[0]", reply
    assert "does not hold" in reply["error"]["message"] and "send the item itself" in reply["error"]["message"]
    status, reply, _ = post(port, {"input": ASK, "store": False, "max_output_tokens": 2}, path="/v1/responses")
    assert status == 200 and reply["store"] is False
    kept = reply["output"][-1]["id"]
    status, reply, _ = post(port, {"input": [{"type": "item_reference", "id": kept}]}, path="/v1/responses")
    assert status == 400, reply      # store: false keeps nothing

    cut = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Pa',
           "status": "incomplete"}
    base = [{"role": "user", "content": "Weather?"}]
    with_cut = client.responses.create(model="m", input=[*base, cut, {"role": "user", "content": "say hi"}],
                                       tools=[FLAT_TOOL], **again)
    without = client.responses.create(model="m", input=[*base, {"role": "user", "content": "say hi"}],
                                      tools=[FLAT_TOOL], **again)
    assert with_cut.output_text == without.output_text
    status, reply, _ = post(port, {"input": [*base, {"role": "assistant", "content": "ok"},
                                             {**cut, "status": "completed"}], "tools": [FLAT_TOOL]},
                            path="/v1/responses")
    assert status == 400 and reply["error"]["param"] == "input[2].arguments", reply

    for bad, param in (("[1]", "input[2].arguments"), ("null", "input[2].arguments")):
        status, reply, _ = post(port, {"input": [*base, {"role": "assistant", "content": "ok"},
                                                 {**cut, "arguments": bad, "status": "completed"}]},
                                path="/v1/responses")
        assert status == 400 and reply["error"]["param"] == param, reply
        assert "must be a JSON object" in reply["error"]["message"], reply
    status, reply, _ = post(port, {"input": [{"type": "item_reference"}]}, path="/v1/responses")
    assert status == 400 and reply["error"]["param"] == "input[0].id", reply
    # a message the token limit cut is incomplete, as OpenAI marks it
    r = client.responses.create(model="m", input=ASK, max_output_tokens=3, temperature=0,
                                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.status == "incomplete" and r.output[-1].status == "incomplete", r

    # a prompt past the context names the request's input (its chat reading's param is messages)
    from edgevl import responses
    assert responses.renamed("messages", []) == "input"
    assert responses.renamed("messages[0].content", ["input[2]"]) == "input[2].content"
    # a path a message quotes keeps its own folder names
    assert responses.renamed("messages[0].content[0]: messages[0]/../c/2.png cannot be decoded", ["input[2]"]) == \
        "input[2].content[0]: messages[0]/../c/2.png cannot be decoded"

    both = client.responses.create(model="m", instructions="Be brief.", input=[
        {"role": "developer", "content": "Answer in French."}, {"role": "user", "content": ASK}], **again)
    one = client.responses.create(model="m", instructions="Be brief.\n\nAnswer in French.", input=ASK, **again)
    assert both.output_text == one.output_text


def _loop(reasoning: bool, output_id: str = "c1") -> list:
    thought = [{"type": "reasoning", "id": "rs_1", "summary": [],
                "content": [{"type": "reasoning_text", "text": "One city, one call."}]}] if reasoning else []
    return [{"role": "user", "content": "Weather in Paris?"}, *thought,
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": output_id, "output": "Sunny"}]


def test_a_tool_loops_reasoning_item_goes_back_as_the_chat_endpoints_does(client):
    """A reasoning item before the calls is that turn's thinking, which Qwen's template keeps
    after the last user message: the prompt is the chat endpoint's with reasoning_content."""
    with_it, without = (client.responses.create(model="m", input=_loop(r), tools=[FLAT_TOOL], max_output_tokens=1,
                                                temperature=0) for r in (True, False))
    c = chat(client, [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": "", "reasoning_content": "One city, one call.",
                       "tool_calls": [{"id": "c1", "type": "function", "function": {
                           "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}], tools=[CHAT_TOOL], max_tokens=1)
    assert with_it.usage.input_tokens == c.usage.prompt_tokens > without.usage.input_tokens


def test_usage_validates_as_the_sdks_types(server):
    """The whole body, usage's cache counts included, validates against the openai SDK's own
    pydantic types (frameworks and proxies re-parse it strictly)."""
    from openai.types.responses import Response

    port = server.server_address[1]
    status, body, _ = post(port, {"input": "hi", "max_output_tokens": 3}, path="/v1/responses")
    assert status == 200, body
    r = Response.model_validate(body)
    details = r.usage.input_tokens_details
    assert details.cached_tokens + details.cache_write_tokens == r.usage.input_tokens
    again = Response.model_validate(post(port, {"input": "hi", "max_output_tokens": 3}, path="/v1/responses")[1])
    assert again.usage.input_tokens_details.cached_tokens > 0   # the slot kept what the first one wrote


@pytest.mark.parametrize("items,param,needle", [
    (_loop(False, "c7"), "input[2]", "input[2].call_id 'c7' names no call of input[1]"),
    ([{"role": "user", "content": "hi"}, {"type": "function_call", "name": "get_weather", "arguments": "{}"}],
     "input[1].call_id", "needs its call_id"),
    (_loop(False)[:2], "input[1]", "have no function_call_output after it; send a function_call_output item for each "
                                   "call (its call_id)"),
])
def test_function_call_items_that_do_not_pair_are_400s(server, items, param, needle):
    status, reply, _ = post(server.server_address[1], {"input": items, "tools": [FLAT_TOOL]}, path="/v1/responses")
    assert status == 400 and reply["error"]["param"] == param, reply
    assert needle in reply["error"]["message"] and "messages[" not in reply["error"]["message"], reply
