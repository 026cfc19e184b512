"""Image bombs: sent concurrently they keep a real server process's memory bounded (its VmHWM),
decoded pixels are reused across request threads, and a PNG's pixel count is read from its
header before anything is decoded."""

import base64
import os
import re
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from edgevl.demo import demo_package
from support.common import TESTS
from support.files import png_bomb, png_chunk
from support.server import post, status_kb


def image_msg(path, text="What is it?"):
    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def test_concurrent_image_bombs_keep_server_memory_bounded(tmp_path):
    """16 concurrent requests, each with 10000x10000 PNGs (100 M pixels, 320 KB each): 14 send two
    (over the per-request pixel limit: refused from the headers, the second never decoded), 2
    send one (decoded, one request at a time, each to ~400 MB of pixels). The server process's
    peak RSS (VmHWM) must stay under the model's RSS + 1 GiB (decoding before the queue took
    7.3 GB for 16 such requests)."""
    pkg = demo_package()
    png = png_bomb(tmp_path / "big.png", 10000, 10000)
    one = image_msg(png)
    two = [{"role": "user", "content": one[0]["content"][:1] * 2 + one[0]["content"][1:]}]
    small = image_msg(png_bomb(tmp_path / "small.png", 128, 128))
    # budget 256 patches: a 10000x10000 image fits (as it does the real model's 36864)
    proc = subprocess.Popen([sys.executable, "-m", "edgevl", "serve", str(pkg), "--port", "0", "--max-queue", "16",
                             "--threads", "1", "--max-image-patches", "256"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        port = int(re.search(r"127\.0\.0\.1:(\d+)", line).group(1))
        status, body, _ = post(port, {"messages": small, "max_tokens": 2})  # warm: the vision graph ran once
        assert status == 200, body
        model_kb = status_kb(proc.pid, "VmHWM")
        bodies = [{"messages": one if i % 8 == 3 else two, "max_tokens": 2} for i in range(16)]
        assert sum(b["messages"] is one for b in bodies) == 2
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda b: post(port, b), bodies))
        peak_kb = status_kb(proc.pid, "VmHWM")
    finally:
        proc.kill()
        proc.wait()
    for b, (status, reply, _) in zip(bodies, results):
        if b["messages"] is one:
            assert status == 200 and reply["usage"]["prompt_tokens"] > 49, reply  # 49 image tokens
        else:
            assert status == 400 and "more than 100000000 pixels in all" in reply["error"]["message"], reply
            assert reply["error"]["param"] == "messages[0].content[1]"
    print(f"\nserver VmHWM: {model_kb / 1024:.0f} MB after loading and one small image; "
          f"{peak_kb / 1024:.0f} MB after 16 concurrent bomb requests (+{(peak_kb - model_kb) / 1024:.0f} MB)")
    assert peak_kb < model_kb + (1 << 20)


def test_concurrent_webp_bombs_decode_within_the_memory_budget(tmp_path):
    """Four concurrent requests, each a 4 KB lossless WebP of 6000x6000: Pillow's WebP decoder
    peaks near 15 bytes a pixel (~540 MB each), so the slots decoding at once took 2 GB and more
    (four 10-megapixel ones took a gateway to 6 GB). The decode budget lets one such request hold
    its pixels at a time: the server's VmHWM stays under the model's + 1 GiB."""
    from PIL import Image

    pkg = demo_package()
    webp = tmp_path / "big.webp"
    Image.new("RGB", (6000, 6000), (20, 40, 60)).save(webp, lossless=True)
    url = "data:image/webp;base64," + base64.b64encode(webp.read_bytes()).decode()
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is it?"}]}]
    small = image_msg(png_bomb(tmp_path / "small.png", 128, 128))
    proc = subprocess.Popen([sys.executable, "-m", "edgevl", "serve", str(pkg), "--port", "0", "--threads", "1",
                             "--parallel", "4", "--max-image-patches", "256"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        port = int(re.search(r"127\.0\.0\.1:(\d+)", proc.stdout.readline()).group(1))
        status, body, _ = post(port, {"messages": small, "max_tokens": 2})
        assert status == 200, body
        model_kb = status_kb(proc.pid, "VmHWM")
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: post(port, {"messages": msgs, "max_tokens": 2}, timeout=300), range(4)))
        peak_kb = status_kb(proc.pid, "VmHWM")
    finally:
        proc.kill()
        proc.wait()
    assert all(r[0] == 200 for r in results), [r[:2] for r in results]
    print(f"\nserver VmHWM: {model_kb / 1024:.0f} MB, then {peak_kb / 1024:.0f} MB after 4 concurrent WebP bombs")
    assert peak_kb < model_kb + (1 << 20)


ARENA_SCRIPT = """
import base64, re, sys, threading
from edgevl import server as S
from support.files import png_bomb
S._one_malloc_arena()  # what starting a server does
png = png_bomb(sys.argv[1], 6400, 6400)  # 164 MB decoded
pending = S._image("data:image/png;base64," + base64.b64encode(png.read_bytes()).decode(), None, "p")
def hwm():
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
before = hwm()
gate, done, sizes = threading.Lock(), threading.Barrier(5), []
def request():
    with gate:  # one at a time, as the server's gate runs them
        sizes.append(pending.decode().size)
    done.wait(60)  # every thread stays alive (waiting requests do) until all are done
threads = [threading.Thread(target=request) for _ in range(5)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert sizes == [(6400, 6400)] * 5
print(hwm() - before)
"""


def test_decoded_pixels_are_reused_across_request_threads(tmp_path):
    """Five live request threads decode a 164 MB image in turn: the peak must grow by about one
    image, not one per thread (it grew by 350 MB here with an arena per thread)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", ARENA_SCRIPT, str(tmp_path / "mid.png")], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    grown_mb = int(r.stdout.split()[-1]) / 1024
    assert grown_mb < 1.5 * 6400 * 6400 * 4 / 2 ** 20, f"peak grew by {grown_mb:.0f} MB"


def test_pixel_header_is_read_before_decoding(monkeypatch):
    """A PNG whose header claims more pixels than the request may hold is refused from the header
    alone: its data is never decoded (here the data is garbage, so decoding would fail otherwise)."""
    from edgevl import server as S

    fake = (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", 60000, 60000, 8, 2, 0, 0, 0))
            + png_chunk(b"IDAT", b"not zlib at all") + png_chunk(b"IEND", b""))
    url = "data:image/png;base64," + base64.b64encode(fake).decode()
    with pytest.raises(S.HTTPError) as e:
        S._image(url, None, "messages[0].content[0]")
    assert e.value.status == 400 and "more than 100000000 pixels" in str(e.value)
