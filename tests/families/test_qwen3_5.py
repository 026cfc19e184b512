"""Qwen3.5 packages (edgevl.convert + edgevl.load) vs transformers' Qwen3_5ForConditionalGeneration
(fp32, random tiny configs): greedy tokens through the public API with input_ids exactly as
transformers' Qwen3VLProcessor makes them, per-layer hidden states, the conv and delta-rule
states after prefill, and chat turns that reuse the previous turn's state."""

import json

import numpy as np
import pytest
import torch

import edgevl
from edgevl import verification
from edgevl.blocks import gated_delta as gd
from edgevl.blocks import rope
from edgevl.errors import EdgevlError
from edgevl.generate import prepare
from edgevl.models import qwen3_5 as q
from edgevl.models.qwen3_5 import model as qm
from support.common import CORPUS, cosine, first_diff, smooth_image
from support.qwen import hf_greedy, hf_inputs, hf_processor, load_hf, make_qwen3_5

# Hv = 2Hk / Hv = Hk, tied / untied, interval 4 / 2 / 3, head 64 / 128 / 256
CONFIGS = list(verification.get("qwen3_5").tiny_variants)
N_NEW = 48


LONG = " ".join(CORPUS[:9])   # well over two chunks (ours: 32 tokens, transformers': 64)
PROMPTS = {
    "short": ([{"role": "user", "content": "Describe it."}], []),
    "long": ([{"role": "user", "content": LONG}], []),
    "image-37x1001": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
                      [smooth_image(37, 1001, 1)]),
    "two-images": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                                 {"type": "image"}, {"type": "text", "text": "compare them."}]}],
                   [smooth_image(64, 150, 2), smooth_image(200, 70, 3)]),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    out = {}
    for i, name in enumerate(CONFIGS):
        ck = make_qwen3_5(root / name, seed=40 + i, variant=name)
        out[name] = (ck, edgevl.convert(ck, root / f"{name}-fp32", dtype="fp32", progress=False))
    return out


_loaded = {}


def _load(models, name):
    if name not in _loaded:
        ck, pk = models[name]
        _loaded[name] = (edgevl.load(pk), load_hf(ck), hf_processor(ck))
    return _loaded[name]


@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("name", CONFIGS)
def test_fp32_greedy_token_exact(models, name, prompt):
    model, ref, proc = _load(models, name)
    msgs, images = PROMPTS[prompt]
    ids, enc = hf_inputs(proc, msgs, images)
    if prompt == "long":
        assert len(ids) > 2 * 64
    if prompt == "short":
        assert len(ids) < gd.CHUNK
    if images:
        assert sum(t == proc.image_token_id for t in ids) == sum(
            int(g.prod()) // 4 for g in enc["image_grid_thw"])
    ours = list(model.generate_tokens(ids, N_NEW, image=images, ignore_eos=True, reuse_cache=False))
    theirs = hf_greedy(ref, enc, N_NEW)
    assert len(ours) == len(theirs) == N_NEW
    first = first_diff(ours, theirs)
    assert first is None, f"{name}/{prompt}: first differing token at {first}: ours {ours[first]} vs {theirs[first]}"


def _reference_prefill(ref, enc):
    outs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o))
             for layer in ref.model.language_model.layers]
    ref.model.rope_deltas = None
    try:
        with torch.no_grad():
            r = ref(**enc, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return [o[0].numpy() for o in outs], r.cache if hasattr(r, "cache") else r.past_key_values, r.logits[0, -1].numpy()


@pytest.mark.parametrize("name", CONFIGS)
def test_layers_and_states_after_prefill(models, name):
    """Long prompt with an image: every layer's hidden state (cosine) and, per recurrent layer, the
    conv window and the delta-rule matrix against transformers' cache after prefill."""
    _, ref, proc = _load(models, name)
    model = edgevl.Model(models[name][1], light_mode=False)   # layer outputs stay extractable
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": LONG}]}]
    images = [smooth_image(90, 60, 5)]
    ids, enc = hf_inputs(proc, msgs, images)
    rows, infos = model.encode_images(images)
    names = model.decoder.info["outputs"]["layers"]
    cache = model.decoder.new_cache()
    hidden, extras = model.decoder.forward(model.embed(ids, rows), cache, model.positions(ids, infos), extract=names)
    logits = model.logits(hidden[-1:])[0]
    states, hf_cache, ref_logits = _reference_prefill(ref, enc)
    for i, (n, st) in enumerate(zip(names, states)):
        c = cosine(extras[n], st)
        assert c >= 0.99999, f"{name}: layer {i} cosine {c:.7f} (max diff {np.abs(extras[n] - st).max():.3g})"
    assert cosine(logits, ref_logits) >= 0.99999
    ours = cache.state_arrays()
    recurrent = [i for i, t in enumerate(ref.config.text_config.layer_types) if t == "linear_attention"]
    assert recurrent and sorted({k[0] for k in ours}) == recurrent
    k = ref.config.text_config.linear_conv_kernel_dim
    for i in recurrent:
        layer = hf_cache.layers[i]
        conv_ref = layer.conv_states[0][0, :, -(k - 1):].numpy()   # the columns the conv reads
        mat_ref = layer.recurrent_states[0][0].numpy()
        conv, mat = ours[(i, "conv")], ours[(i, "recurrent")]
        assert conv.shape == conv_ref.shape and mat.shape == mat_ref.shape
        assert np.abs(conv - conv_ref).max() <= 1e-5 * max(1.0, np.abs(conv_ref).max()), f"layer {i} conv state"
        assert np.abs(mat - mat_ref).max() <= 1e-5 * max(1.0, np.abs(mat_ref).max()), f"layer {i} recurrent state"
    for st in cache.layers:   # K/V hold every prompt token
        if st.kind == "kv":
            assert all(m.h == len(ids) for m in st.mats)


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_chat_second_turn_prefills_only_new_tokens(models, thinking):
    """Two turns through edgevl.generate (image in turn 1): turn 2 restores the snapshot taken
    before turn 1's answer (the template re-renders that answer without its reasoning) and
    prefills only from there; its tokens equal a fresh run's and transformers'."""
    ck, pk = models[CONFIGS[0]]
    model, ref, proc = _load(models, CONFIGS[0])
    model.reset()
    img = smooth_image(120, 80, 7)
    kw = {"enable_thinking": thinking}
    turn1 = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "What is this?"}]}]
    done = edgevl.complete(model, turn1, max_new_tokens=12, temperature=0, chat_template_kwargs=kw)
    if thinking:   # the prompt opens a think block: a random model's output is all reasoning
        assert done.reasoning and not done.text
    turn2 = turn1 + [{"role": "assistant", "content": done.text}, {"role": "user", "content": "And the colors?"}]
    plain = [{**m, "content": [{"type": "image"} if p.get("type") == "image" else p for p in m["content"]]}
             if isinstance(m["content"], list) else m for m in turn2]
    ids2, enc2 = hf_inputs(proc, plain, [img], enable_thinking=thinking)
    assert prepare(model, turn2, chat_template_kwargs=kw).input_ids == ids2
    second = list(model.generate_tokens(ids2, 24, image=[img], ignore_eos=True))
    ids1 = prepare(model, turn1, chat_template_kwargs=kw).input_ids
    header = q.ARCH.snapshot_points(model.tokenizer, ids1)[-1]          # after turn 1's "<|im_start|>assistant\n"
    assert ids2[:header] == ids1[:header] and ids2[header:header + 2] != ids1[header:header + 2]
    assert model.last_prefill_tokens == len(ids2) - header   # the image and turn 1's prompt are not recomputed
    fresh = list(edgevl.load(pk).generate_tokens(ids2, 24, image=[img], ignore_eos=True))
    assert second == fresh, f"first differing token at {first_diff(second, fresh)}"
    assert fresh == hf_greedy(ref, enc2, 24)


def test_reasoning_is_split_from_the_answer(models):
    """A think block in the output goes to Event.reasoning / Completion.reasoning, the answer to
    text (newlines around the markers dropped as the template does); show_reasoning prints both."""
    from edgevl.generate import ReasoningSplitter

    model = _load(models, CONFIGS[0])[0]
    tok = model.tokenizer
    prompt = prepare(model, "hi").input_ids                 # ends with an open "<think>\n"
    out = tok.encode("\nLet me see.\n\n</think>\n\nIt is red.")
    split = ReasoningSplitter(tok, q.ARCH.reasoning_tokens, prompt)
    parts = [split.add(t) for t in out] + [split.flush()]
    assert "".join(a for a, _ in parts) == "It is red."
    assert "".join(r for _, r in parts) == "Let me see."
    closed = prepare(model, "hi", chat_template_kwargs={"enable_thinking": False}).input_ids
    split = ReasoningSplitter(tok, q.ARCH.reasoning_tokens, closed)
    parts = [split.add(t) for t in tok.encode("Red.")] + [split.flush()]
    assert "".join(a for a, _ in parts) == "Red." and not any(r for _, r in parts)


def test_light_mode_off_gives_the_same_tokens(models):
    """The host passes extract each recurrent layer's blobs before their consumers run (light
    mode frees consumed blobs); with light mode off nothing is freed: same tokens either way."""
    _, pk = models["hvhk-untied-i2-hd128"]
    model, _, proc = _load(models, "hvhk-untied-i2-hd128")
    msgs, images = PROMPTS["two-images"]
    ids, _ = hf_inputs(proc, msgs, images)
    heavy = edgevl.Model(pk, light_mode=False)
    assert list(heavy.generate_tokens(ids, 16, image=images, ignore_eos=True)) == list(
        model.generate_tokens(ids, 16, image=images, ignore_eos=True, reuse_cache=False))


def test_image_patch_budget(models):
    model = _load(models, CONFIGS[0])[0]
    img = smooth_image(640, 480, 9)
    rows, info = model.encode_image(img)
    small, sinfo = model.encode_image(img, max_image_patches=64)
    _, gh, gw = sinfo["grid_thw"]
    assert gh * gw <= 64 < info["grid_thw"][1] * info["grid_thw"][2]
    assert small.shape == (gh * gw // 4, rows.shape[1])
    assert model.vision.image_tokens(480, 640, 64) == small.shape[0]
    with pytest.raises(EdgevlError, match="max_image_patches must be at least 4"):
        model.encode_image(img, max_image_patches=2)


def test_text_only_checkpoint(tmp_path):
    """Qwen3_5ForCausalLM checkpoints (model_type qwen3_5_text, tensors under model.*) convert
    with the same decoder: greedy tokens equal transformers'."""
    ck = make_qwen3_5(tmp_path / "ck", seed=5, text_only=True, num_hidden_layers=2, full_attention_interval=2)
    model = edgevl.load(edgevl.convert(ck, tmp_path / "pk", dtype="fp32", progress=False))
    assert model.vision is None and model.arch.name == "qwen3_5"
    ids = prepare(model, LONG[:200]).input_ids
    ours = list(model.generate_tokens(ids, 16, ignore_eos=True))
    assert ours == verification.get("qwen3_5").reference(ck).greedy(ids, 16)
    with pytest.raises(EdgevlError, match="no vision tower"):
        edgevl.generate(model, "hi", image=smooth_image(32, 32))


@pytest.mark.parametrize("stored, top, text", [(True, False, True), (False, True, False)],
                         ids=["stored-head", "no-head"])
def test_tie_flags_that_disagree_are_read_as_transformers_reads_them(tmp_path, stored, top, text):
    """A composite config's two tie_word_embeddings flags may disagree. A stored lm_head of its own
    values stays untied in transformers, so the package uses it too (it took text_config's "tied"
    and answered with the embedding). With no stored head, the composite config's own flag ties it
    whatever its text_config says (the package refused, saying to download a head that no download
    has)."""
    from support.files import edit_json

    ck = make_qwen3_5(tmp_path / "ck", seed=6 if stored else 7, tie_word_embeddings=not stored,
                      num_hidden_layers=2, full_attention_interval=2)

    def disagree(c):
        c["tie_word_embeddings"] = top
        c["text_config"]["tie_word_embeddings"] = text
    edit_json(ck / "config.json", disagree, restamp=False)
    hf = load_hf(ck)
    if not stored:
        assert hf.lm_head.weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()   # tied there
    model = edgevl.load(edgevl.convert(ck, tmp_path / "pk", dtype="fp32", progress=False))
    ids = prepare(model, LONG[:200]).input_ids
    want = hf_greedy(hf, {"input_ids": torch.tensor([ids])}, 12)
    assert list(model.generate_tokens(ids, 12, ignore_eos=True)) == want
    model.close()


def test_a_config_in_the_older_rope_layout_is_read_as_transformers_reads_it(tmp_path):
    """Configs of the transformers 4 era keep M-RoPE's sections in rope_scaling, with rope_theta
    and partial_rotary_factor at the top; transformers takes rope_scaling as the whole of
    rope_parameters. Its sections were ignored (the default ones were used, a silently different
    image answer)."""
    from support.files import edit_json

    ck = make_qwen3_5(tmp_path / "ck", seed=8)
    section = []

    def older(c):
        tc = c["text_config"]
        rp = tc.pop("rope_parameters")
        half = int(tc["head_dim"] * rp["partial_rotary_factor"]) // 2
        section[:] = [half, 0, 0]
        tc["rope_theta"], tc["partial_rotary_factor"] = rp.pop("rope_theta"), rp.pop("partial_rotary_factor")
        tc["rope_scaling"] = {**rp, "mrope_section": section}
    edit_json(ck / "config.json", older, restamp=False)
    model = edgevl.load(edgevl.convert(ck, tmp_path / "pk", dtype="fp32", progress=False))
    assert model.manifest["graphs"]["decoder"]["extra"]["rope"]["mrope_section"] == section
    ref, proc = load_hf(ck), hf_processor(ck)
    assert ref.config.text_config.rope_parameters["mrope_section"] == section
    msgs, images = PROMPTS["image-37x1001"]
    ids, enc = hf_inputs(proc, msgs, images)
    ours = list(model.generate_tokens(ids, 8, image=images, ignore_eos=True, reuse_cache=False))
    assert ours == hf_greedy(ref, enc, 8)
    ref.model.rope_deltas = None
    with torch.no_grad():
        theirs = ref(**enc).logits[0, -1].numpy()
    rows, infos = model.encode_images(images)
    np.testing.assert_allclose(model.prefill(ids, rows, reuse_cache=False, images=infos), theirs, atol=1e-3)
    model.close()


def test_conversion_of_mtp_blocks_and_bad_configs(models, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    ck, _ = models["hd256-i3"]
    bad = tmp_path / "ck"
    shutil.copytree(ck, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    # an incomplete multi-token-prediction block: refused, unless left out
    with pytest.raises(EdgevlError, match=r"lacks mtp\.pre_fc_norm_embedding\.weight.*--no-mtp"):
        edgevl.convert(bad, tmp_path / "pk", dtype="fp32", progress=False)
    pk = edgevl.convert(bad, tmp_path / "pk", dtype="fp32", mtp="drop", progress=False)
    m = json.loads((pk / "manifest.json").read_text())
    assert m["mtp"] == {"converted": False} and "mtp" not in m["graphs"] and m["options"]["mtp"] == "drop"
    cfg = json.loads((bad / "config.json").read_text())
    for change, msg in ((lambda c: c["text_config"].update(layer_types=["linear_attention"] * 2), "layer_types"),
                        (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[8, 8, 8]),
                         "mrope_section"),
                        (lambda c: c["text_config"].update(linear_num_key_heads=2, linear_num_value_heads=3),
                         "multiple of key heads"),
                        (lambda c: c.pop("text_config"), "needs a text_config")):
        c = json.loads(json.dumps(cfg))
        change(c)
        with pytest.raises(EdgevlError, match=msg):
            qm.TextArgs.from_config(c)


def test_positions_errors():
    with pytest.raises(EdgevlError, match="image tokens but the image gives"):
        rope.rope_positions([1, 5, 5, 5, 2], [(1, 4, 4)], 5, 2)
    with pytest.raises(EdgevlError, match="more image-token runs"):
        rope.rope_positions([1, 5, 5, 5, 5, 2], [], 5, 2)
    with pytest.raises(EdgevlError, match="2 images were given"):
        rope.rope_positions([1, 5, 5, 5, 5, 2], [(1, 4, 4), (1, 4, 4)], 5, 2)
    with pytest.raises(EdgevlError, match="M-RoPE needs the image's grid"):
        q.ARCH.positions([1, 5, 5, 2], [None], 5)


def test_server_returns_reasoning_content_and_passes_template_kwargs(models):
    """OpenAI-compatible server: the thinking comes back as message.reasoning_content
    (delta.reasoning_content when streaming), never inside content; chat_template_kwargs
    reaches the template (enable_thinking=false closes the think block in the prompt)."""
    from openai import OpenAI

    from edgevl.server import make_server

    model = _load(models, CONFIGS[0])[0]
    srv, _ = make_server(model)
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="x")
        msgs = [{"role": "user", "content": "How many shapes are there?"}]
        r = client.chat.completions.create(model="m", messages=msgs, max_tokens=8, temperature=0)
        thought = r.choices[0].message.model_extra.get("reasoning_content")
        # a random model never closes the think block the prompt opened: all of it is reasoning
        assert thought and r.choices[0].message.content == ""
        assert thought == edgevl.complete(model, msgs, max_new_tokens=8, temperature=0).reasoning
        pieces = [c.choices[0].delta for c in client.chat.completions.create(
            model="m", messages=msgs, max_tokens=8, temperature=0, stream=True) if c.choices]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in pieces) == thought
        assert not "".join(d.content or "" for d in pieces)
        r = client.chat.completions.create(model="m", messages=msgs, max_tokens=8, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        off = edgevl.complete(model, msgs, max_new_tokens=8, temperature=0,
                              chat_template_kwargs={"enable_thinking": False})
        assert r.choices[0].message.content == off.text and not off.reasoning
        assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
        import openai
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
            client.chat.completions.create(model="m", messages=msgs, max_tokens=2,
                                           extra_body={"chat_template_kwargs": ["enable_thinking"]})
        # the architecture's template switches take JSON booleans only
        for k, v in (("add_vision_id", 1), ("enable_thinking", None)):
            with pytest.raises(openai.BadRequestError, match=f"{k} must be true or false"):
                client.chat.completions.create(model="m", messages=msgs, max_tokens=2,
                                               extra_body={"chat_template_kwargs": {k: v}})
    finally:
        srv.stop()


def test_cli_thinking_flags(models):
    import subprocess
    import sys

    _, pk = models[CONFIGS[0]]

    def run(*flags):
        r = subprocess.run([sys.executable, "-m", "edgevl", "run", str(pk), "--prompt", "hi", "--max-new-tokens", "6",
                            "--temperature", "0", "--threads", "1", *flags],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout

    model = _load(models, CONFIGS[0])[0]
    done = edgevl.complete(model, "hi", max_new_tokens=6, temperature=0)
    assert run().strip() == done.text.strip()              # thinking hidden by default
    assert run("--show-thinking").startswith("<think>\n" + done.reasoning)
    off = edgevl.complete(model, "hi", max_new_tokens=6, temperature=0, chat_template_kwargs={"enable_thinking": False})
    assert run("--no-thinking").strip() == off.text.strip()


def test_verify_table_has_the_recurrent_states(models, capsys):
    """edgevl verify: per-layer rows plus, for each recurrent layer, its conv window and delta-rule
    matrix against transformers' cache after the prefill."""
    from edgevl.verification.verify import verify

    ck, pk = models["hd256-i3"]
    assert verify(pk, ck, prompt="Describe the image.", image=smooth_image(50, 40, 2), max_new_tokens=4)
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("state")]
    assert [(r[2], r[3]) for r in rows] == [("0", "conv"), ("0", "recurrent"), ("1", "conv"), ("1", "recurrent")]
    assert all(float(r[4]) >= 0.99999 for r in rows) and "PASS" in out


def test_prefill_memory_grows_linearly_with_the_prompt(tmp_path):
    """A prompt prefilled in chunks: each chunk's attention sees more keys than the last, so its
    buffers never fit in the last chunk's, and pooled beside them they added up to the square of
    the prompt (fp32, 16k tokens in 64-row chunks: 0.84 GB above the loaded model; now about the
    KV and state). In a child process, whose peak (VmHWM) is its own."""
    from support.common import child_peak_kb

    ck = make_qwen3_5(tmp_path / "ck", seed=9, max_position_embeddings=65536)
    pk = edgevl.convert(ck, tmp_path / "pk", dtype="fp32", progress=False)
    grown = {}
    for n in (3000, 12000):
        grown[n] = child_peak_kb(
            f"import edgevl, numpy as np; m = edgevl.load({str(pk)!r}, prefill_chunk=64, threads=1); "
            f"h0 = peak(); ids = [int(t) for t in np.random.default_rng(0).integers(10, 300, {n})]; "
            "list(m.generate_tokens(ids, 1, reuse_cache=False)); print(peak() - h0)") / 1024
    print(f"prefill peak above the loaded model: 3000 tokens {grown[3000]:.0f} MB, 12000 tokens {grown[12000]:.0f} MB")
    # 4x the prompt: linear growth adds about 4x; the square, 16x
    assert grown[12000] < 8 * max(grown[3000], 8), grown
