"""Speculative decoding with the MTP block (edgevl/speculative.py) on tiny Qwen3.5 and Qwen3.5-MoE
checkpoints whose block was briefly trained (so drafts are accepted and rejected): fp32 greedy output
identical to plain decoding (text, image and chunked prompts, chats that reuse the cache, 1 and 2
draft tokens), the block's logits against the PyTorch reference, the draft counts the reference
predicts, the rejection rule, seeded sampling, undo, and the options around it."""

import numpy as np
import pytest

import edgevl
from edgevl import speculative, verification
from edgevl.errors import EdgevlError
from edgevl.generate import generate, prepare
from edgevl.sample import Sampler
from support.common import CORPUS, cosine, smooth_image

# (family, variant): Hv = 2Hk tied; Hv = Hk untied head 128; the MoE block
CASES = [("qwen3_5", list(verification.get("qwen3_5").tiny_variants)[0]),
         ("qwen3_5", list(verification.get("qwen3_5").tiny_variants)[1]),
         ("qwen3_5_moe", list(verification.get("qwen3_5_moe").tiny_variants)[0])]
IDS = [f"{f}-{v}" for f, v in CASES]
N_NEW = 40
PROMPTS = {
    "short": ("Describe a cat.", None),
    "long": (" ".join(CORPUS[:6]), None),                  # several prefill chunks (prefill_chunk=16)
    "image": ("What is this?", [smooth_image(64, 90, 4)]),
}


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for i, (family, variant) in enumerate(CASES):
        v = verification.get(family)
        ck = v.make_tiny(root / f"ck{i}", variant=variant, seed=70 + i, train_steps=20, mtp_train_steps=40)
        out[IDS[i]] = (ck, edgevl.convert(ck, root / f"pk{i}", dtype="fp32", progress=False), v)
    return out


_models = {}


def _model(packages, case, **options):
    key = (case, tuple(sorted(options.items())))
    if key not in _models:
        _models[key] = edgevl.load(packages[case][1], **{"prefill_chunk": 16, **options})
    return _models[key]


@pytest.fixture(autouse=True)
def _always_draft(monkeypatch):
    """Drafting stays on whatever the acceptance, so every generation accepts and rejects."""
    monkeypatch.setattr(speculative, "AUTO_OFF_RATE", 0.0)
    monkeypatch.setattr(speculative, "AUTO_OFF_CYCLES", 1 << 30)


def spoil_every(n: int):
    """A draft head whose every n-th draft is wrong (its argmax + 1): rejections, whatever the
    model's text."""
    calls = [0]
    real = speculative.DraftHead.many

    def head(self, hidden, allowed):
        out = []
        for t in real(self, hidden, allowed):
            calls[0] += 1
            out.append((t + 1) % self.head.info["extra"]["shards"][-1]["rows"][1] if calls[0] % n == 0 else t)
        return out
    return head


@pytest.mark.parametrize("k", [1, 2, 3, None])   # 2: a verify pass of 3 rows takes a 4th; None: adaptive
@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("case", IDS)
def test_greedy_output_identical_to_plain_decoding(packages, case, prompt, k, monkeypatch):
    plain = _model(packages, case, speculative="none")
    spec = _model(packages, case, draft_tokens=k)
    assert (spec.mtp.k, spec.mtp.adaptive, spec.mtp.pad) == (k or speculative.DEFAULT_DRAFT_TOKENS, k is None, True)
    assert plain.speculative == "none" and spec.speculative == "mtp"
    text, images = PROMPTS[prompt]
    prep = prepare(plain, text, image=images)
    want = list(plain.generate_tokens(prep.input_ids, N_NEW, image=prep.encoded, ignore_eos=True, reuse_cache=False))
    got = list(spec.generate_tokens(prep.input_ids, N_NEW, image=prep.encoded, ignore_eos=True, reuse_cache=False))
    assert got == want
    stats = spec.runtime_stats()["speculative"]
    assert stats["accepted"] > 0 and stats["drafted"] >= N_NEW // ((k or 3) + 1), stats
    # with some drafts wrong: rows taken back at every place in a cycle, the same output
    monkeypatch.setattr(speculative.DraftHead, "many", spoil_every(3))
    got = list(spec.generate_tokens(prep.input_ids, N_NEW, image=prep.encoded, ignore_eos=True, reuse_cache=False))
    assert got == want
    stats = spec.runtime_stats()["speculative"]
    assert 0 < stats["accepted"] < stats["drafted"], stats


@pytest.mark.parametrize("case", IDS)
def test_counts_are_what_the_reference_predicts(packages, case):
    ck, _, v = packages[case]
    ref = v.reference(ck)
    for k in (1, 2, 3, None):   # None: the default, up to 3 by the draft-length rule
        spec = _model(packages, case, draft_tokens=k)
        ids = prepare(spec, "Count from one to ten please.").input_ids
        out = list(spec.generate_tokens(ids, N_NEW, ignore_eos=True, reuse_cache=False))
        want = ref.speculative_counts(ids, out, k or speculative.DEFAULT_DRAFT_TOKENS, adaptive=k is None)
        got = spec.runtime_stats()["speculative"]
        assert got == {**want, "summary": got["summary"]}, k


@pytest.mark.parametrize("prompt", ["long", "image"])
@pytest.mark.parametrize("case", IDS)
def test_block_logits_match_the_reference(packages, case, prompt):
    """Row i: token i+1's embedding (an image row's merged embedding) and the decoder's hidden
    state at i, at i's M-RoPE position: top-1 equal everywhere, cosine >= 0.9999 (fp32)."""
    ck, _, v = packages[case]
    model = _model(packages, case)
    text, images = PROMPTS[prompt]
    prep = prepare(model, text, image=images)
    ids = prep.input_ids
    x = model.embed(ids, prep.image_rows)
    hidden, _ = model.decoder.forward(x, model.decoder.new_cache(), model.positions(ids, prep.images))
    out = speculative.block_outputs(model.mtp, x[1:], hidden[:-1], model.positions(ids, prep.images)[:, :-1])
    ours = model.logits(out)
    ref = v.reference(ck)
    _, theirs = ref.mtp_states(ids, ref.prepare_images(images, prep.images) if images else None)
    assert ours.shape == theirs.shape
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    assert min(cosine(a, b) for a, b in zip(ours, theirs)) >= 0.9999


@pytest.mark.parametrize("case", [IDS[0], IDS[2]])
def test_chat_turns_reuse_the_cache_and_match_plain_decoding(packages, case):
    plain = _model(packages, case, speculative="none")
    spec = _model(packages, case, draft_tokens=2)
    for m in (plain, spec):
        m.reset()
    msgs_p, msgs_s = [], []
    for turn, question in enumerate(["Tell me about rivers.", "And mountains?", "Which is older?"]):
        msgs_p.append({"role": "user", "content": question})
        msgs_s.append({"role": "user", "content": question})
        a = generate(plain, msgs_p, max_new_tokens=24, temperature=0)
        b = generate(spec, msgs_s, max_new_tokens=24, temperature=0)
        assert a == b
        if turn:   # the previous turn's state was reused
            assert spec.last_prefill_tokens < len(prepare(spec, msgs_s).input_ids)
        msgs_p.append({"role": "assistant", "content": a})
        msgs_s.append({"role": "assistant", "content": b})


def test_seeded_sampling_is_reproducible(packages):
    spec = _model(packages, IDS[0], draft_tokens=2)
    ids = prepare(spec, "Describe a cat.").input_ids
    runs = [list(spec.generate_tokens(ids, 30, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True))
            for s in (7, 7, 8)]
    assert runs[0] == runs[1] != runs[2]
    assert spec.runtime_stats()["speculative"]["drafted"] > 0


@pytest.mark.parametrize("case", IDS)
def test_a_seeded_answer_is_the_same_with_drafts_or_without(packages, case):
    """A sampled position takes one draw whether or not a draft stands there (the draft is kept
    iff it is the token drawn), so a seed gives the same answer with drafting on or off; the
    drafts were both kept and turned down."""
    spec = _model(packages, case, draft_tokens=2)
    plain = _model(packages, case, speculative="none")
    ids = prepare(spec, "Describe a cat.").input_ids
    drafted = accepted = 0
    for seed, pen in ((7, 0.0), (8, 0.0), (9, 1.5)):
        kw = dict(temperature=0.5, top_p=0.95, seed=seed, ignore_eos=True, presence_penalty=pen,
                  frequency_penalty=pen / 3)
        assert list(spec.generate_tokens(ids, 40, **kw)) == list(plain.generate_tokens(ids, 40, **kw))
        stats = spec.runtime_stats()["speculative"]      # this generation's
        drafted, accepted = drafted + stats["drafted"], accepted + stats["accepted"]
    assert 0 < accepted < drafted


def test_rejection_rule_keeps_the_distribution():
    """Sampler.check over many draws: the token it returns is distributed as the sampler's own
    distribution, for a likely and an unlikely draft."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=12).astype(np.float32) * 2
    s = Sampler(temperature=0.8, top_k=8, seed=1)
    p = s.distribution(logits)
    for draft in (int(np.argmax(p)), int(np.argsort(p)[-6])):
        n = 20000
        counts = np.bincount([s.check(logits, (), draft) for _ in range(n)], minlength=len(p)) / n
        assert np.abs(counts - p).max() < 0.015, (draft, counts, p)
    greedy = Sampler(temperature=0)
    assert greedy.check(logits, (), 3) == int(np.argmax(logits))


# How far "feed k rows, take back some" may round from "feed the kept rows": ncnn blocks a
# forward's rows differently for different row counts (one row, a few, eight), which only
# reorders fp32 sums, so each operation's result moves by a few ulps of its operands and the
# states, a few layers deep, by an amount that scales with their magnitudes. Measured as the
# largest difference over the array's largest value, on the three tiny packages, two prompts,
# three row starts, every split of up to 8 rows and 1, 2 and 4 threads (an AVX-512 CPU): at most
# 2.5e-5 (about 210 fp32 ulps; most cases well below 3e-6, half exact); bound: 4x that. A wrong
# undo (columns kept one off, or nothing taken back) is about 1 on the same scale.
UNDO_ROUNDING = 1e-4


def _same_up_to_row_blocking(a, b, what):
    worst = float(np.abs(np.asarray(a, np.float64) - b).max())
    scale = float(np.abs(np.asarray(b, np.float64)).max())
    assert worst <= UNDO_ROUNDING * scale, f"{what}: off by {worst:.3g}, {worst / (scale or 1):.3g} of its largest"


@pytest.mark.parametrize("case", IDS)
@pytest.mark.parametrize("fed,dropped", [(3, 2), (8, 7), (8, 3)])
def test_undo_leaves_the_state_of_the_kept_rows(packages, case, fed, dropped):
    """Rows fed undoably and the last ones taken back: KV length, conv windows (all the columns
    they keep) and delta-rule states equal a cache fed the kept rows only (up to UNDO_ROUNDING)."""
    model = _model(packages, case, speculative="none")
    ids = prepare(model, "Describe a cat.").input_ids
    dec = model.decoder
    assert dec.undo_rows == 8

    def prefilled():
        c = dec.new_cache()
        dec.forward(model.embed(ids), c, model.positions(ids))
        return c

    a, b = prefilled(), prefilled()
    n = a.length
    rows = list(range(11, 11 + fed))
    kept = fed - dropped
    dec.forward(model.embedding(rows), a, np.arange(n, n + fed)[None], undoable=True)
    dec.undo(a, fed, dropped)
    dec.forward(model.embedding(rows[:kept]), b, np.arange(n, n + kept)[None], undoable=True)
    assert a.length == b.length == n + kept and a.next_positions == b.next_positions
    sa, sb = a.state_arrays(), b.state_arrays()
    assert sa.keys() == sb.keys() and sa
    for key in sa:
        _same_up_to_row_blocking(sa[key], sb[key], str(key))
    windows = 0
    for x, y in zip(a.layers, b.layers):
        if x.truncatable:     # KV: the same length (values: ncnn's own layout; the next token checks them)
            assert [m.h for m in x.mats] == [m.h for m in y.mats] == [n + kept, n + kept]
        elif getattr(x, "window", False):   # the columns kept for a later undo too
            windows += 1
            _same_up_to_row_blocking(x.snapshot()[0], y.snapshot()[0], "conv window")
    assert windows
    # and the next token's logits agree
    la = model.logits(dec.forward(model.embedding([5]), a, np.array([[n + kept]]))[0])
    lb = model.logits(dec.forward(model.embedding([5]), b, np.array([[n + kept]]))[0])
    assert cosine(la, lb) > 0.99999


def test_draft_vocab_subset_keeps_the_output(packages):
    """Drafting among the first 128 vocabulary rows (the head's first shard in these tests):
    the same output, drafts from those rows only."""
    plain = _model(packages, IDS[0], speculative="none")
    sub = _model(packages, IDS[0], draft_vocab=100)
    assert sub.mtp.head.blobs is not None and sub.mtp.head.rows == 128 < sub.vocab_size
    ids = prepare(plain, "Count from one to ten please.").input_ids
    want = list(plain.generate_tokens(ids, N_NEW, ignore_eos=True, reuse_cache=False))
    assert list(sub.generate_tokens(ids, N_NEW, ignore_eos=True, reuse_cache=False)) == want
    h = np.random.default_rng(1).normal(size=(1, sub.config["text_config"]["hidden_size"])).astype(np.float32)
    assert sub.mtp.head(h) == int(np.argmax(sub.logits(h)[0, :128]))


def test_no_mtp_conversion_and_options(packages, tmp_path):
    ck, pk, _ = packages[IDS[0]]
    assert edgevl.load(pk).manifest["mtp"] == {"converted": True}
    bare = edgevl.convert(ck, tmp_path / "bare", dtype="fp32", mtp="drop", progress=False)
    m = edgevl.load(bare)
    assert "mtp" not in m.manifest["graphs"] and m.manifest["mtp"] == {"converted": False}
    assert m.speculative == "none" and not (bare / "mtp.bin").exists()
    with pytest.raises(EdgevlError, match="lacks.*--no-mtp"):
        edgevl.load(bare, speculative="mtp")
    for bad, msg in ((dict(speculative="fast"), "speculative must be"), (dict(draft_tokens=8), "from 1 to 7"),
                     (dict(draft_tokens=0), "from 1 to 7"), (dict(draft_vocab=-1), "draft_vocab")):
        with pytest.raises(EdgevlError, match=msg):
            edgevl.load(pk, **bad)


def test_verify_covers_the_block(packages):
    from edgevl.verification.verify import compare

    ck, pk, _ = packages[IDS[2]]
    rep = compare(pk, ck, "Describe a cat.", max_new_tokens=8)
    assert {name for sec, name, _, _ in rep.rows if sec == "mtp"} == {"block output", "logits"}
    assert rep.mtp_top1[0] == rep.mtp_top1[1] > 0 and rep.ok


def test_command_line(packages, tmp_path, capsys):
    """``convert --no-mtp``; ``run --verbose`` reports the acceptance; ``--speculative mtp`` on a
    package without the block is one error line."""
    from support.cli import cli, one_line_error

    ck, pk, _ = packages[IDS[0]]
    code, _, err = cli(capsys, "convert", ck, tmp_path / "bare", "--dtype", "fp32", "--no-mtp", "--quiet")
    assert code == 0, err
    assert "mtp" not in edgevl.load(tmp_path / "bare").manifest["graphs"]
    code, out, err = cli(capsys, "run", pk, "--prompt", "Count to ten.", "--max-new-tokens", "12", "--verbose",
                         "--draft-tokens", "2")
    assert code == 0 and out.strip(), err
    assert "speculative decoding (MTP, 2 draft tokens):" in err and "drafts accepted" in err
    code, _, err = cli(capsys, "run", pk, "--prompt", "Count to ten.", "--max-new-tokens", "4", "--verbose",
                       "--speculative", "none")
    assert code == 0 and "speculative decoding" not in err
    one_line_error(*cli(capsys, "run", tmp_path / "bare", "--prompt", "Hi", "--speculative", "mtp")[::2],
                   "--no-mtp")
    one_line_error(*cli(capsys, "run", pk, "--prompt", "Hi", "--draft-tokens", "9")[::2], "draft_tokens")


def test_draft_length_follows_the_acceptance_at_each_position(monkeypatch):
    """The adaptive length on its own: three drafts at the start of a trial ((2/3)^3 = 0.296),
    shorter where drafts are rejected (their chance with every draft before them below
    MIN_REACH), long again once they are accepted."""
    monkeypatch.setattr(speculative, "MIN_REACH", 0.25)
    monkeypatch.setattr(speculative, "PRIOR_RATE", 2 / 3)
    monkeypatch.setattr(speculative, "PRIOR_STEPS", 3)
    t = speculative.Trial()
    assert t.length(3) == 3 and t.length(1) == 1
    for _ in range(3):          # the first draft rejected: 2 of 6, the second (not reached) as likely
        t.update(3, 0, 1)
    assert t.reached == [3] and t.length(3) == 1
    t = speculative.Trial()
    for _ in range(10):         # the first draft always accepted, the second never
        t.update(3, 1, 2)
    assert t.reached[:2] == [10, 10] and t.kept[:2] == [10, 0] and t.length(3) == 1
    for _ in range(40):         # every draft accepted
        t.update(1, 1, 2)
        t.update(3, 3, 4)
    assert t.length(3) == 3
    t = speculative.Trial()
    for _ in range(20):         # 0, 1, 2, 2 accepted in turn: two drafts reach 0.5, the third is never accepted
        for a in (0, 1, 2, 2):
            t.update(3, a, a + 1)
    assert t.length(3) == 2


def test_packages_with_the_narrow_conv_window_draft_two_at_most(packages, tmp_path, monkeypatch):
    """A package whose conv windows keep only the K-1 columns the conv reads (converted by an
    older edgevl) takes back at most 3 rows: the default drafts up to 2 and pads nothing, with
    the same output."""
    from edgevl.blocks import gated_delta

    ck, _, _ = packages[IDS[0]]
    monkeypatch.setattr(gated_delta, "UNDO_ROWS", 0)
    old = edgevl.convert(ck, tmp_path / "old", dtype="fp32", progress=False)
    monkeypatch.undo()
    spec = edgevl.load(old, prefill_chunk=16)
    assert spec.decoder.undo_rows == 3 and (spec.mtp.k, spec.mtp.adaptive, spec.mtp.pad) == (2, True, False)
    with pytest.raises(EdgevlError, match="from 1 to 2"):
        edgevl.load(old, draft_tokens=3)
    plain = _model(packages, IDS[0], speculative="none")
    ids = prepare(plain, "Describe a cat.").input_ids
    want = list(plain.generate_tokens(ids, N_NEW, ignore_eos=True, reuse_cache=False))
    assert list(spec.generate_tokens(ids, N_NEW, ignore_eos=True, reuse_cache=False)) == want


def test_drafting_turns_off_when_it_does_not_pay_and_tries_again(monkeypatch):
    """The rule on its own: off after AUTO_OFF_CYCLES steps without an accepted draft (at the
    start) or a low rate once AUTO_OFF_AFTER drafts were made; on again after RETRY_AFTER tokens."""
    monkeypatch.setattr(speculative, "AUTO_OFF_CYCLES", 4)
    monkeypatch.setattr(speculative, "AUTO_OFF_RATE", 0.3)
    t = speculative.Trial()
    assert [t.update(1, 0, 1) for _ in range(4)] == [True, True, True, False]
    for _ in range(speculative.RETRY_AFTER - 1):
        assert not t.update(0, 0, 1)
    assert t.update(0, 0, 1) and t.drafted == 0
    t = speculative.Trial()
    for _ in range(3):          # one accepted draft in the first steps: keeps drafting
        t.update(1, 0, 1)
    assert t.update(1, 1, 2)
    for _ in range(12):
        t.update(1, 0, 1)
    assert t.drafted == 16 and not t.active   # 1 of 16 < 30 %
    t = speculative.Trial()
    for _ in range(40):       # 50 % accepted: stays on
        assert t.update(2, 1, 2)



def test_float_packages_draft_with_an_int8_head(packages, tmp_path):
    """bf16 packages carry the head's first rows as int8 Gemms for drafting (q8 heads are int8
    already, fp32 packages draft with their own head): its drafts are the bf16 head's argmax
    over those rows on nearly every row, and the verifier still uses the package's head."""
    ck, pk, _ = packages[IDS[0]]
    assert "draft_head" not in edgevl.load(pk).manifest["graphs"]
    bf = edgevl.convert(ck, tmp_path / "bf16", dtype="bf16", progress=False)
    spec = edgevl.load(bf, prefill_chunk=16)
    info = spec.manifest["graphs"]["draft_head"]
    assert spec.mtp.head.head.info == info and spec.mtp.head.head is not spec.head
    whole = edgevl.load(bf, draft_vocab=0)      # the whole vocabulary: the package's own head
    assert whole.mtp.head.head is whole.head
    ids = prepare(spec, " ".join(CORPUS[:3])).input_ids
    hidden, _ = spec.decoder.forward(spec.embed(ids), spec.decoder.new_cache(), spec.positions(ids))
    rows = info["extra"]["shards"][-1]["rows"][1]
    want = spec.logits(hidden)[:, :rows].argmax(-1)
    got = np.array([spec.mtp.head(h[None]) for h in hidden])
    assert (got == want).mean() >= 0.95, (got == want).mean()
    out = list(spec.generate_tokens(ids, N_NEW, ignore_eos=True, reuse_cache=False))
    assert len(out) == N_NEW and spec.runtime_stats()["speculative"]["accepted"] > 0


def test_the_blocks_pass_over_a_long_prompt_runs_in_prefill_chunks(packages, monkeypatch):
    """The block catches up with a prompt in chunks of ``prefill_chunk`` rows, as the prompt was
    prefilled, alone and in the engine: it took the whole prompt in one pass, whose mask and
    attention scores grew with the prompt's square (a 28k-token prompt: 9 GB)."""
    from edgevl.engine import Engine

    monkeypatch.setattr(speculative, "CATCH_UP_ROWS", 1)    # these tiny prompts: catch up past prefill_chunk
    spec = _model(packages, IDS[0])
    plain = _model(packages, IDS[0], speculative="none")
    rows = []
    dec = spec.mtp.decoder
    real_one, real_rows = dec.forward, dec.forward_rows

    def one(x, cache, pos, *a, **k):
        rows.append(len(x))
        return real_one(x, cache, pos, *a, **k)

    def many(x, parts, pos, *a, **k):
        rows.extend(n for _, n in parts)
        return real_rows(x, parts, pos, *a, **k)
    monkeypatch.setattr(dec, "forward", one)
    monkeypatch.setattr(dec, "forward_rows", many)
    ids = prepare(spec, " ".join(CORPUS[:12])).input_ids
    assert len(ids) > 4 * spec.prefill_step == 64
    want = list(plain.generate_tokens(ids, 12, ignore_eos=True, reuse_cache=False))
    assert list(spec.generate_tokens(ids, 12, ignore_eos=True, reuse_cache=False)) == want
    assert max(rows) <= spec.prefill_step and len(rows) > len(ids) // spec.prefill_step
    rows.clear()
    other = prepare(spec, " ".join(CORPUS[2:14])).input_ids
    with Engine(spec, parallel=2) as engine:
        streams = [engine.generate_tokens(p, 12, ignore_eos=True) for p in (ids, other)]
        got = [list(s) for s in streams]
    assert got[0] == want and got[1] == list(plain.generate_tokens(other, 12, ignore_eos=True, reuse_cache=False))
    assert max(rows) <= spec.prefill_step


def test_a_decoding_cycles_rows_never_take_the_prompts_catch_up(packages, monkeypatch):
    """However small prefill_chunk is, the few rows a decoding cycle leaves waiting go with the
    next drafting pass: taken as a prompt's catch-up they cost extra block passes and emptied the
    block's pools every cycle."""
    spec = _model(packages, IDS[0], prefill_chunk=2)
    assert spec.prefill_step == 2
    passes = []
    real = spec.mtp.decoder.forward

    def forward(x, cache, pos, *a, kv_hint=0, **k):
        passes.append(kv_hint)      # a catch-up pass says the length the prompt will reach
        return real(x, cache, pos, *a, kv_hint=kv_hint, **k)
    monkeypatch.setattr(spec.mtp.decoder, "forward", forward)
    ids = prepare(spec, "Describe a cat.").input_ids
    assert len(ids) < speculative.CATCH_UP_ROWS
    want = list(_model(packages, IDS[0], speculative="none").generate_tokens(ids, 24, ignore_eos=True,
                                                                             reuse_cache=False))
    assert list(spec.generate_tokens(ids, 24, ignore_eos=True, reuse_cache=False)) == want
    assert spec.runtime_stats()["speculative"]["drafted"] > 0 and passes and not any(passes), passes
