"""`edgevl chat` in a real pseudo-terminal: Ctrl-C at the prompt keeps the conversation, a second
one leaves; /reset keeps an attached image; `--image demo` and `/image demo` work."""

import json
import os
import pty
import select
import subprocess
import sys
import time

import pytest

from edgevl.demo import demo_package
from support.common import ROOT


class Terminal:
    """A child process on a pseudo-terminal (its stdin, stdout and stderr), read with timeouts."""

    def __init__(self, argv, cwd, env):
        # The pty is the child's controlling terminal (Ctrl-C sends it SIGINT): `setsid -c` makes it
        # so. Not pty.fork(): a fork of this multi-threaded test process runs the fork handlers of
        # what it imported (Ray's, Arrow's) in the child, which could hang before the exec and
        # show nothing at all; subprocess starts the child without them.
        self.fd, tty = pty.openpty()
        try:
            self.proc = subprocess.Popen(["setsid", "-c", *argv], stdin=tty, stdout=tty, stderr=tty, cwd=cwd,
                                         env=env)
        finally:
            os.close(tty)
        self.pid = self.proc.pid     # setsid execs in place: the chat's own pid
        self.out = ""

    def read_until(self, text, timeout=120.0) -> str:
        end = time.monotonic() + timeout
        while text not in self.out:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {text!r} within {timeout} s; the terminal shows:\n{self.out}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal (it exited)
                    raise AssertionError(f"the chat exited while waiting for {text!r}:\n{self.out}") from None
                if not chunk:
                    raise AssertionError(f"the chat exited while waiting for {text!r}:\n{self.out}")
                self.out += chunk.decode("utf-8", "replace")
        i = self.out.index(text) + len(text)
        seen, self.out = self.out[:i], self.out[i:]
        return seen

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def interrupt(self) -> None:
        """Ctrl-C once the chat is blocked reading the terminal.

        CPython's readline loses a SIGINT that lands after it printed the prompt but before it
        waits for input (the terminal also flushes the typed line), and the chat then waits for
        a key forever; a person cannot press Ctrl-C within those microseconds, a test can.
        """
        end, quiet = time.monotonic() + 60.0, 0
        while quiet < 5 and time.monotonic() < end:  # the main thread asleep for 5 polls in a row
            try:
                with open(f"/proc/{self.pid}/stat") as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except OSError:
                break
            quiet = quiet + 1 if state == "S" else 0
            time.sleep(0.04)
        self.send("\x03")

    def wait(self, timeout=30.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                return self.proc.returncode
            try:  # keep draining so the child never blocks on a full terminal
                if select.select([self.fd], [], [], 0.1)[0]:
                    self.out += os.read(self.fd, 4096).decode("utf-8", "replace")
            except OSError:
                pass
        return None

    def close(self):
        self.proc.kill()
        self.proc.wait()
        os.close(self.fd)


@pytest.fixture()
def chat(tmp_path):
    demo_package()  # converted once, outside the timed terminal session
    env = dict(os.environ, TERM="dumb", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    terms = []

    def start(*args):
        t = Terminal([sys.executable, "-m", "edgevl.cli", "chat", *args], tmp_path, env)
        terms.append(t)
        return t

    yield start
    for t in terms:
        t.close()


PROMPT = "\n> "


def test_ctrl_c_at_the_prompt_keeps_the_conversation_and_twice_leaves(chat, tmp_path):
    t = chat("--image", "demo", "--seed", "7")
    t.read_until("a random demo scene, saved to demo_scene.png")
    t.read_until("> ")
    assert (tmp_path / "demo_scene.png").is_file()
    t.send("How many shapes are there?\r")
    answer = t.read_until(PROMPT)
    assert "shapes are there?" in answer
    t.send("half a line")
    t.interrupt()                                    # Ctrl-C while typing: the line goes, the chat stays
    notice = t.read_until(PROMPT)
    assert "conversation is kept" in notice and "Ctrl-C again within 2 s" in notice, notice
    t.send("/save t.json\r")
    t.read_until("transcript saved")
    t.read_until("> ")
    msgs = json.loads((tmp_path / "t.json").read_text())["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    assert msgs[0]["content"][-1]["text"] == "How many shapes are there?"
    assert msgs[1]["content"].strip(), msgs  # the first answer is still there
    assert "half a line" not in json.dumps(msgs)
    t.interrupt()
    t.read_until("Ctrl-C again")
    t.read_until("> ")
    t.interrupt()                                    # the second Ctrl-C within 2 s leaves
    assert t.wait() == 0, t.out


def test_reset_keeps_an_attached_image_and_image_demo_works(chat, tmp_path):
    t = chat()
    t.read_until("> ")
    t.send("/image demo\r")
    t.read_until("a random demo scene, saved to demo_scene.png")
    t.read_until("> ")
    t.send("/reset\r")
    said = t.read_until("> ")
    assert "the 1 attached image(s) stay for your next message" in said, said
    t.send("What color is the background?\r")
    t.read_until(PROMPT)
    t.send("/image demo\r")                          # a second scene gets its own file
    t.read_until("saved to demo_scene-2.png")
    t.read_until("> ")
    t.send("/save t.json\r")
    t.read_until("transcript saved")
    msgs = json.loads((tmp_path / "t.json").read_text())["messages"]
    assert msgs[0]["content"][0] == {"type": "image", "image": "demo_scene.png"}, msgs  # kept by /reset
    t.send("/quit\r")
    assert t.wait() == 0, t.out
