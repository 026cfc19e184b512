"""What the chat page shows and keeps when the user or the browser does more than ask: two tabs on
one conversation, an edit cancelled, a refused turn before an image question, a reload while the
answer streams, a history that fills the context, files the browser cannot show or the server would
refuse, and the narrow screen's list of conversations."""

import json
from contextlib import contextmanager

from PIL import Image

from edgevl.demo.scenes import make_scene
from support.web import RECORD, answers, ask, attach, open_page, set_settings, stored, text_of, wait, wait_answer


def questions(conv):
    return [m["text"] for m in conv["messages"] if m["role"] == "user"]


def scene(tmp_path, seed=37, suffix=".png"):
    path = tmp_path / f"scene{seed}{suffix}"
    make_scene(seed).image.save(path)
    return path


@contextmanager
def two_tabs(driver, demo, question):
    """``question`` asked and answered in this tab, then a second tab opened, which shows the most
    recent conversation: the same one. Yields both tabs' handles; the second is closed after."""
    open_page(driver, demo.url, demo.model_id)
    set_settings(driver, max_tokens=3)
    ask(driver, question)
    wait_answer(driver, 1)
    first = driver.current_window_handle
    driver.switch_to.new_window("tab")
    try:
        open_page(driver, demo.url, demo.model_id, keep_storage=True)
        yield first, driver.current_window_handle
    finally:
        for h in driver.window_handles:
            if h != first:
                driver.switch_to.window(h)
                driver.close()
        driver.switch_to.window(first)


def test_a_second_tab_goes_on_from_the_first_tabs_turns(driver, demo):
    with two_tabs(driver, demo, "Q1 from the first tab") as (first, second):
        driver.switch_to.window(first)
        ask(driver, "Q2 from the first tab")
        wait_answer(driver, 2)
        driver.switch_to.window(second)
        wait(lambda: len(answers(driver)) == 2, 10, "the second tab to show the first tab's turn")
        ask(driver, "Q3 from the second tab")
        wait_answer(driver, 3)
        (conv,) = stored(driver)
        assert questions(conv) == ["Q1 from the first tab", "Q2 from the first tab", "Q3 from the second tab"]


def test_turns_asked_in_two_tabs_at_once_are_both_kept(driver, demo):
    open_page(driver, demo.url, demo.model_id)
    set_settings(driver, max_tokens=3)
    ask(driver, "Q1")
    wait_answer(driver, 1)
    # another tab went on with this conversation while this one was asking (no storage event here)
    driver.execute_script("""
        const l = JSON.parse(localStorage.getItem('edgevl.conversations'));
        l[0].messages.push({role: 'user', text: 'Theirs', files: []},
                           {role: 'assistant', text: 'ok', reasoning: '', boxes: []});
        l[0].updated = Date.now() + 1000;
        localStorage.setItem('edgevl.conversations', JSON.stringify(l));""")
    ask(driver, "Mine")
    wait_answer(driver, 2)
    kept = sorted(questions(c) for c in stored(driver))
    assert kept == [["Q1", "Mine"], ["Q1", "Theirs"]], kept


def test_cancel_leaves_an_edited_question_as_it_was(driver, demo, tmp_path):
    a, b = scene(tmp_path, 37), scene(tmp_path, 5)
    open_page(driver, demo.url, demo.model_id)
    driver.execute_script(RECORD)
    set_settings(driver, max_tokens=3)
    attach(driver, a, b)
    wait(lambda: len(driver.find_elements("css selector", "#pending .thumb img")) == 2, 10, "the thumbnails")
    ask(driver, "two images")
    wait_answer(driver, 1)
    driver.find_element("css selector", ".msg.user .edit").click()
    box = driver.find_element("css selector", ".msg.user .edit-text")
    box.clear()
    box.send_keys("changed my mind")
    driver.find_elements("css selector", ".msg.user .remove")[1].click()
    assert len(driver.find_elements("css selector", ".msg.user .files .thumb")) == 1
    driver.find_element("css selector", ".msg.user .cancel").click()
    assert text_of(driver.find_element("css selector", ".msg.user .user-text")) == "two images"
    assert len(driver.find_elements("css selector", ".msg.user .files img")) == 2
    # an edit emptied of text and files is not sent
    driver.find_element("css selector", ".msg.user .edit").click()
    driver.find_element("css selector", ".msg.user .edit-text").clear()
    while driver.find_elements("css selector", ".msg.user .remove"):   # each click draws the editor again
        driver.find_element("css selector", ".msg.user .remove").click()
    driver.find_element("css selector", ".msg.user .resend").click()
    assert driver.execute_script("return window.sent.length") == 1
    driver.find_element("css selector", ".msg.user .cancel").click()
    ((q, _),) = [(m, None) for m in stored(driver)[0]["messages"] if m["role"] == "user"]
    assert q["text"] == "two images" and [f["name"] for f in q["files"]] == [a.name, b.name]


def test_boxes_go_over_the_image_the_server_got_after_a_refused_turn(driver, demo, tmp_path):
    other, star = scene(tmp_path, 5), scene(tmp_path, 37)
    open_page(driver, demo.url, demo.model_id)
    set_settings(driver, max_tokens=0)   # refused: the turn and its image are left out afterwards
    attach(driver, other)
    wait(lambda: driver.find_elements("css selector", "#pending .thumb img"), 10, "the thumbnail")
    ask(driver, "Describe the image.")
    assert "refused the request (400)" in wait_answer(driver, 1)["error"]
    set_settings(driver, max_tokens=24)
    attach(driver, star)
    wait(lambda: driver.find_elements("css selector", "#pending .thumb img"), 10, "the thumbnail")
    ask(driver, "Where is the star?")
    wait(lambda: (a := answers(driver)) and len(a) == 2 and a[1]["state"] == "done" and a[1]["boxes"], 60, "the boxes")
    captions = [text_of(f) for f in driver.find_elements("css selector", ".msg.assistant .boxed figcaption")]
    assert captions == [star.name], captions


HANG_THEN_FAIL = """
const real = window.fetch;
window.fetch = function (url, opts) {   // the answer never comes; the read fails as the page closes
  if (!String(url).includes('chat/completions')) return real.apply(this, arguments);
  return new Promise((_, reject) => window.addEventListener('pagehide',
    () => reject(new TypeError('network error'))));
};
"""


def test_a_reload_during_the_answer_keeps_it_as_stopped_not_failed(driver, demo):
    open_page(driver, demo.url, demo.model_id)
    driver.execute_script(HANG_THEN_FAIL)
    ask(driver, "Kept as stopped?")
    wait(lambda: driver.find_elements("css selector", ".msg.assistant[data-state='streaming']"), 10, "the answer")
    open_page(driver, demo.url, demo.model_id, keep_storage=True)
    (conv,) = stored(driver)
    answer = conv["messages"][1]
    assert answer["stopped"] and "error" not in answer, answer
    assert answers(driver)[0]["error"] is None


def test_a_history_that_fills_the_context_says_to_start_a_new_chat(driver, demo):
    open_page(driver, demo.url, demo.model_id)
    long = " ".join(["word"] * 6000)
    conv = {"id": "full1", "title": "Long", "updated": 1, "messages": [
        {"role": "user", "text": "Tell me a long story", "files": []},
        {"role": "assistant", "text": long, "reasoning": "", "boxes": []}]}
    driver.execute_script("localStorage.setItem('edgevl.conversations', arguments[0])", json.dumps([conv]))
    open_page(driver, demo.url, demo.model_id, keep_storage=True)
    ask(driver, "And then?")
    got = wait_answer(driver, 2)
    assert "maximum context length" in got["error"]
    notes = [text_of(n) for n in driver.find_elements("css selector", ".msg.assistant .hint")]
    assert notes and "start a New chat" in notes[-1], notes


def test_an_image_past_the_servers_pixels_is_named_by_its_size(driver, demo, tmp_path):
    big = tmp_path / "big.png"
    Image.new("1", (12000, 12000)).save(big)   # 144 million pixels, a small file
    open_page(driver, demo.url, demo.model_id)
    attach(driver, big)
    note = wait(lambda: text_of(driver.find_element("id", "file-note")), 20, "the note")
    assert "12000x12000 pixels" in note and "at most 100000000 pixels" in note, note
    assert not driver.find_elements("css selector", "#pending .thumb")


def test_boxes_on_a_tiff_the_browser_cannot_show_are_listed(driver, demo, tmp_path):
    tiff = scene(tmp_path, 37, ".tiff")
    open_page(driver, demo.url, demo.model_id)
    attach(driver, tiff)
    wait(lambda: driver.find_elements("css selector", "#pending .thumb .no-preview"), 10, "the placeholder")
    ask(driver, "Where is the star?")
    wait(lambda: driver.find_elements("css selector", ".msg.assistant .box-text"), 60, "the boxes as text")
    lines = [text_of(t) for t in driver.find_elements("css selector", ".msg.assistant .box-text")]
    assert all(": x " in t and ", y " in t for t in lines), lines


def test_escape_or_a_tap_beside_closes_the_narrow_screens_list(driver, demo):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    open_page(driver, demo.url, demo.model_id)
    size = driver.get_window_size()
    try:
        driver.set_window_size(400, 800)
        sidebar, button = driver.find_element("id", "sidebar"), driver.find_element("id", "chats-button")
        button.click()
        assert sidebar.is_displayed()
        ActionChains(driver).send_keys(Keys.ESCAPE).perform()
        assert not sidebar.is_displayed()
        button.click()
        assert sidebar.is_displayed()
        beside = driver.find_element("id", "messages")   # its middle is under the list, its right is not
        ActionChains(driver).move_to_element_with_offset(beside, 150, 0).click().perform()
        assert not sidebar.is_displayed()
    finally:
        driver.set_window_size(size["width"], size["height"])


HANG = """
const real = window.fetch;
window.fetch = function (url, opts) {   // the answer never comes, until window.finish() ends the stream
  if (!String(url).includes('chat/completions')) return real.apply(this, arguments);
  return new Promise((_, reject) => { window.finish = () => reject(new TypeError('network error')); });
};
"""


def test_a_second_tab_neither_takes_a_waiting_question_nor_undoes_a_delete(driver, demo):
    with two_tabs(driver, demo, "Q1") as (first, second):
        driver.switch_to.window(first)
        driver.execute_script(HANG)
        ask(driver, "Waiting in the first tab")   # saved at once, its answer still to come
        wait(lambda: driver.find_elements("css selector", ".msg.assistant[data-state='streaming']"), 10, "the answer")
        driver.switch_to.window(second)
        driver.execute_script(RECORD)
        ask(driver, "Asked in the second tab")
        wait_answer(driver, 2)
        body = driver.execute_script("return window.sent")[-1]
        asked = [m["content"] for m in body["messages"] if m["role"] == "user"]
        assert asked == ["Q1", "Asked in the second tab"], asked   # not the other tab's waiting question
        # the second tab deletes the first tab's conversation while it waits for its answer
        mine = driver.execute_script("return localStorage.getItem('edgevl.conversations')")
        theirs = [c for c in json.loads(mine) if "Waiting in the first tab" in questions(c)]
        assert len(theirs) == 1
        driver.execute_script("""
            const l = JSON.parse(localStorage.getItem('edgevl.conversations'));
            localStorage.setItem('edgevl.conversations', JSON.stringify(l.filter((c) => c.id !== arguments[0])));""",
                              theirs[0]["id"])
        driver.switch_to.window(first)
        driver.execute_script("window.finish()")
        wait(lambda: driver.find_elements("css selector", ".msg.assistant[data-state='done']"), 10, "the end")
        assert not [c for c in stored(driver) if "Waiting in the first tab" in questions(c)]   # stays deleted
        notes = [text_of(n) for n in driver.find_elements("css selector", "#messages > .note")]
        assert any("deleted in another tab" in n for n in notes), notes


def test_a_lossless_webp_past_the_servers_pixels_is_named_by_its_size(driver, demo, tmp_path):
    # a VP8L header claiming 16000x16000 (the size sits in its first bytes; no pixels follow)
    bits = (16000 - 1) | (16000 - 1) << 14
    body = b"VP8L" + (5).to_bytes(4, "little") + bytes([0x2F]) + bits.to_bytes(4, "little")
    webp = tmp_path / "big.webp"
    webp.write_bytes(b"RIFF" + (4 + len(body)).to_bytes(4, "little") + b"WEBP" + body)
    open_page(driver, demo.url, demo.model_id)
    attach(driver, webp)
    note = wait(lambda: text_of(driver.find_element("id", "file-note")), 20, "the note")
    assert "16000x16000 pixels" in note, note
