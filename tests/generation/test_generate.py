"""Sampling, stop strings, streaming, context limits and KV-cache reuse on a Youtu-LLM package."""

import numpy as np
import pytest

import edgevl
from edgevl.errors import EdgevlError
from edgevl.generate import stream_events
from edgevl.tokenizer import StreamDecoder
from support.youtu import hf_greedy, load_hf, make_youtu


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A briefly trained tiny model: it continues corpus text, so its output is real text."""
    root = tmp_path_factory.mktemp("gen")
    ck = make_youtu(root / "ck", seed=5, train_steps=200)
    edgevl.convert(ck, root / "pk", dtype="fp32", progress=False)
    return ck, root / "pk"


@pytest.fixture()
def model(trained):
    m = edgevl.load(trained[1])
    yield m


def test_seeded_sampling_is_reproducible(model):
    kw = dict(max_new_tokens=24, temperature=1.0, top_k=50, top_p=0.95, raw=True)
    a = edgevl.generate(model, "The quick", seed=7, **kw)
    b = edgevl.generate(model, "The quick", seed=7, **kw)
    others = {edgevl.generate(model, "The quick", seed=s, **kw) for s in range(8, 12)}
    assert a == b
    assert len(others | {a}) > 1  # different seeds do sample differently
    greedy = edgevl.generate(model, "The quick", max_new_tokens=24, raw=True)
    assert greedy == edgevl.generate(model, "The quick", max_new_tokens=24, raw=True, seed=123)


def test_a_generation_resumed_after_another_started_stops_with_an_error(model):
    """Generations share the model's one cache: one read again after another started (whose
    prompt replaced the cache) would go on from the other's state. It stops with a one-line
    error instead; the later one, and any read to its end or closed first, are whole."""
    a_ids, b_ids = model.tokenizer.encode("The quick"), model.tokenizer.encode("Once upon a")
    want_b = list(model.generate_tokens(b_ids, 8, ignore_eos=True, reuse_cache=False))
    a = model.generate_tokens(a_ids, 8, ignore_eos=True)
    next(a)
    b = model.generate_tokens(b_ids, 8, ignore_eos=True, reuse_cache=False)
    got_b = [next(b)]
    with pytest.raises(EdgevlError, match="another generation started on this model before this one ended"):
        next(a)
    assert got_b + list(b) == want_b
    a = model.generate_tokens(a_ids, 8, ignore_eos=True)
    next(a)
    a.close()       # closed first: the next one runs as usual
    assert list(model.generate_tokens(b_ids, 8, ignore_eos=True, reuse_cache=False)) == want_b


def test_repetition_penalty_changes_greedy_choice(model):
    plain = list(model.generate_tokens(model.tokenizer.encode("The quick"), 24, ignore_eos=True))
    pen = list(model.generate_tokens(model.tokenizer.encode("The quick"), 24, ignore_eos=True,
                                     repetition_penalty=3.0))
    assert plain != pen
    assert len(set(pen)) >= len(set(plain))


def test_presence_and_frequency_penalties_count_the_generated_tokens_only():
    from edgevl.sample import Sampler

    logits = np.linspace(0.0, 1.0, 8, dtype=np.float32)
    s = Sampler(presence_penalty=0.5, frequency_penalty=0.25, prompt_tokens=2)
    got = s._penalized(logits, [1, 2, 3, 3, 5])          # prompt [1, 2]; generated 3, 3, 5
    want = logits.copy()
    want[3] -= 2 * 0.25 + 0.5
    want[5] -= 0.25 + 0.5
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)
    # greedy takes the penalised argmax: 7 until it was generated, then 6
    greedy = Sampler(presence_penalty=2.0, prompt_tokens=1)
    assert greedy(logits, [0]) == 7 and greedy(logits, [0, 7]) == 6
    for bad in (2.5, -3, float("nan")):
        with pytest.raises(EdgevlError, match="presence_penalty must be a number from -2 to 2"):
            Sampler(presence_penalty=bad)


def test_presence_penalty_changes_what_repeats(model):
    ids = model.tokenizer.encode("The quick")
    plain = list(model.generate_tokens(ids, 32, ignore_eos=True))
    pen = list(model.generate_tokens(ids, 32, ignore_eos=True, presence_penalty=2.0, frequency_penalty=1.0))
    assert plain != pen and len(set(pen)) > len(set(plain))
    # the prompt's own tokens are not penalised: only what the answer has written
    assert pen[0] == plain[0]


def test_stop_strings(model):
    full = edgevl.generate(model, "How many", max_new_tokens=40, raw=True)
    assert len(full) > 12
    stop = full[6:9]
    cut = edgevl.generate(model, "How many", max_new_tokens=40, raw=True, stop=[stop, "\u2603never"])
    assert cut == full[:full.index(stop)]
    events = list(stream_events(model, "How many", max_new_tokens=40, raw=True, stop=stop))
    assert events[-1].finish_reason == "stop"
    assert "".join(e.text for e in events) == cut


def test_streaming_cjk_decodes_cleanly(model):
    tok = model.tokenizer
    text = "你好，世界！今天天气很好。🙂 café Zürich"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens are partial characters
    dec = StreamDecoder(tok)
    pieces = [dec.add(i) for i in ids] + [dec.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    # cut by the end of generation: a started character is dropped, bytes that never start one
    # (a stray continuation byte) stay U+FFFD, as a whole decode shows them
    cut = tok.encode("你")
    whole = [i for i in tok.encode("😀") if tok.token_bytes(i) and tok.token_bytes(i)[0] >= 0x80]
    if len(cut) > 1:
        dec = StreamDecoder(tok)
        assert "".join([dec.add(i) for i in cut[:-1]] + [dec.flush()]) == ""
    stray = [i for i in whole if 0x80 <= tok.token_bytes(i)[0] <= 0xBF and len(tok.token_bytes(i)) == 1][:1]
    if stray:
        dec = StreamDecoder(tok)
        got = "".join([dec.add(i) for i in stray * 3] + [dec.flush()])
        assert got == tok.decode(stray * 3) and got.count("\ufffd") == 3
    assert len(cut) > 1 or stray          # the tokenizer splits characters: one check ran
    # and through the generator: the model continues CJK corpus text
    out = list(edgevl.stream_generate(model, "你好，", max_new_tokens=16, raw=True))
    assert out and all("\ufffd" not in p for p in out)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in "".join(out))


def test_greedy_matches_transformers_through_the_api(trained, model):
    ck, _ = trained
    ids = model.tokenizer.encode("def main():")
    assert list(model.generate_tokens(ids, 32, ignore_eos=True)) == hf_greedy(load_hf(ck), ids, 32)


def test_context_limits(model):
    n = model.max_context
    with pytest.raises(EdgevlError, match=f"prompt has {n} tokens, but this model's maximum context length is {n} "
                                          "tokens"):
        list(model.generate_tokens([5] * n, 4))
    with pytest.raises(EdgevlError, match="leave room for the answer") as e:   # a text prompt: no image hint
        edgevl.generate(model, "word " * (2 * n), max_new_tokens=2)
    assert "image" not in str(e.value)
    # generation stops at the context end instead of running past it
    toks = list(model.generate_tokens([5] * (n - 3), 50, ignore_eos=True))
    assert len(toks) == 3
    with pytest.raises(EdgevlError, match="prompt is empty"):
        edgevl.generate(model, "   ")
    with pytest.raises(EdgevlError, match="temperature"):
        edgevl.generate(model, "hi", temperature=-1)


def test_kv_cache_truncate_rolls_back(model):
    ids = model.tokenizer.encode("The quick brown fox jumps over")
    ref = list(model.generate_tokens(ids, 12, ignore_eos=True, reuse_cache=False))
    model.prefill(ids + ref[:5] + [7, 8, 9], reuse_cache=False)
    model.cache.rollback(len(ids) - 2)   # roll back into the prompt
    model.cache_keys = model.cache_keys[:len(ids) - 2]
    again = list(model.generate_tokens(ids, 12, ignore_eos=True))   # reuses the 2-short prefix
    assert model.last_prefill_tokens == 2
    assert again == ref


def test_chat_second_turn_prefills_only_new_tokens(model):
    turn1 = [{"role": "user", "content": "How many shapes are there?"}]
    a1 = edgevl.generate(model, turn1, max_new_tokens=12)
    turn2 = turn1 + [{"role": "assistant", "content": a1}, {"role": "user", "content": "What color?"}]
    ids2 = model.tokenizer.encode(model.tokenizer.apply_chat_template(turn2))
    a2 = list(model.generate_tokens(ids2, 16))
    assert model.last_prefill_tokens < len(ids2) // 2
    fresh = edgevl.load(model.path)
    assert list(fresh.generate_tokens(ids2, 16, reuse_cache=False)) == a2
    assert fresh.last_prefill_tokens == len(ids2)


def test_sampler_top_k_top_p_restrict_support():
    from edgevl.sample import Sampler

    logits = np.array([5.0, 4.0, 3.0, 0.0, -1.0], np.float32)
    seen = {Sampler(1.0, top_k=2, seed=s)(logits) for s in range(200)}
    assert seen == {0, 1}
    seen = {Sampler(1.0, top_p=0.5, seed=s)(logits) for s in range(200)}
    assert seen == {0}
    seen = {Sampler(5.0, seed=s)(logits) for s in range(300)}
    assert seen == {0, 1, 2, 3, 4}


def test_low_memory_mode_gives_the_same_tokens(trained):
    _, pk = trained
    ids = [5, 17, 33, 8, 90, 12]
    resident = list(edgevl.load(pk).generate_tokens(ids, 12, ignore_eos=True))
    low = edgevl.load(pk, low_memory=True)
    assert type(low.decoder.net).__name__ == "SectionedNet"
    assert list(low.generate_tokens(ids, 12, ignore_eos=True)) == resident


def test_a_cut_character_is_told_as_utf8_tells_it():
    """The bytes held back at the end of an answer are a character's start that more bytes would
    complete (some continuation makes the decode lose a U+FFFD), nothing else: random byte strings."""
    import itertools
    import random

    from edgevl.tokenizer import _cut_character

    def bad(x):
        return x.decode("utf-8", "replace").count("\ufffd")

    ends = [bytes(c) for k in (1, 2, 3) for c in itertools.product((0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF), repeat=k)]
    rng = random.Random(0)
    pool = [0x41, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xE4, 0xED, 0xEF, 0xF0, 0xF4, 0xF5]
    for _ in range(3000):
        b = bytes(rng.choice(pool) for _ in range(rng.randint(1, 5)))
        assert _cut_character(b) == any(bad(b + e) < bad(b) for e in ends), b
