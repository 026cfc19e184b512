"""The chat page keeps what the user gave it: a turn the server refused does not break the turns
after it; the question survives a reload mid-answer; two tabs do not write over each other's
conversations; a conversation too large for the storage costs no other its place; Escape leaves
the settings as they were; a narrow screen still reaches the conversations; files are taken by
what the server reads (one-frame GIFs as images, TIFF, files without an extension) and by what a
whole conversation sends. Markdown links with parentheses and nested fences render."""

import json

from PIL import Image

from edgevl.demo.scenes import make_scene
from support.web import RECORD, ask, attach, open_page, set_settings, stored, text_of, wait, wait_answer


def texts(body):
    return [(m["role"], m["content"] if isinstance(m["content"], str) else m["content"][-1]["text"])
            for m in body["messages"]]


def test_a_refused_turn_is_left_out_of_the_next_requests(driver, demo):
    open_page(driver, demo.url, demo.model_id)
    driver.execute_script(RECORD)
    set_settings(driver, max_tokens=0)
    ask(driver, "First question")
    assert "refused the request (400)" in wait_answer(driver, 1)["error"]
    set_settings(driver, max_tokens=4)
    ask(driver, "Second question")
    got = wait_answer(driver, 2)
    assert got["error"] is None
    sent = driver.execute_script("return window.sent")
    assert texts(sent[-1]) == [("user", "Second question")], sent[-1]
    assert "left out of the next requests" in text_of(driver.find_elements("css selector", ".msg.assistant")[0])


def test_an_answer_stopped_before_any_text_is_not_sent_back(driver, demo):
    open_page(driver, demo.url, demo.model_id)
    conv = {"id": "stopped1", "title": "Hi", "updated": 1, "messages": [
        {"role": "user", "text": "Hi", "files": []},
        {"role": "assistant", "text": "", "reasoning": "", "boxes": [], "stopped": True}]}
    driver.execute_script("localStorage.setItem('edgevl.conversations', arguments[0])", json.dumps([conv]))
    open_page(driver, demo.url, demo.model_id, keep_storage=True)
    driver.execute_script(RECORD)
    set_settings(driver, max_tokens=4)
    ask(driver, "Again")
    wait_answer(driver, 2)
    body = driver.execute_script("return window.sent")[-1]
    assert texts(body) == [("user", "Hi"), ("user", "Again")], body


HANG = """
const real = window.fetch;
window.fetch = function (url, opts) {   // the answer never comes
  if (String(url).includes('chat/completions')) return new Promise(() => {});
  return real.apply(this, arguments);
};
"""


def test_the_question_survives_a_reload_during_its_answer(driver, demo):
    open_page(driver, demo.url, demo.model_id)
    driver.execute_script(HANG)
    ask(driver, "Will this be kept?")
    wait(lambda: driver.find_elements("css selector", ".msg.assistant[data-state='streaming']"), 10, "the answer")
    assert stored(driver)[0]["messages"][0]["text"] == "Will this be kept?"
    open_page(driver, demo.url, demo.model_id, keep_storage=True)   # a reload
    (conv,) = stored(driver)
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"] and conv["messages"][1]["stopped"]
    assert len(driver.find_elements("css selector", "#conversations li")) == 1
    assert text_of(driver.find_element("css selector", ".msg.user .user-text")) == "Will this be kept?"


def test_two_tabs_keep_each_others_conversations(driver, demo):
    open_page(driver, demo.url, demo.model_id)
    set_settings(driver, max_tokens=4)
    ask(driver, "From this tab")
    wait_answer(driver, 1)
    # another tab saves its own conversation meanwhile
    theirs = {"id": "othertab", "title": "From the other tab", "updated": 2, "messages": [
        {"role": "user", "text": "From the other tab", "files": []},
        {"role": "assistant", "text": "ok", "reasoning": "", "boxes": []}]}
    driver.execute_script("const l = JSON.parse(localStorage.getItem('edgevl.conversations'));"
                          "l.push(arguments[0]); localStorage.setItem('edgevl.conversations', JSON.stringify(l))",
                          theirs)
    ask(driver, "Still this tab")
    wait_answer(driver, 2)
    kept = {c["id"]: c for c in stored(driver)}
    assert "othertab" in kept and len(kept) == 2, list(kept)


SIZED_STORAGE = """
window.roomBytes = arguments[0];   // the storage's room for the conversations, in characters
const real = Storage.prototype.setItem;
Storage.prototype.setItem = function (key, value) {
  if (key === 'edgevl.conversations' && value.length > window.roomBytes) {
    throw new DOMException('the quota is exceeded', 'QuotaExceededError');
  }
  return real.call(this, key, value);
};
"""


def test_a_conversation_too_large_to_keep_costs_no_other_its_place(driver, demo, tmp_path):
    open_page(driver, demo.url, demo.model_id)
    set_settings(driver, max_tokens=4)
    ask(driver, "A small one")
    wait_answer(driver, 1)
    (small,) = stored(driver)
    driver.execute_script(SIZED_STORAGE, 20000)
    big = tmp_path / "big.png"
    Image.effect_noise((160, 160), 64).convert("RGB").save(big)   # noise: a data URL well over the room
    driver.find_element("id", "new-chat").click()
    attach(driver, big)
    wait(lambda: driver.find_elements("css selector", "#pending .thumb img"), 10, "the thumbnail")
    ask(driver, "A large one")
    wait_answer(driver, 1)
    wait(lambda: driver.find_elements("css selector", "#messages > .note"), 5, "the note")
    assert [c["id"] for c in stored(driver)] == [small["id"]]
    driver.find_element("id", "new-chat").click()
    assert not driver.find_elements("css selector", "#messages > .note")   # the note is that conversation's
    ask(driver, "Another small one")
    wait_answer(driver, 1)
    kept = [c["title"] for c in stored(driver)]
    assert kept == ["Another small one", "A small one"], kept


def test_escape_leaves_the_settings_as_they_were(driver, demo):
    from selenium.webdriver.common.keys import Keys

    open_page(driver, demo.url, demo.model_id)
    set_settings(driver, temperature=0.5)
    driver.find_element("id", "settings-button").click()
    field = driver.find_element("id", "set-temperature")
    field.clear()
    field.send_keys("1.5")
    field.send_keys(Keys.ESCAPE)
    wait(lambda: not driver.find_element("id", "settings").get_attribute("open"), 5, "the settings to close")
    assert json.loads(driver.execute_script("return localStorage.getItem('edgevl.settings')"))["temperature"] == "0.5"
    driver.find_element("id", "settings-button").click()
    driver.find_element("id", "settings-cancel").click()
    assert json.loads(driver.execute_script("return localStorage.getItem('edgevl.settings')"))["temperature"] == "0.5"


def test_a_narrow_screen_reaches_the_conversations(driver, demo):
    open_page(driver, demo.url, demo.model_id)
    size = driver.get_window_size()
    try:
        driver.set_window_size(400, 800)
        sidebar, button = driver.find_element("id", "sidebar"), driver.find_element("id", "chats-button")
        assert not sidebar.is_displayed() and button.is_displayed()
        button.click()
        assert sidebar.is_displayed()
        driver.find_element("id", "new-chat").click()
        assert not sidebar.is_displayed()
    finally:
        driver.set_window_size(size["width"], size["height"])
    assert not driver.find_element("id", "chats-button").is_displayed()


def test_files_are_taken_by_what_the_server_reads(driver, demo_model, start_server, tmp_path):
    scene = make_scene(37).image
    tiff, bare, svg = tmp_path / "scan.tiff", tmp_path / "photo", tmp_path / "drawing.svg"
    scene.save(tiff)
    scene.save(bare, format="PNG")
    svg.write_text('<svg xmlns="http://www.w3.org/2000/svg" width="8" height="8"><rect width="8" height="8"/></svg>')
    noise = tmp_path / "noise.png"
    Image.effect_noise((160, 160), 64).convert("RGB").save(noise)
    first, later = tiff.stat().st_size + bare.stat().st_size, noise.stat().st_size
    # a limit that takes the first turn's files and the noise alone, but not all of them together
    limit = int((first + later / 2) * 4 / 3) + 4000
    assert later * 4 / 3 < limit < (first + later) * 4 / 3
    srv = start_server(demo_model, max_body=limit)
    open_page(driver, srv.url, srv.model_id)
    attach(driver, tiff, bare, svg)
    note = wait(lambda: text_of(driver.find_element("id", "file-note")), 10, "the file message")
    assert "drawing.svg is not an image" in note, note
    names = [text_of(f) for f in driver.find_elements("css selector", "#pending figcaption")]
    assert names == ["scan.tiff", "photo"], names
    set_settings(driver, max_tokens=2)
    ask(driver, "Describe the image.")
    assert wait_answer(driver, 1)["error"] is None
    # every turn's files go with each request: the next one would pass the server's limit
    attach(driver, noise)
    note = wait(lambda: "already" in text_of(driver.find_element("id", "file-note")), 10, "the file message")
    note = text_of(driver.find_element("id", "file-note"))
    assert "with the files already in this conversation" in note, note
    assert not driver.find_elements("css selector", "#pending figure")


MARKDOWN = """
const div = document.createElement('div');
window.EdgevlMarkdown.render(arguments[0], div);
return div.innerHTML;
"""


def test_links_with_parentheses_and_nested_fences(driver, demo):
    open_page(driver, demo.url, demo.model_id)
    html = driver.execute_script(MARKDOWN, "See [Python](https://en.wikipedia.org/wiki/Python_(language)).")
    assert 'href="https://en.wikipedia.org/wiki/Python_(language)"' in html and html.endswith(".</p>"), html
    html = driver.execute_script(MARKDOWN, "````md\n```py\nx = 1\n```\n````\nafter")
    assert html == '<pre><code data-lang="md">```py\nx = 1\n```</code></pre><p>after</p>', html


def test_a_one_frame_gif_goes_as_an_image(driver, demo, tmp_path):
    """A still GIF whose bytes hold a frame marker's (21 F9 04) outside any frame (here in its
    comment; pixel data can hold them too) is one image."""
    gif = tmp_path / "still.gif"
    make_scene(37).image.convert("P").save(gif, comment=b"marker \x21\xf9\x04 and \x21\xf9\x04 again")
    assert Image.open(gif).n_frames == 1 and gif.read_bytes().count(b"\x21\xf9\x04") >= 2
    open_page(driver, demo.url, demo.model_id)
    attach(driver, gif)
    wait(lambda: driver.find_elements("css selector", "#pending figure"), 10, "the thumbnail")
    assert not text_of(driver.find_element("id", "file-note")), "taken for an animation"


def test_a_question_asked_before_the_key_stays_in_the_box(driver, demo_model, start_server):
    from selenium.webdriver.common.keys import Keys

    srv = start_server(demo_model, api_key="s3cret")
    driver.get(srv.url + "/")
    driver.execute_script("localStorage.clear()")
    driver.get(srv.url + "/")
    wait(lambda: driver.find_element("id", "key-dialog").get_attribute("open"), 10, "the key dialog")
    driver.find_element("id", "api-key").send_keys(Keys.ESCAPE)   # dismissed: the user asks first
    wait(lambda: not driver.find_element("id", "key-dialog").get_attribute("open"), 5, "the dialog to close")
    ask(driver, "Asked too early")
    wait(lambda: driver.find_element("id", "key-dialog").get_attribute("open"), 10, "the key dialog again")
    assert driver.find_element("id", "prompt").get_attribute("value") == "Asked too early"
    assert not driver.find_elements("css selector", ".msg.user")
    driver.find_element("id", "api-key").send_keys("s3cret")
    driver.find_element("id", "key-submit").click()
    wait(lambda: driver.find_element("id", "model-name").text == srv.model_id, 10, "the model")
    set_settings(driver, max_tokens=2)
    driver.find_element("id", "prompt").send_keys(Keys.ENTER)
    wait_answer(driver, 1)
    assert [text_of(m) for m in driver.find_elements("css selector", ".msg.user .user-text")] == ["Asked too early"]
