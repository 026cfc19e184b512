"""Driving the chat page of ``edgevl serve`` in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver`` packages, through Selenium): start the browser, open the page, attach files,
ask, wait for the answer, and list every URL the browser requested."""

from __future__ import annotations

import json
import os
import shutil
import time

INSTALL = ("run scripts/install-chromium.sh (Debian's chromium and chromium-driver) and pip install -e '.[dev]' "
           "(selenium)")


def browser(width: int = 1200, height: int = 860):
    """A headless Chromium that logs its network requests; raises RuntimeError in one line when
    Chromium, its driver or Selenium is missing."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or next((p for p in ["/usr/bin/chromedriver"] if os.path.exists(p)), None)
    if binary is None or driver is None:
        missing = "chromium" if binary is None else "chromedriver"
        raise RuntimeError(f"the web tests need Chromium and its driver, and {missing} is not installed; {INSTALL}")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        raise RuntimeError(f"the web tests need the selenium package; {INSTALL}") from None
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--force-color-profile=srgb", "--hide-scrollbars",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-default-apps", "--disable-sync", "--force-prefers-reduced-motion"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    # the driver is given: Selenium's own manager would try to download one
    return webdriver.Chrome(options=opts, service=Service(driver))


def requested_urls(driver) -> list[str]:
    """Every URL the page requested since the last call (the performance log drains as it is read)."""
    urls = []
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    return urls


def wait(cond, seconds: float = 30, what: str = "the page"):
    """``cond()``'s first true value, polled; AssertionError naming ``what`` when time runs out."""
    t0 = time.monotonic()
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() - t0 > seconds:
            raise AssertionError(f"timed out after {seconds} s waiting for {what}")
        time.sleep(0.03)


def open_page(driver, url: str, model_id: str | None = None, keep_storage: bool = False):
    """Open the page at ``url`` with empty local storage (unless ``keep_storage``) and wait until it
    knows the model."""
    driver.get(url + "/")
    if not keep_storage:
        driver.execute_script("localStorage.clear()")
        driver.get(url + "/")
    if model_id is not None:
        wait(lambda: driver.find_element("id", "model-name").text == model_id, 20, "the page to show the model")


def attach(driver, *paths):
    driver.find_element("id", "file-input").send_keys("\n".join(str(p) for p in paths))


def ask(driver, text: str):
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element("id", "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


SNAPSHOT = """
const msgs = [...document.querySelectorAll('#messages .msg.assistant')];
return msgs.map((m) => {
  const q = (sel) => m.querySelector(sel);
  const details = q('details.reasoning');
  return {state: m.dataset.state, text: q('.content') ? q('.content').textContent : null,
          reasoning: details ? q('.reasoning-text').textContent : null, reasoning_open: details ? details.open : null,
          error: q('.error') ? q('.error').textContent : null,
          stopped: [...m.querySelectorAll('.note')].some((n) => n.textContent === 'Stopped.'),
          stats: q('.stats') ? q('.stats').textContent : null,
          boxes: [...m.querySelectorAll('.box')].map((b) => {
            const r = b.getBoundingClientRect(), i = b.closest('.frame').querySelector('img').getBoundingClientRect();
            return {box: b.dataset.box.split(',').map(Number), label: b.querySelector('.box-label').textContent,
                    left: r.left - i.left, top: r.top - i.top, width: r.width, height: r.height,
                    image_width: i.width, image_height: i.height,
                    natural: [b.closest('.frame').querySelector('img').naturalWidth,
                              b.closest('.frame').querySelector('img').naturalHeight]};
          })};
});
"""


def answers(driver) -> list[dict]:
    """Each answer on the page as the user sees it: state (streaming/done), text, reasoning (and
    whether it is unfolded), error, stopped, stats line, and its boxes with their places over the
    image, read in one go (the page redraws answers as they stream)."""
    return driver.execute_script(SNAPSHOT)


def wait_answer(driver, n: int, seconds: float = 60) -> dict:
    """The n-th answer (from 1) once it is complete."""
    def done():
        a = answers(driver)
        return a[n - 1] if len(a) >= n and a[n - 1]["state"] == "done" else None
    return wait(done, seconds, f"answer {n}")


def text_of(element) -> str:
    """The element's whole text, shown or collapsed."""
    return element.get_attribute("textContent")


def set_settings(driver, **values):
    """Open the settings dialog, fill the fields given (system, temperature, top_p, max_tokens,
    seed), close it."""
    driver.find_element("id", "settings-button").click()
    for k, v in values.items():
        field = driver.find_element("id", f"set-{k}")
        field.clear()
        field.send_keys(str(v))
    driver.find_element("id", "settings-close").click()
    wait(lambda: not driver.find_element("id", "settings").get_attribute("open"), 5, "the settings to close")


# every request body the page sends, kept in the page (window.sent)
RECORD = """
window.sent = [];
const real = window.fetch;
window.fetch = function (url, opts) {
  if (String(url).includes('chat/completions')) window.sent.push(JSON.parse(opts.body));
  return real.apply(this, arguments);
};
"""


def stored(driver) -> list:
    """The conversations the page keeps in the browser's local storage."""
    return json.loads(driver.execute_script("return localStorage.getItem('edgevl.conversations')") or "[]")
