"""Log-probabilities (OpenAI's ``logprobs`` / ``top_logprobs``): each answer token's, the model's own
(a log-softmax of its logits before penalties, temperature and masks), the same with drafting, in
the engine's shared forwards, and only for the answer's tokens. OpenAI's ``logit_bias``: added to
the logits before sampling, with drafting and in the engine alike."""

import json
import threading

import numpy as np
import pytest

import edgevl
from edgevl import speculative, verification
from edgevl.engine import Engine
from edgevl.errors import EdgevlError
from edgevl.generate import prepare, stream_events
from edgevl.sample import Logprobs, Sampler

FAMILIES = {"qwen3_5": {"mtp": True, "train_steps": 20, "mtp_train_steps": 40}, "youtu": {}}


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    out = {}
    for i, (family, kw) in enumerate(FAMILIES.items()):
        v = verification.get(family)
        ck = v.make_tiny(root / f"ck{i}", variant=list(v.tiny_variants)[0], seed=30 + i, **kw)
        out[family] = edgevl.convert(ck, root / f"pk{i}", dtype="fp32", progress=False)
    yield out
    for m in _models.values():
        m.close()
    _models.clear()


_models = {}


def _model(packages, family, **options):
    key = (family, tuple(sorted(options.items())))
    if key not in _models:
        _models[key] = edgevl.load(packages[family], prefill_chunk=16, **options)
    return _models[key]


def log_softmax(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_tokens_logprob_is_the_log_softmax_of_the_models_logits(packages, family):
    """Sampled with penalties and a temperature, the numbers are still the model's own: the
    log-softmax of the raw logits at each position, recomputed here step by step."""
    model = _model(packages, family, speculative="none")
    ids = prepare(model, "Describe a cat.").input_ids
    noted = Logprobs(4)
    toks = list(model.generate_tokens(ids, 20, temperature=0.9, top_k=6, repetition_penalty=1.4,
                                      presence_penalty=1.0, seed=4, ignore_eos=True, reuse_cache=False,
                                      logprobs=noted))
    assert len(noted.entries) == len(toks) == 20
    logits = model.prefill(ids, reuse_cache=False)
    not_top = 0
    for tok, (t, lp, top) in zip(toks, noted.entries):
        ref = log_softmax(logits)
        order = np.argsort(-ref, kind="stable")[:4]
        assert t == tok
        assert abs(lp - ref[tok]) < 1e-5
        assert [i for i, _ in top] == order.tolist()
        np.testing.assert_allclose([v for _, v in top], ref[order], rtol=0, atol=1e-5)
        not_top += tok != order[0]
        logits = model.step(tok)
    assert not_top > 0     # the settings picked other tokens than the model's first choice


def test_drafting_gives_the_same_logprobs(packages, monkeypatch):
    monkeypatch.setattr(speculative, "AUTO_OFF_RATE", 0.0)
    monkeypatch.setattr(speculative, "AUTO_OFF_CYCLES", 1 << 30)
    plain = _model(packages, "qwen3_5", speculative="none")
    spec = _model(packages, "qwen3_5", draft_tokens=2)
    ids = prepare(plain, "Count to ten.").input_ids
    a, b = Logprobs(3), Logprobs(3)
    want = list(plain.generate_tokens(ids, 24, ignore_eos=True, reuse_cache=False, logprobs=a))
    got = list(spec.generate_tokens(ids, 24, ignore_eos=True, reuse_cache=False, logprobs=b))
    assert got == want and spec.runtime_stats()["speculative"]["accepted"] > 0
    # a verify pass may have looked past the budget: the entries of the tokens given match
    for (ta, la, pa), (tb, lb, pb) in zip(a.entries, b.entries[:len(got)]):
        assert ta == tb and abs(la - lb) < 1e-4
        assert [i for i, _ in pa] == [i for i, _ in pb]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_requests_decoding_together_get_their_own_logprobs(packages, family):
    model = _model(packages, family)
    prompts = [prepare(model, p).input_ids for p in ("Describe a cat.", "Name a colour.", "Count to ten.")]
    kws = [dict(), dict(temperature=0.8, seed=5), dict(top_k=3, temperature=1.0, seed=6)]
    want = []
    for ids, kw, top in zip(prompts, kws, (0, 2, 5)):
        noted = Logprobs(top)
        want.append((list(model.generate_tokens(ids, 16, ignore_eos=True, reuse_cache=False, logprobs=noted,
                                                **kw)), noted))
    engine = Engine(model, parallel=3)
    try:
        notes = [Logprobs(top) for top in (0, 2, 5)]
        got = [[] for _ in prompts]
        streams = [engine.generate_tokens(ids, 16, ignore_eos=True, logprobs=n, **kw)
                   for ids, kw, n in zip(prompts, kws, notes)]
        threads = [threading.Thread(target=lambda s=s, g=g: g.extend(s)) for s, g in zip(streams, got)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert engine.rows > engine.steps > 0
        for (toks, a), g, b in zip(want, got, notes):
            assert g == toks
            for (ta, la, pa), (tb, lb, pb) in zip(a.entries, b.entries[:len(g)]):
                assert ta == tb and abs(la - lb) < 1e-4 and len(pa) == len(pb)
    finally:
        engine.close()


def test_answers_carry_openai_shaped_entries(packages):
    model = _model(packages, "youtu")
    c = edgevl.complete(model, "Describe a cat.", max_new_tokens=10, logprobs=True, top_logprobs=2)
    assert c.finish_reason == "length" and len(c.logprobs) == c.generation_tokens == 10
    for e in c.logprobs:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and e["logprob"] <= 0
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-9
    json.dumps(c.logprobs, allow_nan=False)
    assert edgevl.complete(model, "Describe a cat.", max_new_tokens=4).logprobs is None
    with pytest.raises(EdgevlError, match="top_logprobs needs logprobs=True"):
        edgevl.complete(model, "Hi", max_new_tokens=2, top_logprobs=2)
    with pytest.raises(EdgevlError, match="top_logprobs must be an integer from 0 to 20"):
        edgevl.complete(model, "Hi", max_new_tokens=2, logprobs=True, top_logprobs=21)


def test_the_reasonings_tokens_have_none(packages, monkeypatch):
    """Tokens inside the think block and its markers get no entry; the answer's each get theirs."""
    model = _model(packages, "qwen3_5", speculative="none")
    tok = model.tokenizer
    start, end = (tok.token_to_id(m) for m in model.arch.reasoning_tokens)
    words = [tok.encode(w)[0] for w in ("a", "b", "c", "d")]
    seq = [words[0], start, words[1], words[2], end, words[3], words[0]]

    def fake(ids, n, logprobs=None, **kw):
        for i, t in enumerate(seq):
            logprobs.entries.append((t, -float(i), []))
            yield t
    monkeypatch.setattr(model, "generate_tokens", fake)
    events = list(stream_events(model, "x", raw=True, max_new_tokens=len(seq), logprobs=True))
    got = [e["logprob"] for ev in events for e in ev.logprobs]
    assert got == [0.0, -5.0, -6.0]
    assert [e["token"] for ev in events for e in ev.logprobs] == [tok.decode([t]) for t in (seq[0], seq[5], seq[6])]


def test_a_stop_string_leaves_out_the_entries_of_the_tokens_it_cut(packages, monkeypatch):
    """An entry goes out with the first of its token's text: where a stop string cuts the answer,
    the tokens whose text lies wholly after the cut have none (their text is not the answer's), the
    token the cut splits keeps its entry, and streamed entries are the same."""
    model = _model(packages, "youtu")
    tok = model.tokenizer
    text = "The cat sat on the mat"
    seq = tok.encode(text)
    pieces = [tok.decode([t]) for t in seq]
    assert "".join(pieces) == text and len(seq) > 4
    starts = np.cumsum([0] + [len(p) for p in pieces[:-1]])

    def fake(ids, n, logprobs=None, **kw):
        for i, t in enumerate(seq):
            logprobs.entries.append((t, -float(i), []))
            yield t
    monkeypatch.setattr(model, "generate_tokens", fake)
    cuts = [c for c in range(1, len(text) - 2) if text.find(text[c:c + 3]) == c]
    assert len(cuts) > 10
    for c in cuts:
        events = list(stream_events(model, "x", raw=True, max_new_tokens=len(seq), logprobs=True,
                                    stop=[text[c:c + 3]]))
        assert "".join(ev.text for ev in events) == text[:c] and events[-1].finish_reason == "stop"
        got = [e["logprob"] for ev in events for e in ev.logprobs]
        assert got == [-float(i) for i in range(len(seq)) if starts[i] < c], (c, got)
        c_all = edgevl.complete(model, "x", raw=True, max_new_tokens=len(seq), logprobs=True, stop=[text[c:c + 3]])
        assert [e["logprob"] for e in c_all.logprobs] == got
    whole = list(stream_events(model, "x", raw=True, max_new_tokens=len(seq), logprobs=True, stop=["zzz"]))
    assert [e["logprob"] for ev in whole for e in ev.logprobs] == [-float(i) for i in range(len(seq))]


def test_a_stop_string_at_a_character_split_into_byte_tokens_leaves_out_their_entries(packages, monkeypatch):
    """Tokens that each hold part of a character add no text until the character is whole: where
    a stop string starts at that character, their entries went out before the cut was known."""
    model = _model(packages, "youtu")
    tok = model.tokenizer
    text = "ab你好cd"
    seq = tok.encode(text)
    assert any("\ufffd" in tok.decode([t]) for t in seq)     # the CJK characters come in byte tokens
    # where each token's text starts: the whole characters of the bytes before it
    starts = [len(b"".join(tok.token_bytes(t) for t in seq[:i]).decode("utf-8", "ignore")) for i in range(len(seq))]

    def fake(ids, n, logprobs=None, **kw):
        for i, t in enumerate(seq):
            logprobs.entries.append((t, -float(i), []))
            yield t
    monkeypatch.setattr(model, "generate_tokens", fake)
    for stop, cut in (("你", 2), ("你好c", 2), ("好", 3), ("ab", 0)):
        events = list(stream_events(model, "x", raw=True, max_new_tokens=len(seq), logprobs=True, stop=[stop]))
        assert "".join(ev.text for ev in events) == text[:cut]
        got = [e["logprob"] for ev in events for e in ev.logprobs]
        assert got == [-float(i) for i in range(len(seq)) if starts[i] < cut], (stop, got, starts)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_token_bytes_spell_the_text_even_inside_a_character(packages, family):
    tok = _model(packages, family).tokenizer
    text = "你好，世界！🙂 café Zürich"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)    # tokens that hold part of a character
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_logit_bias_is_added_before_every_processor():
    logits = np.array([0.0, 1.0, 3.0, 2.0], np.float32)
    assert Sampler()(logits) == 2
    assert Sampler(logit_bias={"2": -2.5})(logits) == 3       # 3 - 2.5 < 2: token 3 now leads
    assert Sampler(logit_bias={0: 3.5, 9: 100})(logits) == 0  # ids past the row are no token of it
    p = Sampler(temperature=1.0, logit_bias={3: -100})
    assert p.distribution(logits)[3] < 1e-40
    # a repetition penalty works on the biased logit: 3 + 1 = 4 -> 4 / 2 = 2 < 2.5
    assert Sampler(repetition_penalty=2.0, logit_bias={1: 1.5, 2: 1.0})(logits, [2]) == 1
    for bad, msg in (([1], "must be an object"), ({"a": 1}, "keys must be token ids"),
                     ({-1: 1}, "keys must be token ids"), ({1: 100.5}, "from -100 to 100"),
                     ({1: float("inf")}, "from -100 to 100"), ({1: True}, "from -100 to 100")):
        with pytest.raises(EdgevlError, match=msg):
            Sampler(logit_bias=bad)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logit_bias_bans_and_forces_tokens_with_drafting_and_beside_other_requests(packages, family,
                                                                                   monkeypatch):
    monkeypatch.setattr(speculative, "AUTO_OFF_RATE", 0.0)
    monkeypatch.setattr(speculative, "AUTO_OFF_CYCLES", 1 << 30)
    plain = _model(packages, family, speculative="none")
    ids = prepare(plain, "Describe a cat.").input_ids
    greedy = list(plain.generate_tokens(ids, 12, ignore_eos=True, reuse_cache=False))
    ban = dict.fromkeys(set(greedy), -100)
    banned = list(plain.generate_tokens(ids, 12, ignore_eos=True, reuse_cache=False, logit_bias=ban))
    assert not set(banned) & set(greedy)
    forced = list(plain.generate_tokens(ids, 6, ignore_eos=True, reuse_cache=False, logit_bias={"7": 100}))
    assert forced == [7] * 6
    # drafting (where the model drafts: its drafts ignore the bias, the check does not) and the engine
    model = _model(packages, family)
    assert list(model.generate_tokens(ids, 12, ignore_eos=True, reuse_cache=False, logit_bias=ban)) == banned
    if model.mtp is not None:
        assert model.runtime_stats()["speculative"]["drafted"] > 0
    engine = Engine(model, parallel=2)
    try:
        other = engine.generate_tokens(prepare(model, "Name a colour.").input_ids, 12, ignore_eos=True)
        mine = engine.generate_tokens(ids, 12, ignore_eos=True, logit_bias=ban)
        got, rest = [], []
        t = threading.Thread(target=lambda: rest.extend(other))
        t.start()
        got.extend(mine)
        t.join(60)
        assert got == banned and len(rest) == 12
    finally:
        engine.close()
    with pytest.raises(EdgevlError, match=f"from 0 to {model.vocab_size - 1}"):
        edgevl.generate(model, "Hi", max_new_tokens=2, logit_bias={model.vocab_size: 5})
