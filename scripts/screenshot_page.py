"""Screenshot of the chat page (docs/web_page.png): the demo model behind `edgevl serve`, asked
about demo scene 37 in headless Chromium, its box drawn over the image.

    python scripts/screenshot_page.py [--out docs/web_page.png]

Needs Debian's chromium and chromium-driver (scripts/install-chromium.sh) and selenium (the dev extra).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]

import edgevl  # noqa: E402
from edgevl.demo import demo_package  # noqa: E402
from edgevl.demo.scenes import make_scene  # noqa: E402
from edgevl.server import make_server  # noqa: E402
from support.web import ask, attach, browser, open_page, wait, wait_answer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE.parent / "docs" / "web_page.png"))
    args = ap.parse_args()
    srv, _ = make_server(edgevl.load(demo_package()), model_name="demo")
    driver = browser(1200, 1150)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            scene = Path(tmp) / "scene37.png"
            make_scene(37).image.save(scene)
            open_page(driver, srv.url, "demo")
            attach(driver, scene)
            wait(lambda: driver.find_elements("css selector", "#pending .thumb img"), 10, "the thumbnail")
            ask(driver, "Describe the image.")
            wait_answer(driver, 1)
            ask(driver, "Where is the star?")
            wait(lambda: wait_answer(driver, 2)["boxes"], 30, "the boxes")
            driver.execute_script("document.activeElement.blur()")  # no caret in the picture
            driver.save_screenshot(args.out)
    finally:
        driver.quit()
        srv.stop()
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
