"""The conformance suite: every registered architecture, from its own tiny checkpoints.

A new architecture registers itself (edgevl/models/__init__.py) and its verification
(edgevl/verification/families/<family>.py) provides ``make_tiny`` and ``reference``; it then gets
all of this: fp32 conversion, greedy token parity with its PyTorch
reference (text, and an image prompt for vision models), per-layer cosine, chat prefix reuse equal
to a fresh run, reduced-precision top-1 agreement, bad inputs, and a bench smoke run.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

import edgevl
from edgevl import models, verification
from edgevl.errors import EdgevlError
from edgevl.generate import prepare
from edgevl.verification.verify import compare
from support import precision
from support.common import PROMPTS, first_diff, smooth_image

ARCHS = models.names()
N_NEW = 24
PROMPT = "Describe the image in one sentence."


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Per architecture: (checkpoint, fp32 package), from its first tiny variant."""
    cache = {}

    def get(name):
        if name not in cache:
            fam = verification.get(name)
            root = tmp_path_factory.mktemp(name)
            variant = next(iter(fam.tiny_variants), None)
            ck = fam.make_tiny(root / "ck", variant, seed=7)
            cache[name] = (ck, edgevl.convert(ck, root / "pk", dtype="fp32", progress=False))
        return cache[name]
    return get


@pytest.mark.parametrize("name", ARCHS)
def test_fp32_greedy_parity_and_layers(built, name):
    ck, pk = built(name)
    model = edgevl.load(pk)
    ref = verification.get(name).reference(ck)
    prep = prepare(model, "How many shapes are there?")
    ours = list(model.generate_tokens(prep.input_ids, N_NEW, ignore_eos=True, reuse_cache=False))
    theirs = ref.greedy(prep.input_ids, N_NEW)
    assert ours == theirs, f"{name}: first differing token at {first_diff(ours, theirs)}"
    rep = compare(pk, ck, PROMPT, max_new_tokens=4)
    low = [(layer, c) for _, layer, c, _ in rep.rows if c < 0.99999]
    assert not low and rep.identical, f"{name}: layers below 0.99999 cosine: {low}"


@pytest.mark.parametrize("name", [n for n in ARCHS if models.get(n).has_vision])
def test_fp32_image_prompt_parity(built, name):
    ck, pk = built(name)
    model = edgevl.load(pk)
    assert model.vision is not None
    img = smooth_image(37, 61, seed=3)
    prep = prepare(model, PROMPT, image=img)
    ref = verification.get(name).reference(ck)
    ref_images = ref.prepare_images([img], prep.images)
    ours = list(model.generate_tokens(prep.input_ids, N_NEW, image=prep.encoded, ignore_eos=True,
                                      reuse_cache=False))
    theirs = ref.greedy(prep.input_ids, N_NEW, images=ref_images)
    assert ours == theirs, f"{name}: first differing token at {first_diff(ours, theirs)}"
    rep = compare(pk, ck, PROMPT, image=img, max_new_tokens=4)
    low = [(sec, layer, c) for sec, layer, c, _ in rep.rows if c < 0.99999]
    assert not low and rep.identical, f"{name}: below 0.99999 cosine: {low}"


@pytest.mark.parametrize("name", ARCHS)
def test_chat_prefix_reuse_equals_fresh_run(built, name):
    _, pk = built(name)
    model = edgevl.load(pk)
    turn1 = [{"role": "user", "content": "How many shapes are there?"}]
    a1 = edgevl.generate(model, turn1, max_new_tokens=8)
    turn2 = turn1 + [{"role": "assistant", "content": a1}, {"role": "user", "content": "What color is it?"}]
    ids2 = prepare(model, turn2).input_ids
    second = list(model.generate_tokens(ids2, 12, ignore_eos=True))
    # only what follows turn 1's prompt is new (a template may re-render turn 1's answer
    # differently from how it was generated, e.g. without its reasoning: that much is recomputed)
    ids1 = prepare(model, turn1).input_ids
    shared = first_diff(ids1, ids2)
    assert 0 < model.last_prefill_tokens <= len(ids2) - (len(ids1) if shared is None else shared), \
        "the second turn re-prefilled the conversation"
    fresh = list(edgevl.load(pk).generate_tokens(ids2, 12, ignore_eos=True))
    assert second == fresh
    # going back into the conversation (an edited earlier turn) recomputes from a valid point
    edited = prepare(model, [{"role": "user", "content": "How many circles are there?"}]).input_ids
    again = list(model.generate_tokens(edited, 6, ignore_eos=True))
    assert again == list(edgevl.load(pk).generate_tokens(edited, 6, ignore_eos=True))


@pytest.mark.parametrize("name", ARCHS)
def test_prefill_in_chunks_equals_one_run(built, name):
    """A prompt prefilled a few tokens per run (``prefill_chunk``: attention over the cache,
    recurrent states carried between runs, experts routed per run) gives the one-run logits and
    tokens, with an image's rows split across runs too where the model takes images."""
    _, pk = built(name)
    whole = edgevl.load(pk)
    image = smooth_image(64, 48) if whole.vision is not None else None
    prep = prepare(whole, PROMPT, image=image)
    n = len(prep.input_ids)
    chunk = 5 if n > 10 else 2
    assert n > 2 * chunk
    parts = edgevl.load(pk, prefill_chunk=chunk)
    rows, infos = whole.encode_images(image)
    want = whole.prefill(prep.input_ids, rows, reuse_cache=False, images=infos)
    got = parts.prefill(prep.input_ids, rows, reuse_cache=False, images=infos)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
    assert list(parts.generate_tokens(prep.input_ids, 12, image=image, ignore_eos=True, reuse_cache=False)) == \
        list(whole.generate_tokens(prep.input_ids, 12, image=image, ignore_eos=True, reuse_cache=False))
    with pytest.raises(EdgevlError, match="prefill_chunk must be >= 1"):
        edgevl.load(pk, prefill_chunk=0)


class Interrupt(BaseException):
    """Stands for a Ctrl-C (a notebook interrupt) or a read failing inside a forward."""


def interrupt_inside_forward(model, after_calls: int):
    """Make the decoder's ``after_calls``-th host step of the next forward raise once its work is
    done (earlier layers' state already advanced), or the graph run itself where there is none."""
    calls = [0]

    def wrap(fn):
        def hooked(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls[0] += 1
            if calls[0] == after_calls:
                raise Interrupt
            return out
        return hooked

    dec = model.decoder
    if dec.hooks:
        originals = dict(dec.hooks)
        dec.hooks.update({k: wrap(f) for k, f in originals.items()})
        return lambda: dec.hooks.update(originals)
    original = dec.net.execute
    dec.net.execute = wrap(original)
    return lambda: setattr(dec.net, "execute", original)


@pytest.mark.parametrize("name", ARCHS)
def test_a_forward_interrupted_midway_leaves_a_whole_cache(built, name):
    """An exception inside a prefill or a decode step leaves the cache as it was before the call
    (or at an earlier point it kept): continuing the conversation with the cache gives exactly
    the tokens of a fresh run."""
    _, pk = built(name)
    model = edgevl.load(pk, prefill_chunk=4)
    ids1 = prepare(model, "How many shapes are there?").input_ids
    out1 = list(model.generate_tokens(ids1, 6, ignore_eos=True))
    per_prefill = max(1, len(model.decoder.passes))
    per_step = max(1, sum(p.get("when", "always") == "always" for p in model.decoder.passes))
    for call, question in enumerate(["What color is it? Say where.", "Which one is the largest of them?",
                                     "Count them again, one by one."], 1):
        ids2 = ids1 + out1 + prepare(model, question, raw=True).input_ids
        # inside the prefill of the new question: in its first, second and third 4-token chunk
        restore = interrupt_inside_forward(model, (call - 1) * per_prefill + max(1, per_prefill // 2))
        with pytest.raises(Interrupt):
            list(model.generate_tokens(ids2, 4, ignore_eos=True))
        restore()
        assert model.cache.length == len(model.cache_keys) <= len(ids1) + len(out1)
        # inside a decode step
        gen = model.generate_tokens(ids2, 4, ignore_eos=True)
        next(gen)
        restore = interrupt_inside_forward(model, min(call, per_step))
        with pytest.raises(Interrupt):
            next(gen)
        restore()
        assert model.cache.length == len(model.cache_keys) == len(ids2)
    # a prompt that extends the cached one reuses the cache without recomputing any of it
    ids3 = ids2 + prepare(model, " And then?", raw=True).input_ids
    again = list(model.generate_tokens(ids3, 8, ignore_eos=True))
    fresh = list(edgevl.load(pk).generate_tokens(ids3, 8, ignore_eos=True))
    assert again == fresh, f"{name}: first differing token at {first_diff(again, fresh)}"


# Teacher-forced over 4 x 48 tokens on briefly trained tiny models (tests/support/precision.py):
# top-1 agreement, the logit cosine of all but the sensitive rows, and the largest reference gap a
# disagreement crossed there (in row standard deviations). Measured over 5 seeds x AVX-512/AVX2
# (every family, worst first): top-1 bf16 0.964 (youtu_vl), q8 0.927 (youtu_vl); cosine bf16
# 0.975, q8 0.976 (qwen3_5_moe, 4th lowest row), the dense families >= 0.978; gap bf16 0.27, q8
# 0.52. Bounds: those less precision.MARGIN.
TOLERANCE = {"bf16": (0.94, 0.96, 0.45), "q8": (0.90, 0.96, 0.80)}   # top-1, cosine, gap


# Training steps: 250, but 150 for youtu_moe, whose steps take ~3x as long in transformers (its
# 250 steps took 80 s, the suite's slowest test). Over seeds 11-15 (AVX2) it kept top-1 >= 0.990, cosine >= 0.992
# and gaps <= 0.031 at 150 steps in bf16 and q8. 150 is not enough for qwen3_5_moe (one seed of
# five fell to 0.93 top-1 and 0.94 cosine).
TRAIN_STEPS = {"youtu_moe": 150}


def trained_checkpoint(name: str, folder, seed: int = 11):
    """The briefly trained bf16 checkpoint of ``name``'s first tiny variant (real checkpoints
    ship bf16 weights, which a bf16 conversion keeps exactly)."""
    fam = verification.get(name)
    return fam.make_tiny(folder, next(iter(fam.tiny_variants), None), seed=seed, dtype="bf16",
                         train_steps=TRAIN_STEPS.get(name, 250))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = trained_checkpoint(name, tmp_path_factory.mktemp(name + "-trained") / "ck")
        return cache[name]
    return get


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("name", ARCHS)
def test_reduced_precision_top1(trained, tmp_path, name, dtype):
    ck = trained(name)
    model = edgevl.load(edgevl.convert(ck, tmp_path / dtype, dtype=dtype, progress=False))
    ref = verification.get(name).reference(ck)   # computes in fp32
    got = precision.compare(model, ref, [prepare(model, p).input_ids for p in PROMPTS])
    top1, cos, gap = TOLERANCE[dtype]
    skip = precision.sensitive_rows(got.total, verification.get(name).precision_outlier_rows)
    assert got.rate >= top1 and got.low(skip) >= cos and got.gap(skip) <= gap, f"{name} {dtype}: {got.line(skip)}"


@pytest.mark.parametrize("name", ARCHS)
def test_bad_inputs(built, tmp_path, name):
    ck, pk = built(name)
    model = edgevl.load(pk)
    with pytest.raises(EdgevlError, match="context length is"):
        list(model.generate_tokens([1] * model.max_context, 1))
    with pytest.raises(EdgevlError, match="prompt is empty"):
        edgevl.generate(model, "  ")
    # a checkpoint missing a tensor its config needs: one line naming it, nothing written
    import shutil

    from safetensors.numpy import load_file, save_file
    bad = tmp_path / "bad"
    shutil.copytree(ck, bad)
    files = sorted(bad.glob("*.safetensors"))
    tensors = load_file(files[0])
    dropped = sorted(k for k in tensors if "layers.0." in k)[0]
    del tensors[dropped]
    save_file(tensors, files[0])
    index = bad / "model.safetensors.index.json"
    if index.is_file():
        wm = json.loads(index.read_text())
        wm["weight_map"].pop(dropped, None)
        index.write_text(json.dumps(wm))
    with pytest.raises(EdgevlError, match="is missing from the checkpoint"):
        edgevl.convert(bad, tmp_path / "out", dtype="fp32", progress=False)
    assert not (tmp_path / "out").exists()
    if model.vision is None:
        with pytest.raises(EdgevlError, match="no vision tower"):
            edgevl.generate(model, "hi", image=smooth_image(32, 32))


@pytest.mark.parametrize("name", ARCHS)
def test_bench_smoke(built, name, tmp_path):
    _, pk = built(name)
    r = subprocess.run([sys.executable, "-m", "edgevl", "bench", str(pk), "--prompt-tokens", "8", "--gen-tokens",
                        "2", "--threads", "1", "--repeats", "1", "--json", str(tmp_path / "b.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "b.json").read_text())["results"]["edgevl"]
    assert res["decode_tok_s"] > 0 and res["prefill_tok_s"] > 0 and res["kv_bytes_per_token"] > 0
