"""The engine (continuous batching, edgevl/engine.py): requests decode together, each row with its
own KV cache, conv window, host state and expert routing, and each request gets the greedy tokens
it gets alone (fp32) — with mixed prompt lengths, images, stop tokens, budgets, drafting, more
requests than slots, and a client that goes away mid-answer."""

import itertools
import threading

import numpy as np
import pytest

import edgevl
from edgevl import verification
from edgevl.engine import Engine
from edgevl.errors import EdgevlError
from edgevl.generate import prepare
from support.common import CORPUS, smooth_image

# every decoder kind: gated delta + gated attention with an MTP block and a vision tower; its MoE;
# MLA; KDA + gated MLA with quantile-balanced routing and images
CASES = [("qwen3_5", {"mtp": True, "train_steps": 20, "mtp_train_steps": 40}),
         ("qwen3_5_moe", {"mtp": True}),
         ("youtu", {}),
         ("youtu_moe", {})]


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    out = {}
    for i, (family, kw) in enumerate(CASES):
        v = verification.get(family)
        variant = list(v.tiny_variants)[0]
        kw = {k: x for k, x in kw.items() if k != "mtp" or family.startswith("qwen")}
        ck = v.make_tiny(root / f"ck{i}", variant=variant, seed=90 + i, **kw)
        out[family] = edgevl.convert(ck, root / f"pk{i}", dtype="fp32", progress=False)
    yield out
    for m in _models.values():   # the process's ncnn thread ends with its last model
        m.close()
    _models.clear()


_models = {}


def _model(packages, family):
    if family not in _models:
        _models[family] = edgevl.load(packages[family], prefill_chunk=16)
    return _models[family]


def requests(model) -> list:
    """(prepared prompt, max_new_tokens) of different lengths, with an image where the model
    takes images."""
    out = [(prepare(model, " ".join(CORPUS[:5])), 30),          # several prefill chunks
           (prepare(model, "Describe a cat."), 12),
           (prepare(model, "Count to ten."), 25),
           (prepare(model, "Name a colour."), 18)]
    if model.vision is not None:
        out.append((prepare(model, [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                      "text": "What is this?"}]}],
                            image=[smooth_image(64, 90, 4)]), 20))
    return out


def alone(model, prep, n, stop_ids=None) -> list:
    return list(model.generate_tokens(prep.input_ids, n, image=prep.encoded, reuse_cache=False, ignore_eos=True,
                                      stop_ids=stop_ids))


def consume(stream, into: list, cancel_after: int | None = None) -> None:
    for t in stream:
        into.append(t)
        if cancel_after is not None and len(into) >= cancel_after:
            stream.close()
            return


def start(engine, reqs, stop_at) -> list:
    """Each request's stream (request 2 ends at the token ``stop_at``)."""
    return [engine.generate_tokens(p.input_ids, n, image=p.encoded, ignore_eos=True,
                                   stop_ids=[stop_at] if i == 2 else None) for i, (p, n) in enumerate(reqs)]


def read_all(jobs) -> None:
    """``consume(*job)`` for each job, all at once (a thread each)."""
    threads = [threading.Thread(target=consume, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)


@pytest.mark.parametrize("family", [f for f, _ in CASES])
def test_batched_greedy_tokens_are_the_ones_each_request_gets_alone(packages, family):
    model = _model(packages, family)
    reqs = requests(model)
    want = [alone(model, p, n) for p, n in reqs]
    # a stop token: the request ends where its alone run produced it
    stop_at = want[2][6]
    want[2] = want[2][:want[2].index(stop_at) + 1]
    engine = Engine(model, parallel=3)    # fewer slots than requests: some wait, slots are reused
    try:
        got = [[] for _ in reqs]
        streams = start(engine, reqs, stop_at)
        # a client that goes away after 4 tokens: the others go on
        gone = engine.generate_tokens(reqs[1][0].input_ids, 200, ignore_eos=True)
        left = []
        read_all([(s, g) for s, g in zip(streams, got)] + [(gone, left, 4)])
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"request {i}: {g} != {w}"
        assert left == alone(model, reqs[1][0], 4)
        assert engine.rows > engine.steps > 0      # several requests shared decoder forwards
        if model.mtp is not None:      # and drafting rounds were measured against plain steps
            assert engine.cycles > 0 and any(isinstance(k, tuple) for k in engine.rate)
    finally:
        engine.close()


@pytest.mark.parametrize("family", [f for f, _ in CASES])
def test_seeded_sampled_tokens_are_the_ones_each_request_gets_alone(packages, family):
    """Sampled with a seed, each request gets the tokens it gets alone (there: drafting where
    the model drafts), beside requests with settings of their own, in drafting rounds and plain
    steps alike."""
    model = _model(packages, family)
    reqs = requests(model)
    kws = [dict(temperature=0.6 + 0.2 * i, top_p=0.9, seed=11 + i) for i in range(len(reqs))]
    want = [list(model.generate_tokens(p.input_ids, n, image=p.encoded, reuse_cache=False, ignore_eos=True, **kw))
            for (p, n), kw in zip(reqs, kws)]
    engine = Engine(model, parallel=len(reqs))
    try:
        got = [[] for _ in reqs]
        read_all([(engine.generate_tokens(p.input_ids, n, image=p.encoded, ignore_eos=True, **kw), g)
                  for (p, n), kw, g in zip(reqs, kws, got)])
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"request {i}: {g} != {w}"
        assert engine.rows > engine.steps > 0
    finally:
        engine.close()


def test_drafting_runs_for_a_lone_request_and_output_is_unchanged(packages):
    model = _model(packages, "qwen3_5")
    prep, n = requests(model)[0]
    engine = Engine(model, parallel=2)
    try:
        s = engine.generate_tokens(prep.input_ids, n, ignore_eos=True)
        assert list(s) == alone(model, prep, n)
        assert s.drafted > 0 and engine.steps == 0      # alone: draft-and-verify cycles, no plain steps
    finally:
        engine.close()


def test_requests_draft_together_in_one_verify_pass_and_output_is_unchanged(packages, monkeypatch):
    """Every round a drafting round: each request's drafts (accepted or not, an image's M-RoPE
    positions, a stop token) are verified in one forward with the others', and each request
    still gets the tokens it gets alone."""
    model = _model(packages, "qwen3_5")
    reqs = requests(model)
    want = [alone(model, p, n) for p, n in reqs]
    stop_at = want[2][6]
    want[2] = want[2][:want[2].index(stop_at) + 1]
    rounds = []
    draft = Engine._draft

    def counted(self, streams):
        before = sum(s.accepted for s in streams), sum(s.drafted for s in streams)
        draft(self, streams)
        rounds.append((len(streams), sum(s.accepted for s in streams) - before[0],
                       sum(s.drafted for s in streams) - before[1]))

    monkeypatch.setattr(Engine, "_draft", counted)
    monkeypatch.setattr(Engine, "_choose", lambda self, decoding, **_: self._run(self._draft, decoding))
    engine = Engine(model, parallel=len(reqs))
    try:
        got = [[] for _ in reqs]
        read_all(list(zip(start(engine, reqs, stop_at), got)))
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"request {i}: {g} != {w}"
        together = [r for r in rounds if r[0] > 1]
        assert together and sum(a for _, a, _ in together) > 0            # drafts accepted together
        assert sum(d - a for _, a, d in together) > 0                     # and some taken back
    finally:
        engine.close()


def test_drafting_rounds_or_plain_steps_by_the_rates_measured(packages):
    from edgevl import engine as eng

    engine = Engine(_model(packages, "qwen3_5"), parallel=2)
    try:
        picks = []
        engine._run = lambda fn, streams: picks.append(fn.__name__)
        engine._choose([None] * 4)                      # nothing measured: a plain step first,
        engine.rate[4] = 10.0
        engine._choose([None] * 4)                      # then a drafting round
        assert picks == ["_step", "_draft"]
        engine.rate[("draft", 4)] = 9.9                 # drafting measured slower
        picks.clear()
        for _ in range(500):
            engine._choose([None] * 4)
        looks = [i + 1 for i, p in enumerate(picks) if p == "_draft"]
        r, m = eng.RECHECK, eng.RECHECK_MAX
        want, at, every = [], 0, r
        while at + every <= 500:
            at += every
            want.append(at)
            every = min(2 * every, m)
        assert looks == want
        engine.rate[("draft", 4)] = 10.1                # drafting now faster: it runs, and plain
        picks.clear()                                   # steps are looked at after RECHECK rounds again
        for _ in range(3 * r):
            engine._choose([None] * 4)
        assert [i + 1 for i, p in enumerate(picks) if p == "_step"] == [r, 3 * r]
        # unmeasured at 6 requests: the nearest count measured both ways (5, not 2) has plain
        # steps ahead, so drafting is not tried at 6 for RECHECK rounds
        engine.rate.clear()
        engine.rate.update({2: 10.0, ("draft", 2): 15.0, 5: 10.0, ("draft", 5): 5.0, 6: 12.0})
        picks.clear()
        for _ in range(r):
            engine._choose([None] * 6)
        assert picks == ["_step"] * (r - 1) + ["_draft"]
        # unmeasured at 3: the nearest is 2, where drafting won
        engine.rate[3] = 9.0
        picks.clear()
        engine._choose([None] * 3)
        assert picks == ["_draft"]
    finally:
        engine.close()


def test_a_new_request_reuses_a_slot_that_holds_its_prefix(packages):
    model = _model(packages, "youtu")
    system = " ".join(CORPUS[:4])
    first = prepare(model, [{"role": "system", "content": system}, {"role": "user", "content": "Hello."}])
    second = prepare(model, [{"role": "system", "content": system}, {"role": "user", "content": "Goodbye."}])
    shared = next(i for i, (a, b) in enumerate(zip(first.input_ids, second.input_ids)) if a != b)
    engine = Engine(model, parallel=2)
    try:
        list(engine.generate_tokens(first.input_ids, 3))
        s = engine.generate_tokens(second.input_ids, 5, ignore_eos=True)
        assert list(s) == alone(model, second, 5)
        assert s.prefill_tokens == len(second.input_ids) - shared    # the shared system prompt came from the slot
    finally:
        engine.close()


def test_a_long_prompt_is_prefilled_beside_the_other_requests_steps(packages, monkeypatch):
    """A prompt of several chunks runs one chunk per round, each in one forward with a row of the
    decoding request (it waits one chunk, not the whole prompt), and both get their alone tokens."""
    model = _model(packages, "youtu")
    short, long_ = prepare(model, "Describe a cat."), prepare(model, " ".join(CORPUS[:6]))
    assert len(long_.input_ids) > 3 * 16        # prefill_chunk=16: several chunks
    want = [alone(model, short, 30), alone(model, long_, 5)]
    rounds = []
    real = Engine._mixed

    def log(self, streams):
        rounds.append([("prompt" if s.tok is None else "row", s.args["ids"] == long_.input_ids) for s in streams])
        return real(self, streams)
    monkeypatch.setattr(Engine, "_mixed", log)
    engine = Engine(model, parallel=2)
    try:
        first = engine.generate_tokens(short.input_ids, 30, ignore_eos=True)
        got = [next(first), next(first)]
        second = engine.generate_tokens(long_.input_ids, 5, ignore_eos=True)
        assert list(second) == want[1]
        got += list(first)
        assert got == want[0]
    finally:
        engine.close()
    chunks = [r for r in rounds if ("prompt", True) in r]
    assert len(chunks) >= 3
    assert all(r == [("prompt", True), ("row", False)] for r in chunks)


def test_prompts_that_arrive_together_are_computed_in_one_forward(packages, monkeypatch):
    """Waiting prompts whose chunks fit in one chunk's rows run in one forward (with images and
    a request decoding beside them), and each request gets its alone tokens."""
    model = _model(packages, "qwen3_5")
    reqs = requests(model)[1:]          # the short ones and the image
    want = [alone(model, p, n) for p, n in reqs]
    rounds = []
    real = Engine._mixed

    def log(self, streams):
        rounds.append(sum(s.tok is None for s in streams))
        return real(self, streams)
    monkeypatch.setattr(Engine, "_mixed", log)
    engine = Engine(model, parallel=len(reqs))
    engine.prompt_rows = 1 << 12
    try:
        with engine.cond:       # the scheduler sees them all at once
            streams = start(engine, reqs, stop_at=-1)
        got = [[] for _ in reqs]
        read_all(list(zip(streams, got)))
        assert got == want
        assert rounds[0] == len(reqs)       # (each prompt takes several chunks of 16 rows)
        assert sum(rounds) == engine.chunks > engine.prompts
    finally:
        engine.close()


def test_a_request_that_leaves_mid_prompt_leaves_its_slot_whole(packages, monkeypatch):
    model = _model(packages, "qwen3_5")
    long_ = prepare(model, " ".join(CORPUS[:6]))
    real = Engine._mixed
    engine = Engine(model, parallel=1)

    def leave_after_one_chunk(self, streams):
        real(self, streams)
        if streams[0].args["max_new"] == 7:
            streams[0].close()
    monkeypatch.setattr(Engine, "_mixed", leave_after_one_chunk)
    try:
        gone = engine.generate_tokens(long_.input_ids, 7, ignore_eos=True)
        assert list(gone) == []
        slot = engine.slots[0]
        assert slot.cache.length == len(slot.keys) < len(long_.input_ids)
        assert list(engine.generate_tokens(long_.input_ids, 6, ignore_eos=True)) == alone(model, long_, 6)
    finally:
        engine.close()


def test_a_low_memory_model_serves_one_request_at_a_time(packages):
    """--low-memory loads the decoder a section at a time, which runs one sequence's forwards
    only: with one slot, a request's prompt and steps are that sequence's own."""
    model = edgevl.load(packages["youtu"], low_memory=True)
    try:
        prep, n = requests(model)[1]
        engine = Engine(model, parallel=1)
        try:
            assert list(engine.generate_tokens(prep.input_ids, n, ignore_eos=True)) == alone(model, prep, n)
        finally:
            engine.close()
    finally:
        model.close()


def test_engine_options_are_checked(packages):
    model = _model(packages, "youtu")
    for bad in (0, -1, 1.5, True, 1000):
        with pytest.raises(EdgevlError, match=r"parallel \(--parallel\) must be between 1 and 256"):
            Engine(model, parallel=bad)


def test_a_failing_step_ends_only_its_requests(packages, monkeypatch):
    model = _model(packages, "youtu")
    prep = requests(model)[1][0]
    engine = Engine(model, parallel=2)
    try:
        real = model.decoder.forward      # a lone request's forwards: its prompt, then steps
        calls = []

        def fail(*a, **k):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("boom")
            return real(*a, **k)

        monkeypatch.setattr(model.decoder, "forward", fail)
        with pytest.raises(RuntimeError, match="boom"):
            list(engine.generate_tokens(prep.input_ids, 10, ignore_eos=True))
        monkeypatch.undo()
        assert list(engine.generate_tokens(prep.input_ids, 6, ignore_eos=True)) == alone(model, prep, 6)
    finally:
        engine.close()


def test_a_fault_of_the_scheduler_ends_the_requests_under_way_not_the_engine(packages, monkeypatch):
    """Not a step's failure (handed to that step's requests) but one in the scheduler itself:
    its requests get a one-line error instead of waiting for ever, and the engine serves on."""
    model = _model(packages, "youtu")
    prep = requests(model)[1][0]
    engine = Engine(model, parallel=2)
    try:
        real = Engine._drop_finished
        calls = []

        def fault(self):
            if len(self.active) == 2 and not calls:     # once both requests are under way
                calls.append(1)
                raise RuntimeError("boom")
            return real(self)

        monkeypatch.setattr(Engine, "_drop_finished", fault)
        streams = [engine.generate_tokens(prep.input_ids, 10, ignore_eos=True) for _ in range(2)]
        errors = [None, None]

        def read(i):
            try:
                list(streams[i])
            except EdgevlError as e:
                errors[i] = str(e)
        readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(60)
        assert errors == ["the engine failed: boom"] * 2
        monkeypatch.undo()
        assert list(engine.generate_tokens(prep.input_ids, 6, ignore_eos=True)) == alone(model, prep, 6)
    finally:
        engine.close()


def test_decoder_rows_of_several_caches_match_one_at_a_time(packages):
    """forward_rows with rows of different lengths per sequence (a prompt chunk beside decode
    rows) gives each sequence the hidden states and state its own forwards give."""
    model = _model(packages, "qwen3_5")
    dec = model.decoder
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(5, 200, n)) for n in (9, 4, 6)]

    def run():
        caches = [dec.new_cache() for _ in prompts]
        alone_h = []
        for ids, c in zip(prompts, caches):
            h, _ = dec.forward(model.embedding(ids[:-2]), c, np.arange(len(ids) - 2)[None])
        ref = [dec.new_cache() for _ in prompts]
        for ids, c in zip(prompts, ref):
            dec.forward(model.embedding(ids[:-2]), c, np.arange(len(ids) - 2)[None])
            h, _ = dec.forward(model.embedding(ids[-2:]), c, np.arange(len(ids) - 2, len(ids))[None])
            alone_h.append(h)
        rows = [ids[-2:] for ids in prompts]
        pos = np.concatenate([np.arange(len(ids) - 2, len(ids)) for ids in prompts])[None]
        h = dec.forward_rows(model.embedding(sum(rows, [])), [(c, 2) for c in caches], pos)
        return h, np.concatenate(alone_h), caches, ref

    h, want, caches, ref = model._owner.call(run)
    np.testing.assert_allclose(h, want, rtol=1e-5, atol=1e-5)
    for c, r in zip(caches, ref):
        assert c.length == r.length and c.next_positions == r.next_positions
        for (k, a), (_, b) in zip(sorted(c.state_arrays().items()), sorted(r.state_arrays().items())):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=str(k))


def filled(model, prompts) -> list:
    """A new decoder cache per prompt, each prefilled with its prompt (owner thread)."""
    dec = model.decoder
    caches = [dec.new_cache() for _ in prompts]
    for ids, c in zip(prompts, caches):
        dec.forward(model.embedding(ids), c, np.arange(len(ids))[None], ids=ids)
    return caches


@pytest.mark.parametrize("family", ["qwen3_5", "youtu_moe"])
def test_decode_rows_of_several_caches_keep_each_window_as_plain_forwards_do(packages, family):
    """One row per sequence keeps each conv window as a ring of rows on the host: steps of
    several caches, then plain steps (the window back in the graph's layout), a snapshot taken
    between them and a rollback to it give what plain forwards give (a window off by one row
    is off by far more than the tolerance, which covers the Gemms' sums over other row counts)."""
    model = _model(packages, family)
    dec = model.decoder
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(5, 200, n)) for n in (7, 3, 11)]
    steps = [list(rng.integers(5, 200, 9)) for _ in prompts]

    def plain(c, tok):
        return dec.forward(model.embedding([tok]), c, np.array([[c.next_position]]), ids=[tok])[0]

    def run():
        ref = filled(model, prompts)
        want = [[plain(c, t) for t in toks] for c, toks in zip(ref, steps)]
        caches, got = filled(model, prompts), [[] for _ in prompts]
        for i in range(6):      # 6 steps together (the windows' width is 8: the ring wraps below)
            pos = np.array([[c.next_position for c in caches]], np.int64)
            toks = [s[i] for s in steps]
            h = dec.forward_rows(model.embedding(toks), [(c, 1) for c in caches], pos, ids=toks)
            for b in range(len(caches)):
                got[b].append(h[b:b + 1])
            if i == 2:
                caches[0].snapshot()
                at = caches[0].length
        for b, c in enumerate(caches):      # the rest alone, through the graph's own window
            got[b] += [plain(c, t) for t in steps[b][6:]]
        # back to the snapshot taken between steps together: the same rows again give the same
        caches[0].rollback(at)
        again = [plain(caches[0], t) for t in steps[0][3:]]
        return want, got, again, caches, ref

    want, got, again, caches, ref = model._owner.call(run)
    close = {"rtol": 2e-3, "atol": 2e-3}
    for b in range(len(prompts)):
        for i, (g, w) in enumerate(zip(got[b], want[b])):
            np.testing.assert_allclose(g, w, **close, err_msg=f"sequence {b}, step {i}")
        s, r = caches[b].state_arrays(), ref[b].state_arrays()
        assert s.keys() == r.keys()
        for k in s:
            np.testing.assert_allclose(s[k], r[k], **close, err_msg=str((b, k)))
    for g, w in zip(again, want[0][3:]):
        np.testing.assert_allclose(g, w, **close)


@pytest.mark.parametrize("family", ["qwen3_5", "youtu_moe"])
def test_decode_rows_beside_a_prompt_chunk_keep_their_windows_as_rings(packages, family):
    """A forward with a prompt's chunk and decode rows of other sequences (the engine's mixed
    rounds): the decode rows extend their windows as rings, the prompt its window as columns, and
    every sequence's outputs and states are what plain forwards give, through steps together
    before and after it and plain steps after that."""
    model = _model(packages, family)
    dec = model.decoder
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(5, 200, n)) for n in (6, 10, 4)]
    steps = [list(rng.integers(5, 200, 9)) for _ in prompts[1:]]
    chunk = list(rng.integers(5, 200, 5))          # the first sequence's next chunk

    def plain(c, toks):
        pos = np.arange(c.next_position, c.next_position + len(toks))[None]
        return dec.forward(model.embedding(toks), c, pos, ids=toks)[0]

    def run():
        ref = filled(model, prompts)
        want_chunk = plain(ref[0], chunk)
        want = [[plain(c, [t]) for t in toks] for c, toks in zip(ref[1:], steps)]
        caches = filled(model, prompts)
        c0, decoding = caches[0], caches[1:]
        got = [[] for _ in steps]

        def step(i, first=()):
            """Row i of each decoding sequence, after the rows ``first`` of the first sequence."""
            toks = [s[i] for s in steps]
            pos = np.array([[c.next_position for c in decoding]], np.int64)
            pos = np.concatenate([np.arange(c0.next_position, c0.next_position + len(first))[None], pos], 1)
            parts = ([(c0, len(first))] if first else []) + [(c, 1) for c in decoding]
            h = dec.forward_rows(model.embedding(list(first) + toks), parts, pos, ids=list(first) + toks)
            for b in range(len(decoding)):
                got[b].append(h[len(first) + b:len(first) + b + 1])
            return h[:len(first)]

        step(0)
        step(1)                                      # the windows are rings now
        got_chunk = step(2, chunk)                   # beside the first sequence's chunk
        for i in range(3, 6):
            step(i)
        for b, c in enumerate(decoding):             # the rest alone, through the graph's own window
            got[b] += [plain(c, [t]) for t in steps[b][6:]]
        return want_chunk, got_chunk, want, got, caches, ref

    want_chunk, got_chunk, want, got, caches, ref = model._owner.call(run)
    close = {"rtol": 2e-3, "atol": 2e-3}
    np.testing.assert_allclose(got_chunk, want_chunk, **close)
    for b in range(len(steps)):
        assert len(got[b]) == len(want[b])
        for i, (g, w) in enumerate(zip(got[b], want[b])):
            np.testing.assert_allclose(g, w, **close, err_msg=f"sequence {b + 1}, step {i}")
    for c, r in zip(caches, ref):
        s, w = c.state_arrays(), r.state_arrays()
        assert s.keys() == w.keys()
        for k in s:
            np.testing.assert_allclose(s[k], w[k], **close, err_msg=str(k))


def test_choices_are_each_the_answer_alone_with_its_seed(packages):
    """``stream_choices``: n answers to one prompt, prepared once (an image encoded once). Through
    an engine they decode together (drafting on), the later ones going on from a copy of the
    first's state at the prompt's end (no prompt computed again); without one, one after the
    other, the later ones starting from the first's prompt in the cache. Either way answer i is
    what a request of its own with seed + i gives."""
    from edgevl.generate import stream_choices

    model = _model(packages, "qwen3_5")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    image = [smooth_image(64, 90, 4)]
    kw = dict(image=image, max_new_tokens=12, temperature=1.2, top_k=0, top_p=1.0, thinking=False)
    want = [[ev.token for ev in edgevl.stream_events(model, msgs, seed=5 + i, reuse_cache=False, **kw)]
            for i in range(3)]
    assert len({tuple(w) for w in want}) > 1, "three seeds sampled one answer: the test proves nothing"
    encoded = []
    real = model.encode_image

    def counted(*a, **k):
        encoded.append(1)
        return real(*a, **k)

    model.encode_image = counted
    try:
        engine = Engine(model, parallel=3)
        try:
            list(stream_choices(model, msgs, 1, seed=5, engine=engine, reuse_cache=False, **kw)[0])
            one = engine.chunks      # the prompt chunks of one answer
            steps, rows = engine.steps, engine.rows
            evs = [list(c) for c in stream_choices(model, msgs, 3, seed=5, engine=engine, reuse_cache=False, **kw)]
            assert engine.rows - rows > engine.steps - steps    # some forwards carried several answers
            assert engine.chunks == 2 * one                     # the prompt was computed once
            assert [e[-1].prefill_tokens for e in evs[1:]] == [0, 0]
        finally:
            engine.close()
        assert [[ev.token for ev in e] for e in evs] == want
        n_images = len(encoded)
        choices = stream_choices(model, msgs, 3, seed=5, reuse_cache=True, **kw)
        evs = [[], [], []]
        for row in itertools.zip_longest(*choices):     # read side by side: each runs once the ones ahead ended
            for e, ev in zip(evs, row):
                if ev is not None:
                    e.append(ev)
        assert [[ev.token for ev in e] for e in evs] == want
        assert evs[1][-1].prefill_tokens < evs[1][-1].prompt_tokens // 2     # the prompt came from the cache
        assert n_images == 2 and len(encoded) == 3      # the image is encoded once per request of answers
    finally:
        del model.encode_image
    with pytest.raises(EdgevlError, match="n .answers to the prompt. must be from 1 to 16"):
        stream_choices(model, "hi", 0)


@pytest.mark.parametrize("family", [f for f, _ in CASES])
def test_answers_that_share_a_prompt_decode_as_alone(packages, family):
    """Greedy answers that go on from a copy of the first's prompt state (KV panels, conv
    windows, delta-rule and MTP states copied, each growing apart) are each the answer alone, in
    every family; more answers than slots wait and still take the copy; one cancelled early
    leaves the others whole."""
    model = _model(packages, family)
    prep = prepare(model, " ".join(CORPUS[:4]))
    want = alone(model, prep, 20)
    engine = Engine(model, parallel=2)
    try:
        first = engine.generate_tokens(prep.input_ids, 20, ignore_eos=True)
        others = [engine.generate_tokens(prep.input_ids, 20, ignore_eos=True, after=first) for _ in range(3)]
        gone = engine.generate_tokens(prep.input_ids, 200, ignore_eos=True, after=first)
        got = [[] for _ in range(4)]
        left = []
        read_all([(s, g) for s, g in zip([first, *others], got)] + [(gone, left, 3)])
        assert got == [want] * 4
        assert [s.prefill_tokens for s in others] == [0, 0, 0]
        assert first.fork is None        # the copy goes once every follower took it
    finally:
        engine.close()


@pytest.mark.parametrize("family", [f for f, _ in CASES])
def test_a_shared_system_prompt_or_image_is_not_computed_again(packages, family):
    """Prefix reuse reaches recurrent models too: their state is snapshotted before each user
    turn and after each image, so another conversation with the same system prompt, or another
    question about the same image, computes only what differs (in the engine's slots as in a
    lone model), and gets the tokens of a fresh run."""
    model = _model(packages, family)
    system = {"role": "system", "content": " ".join(CORPUS[:3])}
    image = smooth_image(64, 90, 4)

    def turn(q, with_image):
        content = ([{"type": "image"}] if with_image else []) + [{"type": "text", "text": q}]
        return [system, {"role": "user", "content": content}]

    cases = [(False, "Describe a cat."), (False, "Name a colour.")]
    if model.vision is not None:
        cases += [(True, "What is this?"), (True, "What colour is it?")]
    preps = [prepare(model, turn(q, im), image=[image] if im else None) for im, q in cases]
    fresh = [alone(model, p, 6) for p in preps]
    engine = Engine(model, parallel=1)     # one slot: each request finds the one before it there
    try:
        for i, (p, want) in enumerate(zip(preps, fresh)):
            s = engine.generate_tokens(p.input_ids, 6, image=p.encoded, ignore_eos=True)
            assert list(s) == want, i
            if i % 2:     # the second of each pair: only what differs was computed
                ids = p.input_ids
                shared = next(k for k, (a, b) in enumerate(zip(ids, preps[i - 1].input_ids)) if a != b)
                points = [q for q in model.arch.snapshot_points(model.tokenizer, ids) if q <= shared]
                reused = len(ids) - s.prefill_tokens
                assert reused >= (shared if model.cache.truncatable else max(points)), (i, reused, shared, points)
                assert reused > len(ids) // 2, (i, reused, len(ids))
    finally:
        engine.close()


@pytest.mark.parametrize("family", [f for f, _ in CASES])
def test_a_prompt_sharing_a_running_requests_prefix_starts_from_a_copy(packages, family):
    """A request that arrives while another with the same system prompt decodes takes a copy of
    that one's state into its free slot and computes only its own turn; both get the tokens
    they get alone."""
    model = _model(packages, family)
    system = {"role": "system", "content": " ".join(CORPUS[:3])}
    a, b = (prepare(model, [system, {"role": "user", "content": q}]) for q in ("Describe a cat.", "Name a colour."))
    want_a, want_b = alone(model, a, 16), alone(model, b, 8)
    engine = Engine(model, parallel=2)
    try:
        first = engine.generate_tokens(a.input_ids, 16, ignore_eos=True)
        got_a = [next(first)]            # its prompt is whole; it decodes on in its slot
        second = engine.generate_tokens(b.input_ids, 8, ignore_eos=True)
        got_b = list(second)
        got_a += list(first)
        assert (got_a, got_b) == (want_a, want_b)
        shared = next(k for k, (x, y) in enumerate(zip(a.input_ids, b.input_ids)) if x != y)
        assert len(b.input_ids) - second.prefill_tokens > shared // 2, (second.prefill_tokens, shared)
    finally:
        engine.close()


def test_slot_memory_counts_the_snapshots_prefix_reuse_keeps(packages):
    """The server's start-up memory line counts each slot's snapshots of recurrent state (a
    prompt with several turns and an image keeps the most), not only the live state."""
    from edgevl.runtime import MAX_SNAPSHOTS, state_bytes

    model = _model(packages, "qwen3_5")
    turns = [{"role": "system", "content": "Be brief."}]
    for q in ("Describe a cat.", "And a dog?", "And a bird?"):
        turns += [{"role": "user", "content": q}, {"role": "assistant", "content": "It is small."}]
    turns.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]})
    prep = prepare(model, turns, image=[smooth_image(64, 90, 4)])
    model.reset()
    alone(model, prep, 1)
    snaps = model.cache._snapshots
    assert len(snaps) == MAX_SNAPSHOTS
    kept = sum(a.nbytes for v in snaps.values() for layer in v for a in (layer or ()))
    engine = Engine(model, parallel=1)
    try:
        live = state_bytes(model.decoder.info["state"], model.max_context, model.kv_elem_bytes)
        assert engine.state_bytes() - live == kept > 0
    finally:
        engine.close()


def test_closing_the_engine_ends_its_requests_in_its_own_words(packages):
    """An API user has no server: a request the engine's close() cuts short says the engine was
    closed; a loaded model is refused by pickle (another process loads its own)."""
    import pickle

    from edgevl.errors import ShuttingDown

    model = _model(packages, "youtu")
    prep = requests(model)[1][0]
    engine = Engine(model, parallel=1)
    first = engine.generate_tokens(prep.input_ids, 400, ignore_eos=True)
    queued = engine.generate_tokens(prep.input_ids, 400, ignore_eos=True)
    next(first)
    engine.close()
    for s in (first, queued):
        with pytest.raises(ShuttingDown, match="the engine was closed before this request ended"):
            list(s)
    with pytest.raises(TypeError, match="cannot be pickled .* call edgevl.load in each process"):
        pickle.dumps(model)
