"""The chat page with the demo model, in a real headless Chromium: an image and a question give the
answer the API gives for the same request, turn after turn; boxes are drawn over the image where the
API puts them; edit, regenerate, new chat and reload (local storage); bad files, API errors and the
API key; model text and file names never become HTML; nothing is fetched from outside."""

import base64
import dataclasses

import pytest

from edgevl import server as server_module
from edgevl.demo.scenes import make_scene
from support.clips import save_animation, small_frames
from support.server import post
from support.web import (
    answers,
    ask,
    attach,
    open_page,
    requested_urls,
    set_settings,
    stored,
    text_of,
    wait,
    wait_answer,
)


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    """Demo scenes as PNG files: seed 37 has a star, a circle and a triangle."""
    root = tmp_path_factory.mktemp("web-scenes")
    out = {}
    for seed in (37, 5):
        out[seed] = root / f"scene{seed}.png"
        make_scene(seed).image.save(out[seed])
    return out


def data_url(path, mime="image/png"):
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def api(srv, messages, headers=None, **extra):
    """The API's answer message to the request the page should have sent."""
    status, reply, _ = post(srv.server_address[1], {"messages": messages, **extra}, headers)
    assert status == 200, reply
    return reply["choices"][0]["message"]


def user(text, *images):
    if not images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": data_url(p)}} for p in images),
                                        {"type": "text", "text": text}]}


def test_image_question_answers_as_the_api_turn_after_turn(driver, demo, scenes):
    requested_urls(driver)  # what earlier tests left in the log
    open_page(driver, demo.url, demo.model_id)
    attach(driver, scenes[37])
    wait(lambda: driver.find_elements("css selector", "#pending .thumb img"), 10, "the thumbnail")
    ask(driver, "Describe the image.")
    first = wait_answer(driver, 1)
    want = api(demo, [user("Describe the image.", scenes[37])])
    assert first["text"] == want["content"] and want["content"].startswith("A small green star"), (first, want)
    assert first["error"] is None and first["reasoning"] is None
    # a thumbnail of the image in the question, named
    shown = driver.find_element("css selector", ".msg.user .files figure")
    assert shown.find_element("css selector", "img").get_attribute("src") == data_url(scenes[37])
    assert text_of(shown.find_element("css selector", "figcaption")) == "scene37.png"

    ask(driver, "How many shapes are there?")
    second = wait_answer(driver, 2)
    want2 = api(demo, [user("Describe the image.", scenes[37]), {"role": "assistant", "content": want["content"]},
                       user("How many shapes are there?")])
    assert second["text"] == want2["content"] and second["text"] != first["text"], (second, want2)
    # stats: the tokens the server counted (the end-of-text token included), timings
    status, reply, _ = post(demo.server_address[1], {"messages": [
        user("Describe the image.", scenes[37]), {"role": "assistant", "content": want["content"]},
        user("How many shapes are there?")]})
    n = reply["usage"]["completion_tokens"]
    assert second["stats"].startswith(f"{n} tokens · first token ") and " tokens/s" in second["stats"], second

    # every request went to this server, through its public API
    urls = requested_urls(driver)
    base = demo.url
    for path in ("/", "/web/app.js", "/web/markdown.js", "/web/style.css", "/props", "/v1/chat/completions"):
        assert base + path in urls, (path, urls)
    assert all(u.startswith((base + "/", "data:", "blob:")) for u in urls), urls

    # kept in the browser: a reload shows the conversation and lists it
    open_page(driver, demo.url, demo.model_id, keep_storage=True)
    again = wait(lambda: len(answers(driver)) == 2 and answers(driver), 10, "the stored conversation")
    assert [a["text"] for a in again] == [want["content"], want2["content"]]
    items = driver.find_elements("css selector", "#conversations li .open")
    assert [text_of(i) for i in items] == ["Describe the image."]
    [conv] = stored(driver)
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant", "user", "assistant"]

    # a new chat starts empty; the old one stays listed and opens again
    driver.find_element("id", "new-chat").click()
    assert answers(driver) == []
    attach(driver, scenes[5])
    wait(lambda: driver.find_elements("css selector", "#pending .thumb img"), 10, "the thumbnail")
    ask(driver, "Describe the image.")
    other = wait_answer(driver, 1)
    assert other["text"] == api(demo, [user("Describe the image.", scenes[5])])["content"] != want["content"]
    assert len(stored(driver)) == 2
    driver.find_elements("css selector", "#conversations li .open")[1].click()
    assert [a["text"] for a in answers(driver)] == [want["content"], want2["content"]]


def test_boxes_are_drawn_over_the_image_where_the_api_puts_them(driver, demo, scenes):
    open_page(driver, demo.url, demo.model_id)
    attach(driver, scenes[37])
    wait(lambda: driver.find_elements("css selector", "#pending .thumb img"), 10, "the thumbnail")
    ask(driver, "Where is the star?")
    want = api(demo, [user("Where is the star?", scenes[37])])
    assert want["boxes"], want
    got = wait(lambda: (a := wait_answer(driver, 1))["boxes"] and a, 10, "the boxes")
    assert got["text"] == want["content"]  # the box tokens, shown as text
    assert [b["box"] for b in got["boxes"]] == [b["box"] for b in want["boxes"]]
    for b in got["boxes"]:
        x1, y1, x2, y2 = b["box"]
        sx, sy = b["image_width"] / b["natural"][0], b["image_height"] / b["natural"][1]
        assert sx > 1.5  # the 128-pixel scene is shown enlarged
        assert abs(b["left"] - x1 * sx) <= 1 and abs(b["top"] - y1 * sy) <= 1, b
        assert abs(b["width"] - (x2 - x1 + 1) * sx) <= 1 and abs(b["height"] - (y2 - y1 + 1) * sy) <= 1, b
        assert b["label"]


def test_edit_and_regenerate(driver, demo, scenes):
    open_page(driver, demo.url, demo.model_id)
    attach(driver, scenes[37])
    wait(lambda: driver.find_elements("css selector", "#pending .thumb img"), 10, "the thumbnail")
    ask(driver, "Describe the image.")
    wait_answer(driver, 1)
    driver.find_element("css selector", ".msg.user .edit").click()
    box = driver.find_element("css selector", ".msg.user .edit-text")
    box.clear()
    box.send_keys("What color is the background?")
    driver.find_element("css selector", ".msg.user .resend").click()
    got = wait(lambda: (a := answers(driver)) and a[0]["state"] == "done" and "star" not in a[0]["text"] and a,
               30, "the edited turn's answer")
    want = api(demo, [user("What color is the background?", scenes[37])])["content"]
    assert [a["text"] for a in got] == [want] and "lack" in want, (got, want)   # "Black."
    # the edited turn keeps its image
    assert driver.find_element("css selector", ".msg.user .files img").get_attribute("src") == data_url(scenes[37])
    before = stored(driver)[0]["updated"]
    driver.find_element("css selector", ".msg.assistant .regenerate").click()
    wait(lambda: stored(driver)[0]["updated"] != before, 30, "the answer again")  # saved once it is whole
    again = wait_answer(driver, 1)
    assert len(answers(driver)) == 1 and again["text"] == want


def test_bad_files_get_a_message_and_names_stay_text(driver, demo, tmp_path, scenes):
    open_page(driver, demo.url, demo.model_id)
    notes = tmp_path / "notes.txt"
    notes.write_text("not an image")
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(64))
    hostile = tmp_path / "<img src=x onerror=window.pwned=1>.png"
    hostile.write_bytes(scenes[37].read_bytes())
    gif = tmp_path / "moving.gif"
    save_animation(gif, small_frames(3, 64, 48))
    attach(driver, notes, broken, clip, hostile, gif)
    note = wait(lambda: text_of(driver.find_element("id", "file-note")), 10, "the file message")
    assert "notes.txt is not an image; choose a PNG, JPEG, WebP, GIF, BMP or TIFF file." in note, note
    assert "broken.png could not be read as an image" in note, note
    assert "clip.mp4: this model (youtu_vl) takes no video; attach still images instead." in note, note
    assert "moving.gif: this model takes no video, so only the GIF's first frame is sent." in note, note
    # the good files are attached, the names shown as text
    figs = driver.find_elements("css selector", "#pending figure figcaption")
    assert [text_of(f) for f in figs] == [hostile.name, "moving.gif"]
    ask(driver, "Describe the image.")
    got = wait_answer(driver, 1)
    assert text_of(driver.find_element("css selector", ".msg.user figcaption")) == hostile.name
    assert got["text"] == api(demo, [user("Describe the image.", hostile, gif)])["content"]
    assert driver.execute_script("return window.pwned") is None
    assert not driver.find_elements("css selector", "img[src='x']")


def test_a_question_without_an_image_gets_a_note(driver, demo):
    open_page(driver, demo.url, demo.model_id)
    ask(driver, "Describe the image.")
    got = wait_answer(driver, 1)
    assert got["text"] == api(demo, [user("Describe the image.")])["content"]  # sent all the same
    assert text_of(driver.find_element("id", "file-note")) == \
        "This model answers questions about an image only: attach one, or its answer means nothing."


def test_api_errors_show_as_messages(driver, demo, scenes):
    open_page(driver, demo.url, demo.model_id)
    set_settings(driver, max_tokens=0)
    attach(driver, scenes[37])
    wait(lambda: driver.find_elements("css selector", "#pending .thumb img"), 10, "the thumbnail")
    ask(driver, "Describe the image.")
    got = wait_answer(driver, 1)
    assert got["error"] == "The server refused the request (400): max_tokens must be >= 1, got 0", got
    set_settings(driver, max_tokens="")
    # a prompt longer than the context: refused at once, with the server's reason
    driver.execute_script("document.getElementById('prompt').value = 'word '.repeat(3000)")
    ask(driver, "")
    got = wait_answer(driver, 2)
    assert got["error"].startswith("The server refused the request (400): the prompt has ") and \
        "context length is 2048" in got["error"], got
    # regenerate retries the failed turn (here with the same result)
    assert driver.find_elements("css selector", ".msg.assistant .regenerate")


HOSTILE = ["Fine. <scr", "ipt>window.pwned = 1</script> <img src=x onerror=\"window.pwned=2\"> ",
           "[link](javascript:window.pwned=3) **bold** `<b>code</b>`"]


def test_model_text_is_shown_as_text(driver, demo, scenes, monkeypatch):
    """An answer is untrusted text: a model that answers with HTML and script gets it shown."""
    real = server_module.stream_choices

    def hostile(model, messages, **kwargs):  # the real generation, its text replaced
        evs = list(real(model, messages, **kwargs)[0])
        for piece in HOSTILE:
            yield dataclasses.replace(evs[-1], text=piece, finish_reason=None, boxes=[])
        yield dataclasses.replace(evs[-1], text="")

    monkeypatch.setattr(server_module, "stream_choices", lambda *a, **k: [hostile(*a, **k)])
    open_page(driver, demo.url, demo.model_id)
    attach(driver, scenes[37])
    wait(lambda: driver.find_elements("css selector", "#pending .thumb img"), 10, "the thumbnail")
    ask(driver, "<script>window.pwned = 4</script>")
    got = wait_answer(driver, 1)
    assert got["text"] == "Fine. <script>window.pwned = 1</script> <img src=x onerror=\"window.pwned=2\"> " \
                          "[link](javascript:window.pwned=3) bold <b>code</b>", got
    assert text_of(driver.find_element("css selector", ".msg.user .user-text")) == "<script>window.pwned = 4</script>"
    messages = driver.find_element("id", "messages")
    assert not messages.find_elements("css selector", "script, img[src='x'], a[href^='javascript'], b")
    assert messages.find_elements("css selector", ".msg.assistant strong")  # the markdown still renders
    assert driver.execute_script("return window.pwned") is None


def test_api_key_is_asked_once_and_sent(driver, demo_model, scenes, start_server):
    srv = start_server(demo_model, api_key="s3cret")
    driver.get(srv.url + "/")  # the page loads without the key; the API does not answer
    driver.execute_script("localStorage.clear()")
    driver.get(srv.url + "/")
    wait(lambda: driver.find_element("id", "key-dialog").get_attribute("open"), 10, "the key dialog")
    assert driver.find_element("id", "model-name").text == "edgevl"
    key = driver.find_element("id", "api-key")
    key.send_keys("wrong")
    driver.find_element("id", "key-submit").click()
    wait(lambda: "refused the key" in text_of(driver.find_element("id", "key-note")), 10, "the refusal")
    key.send_keys("s3cret")
    driver.find_element("id", "key-submit").click()
    wait(lambda: driver.find_element("id", "model-name").text == srv.model_id, 10, "the model")
    attach(driver, scenes[37])
    wait(lambda: driver.find_elements("css selector", "#pending .thumb img"), 10, "the thumbnail")
    ask(driver, "How many shapes are there?")
    want = api(srv, [user("How many shapes are there?", scenes[37])], headers={"Authorization": "Bearer s3cret"})
    assert wait_answer(driver, 1)["text"] == want["content"]
    # kept: a reload asks no more
    open_page(driver, srv.url, srv.model_id, keep_storage=True)
    assert not driver.find_element("id", "key-dialog").get_attribute("open")


GIVE = """
const [b64, name, how] = arguments;
const data = new DataTransfer();
data.items.add(new File([Uint8Array.from(atob(b64), (c) => c.charCodeAt(0))], name, {type: 'image/png'}));
const target = document.getElementById(how === 'drop' ? 'messages' : 'prompt');
target.dispatchEvent(how === 'drop'
  ? new DragEvent('drop', {dataTransfer: data, bubbles: true, cancelable: true})
  : new ClipboardEvent('paste', {clipboardData: data, bubbles: true, cancelable: true}));
"""


def test_dropped_and_pasted_images_go_with_the_question(driver, demo, scenes):
    open_page(driver, demo.url, demo.model_id)
    driver.execute_script(GIVE, base64.b64encode(scenes[37].read_bytes()).decode(), "dropped.png", "drop")
    driver.execute_script(GIVE, base64.b64encode(scenes[5].read_bytes()).decode(), "pasted.png", "paste")
    wait(lambda: len(driver.find_elements("css selector", "#pending .thumb img")) == 2, 10, "two thumbnails")
    assert [text_of(f) for f in driver.find_elements("css selector", "#pending figcaption")] == \
        ["dropped.png", "pasted.png"]
    ask(driver, "How many shapes are there?")
    got = wait_answer(driver, 1)
    assert got["text"] == api(demo, [user("How many shapes are there?", scenes[37], scenes[5])])["content"]
    assert len(driver.find_elements("css selector", ".msg.user .files img")) == 2


FULL_STORAGE = """
window.room = arguments[0];   // conversations the storage still takes
const real = Storage.prototype.setItem;
Storage.prototype.setItem = function (key, value) {
  if (key === 'edgevl.conversations' && JSON.parse(value).length > window.room) {
    throw new DOMException('the quota is exceeded', 'QuotaExceededError');
  }
  return real.call(this, key, value);
};
"""


def test_a_full_storage_drops_the_oldest_conversations_then_says_so(driver, demo, scenes):
    open_page(driver, demo.url, demo.model_id)
    for k, seed in enumerate((37, 5)):
        if k:
            driver.find_element("id", "new-chat").click()
        attach(driver, scenes[seed])
        wait(lambda: driver.find_elements("css selector", "#pending .thumb img"), 10, "the thumbnail")
        ask(driver, "Describe the image.")
        wait_answer(driver, 1)
    first, second = stored(driver)[::-1]
    driver.execute_script(FULL_STORAGE, 2)
    driver.find_element("id", "new-chat").click()
    attach(driver, scenes[37])
    wait(lambda: driver.find_elements("css selector", "#pending .thumb img"), 10, "the thumbnail")
    ask(driver, "How many shapes are there?")
    wait_answer(driver, 1)
    kept = stored(driver)
    assert [c["id"] for c in kept][1:] == [second["id"]]   # the oldest went
    assert len(driver.find_elements("css selector", "#conversations li")) == 2
    assert not driver.find_elements("css selector", "#messages > .note")
    driver.execute_script("window.room = 0")
    ask(driver, "What color is the background?")
    wait_answer(driver, 2)
    note = wait(lambda: driver.find_elements("css selector", "#messages > .note"), 5, "the note")[0]
    assert text_of(note).startswith("This conversation is too large for the browser's storage")
    assert [c["id"] for c in stored(driver)] == [c["id"] for c in kept]  # what was kept stays
