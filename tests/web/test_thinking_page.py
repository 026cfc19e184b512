"""The chat page with a tiny thinking Qwen3.5 (random weights, an MTP block, video): the reasoning
shown collapsed above the answer, the thinking switch, speculative decoding's counts, an animated
GIF sent as a video, and the stop button, which ends the server's generation."""

import base64
import json

import pytest

import edgevl
from edgevl.generate import stream_events
from support.clips import save_animation, small_frames
from support.qwen import make_qwen3_5
from support.server import post, wait_for
from support.web import answers, ask, attach, open_page, set_settings, text_of, wait, wait_answer


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, module_servers):
    root = tmp_path_factory.mktemp("web-qwen")
    ck = make_qwen3_5(root / "ck", seed=90, mtp=True)
    return module_servers(edgevl.load(edgevl.convert(ck, root / "pk", dtype="fp32", progress=False)))


def api(srv, messages, **extra):
    status, reply, _ = post(srv.server_address[1], {"messages": messages, "stream": False, **extra})
    assert status == 200, reply
    return reply


def stored_answer(driver, n=1):
    """The n-th answer as the page keeps it (its raw text: the page shows it as Markdown)."""
    conv = json.loads(driver.execute_script("return localStorage.getItem('edgevl.conversations')"))[0]
    return [m for m in conv["messages"] if m["role"] == "assistant"][n - 1]


def test_reasoning_is_collapsed_and_the_switch_turns_it_off(driver, qwen):
    open_page(driver, qwen.url, qwen.model_id)
    assert "thinking" in driver.find_element("id", "model-caps").text
    switch = driver.find_element("id", "thinking")
    assert switch.is_displayed() and switch.is_selected()   # the template's default: thinking
    set_settings(driver, max_tokens=24, temperature=0, seed=3)
    ask(driver, "Hello")
    got = wait_answer(driver, 1)
    want = api(qwen, [{"role": "user", "content": "Hello"}], max_tokens=24, temperature=0, seed=3,
               chat_template_kwargs={"enable_thinking": True})
    reasoning = want["choices"][0]["message"].get("reasoning_content")
    assert reasoning and got["reasoning"] == reasoning, (got, want)
    assert got["reasoning_open"] is False   # collapsed
    summary = driver.find_element("css selector", ".msg.assistant details.reasoning summary")
    assert summary.is_displayed() and not driver.find_element("css selector", ".reasoning-text").is_displayed()
    summary.click()
    assert driver.find_element("css selector", ".reasoning-text").is_displayed()
    # speculative decoding's counts, as the server reports them in the stream's usage
    assert " drafted tokens accepted" in got["stats"] and got["stats"].startswith("24 tokens · "), got

    # thinking off: no reasoning, the answer the API gives with the switch off
    driver.find_element("id", "new-chat").click()
    switch.click()
    assert not switch.is_selected()
    ask(driver, "Hello")
    got = wait_answer(driver, 1)
    off = api(qwen, [{"role": "user", "content": "Hello"}], max_tokens=24, temperature=0, seed=3,
              chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert "reasoning_content" not in off and got["reasoning"] is None, (got, off)
    assert stored_answer(driver)["text"] == off["content"] and got["text"].strip()


def test_props_say_the_api_takes_tools(qwen):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", qwen.server_address[1], timeout=10)
    conn.request("GET", "/props")
    assert json.loads(conn.getresponse().read())["tools"] is True   # Qwen3.5's template calls tools
    conn.close()


def test_speculative_counts_come_with_the_streamed_usage(qwen):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 24, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    status, raw, _ = post(qwen.server_address[1], body)
    assert status == 200
    events = [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: {")]
    usage = events[-1]["usage"]
    spec = usage["speculative"]
    assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"], usage
    # as the API counts them for the same request alone
    last = list(stream_events(qwen.model, body["messages"], max_new_tokens=24, temperature=0,
                              reuse_cache=False))[-1]
    assert (last.drafted, last.accepted) == (spec["drafted"], spec["accepted"])
    # and the server's own speeds, which the page shows
    assert usage["timings"]["predicted_per_second"] > 0 and usage["timings"]["prompt_per_second"] > 0, usage


def test_an_animated_gif_goes_as_a_video(driver, qwen, tmp_path):
    gif = tmp_path / "clip.gif"
    save_animation(gif, small_frames(4, 64, 48))
    open_page(driver, qwen.url, qwen.model_id)
    driver.find_element("id", "thinking").click()    # off: the tiny model's answer, not its thoughts
    set_settings(driver, max_tokens=6, temperature=0)
    attach(driver, gif)
    wait(lambda: driver.find_elements("css selector", "#pending .thumb img"), 10, "the thumbnail")
    ask(driver, "What happens in the video?")
    got = wait_answer(driver, 1)
    url = "data:image/gif;base64," + base64.b64encode(gif.read_bytes()).decode()
    want = api(qwen, [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                   {"type": "text", "text": "What happens in the video?"}]}],
               max_tokens=6, temperature=0, chat_template_kwargs={"enable_thinking": False})
    assert got["error"] is None and stored_answer(driver)["text"] == want["choices"][0]["message"]["content"]
    # the prompt held the clip's tokens (a GIF sent as an image would count those of one frame)
    assert f"prompt {want['usage']['prompt_tokens']}" in got["stats"]


def test_stop_ends_the_answer_and_the_generation(driver, qwen):
    open_page(driver, qwen.url, qwen.model_id)
    set_settings(driver, temperature=0)   # no max tokens: to the context's end (seconds) unless stopped
    ask(driver, "Tell me everything.")
    wait(lambda: (a := answers(driver)) and (a[0]["reasoning"] or a[0]["text"]), 30, "the answer to start")
    assert qwen.gate.locked()
    driver.find_element("id", "stop").click()
    got = wait_answer(driver, 1, 10)
    assert got["stopped"] and got["error"] is None, got
    assert wait_for(lambda: not qwen.gate.locked(), 3) is not None, "the server went on generating"
    assert driver.find_element("id", "send").is_displayed() and not driver.find_element("id", "stop").is_displayed()
    shown = len(stored_answer(driver)["reasoning"])
    assert 0 < shown and len(text_of(driver.find_element("css selector", ".reasoning-text"))) == shown
    # the page takes the next question
    set_settings(driver, max_tokens=4)
    ask(driver, "Hello")
    assert wait_answer(driver, 2)["error"] is None
