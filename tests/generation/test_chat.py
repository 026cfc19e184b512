"""`edgevl chat`: multi-turn KV-cache reuse, commands, the context-overflow policy, the real CLI."""

import io
import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import edgevl
from edgevl.chat import ChatSession, chat_loop
from edgevl.errors import EdgevlError
from edgevl.generate import prepare, stream_events
from support.youtu import make_youtu
from support.youtu_vl import make_vl


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    # briefly trained: its answers are corpus-like text that re-tokenizes to the generated tokens
    root = tmp_path_factory.mktemp("chat")
    ck = make_youtu(root / "ck", seed=1, max_position_embeddings=128, train_steps=100)
    return edgevl.convert(ck, root / "pk", dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def vl_pkg(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-vl")
    ck, _ = make_vl(root / "ck", seed=4)
    return edgevl.convert(ck, root / "pk", dtype="fp32", progress=False)


def chat_lines(model, lines, **kw):
    """Run chat_loop on ``lines`` as the user's input (then end of input): (exit code, output)."""
    feed = iter(lines)

    def fake_input(prompt):
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    code = chat_loop(model, input_fn=fake_input, out=out, **kw)
    return code, out.getvalue()


def test_second_turn_prefills_only_new_tokens_and_matches_a_fresh_run(pkg):
    model = edgevl.load(pkg)
    chat = ChatSession(model, max_new_tokens=10)
    first = "".join(chat.send("How many shapes are there?"))
    ids1, toks1 = prepare(model, chat.messages[:1]).input_ids, chat.last_tokens
    assert model.last_prefill_tokens == len(ids1)
    second = "".join(chat.send("What color is the square?"))
    ids2 = prepare(model, chat.messages[:-1]).input_ids
    # the cache held turn 1's prompt and answer: only the new turn's tokens were computed
    assert model.last_prefill_tokens == len(ids2) - len(ids1) - len(toks1) < len(ids2) / 2
    assert chat.messages[1] == {"role": "assistant", "content": first}
    # fp32 greedy: the same tokens as a fresh model over the whole conversation
    fresh = edgevl.load(pkg)
    ref = [ev.token for ev in stream_events(fresh, chat.messages[:-1], max_new_tokens=10, reuse_cache=False)
           if ev.token is not None]
    assert chat.last_tokens == ref and second == chat.messages[-1]["content"]


def test_commands_reset_save_help_bad_image(pkg, tmp_path):
    model = edgevl.load(pkg)
    save = tmp_path / "t.json"
    code, out = chat_lines(model, ["/help", "Hello there", f"/image {tmp_path / 'nope.png'}", "/bogus",
                                   f"/save {save}", "/reset", "Hi again", f"/save {tmp_path / 'no' / 'x.json'}",
                                   "/quit", "never read"], max_new_tokens=6)
    assert code == 0
    assert "commands:" in out and "/image PATH" in out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 3, out
    assert "no vision tower" in errors[0] and "unknown command /bogus" in errors[1] and "x.json" in errors[2]
    data = json.loads(save.read_text())
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["messages"][0]["content"] == "Hello there"
    # /reset cleared the cache too: "Hi again" was prefilled from scratch
    assert model.last_prefill_tokens == len(prepare(model, [{"role": "user", "content": "Hi again"}]).input_ids)


def test_ctrl_c_stops_an_answer_and_the_chat_goes_on(pkg):
    model = edgevl.load(pkg)
    real, calls = model.step, []

    def step(token):  # Ctrl-C while the model computes the 3rd token
        calls.append(token)
        if len(calls) % 10 == 3:
            raise KeyboardInterrupt
        return real(token)

    model.step = step
    chat = ChatSession(model, max_new_tokens=8)
    with pytest.raises(KeyboardInterrupt):
        "".join(chat.send("How many shapes are there?"))
    assert len(chat.last_tokens) == 3 and chat.messages[-1]["role"] == "assistant"  # the partial answer is kept
    # the interrupted step left the cache whole: the conversation goes on from it as from scratch
    assert model.cache.length == len(model.cache_keys) > 0
    ids = model.cache_keys + [chat.last_tokens[-1]]
    model.step = real
    assert list(model.generate_tokens(ids, 6, ignore_eos=True)) == \
        list(edgevl.load(pkg).generate_tokens(ids, 6, ignore_eos=True))
    model.step = step
    calls[:] = [0] * 12  # the next call is the 13th: the first answer is interrupted, the next ones are not
    code, out = chat_lines(model, ["How many shapes are there?", "Two?", "/save /dev/null"], max_new_tokens=4)
    assert code == 0 and out.count("[interrupted]") == 1 and out.rstrip().endswith("[transcript saved to /dev/null]")


def test_overflow_drops_oldest_turns_and_refuses_oversized_messages(pkg):
    model = edgevl.load(pkg)
    lines = ["How many shapes are there?", "What color is the square?", "Describe the image.",
             "word " * 100, "Two."]
    code, out = chat_lines(model, lines, max_new_tokens=12, system="Be brief.")
    assert code == 0
    notices = [line for line in out.splitlines() if line.startswith("[context full")]
    assert notices and "dropped the 1 oldest turn" in notices[0], out
    refused = [line for line in out.splitlines() if line.startswith("error: message refused")]
    assert len(refused) == 1 and "128-token context" in refused[0], out
    # the chat went on after the refusal
    assert out.rstrip().splitlines()[-1] != refused[0]

    chat = ChatSession(model, max_new_tokens=12, system="Be brief.")
    for q in lines[:3]:
        "".join(chat.send(q))
        n = len(prepare(model, chat.messages[:-1]).input_ids)
        assert n + 12 <= model.max_context
    assert chat.dropped >= 1 and chat.messages[0] == {"role": "system", "content": "Be brief."}
    assert chat.messages[-2] == {"role": "user", "content": lines[2]}
    before = list(chat.messages)
    with pytest.raises(EdgevlError, match="message refused"):
        chat.send("word " * 100)
    assert chat.messages == before  # a refused message changes nothing
    with pytest.raises(EdgevlError, match="max_new_tokens"):
        ChatSession(model, max_new_tokens=128)


def test_image_turns_reuse_the_cache(vl_pkg, tmp_path):
    model = edgevl.load(vl_pkg)
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    (tmp_path / "bad.png").write_bytes(b"not an image")
    code, out = chat_lines(model, [f"/image {tmp_path / 'bad.png'}", f"/image {tmp_path / 'none.png'}", "hi"],
                           max_new_tokens=4)
    lines = out.splitlines()
    assert code == 0 and "Not a readable image" in lines[1] and "not found" in lines[2], out
    assert lines[3].startswith("[") is False  # no image was attached; "hi" was answered
    chat = ChatSession(model, max_new_tokens=6)
    with pytest.raises(EdgevlError, match="Not a readable image"):
        chat.attach(tmp_path / "bad.png")
    chat.attach(tmp_path / "a.png")
    "".join(chat.send("What is it?"))
    n_image = sum(isinstance(k, tuple) for k in model.cache_keys)  # image rows are keyed by digest
    assert n_image > 0 and chat.messages[0]["content"][0] == {"type": "image", "image": str(tmp_path / "a.png")}
    "".join(chat.send("And now?"))
    ids2 = prepare(model, chat.messages[:-1]).input_ids
    assert model.last_prefill_tokens < len(ids2) - n_image  # the image rows came from the cache
    json.loads(chat.save(tmp_path / "t.json").read_text())  # image parts are stored as paths


def test_a_file_overwritten_and_attached_again_leaves_the_earlier_turn_its_pixels(vl_pkg, tmp_path):
    """A camera overwrites latest.png between turns and the user attaches it again: encodings were
    remembered by path, so the first turn silently showed the new picture too."""
    model = edgevl.load(vl_pkg)
    rng = np.random.default_rng(3)
    old, new = (Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)) for _ in range(2))
    latest = tmp_path / "latest.png"
    old.save(latest)
    chat = ChatSession(model, max_new_tokens=6)
    chat.attach(latest)
    first = "".join(chat.send("What is it?"))
    new.save(latest)
    chat.attach(latest)
    second = "".join(chat.send("And now?"))
    old.save(tmp_path / "old.png")
    new.save(tmp_path / "new.png")
    convo = [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "old.png")},
                                          {"type": "text", "text": "What is it?"}]},
             {"role": "assistant", "content": first},
             {"role": "user", "content": [{"type": "image", "image": str(tmp_path / "new.png")},
                                          {"type": "text", "text": "And now?"}]}]
    expected = edgevl.generate(model, convo, max_new_tokens=6)
    assert second == expected
    convo[0]["content"][0]["image"] = str(tmp_path / "new.png")       # what it answered before
    assert edgevl.generate(model, convo, max_new_tokens=6) != expected
    model.close()


def test_cli_chat_subprocess(pkg, tmp_path):
    script = f"Hello there\n/image {tmp_path / 'x.png'}\n/save {tmp_path / 't.json'}\nHi\n"  # then EOF
    r = subprocess.run([sys.executable, "-m", "edgevl", "chat", str(pkg), "--max-new-tokens", "6"],
                       input=script, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "edgevl chat:" in r.stdout
    assert "error: this model has no vision tower" in r.stdout
    assert len(json.loads((tmp_path / "t.json").read_text())["messages"]) == 2


def test_save_writes_the_turns_the_context_dropped_too(pkg, tmp_path):
    model = edgevl.load(pkg)
    chat = ChatSession(model, max_new_tokens=12, system="Be brief.")
    asked = ["How many shapes are there?", "What color is the square?", "Describe the image.", "Two."]
    for q in asked:
        "".join(chat.send(q))
    assert chat.earlier and chat.messages[1]["content"] != asked[0]        # the context dropped turns
    saved = json.loads(chat.save(tmp_path / "t.json").read_text())
    assert [m["content"] for m in saved["messages"] if m["role"] == "user"] == asked
    assert saved["messages"][0] == {"role": "system", "content": "Be brief."}
    assert len(saved["messages"]) == 1 + 2 * len(asked)
    assert saved["dropped_from_context"] == len(chat.earlier) // 2 >= 1
    code, out = chat_lines(model, asked + [f"/save {tmp_path / 'u.json'}"], max_new_tokens=12)
    assert "no longer in the model's context" in out.strip().splitlines()[-1], out
    chat.reset()
    assert not json.loads(chat.save(tmp_path / "v.json").read_text())["messages"][1:]


def test_a_small_context_starts_a_chat_with_room_for_the_conversation(pkg):
    model = edgevl.load(pkg)
    assert ChatSession(model).max_new_tokens == min(256, model.max_context // 2)


def test_images_that_cannot_fit_are_refused_when_attached(vl_pkg, tmp_path):
    """Attached images that alone fill the context would refuse every message after (a refusal
    keeps them, and no command takes one back): the image past the room is refused at /image."""
    model = edgevl.load(vl_pkg)
    Image.fromarray(np.full((96, 128, 3), 120, np.uint8)).save(tmp_path / "a.png")
    chat = ChatSession(model, max_new_tokens=8)
    with pytest.raises(EdgevlError, match="image refused: the .* attached images and videos would take .* no room"):
        for _ in range(model.max_context):
            chat.attach(tmp_path / "a.png")
    assert len(chat.pending_images) >= 1
    assert "".join(chat.send("What is it?")) is not None                    # the message still fits


@pytest.fixture(scope="module")
def qwen_vl_pkg(tmp_path_factory):
    """A random Qwen3.5 with its vision tower (the family that takes video)."""
    from support.qwen import make_qwen3_5

    root = tmp_path_factory.mktemp("chat-qwen-vl")
    return edgevl.convert(make_qwen3_5(root / "ck", seed=2), root / "pk", dtype="fp32", progress=False)


def noise_frames(folder, rng, n: int = 4):
    """A folder of ``n`` 112x112 frames of noise (a clip)."""
    folder.mkdir()
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8)).save(folder / f"{i:03d}.png")
    return folder


def test_a_video_after_an_image_is_checked_with_it(qwen_vl_pkg, tmp_path):
    """/video checks the attached images with the clip, as /image checks the videos: each fits
    alone, both together would leave no room for a message."""
    model = edgevl.load(qwen_vl_pkg)
    rng = np.random.default_rng(0)
    noise_frames(tmp_path / "frames", rng)
    Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8)).save(tmp_path / "img.png")
    probe = ChatSession(model, max_new_tokens=16)
    text = [{"type": "text", "text": ""}]
    base = probe._count([{"role": "user", "content": text}])
    image = probe._count([{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "img.png")}, *text]}])
    video = probe._count([{"role": "user", "content": [{"type": "video", "video": str(tmp_path / "frames")}, *text]}])
    room = image + video - base - 1              # each fits alone with room for a message; both do not
    for first in ("image", "video"):
        chat = ChatSession(model, max_new_tokens=model.max_context - room)
        if first == "image":
            chat.attach(tmp_path / "img.png")
            with pytest.raises(EdgevlError, match="video refused: the 2 attached images and videos"):
                chat.attach_video(tmp_path / "frames")
        else:
            chat.attach_video(tmp_path / "frames")
            with pytest.raises(EdgevlError, match="image refused: the 2 attached images and videos"):
                chat.attach(tmp_path / "img.png")
        assert "".join(chat.send("hi")) is not None   # the one attached still leaves room for a message


def test_videos_that_fill_the_context_drop_the_oldest_turns(qwen_vl_pkg, tmp_path, monkeypatch):
    """The conversation's videos were counted from their headers before any turn could go, so
    once they added up past the context every message was refused, text alone too, until /reset;
    the oldest turns go first, as for text."""
    model = edgevl.load(qwen_vl_pkg)
    noise_frames(tmp_path / "frames", np.random.default_rng(1))
    video = {"type": "video", "video": str(tmp_path / "frames")}
    text = {"type": "text", "text": "a"}
    one = ChatSession(model, max_new_tokens=4)._count([{"role": "user", "content": [video, text]}])
    clip = model.video_tokens(str(tmp_path / "frames"))
    monkeypatch.setattr(model, "max_context", one + clip // 2 + 8)    # one clip and a reply fit, two clips do not
    chat = ChatSession(model, max_new_tokens=4)
    chat.attach_video(tmp_path / "frames")
    "".join(chat.send("One?"))
    chat.attach_video(tmp_path / "frames")
    "".join(chat.send("Two?"))
    assert chat.dropped == 1 and len(chat.earlier) == 2
    "".join(chat.send("Text only?"))
    assert chat.messages[-1]["role"] == "assistant" and len(chat.earlier) >= 2
    # a text alone too long is refused for itself, not for the videos counted on the way
    with pytest.raises(EdgevlError, match="message refused: it needs .* prompt tokens"):
        chat.send("word " * 400)
    # a clip that cannot fit beside a long system prompt is refused with its own count
    long = ChatSession(model, max_new_tokens=4, system="Be brief and exact. " * 20)
    with pytest.raises(EdgevlError, match=r"video refused: the video takes \d+ tokens and the rest of the prompt"):
        long.attach_video(tmp_path / "frames")
    model.close()


def test_attachments_are_let_go_with_their_turns_and_kept_across_reset(vl_pkg, tmp_path, monkeypatch):
    """Each attachment keeps its own encoding: those of dropped turns are let go (a camera's
    latest.png sent every turn grew the memo without bound), and /reset that keeps what is
    attached keeps its pixels (the file may have been overwritten since)."""
    model = edgevl.load(vl_pkg)
    rng = np.random.default_rng(5)
    latest = tmp_path / "latest.png"
    Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(latest)
    one = ChatSession(model, max_new_tokens=4)._count([{"role": "user", "content": [
        {"type": "image", "image": str(latest)}, {"type": "text", "text": "Turn 10?"}]}])
    monkeypatch.setattr(model, "max_context", 3 * one + 16)      # about three turns fit
    chat = ChatSession(model, max_new_tokens=4)
    for turn in range(12):
        Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(latest)
        chat.attach(latest)
        "".join(chat.send(f"Turn {turn}?"))
    in_context = sum(isinstance(m["content"], list) for m in chat.messages)
    assert chat.earlier and len(chat.model.rows) == in_context < 12
    before = Image.open(latest).copy()
    chat.attach(latest)
    Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(latest)   # overwritten since
    chat.reset(keep_attached=True)
    answer = "".join(chat.send("What is it?"))
    before.save(tmp_path / "before.png")
    assert answer == edgevl.generate(model, [{"role": "user", "content": [
        {"type": "image", "image": str(tmp_path / "before.png")}, {"type": "text", "text": "What is it?"}]}],
        max_new_tokens=4)
    model.close()


def test_a_full_context_drops_enough_turns_that_the_next_ones_reuse_the_cache(pkg):
    """Dropping just the one oldest turn left the context full: every turn after that dropped one
    again, and each drop moves the prompt's start, so every turn recomputed the whole context
    (42 s a turn at 64k tokens). Now a drop leaves a quarter of the room free and the turns after
    it reuse the cache."""
    model = edgevl.load(pkg)
    chat = ChatSession(model, max_new_tokens=4)
    room = model.max_context - 4
    drops, reused = [], []
    for i in range(40):
        "".join(chat.send(f"Say {i}."))
        n = len(prepare(model, chat.messages[:-1]).input_ids)     # this turn's prompt
        if chat.dropped:
            assert n <= room - room // 4, (i, n)
            drops.append(i)
        elif drops:
            reused.append(model.last_prefill_tokens < n // 2)
    assert len(drops) >= 2 and min(b - a for a, b in zip(drops, drops[1:])) >= 2, drops
    assert reused and all(reused)


def test_a_long_message_after_many_turns_renders_the_conversation_a_few_times(pkg, monkeypatch):
    """The turns to drop were found one at a time, each rendering and tokenizing the whole
    conversation again: a long message after many short turns cost the square of the context
    (7 s before the prefill at 16k tokens). Now a binary search finds the fewest that leave a
    quarter of the room free."""
    model = edgevl.load(pkg)
    chat = ChatSession(model, max_new_tokens=4)
    chat.messages = [m for i in range(40) for m in ({"role": "user", "content": f"u{i}"},
                                                   {"role": "assistant", "content": f"a{i}"})]
    calls = []
    real = ChatSession._count
    monkeypatch.setattr(ChatSession, "_count", lambda self, m: calls.append(1) or real(self, m))
    chat.send("hi").close()      # the turns go before the answer starts
    k, room = chat.dropped, model.max_context - 4
    assert k >= 20 and len(calls) <= 4 + 2 * (40).bit_length(), (k, len(calls))
    left = chat.messages + [{"role": "user", "content": "hi"}]     # the prompt of the turn
    assert left[0] == {"role": "user", "content": f"u{k}"}
    prompt = lambda msgs: len(prepare(model, msgs).input_ids)   # noqa: E731
    assert prompt(left) <= room - room // 4
    one_less = [{"role": "user", "content": f"u{k - 1}"}, {"role": "assistant", "content": f"a{k - 1}"}] + left
    assert prompt(one_less) > room - room // 4       # the fewest that leave a quarter free
