"""One thread owns a model's ncnn calls (edgevl/owner.py): every load and forward of a model runs
on it whichever thread calls the API (images, chats, speculative decoding, MoE experts);
decoding from a worker thread is as fast as from the thread that loaded the model; errors come
back with their traceback; a Ctrl-C stops the owner at a safe point with the cache whole;
abandoned generators release it; close() and garbage collection end it."""

import gc
import signal
import statistics
import threading
import time
import traceback
import weakref

import ncnn
import pytest

import edgevl
from edgevl import owner as owner_mod
from edgevl import verification
from edgevl.chat import ChatSession
from edgevl.errors import EdgevlError
from edgevl.generate import generate, prepare
from support.common import smooth_image


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    root = tmp_path_factory.mktemp("owner")
    qwen, moe = verification.get("qwen3_5"), verification.get("qwen3_5_moe")
    return {
        # with an MTP block: generation decodes speculatively
        "mtp": edgevl.convert(qwen.make_tiny(root / "ck-mtp", seed=3, mtp=True), root / "pk-mtp", dtype="fp32",
                              progress=False),
        "moe": edgevl.convert(moe.make_tiny(root / "ck-moe", seed=4), root / "pk-moe", dtype="fp32", progress=False),
    }


@pytest.fixture
def own_thread(monkeypatch):
    """The test's models get an ncnn thread of their own (models of other tests may hold the
    process's)."""
    monkeypatch.setattr(owner_mod, "_shared", None)


def in_thread(fn):
    """fn() on a fresh thread; its result (or its exception raised here)."""
    out = {}

    def run():
        try:
            out["r"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            out["e"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "e" in out:
        raise out["e"]
    return out["r"]


@pytest.fixture
def ncnn_threads(monkeypatch):
    """The thread ids of every ncnn net load and run from now on."""
    seen = []

    def record(cls, name):
        real = getattr(cls, name)

        def call(self, *args, **kwargs):
            seen.append(threading.get_ident())
            return real(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, call)

    for name in ("load_param", "load_param_mem", "load_model", "load_model_mem", "create_extractor"):
        record(ncnn.Net, name)
    record(ncnn.Extractor, "extract")
    return seen


@pytest.mark.parametrize("name", ["mtp", "moe"])
def test_every_ncnn_call_of_a_model_runs_on_its_owner_thread(packages, ncnn_threads, name):
    model = edgevl.load(packages[name], prefill_chunk=8)
    assert ncnn_threads, "the load ran no ncnn call"
    owner = model._owner._thread.ident
    image = smooth_image(64, 90, 1)
    # image + text, from the loading thread and from others
    a = generate(model, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}],
                 image=[image], max_new_tokens=6)
    b = in_thread(lambda: generate(model, [{"role": "user", "content": [{"type": "image"},
                                                                          {"type": "text", "text": "What?"}]}],
                                   image=[image], max_new_tokens=6))
    assert a == b
    # chat turns on two other threads (the second reuses the first's cache)
    chat = ChatSession(model, max_new_tokens=5)
    in_thread(lambda: "".join(chat.send("Hello there")))
    in_thread(lambda: "".join(chat.send("And then?")))
    # the lower-level calls too
    model.encode_image(image)
    in_thread(lambda: list(model.generate_tokens(prepare(model, "Hi").input_ids, 4)))
    model.preload()
    if name == "mtp":
        assert model.speculative == "mtp" and model.runtime_stats()["speculative"]["drafted"] > 0
    else:
        assert model.decoder.hooks   # the experts run in host steps, on their own small nets
    assert set(ncnn_threads) == {owner} and owner != threading.get_ident()


def test_errors_come_back_with_their_traceback(packages):
    model = edgevl.load(packages["mtp"])
    with pytest.raises(EdgevlError, match="outside the vocabulary") as info:
        in_thread(lambda: list(model.generate_tokens([1, 10 ** 7], 3)))
    names = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "prefill" in names and "embed" in names       # the owner thread's frames
    assert "<lambda>" in names                              # and the caller's
    # an exception inside a forward, raised by a host step on the owner thread
    hooks = dict(model.decoder.hooks)

    def failing(*args, **kwargs):
        raise OSError("disk gone")
    model.decoder.hooks.update(dict.fromkeys(hooks, failing))
    with pytest.raises(OSError, match="disk gone") as info:
        list(model.generate_tokens(prepare(model, "Hi").input_ids, 3))
    assert "failing" in [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    model.decoder.hooks.update(hooks)
    assert model.cache.length == len(model.cache_keys)
    assert len(list(model.generate_tokens(prepare(model, "Hi").input_ids, 3, ignore_eos=True))) == 3


def test_calls_from_the_owner_thread_go_straight_through(packages):
    model = edgevl.load(packages["moe"])
    ids = prepare(model, "Hi").input_ids
    # generate_tokens calls prefill, which calls logits: all wrapped, all on the owner already
    on_owner = model._owner.call(lambda: list(model.generate_tokens(ids, 5, ignore_eos=True)))
    assert on_owner == list(model.generate_tokens(ids, 5, ignore_eos=True, reuse_cache=False))


@pytest.mark.alone   # the hook waits (at most 10 s) for the main thread to take the signal
def test_ctrl_c_while_waiting_stops_the_owner_with_a_whole_cache(packages):
    """SIGINT to the main thread while the owner runs a forward: the main thread asks the owner to
    stop, the owner raises KeyboardInterrupt at its next safe point (between the forward's host
    steps, inside the forward), the cache goes back to where the call started, and the main
    thread raises KeyboardInterrupt once the owner is done."""
    pk = packages["moe"]
    model = edgevl.load(pk, prefill_chunk=4)
    ids1 = prepare(model, "How many shapes are there?").input_ids
    out1 = list(model.generate_tokens(ids1, 4, ignore_eos=True))
    dec, hooks, calls = model.decoder, dict(model.decoder.hooks), [0]
    assert hooks, "the MoE decoder runs host steps"

    def wrap(fn):
        def hooked(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:   # the 2nd host step of the next forward: Ctrl-C
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                task, end = owner_mod._local.task, time.monotonic() + 10
                while not task.cancel and time.monotonic() < end:   # the main thread asked to stop
                    time.sleep(0.005)
            return fn(*args, **kwargs)
        return hooked

    for where in ("prefill", "step"):
        ids2 = ids1 + out1 + prepare(model, f"Say where ({where}).", raw=True).input_ids
        before = model.cache.length
        gen = model.generate_tokens(ids2, 4, ignore_eos=True)
        if where == "step":
            next(gen)
            before = model.cache.length
        calls[0] = 0
        dec.hooks.update({k: wrap(f) for k, f in hooks.items()})
        with pytest.raises(KeyboardInterrupt) as info:
            next(gen)
        dec.hooks.update(hooks)
        # the owner stopped inside the forward, at a safe point
        assert "checkpoint" in [f.name for f in traceback.extract_tb(info.value.__traceback__)]
        assert model.cache.length == len(model.cache_keys) <= before
        gen.close()
    ids3 = ids2 + prepare(model, " And then?", raw=True).input_ids
    assert list(model.generate_tokens(ids3, 6, ignore_eos=True)) == \
        list(edgevl.load(pk).generate_tokens(ids3, 6, ignore_eos=True))


def test_an_abandoned_generator_releases_the_owner(packages):
    model = edgevl.load(packages["mtp"])
    ids = prepare(model, "Tell me a long story.").input_ids
    gen = model.generate_tokens(ids, 200, ignore_eos=True)
    in_thread(lambda g=gen: next(g))
    gen.close()        # a client that hung up
    gen = model.generate_tokens(ids, 200, ignore_eos=True)
    next(gen)
    del gen            # dropped without close()
    t = time.perf_counter()
    assert len(in_thread(lambda: list(model.generate_tokens(ids, 3, ignore_eos=True)))) == 3
    assert time.perf_counter() - t < 5


def test_close_ends_the_thread_and_later_calls_are_refused(packages, own_thread):
    with edgevl.load(packages["mtp"]) as model:
        ids = prepare(model, "Hi").input_ids
        list(model.generate_tokens(ids, 2))
        thread = model._owner._thread
    assert not thread.is_alive()
    with pytest.raises(EdgevlError, match="closed"):
        list(model.generate_tokens(ids, 2))
    with pytest.raises(EdgevlError, match="closed"):
        model.encode_image(smooth_image(32, 32))
    model.close()   # twice is fine


def test_a_call_racing_close_runs_or_is_refused_never_waits_forever():
    """close() from one thread while another calls in: each call either runs or is refused. A
    call that passed the closed check just before close() queued its task behind the end marker
    and waited forever (about 1 in 200 closes of a model under use)."""
    import sys

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)     # switch threads as often as possible: the window was a few bytecodes
    hung = 0
    try:
        for _ in range(400):
            owner = owner_mod.Owner("edgevl-race")
            started = threading.Event()

            def caller(owner=owner, started=started):
                started.set()
                try:
                    while True:
                        owner.call(int)
                except EdgevlError:
                    return

            t = threading.Thread(target=caller, daemon=True)
            t.start()
            started.wait()
            owner.close()
            t.join(2)
            if t.is_alive():
                hung += 1
                owner._tasks.put(None)     # let the stuck caller's thread go on ending the test
    finally:
        sys.setswitchinterval(interval)
    assert hung == 0


def test_a_dropped_model_is_collected_and_its_thread_ends(packages, own_thread):
    model = edgevl.load(packages["moe"])
    ids = prepare(model, "Hi").input_ids
    in_thread(lambda m=model: list(m.generate_tokens(ids, 3)))
    gen = model.generate_tokens(ids, 50, ignore_eos=True)
    next(gen)
    with pytest.raises(EdgevlError):   # an exception that went through the owner, then dropped
        list(model.generate_tokens([10 ** 7], 2))
    owner, ref = model._owner, weakref.ref(model)
    thread = owner._thread
    del model, gen
    owner.call(lambda: None)   # the dropped generator's close, queued on the owner, has run
    gc.collect()
    assert ref() is None
    thread.join(5)
    assert not thread.is_alive()


def test_models_share_one_thread_until_the_last_lets_go(packages, own_thread, ncnn_threads):
    """Two models, one thread: with a thread each, their OpenMP teams outnumber the cores and
    their workers sleep between layers (2 threads each on 2 cores: 490 -> 85 tok/s here)."""
    a, b = edgevl.load(packages["mtp"]), edgevl.load(packages["moe"])
    thread = a._owner._thread
    assert b._owner._thread is thread and owner_mod.holders() == 2
    in_thread(lambda m=b: list(m.generate_tokens(prepare(m, "Hi").input_ids, 3)))
    list(a.generate_tokens(prepare(a, "Hi").input_ids, 3))
    assert set(ncnn_threads) == {thread.ident}
    a.close()
    assert thread.is_alive() and owner_mod.holders() == 1
    assert len(list(b.generate_tokens(prepare(b, "Hi").input_ids, 3, ignore_eos=True))) == 3
    del b
    gc.collect()
    thread.join(5)
    assert not thread.is_alive() and owner_mod.holders() == 0
    # the next model starts a new one
    c = edgevl.load(packages["mtp"])
    assert c._owner._thread.is_alive() and c._owner._thread is not thread


def test_a_failed_load_lets_go_of_the_thread(tmp_path, own_thread):
    with pytest.raises(EdgevlError):
        edgevl.load(tmp_path)
    assert owner_mod.holders() == 0


def test_checkpoint_is_free_outside_owner_threads():
    owner_mod.checkpoint()   # no task: nothing to stop


def decode_rate(model, n: int = 48) -> float:
    ids = list(range(5, 25))
    t = time.perf_counter()
    got = sum(1 for _ in model.generate_tokens(ids, n, ignore_eos=True, reuse_cache=False))
    return got / (time.perf_counter() - t)


@pytest.mark.alone
def test_decoding_from_another_thread_is_as_fast_as_from_the_loading_thread(tmp_path):
    """A 512-wide bf16 model on 2 threads (small enough to build in seconds, wide enough for
    OpenMP to matter): the API decoding from a threading.Thread against the main thread, side
    by side, interleaved. Measured here: 0.9-1.1x (about 460-500 tok/s both ways); before the owner thread,
    with the nets loaded and run on the main thread, 0.15-0.2x (480-520 vs 75-100 tok/s; the
    task measured 0.3-0.5x on real shapes), which fails every look."""
    ck = verification.get("qwen3_5").make_tiny(tmp_path / "ck", seed=0, text_only=True, hidden_size=512,
                                               intermediate_size=1536, num_hidden_layers=4)
    model = edgevl.load(edgevl.convert(ck, tmp_path / "pk", dtype="bf16", progress=False), threads=2)
    decode_rate(model, 8)   # first-run allocations
    tries = []
    for _ in range(3):   # a busy machine can slow either side for a while: up to three looks
        main, thread = [], []
        for i in range(9):   # interleaved, each side first in turn; one run can jump by 40 % either way here
            for side in ((main, thread) if i % 2 else (thread, main)):
                side.append(decode_rate(model) if side is main else in_thread(lambda: decode_rate(model)))
        tries.append((statistics.median(thread) / statistics.median(main), thread, main))
        if tries[-1][0] >= 0.8:
            break
    others = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
    assert tries[-1][0] >= 0.8, "from a thread at " + "; ".join(
        f"{r:.2f}x the main thread's speed (tok/s from a thread {[round(x) for x in t]}, main {[round(x) for x in m]})"
        for r, t, m in tries) + f"; other threads: {others}"
