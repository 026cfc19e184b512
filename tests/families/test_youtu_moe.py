"""Youtu MoE packages (edgevl.convert + edgevl.load) vs the project's PyTorch reference
(edgevl/verification/references/youtu_moe.py: transformers' kimi_linear KDA with the lower-bounded gate, youtu
MLA with an output gate and interleaved M-RoPE, quantile-balanced MoE, Qwen3-VL tower), fp32, on
two tiny configs (heads/dims, q_lora on/off, headwise/elementwise gate, expert counts): greedy
tokens through the public API for prompts of different lengths and an odd-sized image; image
rows routed with their own qb_beta row end to end; a small expert cache; the assumed layout table;
``</think>`` as the first token; bad input."""

import numpy as np
import pytest
import torch

import edgevl
from edgevl.blocks import gated_delta as gd_block
from edgevl.errors import EdgevlError
from edgevl.generate import prepare, stream_events
from edgevl.models.youtu_moe import model as Y
from edgevl.verification.families.youtu_moe import VERIFY as ARCH
from edgevl.verification.references import youtu_moe as R
from support.common import CORPUS, first_diff, smooth_image
from support.moe import record_routes

CONFIGS = list(ARCH.tiny_variants)
N_NEW = 48


PROMPTS = {
    "short": ("Hi.", None),
    "long": (" ".join(CORPUS[:6]), None),
    "image": ("What is in the picture?", (45, 77)),      # odd sizes: resized to the patch grid
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("youtu-moe")
    out = {}
    for i, name in enumerate(CONFIGS):
        ck = ARCH.make_tiny(root / name, name, seed=30 + i)
        out[name] = (ck, edgevl.convert(ck, root / f"{name}-fp32", dtype="fp32", progress=False))
    return out


_refs = {}


def reference(built, name):
    if name not in _refs:
        _refs[name] = ARCH.reference(built[name][0])
    return _refs[name]


@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("name", CONFIGS)
def test_fp32_greedy_tokens_equal_the_reference(built, name, prompt):
    _, pk = built[name]
    model = edgevl.load(pk)
    ref = reference(built, name)
    text, size = PROMPTS[prompt]
    img = smooth_image(*size, seed=len(name)) if size else None
    prep = prepare(model, text, image=img)
    ours = list(model.generate_tokens(prep.input_ids, N_NEW, image=prep.encoded, ignore_eos=True, reuse_cache=False))
    ref_images = ref.prepare_images([img], prep.images) if img is not None else None
    theirs = ref.greedy(prep.input_ids, N_NEW, images=ref_images)
    assert len(theirs) == N_NEW
    assert ours == theirs, f"{name}/{prompt} ({len(prep.input_ids)} prompt tokens): first difference at " \
                           f"{first_diff(ours, theirs)}"


def test_prompt_lengths_differ():
    # the parity prompts above cover different lengths (and so different token-by-token prefills)
    lengths = {len(t) for t, _ in PROMPTS.values()}
    assert len(lengths) == len(PROMPTS)


def test_image_rows_route_with_the_image_row_of_qb_beta_end_to_end(built, monkeypatch):
    """Through the ncnn path: at the first MoE layer (same router inputs either way), image rows
    choose other experts than they would as text (their qb_beta row differs), text rows the same;
    and the experts chosen equal the reference's, per row."""
    name = CONFIGS[0]
    ck, pk = built[name]
    model = edgevl.load(pk)
    first_moe = min(int(x["layer"]) for x in model.manifest["experts"]["layers"])
    seen = record_routes(monkeypatch, first_moe)
    img = smooth_image(45, 77, seed=1)
    prep = prepare(model, "What is in the picture?", image=img)
    ids = np.asarray(prep.input_ids)
    embeds = model.embed(prep.input_ids, prep.image_rows)
    positions = model.positions(prep.input_ids, prep.images)
    model.decoder.forward(embeds, model.decoder.new_cache(), positions, ids=prep.input_ids)
    model.decoder.forward(embeds, model.decoder.new_cache(), positions)   # no ids: every row as text
    as_image, as_text = seen
    is_img = ids == model.image_token_id
    assert is_img.sum() >= 4
    changed = (as_image != as_text).any(axis=1)
    assert changed[is_img].any(), "image rows must use qb_beta's image row"
    assert not changed[~is_img].any()

    # the reference's choices at that layer, row by row
    ref = reference(built, name)
    chosen = []
    router = ref.model.model.layers[first_moe].mlp.gate
    handle = router.register_forward_hook(lambda m, i, o: chosen.append(np.sort(o[2].numpy(), axis=1)))
    try:
        ref.text_states(prep.input_ids, ref.prepare_images([img], prep.images))
    finally:
        handle.remove()
    assert np.array_equal(chosen[0], as_image)


def test_small_expert_cache_gives_identical_tokens_and_reports_hit_rate(built):
    name = CONFIGS[1]
    _, pk = built[name]
    full = edgevl.load(pk)
    spec = full.manifest["experts"]
    total = spec["expert_bytes"] * spec["num_experts"] * len(spec["layers"])
    prompt = prepare(full, " ".join(CORPUS[2:4]))
    want = list(full.generate_tokens(prompt.input_ids, 32, ignore_eos=True))
    budget_mb = 0.24 * total / 2 ** 20                      # under a quarter of the expert weights
    small = edgevl.load(pk, expert_cache_mb=budget_mb)
    got = list(small.generate_tokens(prompt.input_ids, 32, ignore_eos=True))
    assert got == want, "tokens must not depend on the cache size"
    s = small.runtime_stats()["experts"]
    assert 0 < s["hit_rate"] < 1 and s["evictions"] > 0 and s["peak_resident_bytes"] <= s["budget_bytes"]
    assert f"{100 * s['hit_rate']:.1f} % hit rate" in s["summary"]


@pytest.mark.parametrize("dense", ["auto", "q8"])
def test_q8_dense_path_is_bf16_unless_asked(built, tmp_path, dense):
    """q8 packages keep the dense path bf16 by default; ``--dense q8`` makes its Gemms int8 like
    the experts' (never the router), and asks for a q8 package in one line. Either runs."""
    ck, _ = built[CONFIGS[0]]
    pk = edgevl.convert(ck, tmp_path / dense, dtype="q8", dense=dense, progress=False)
    gemms = [line.split() for line in (pk / "decoder.param").read_text().splitlines() if line.startswith("Gemm")]
    int8 = {g[1] for g in gemms if "18=2" in g}
    routers = {g[1] for g in gemms if g[1].endswith(".mlp.gate")}
    assert routers and not int8 & routers
    assert (len(int8) == len(gemms) - len(routers)) if dense == "q8" else not int8
    model = edgevl.load(pk)
    assert len(list(model.generate_tokens(prepare(model, "Hi").input_ids, 4, ignore_eos=True))) == 4
    if dense == "q8":
        with pytest.raises(EdgevlError, match="needs --dtype q8"):
            edgevl.convert(ck, tmp_path / "bad", dtype="bf16", dense="q8", progress=False)


def test_think_close_as_first_token_is_a_thinking_block_close_not_text(built, monkeypatch):
    """The base model emits </think> first; the answer must not contain it."""
    _, pk = built[CONFIGS[0]]
    model = edgevl.load(pk)
    close = model.tokenizer.token_to_id("</think>")
    assert close is not None
    answer = model.tokenizer.encode("Hello there.")
    eos = min(model.eos_ids)
    monkeypatch.setattr(model, "generate_tokens", lambda *a, **k: iter([close] + answer + [eos]))
    events = list(stream_events(model, "Hi."))
    text = "".join(e.text for e in events)
    assert text == "Hello there." and "think" not in "".join(e.reasoning for e in events) + text


def test_layout_table_drives_the_converter(built, tmp_path):
    """A checkpoint saved with another layout (renamed, experts per expert) converts to the same
    package bytes when the converter is given that table."""
    from edgevl.weights import Checkpoint

    ck, pk = built[CONFIGS[1]]
    layout = R.CheckpointLayout(renames=((r"^model\.", "language_model."), (r"\.self_attn\.", ".mixer.")),
                                experts="per_expert", expert_names=("w1", "w3", "w2"))
    model = R.YoutuVLMoEForConditionalGeneration.from_pretrained(ck)
    other = tmp_path / "renamed"
    model.save_pretrained(other, layout=layout)
    assert any(k.startswith("language_model.layers.1.mlp.experts.0.w1") for k in Checkpoint(other).keys())
    out = tmp_path / "pk"
    out.mkdir()
    Y.convert(Checkpoint(other), out, "fp32", {}, lambda t: None, layout=layout)
    for f in ("decoder.bin", "experts.bin", "lm_head.bin", "vision.bin", "decoder.param"):
        assert (out / f).read_bytes() == (pk / f).read_bytes(), f
    (tmp_path / "pk2").mkdir()
    with pytest.raises(EdgevlError, match="missing from the checkpoint"):   # the default table does not fit
        Y.convert(Checkpoint(other), tmp_path / "pk2", "fp32", {}, lambda t: None)


@pytest.mark.parametrize("case", ["deepstack", "lower_bound", "gate", "mrope", "no_sparse"])
def test_bad_config_gives_one_line(built, tmp_path, case):
    import json
    import shutil

    ck, _ = built[CONFIGS[0]]
    bad = tmp_path / "ck"
    shutil.copytree(ck, bad)
    cfg = json.loads((bad / "config.json").read_text())
    want = {"deepstack": "deepstack", "lower_bound": "kda_gate_lower_bound", "gate": "mla_output_gate",
            "mrope": "mrope_section", "no_sparse": "mlp_layer_types has no sparse layer"}[case]
    if case == "deepstack":
        cfg["vision_config"]["deepstack_visual_indexes"] = [0]
    elif case == "lower_bound":
        cfg["kda_gate_lower_bound"] = 5.0
    elif case == "gate":
        cfg["mla_output_gate"] = "channelwise"
    elif case == "no_sparse":   # converted, then its empty expert store was called corrupt at load
        cfg["mlp_layer_types"] = ["dense"] * cfg["num_hidden_layers"]
    else:
        cfg["rope_parameters"]["mrope_section"] = [3, 3, 3]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EdgevlError, match=want):
        edgevl.convert(bad, tmp_path / "out", dtype="fp32", progress=False)
    assert not (tmp_path / "out").exists()


def test_kda_core_matches_the_recurrence():
    """The fp32 numpy core against kimi_linear's ``recurrent_kimi_delta_attention`` with the
    lower-bounded gate, over 40 tokens from a random state (per-channel decay: a scalar-decay
    shortcut would fail here): as one prompt, and one row at a time (decode: updates deferred in
    the window, folded every KDA_WINDOW tokens), the state checked mid-window and after folds."""
    from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

    gd = gd_block

    H, D, T, lb = 3, 8, 40, -5.0
    core = gd_block.KdaCore(gd.DeltaDims(H, H, D, D), lb)
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((T, 3 * H * D)).astype(np.float32)
    fb = rng.standard_normal((T, H * D + H)).astype(np.float32)
    rate = np.exp(0.3 * rng.standard_normal(H)).astype(np.float32)
    dt = (0.5 * rng.standard_normal(H * D)).astype(np.float32)
    s0 = rng.standard_normal((H, D, D)).astype(np.float32)
    consts = core.consts(np.repeat(rate, D), dt)

    def reference(n):
        q, k, v = (torch.from_numpy(x[:n]).reshape(1, n, H, D) for x in np.split(qkv, 3, axis=1))
        f = torch.from_numpy(fb[:n, :H * D] + dt).reshape(1, n, H, D) * torch.from_numpy(rate)[None, None, :, None]
        beta = torch.sigmoid(torch.from_numpy(fb[:n, H * D:]))[None]
        o, s = recurrent_kimi_delta_attention(q, k, v, lb * torch.sigmoid(f), beta, torch.from_numpy(s0)[None], True,
                                              use_qk_l2norm_in_kernel=True)
        return o.reshape(n, -1).numpy(), s[0].numpy()

    want_o, want_s = reference(T)
    o, st = core(qkv, fb, consts, core.new_state(s0))
    assert np.abs(o - want_o).max() < 1e-4
    assert np.abs(st[0] - want_s).max() < 1e-4 and st[5][0] == 0    # a prompt ends folded
    st = core.new_state(s0)
    for t in range(T):
        o1, st = core(qkv[t:t + 1], fb[t:t + 1], consts, st)
        assert np.abs(o1.reshape(-1) - o[t]).max() < 1e-5
        if t + 1 in (5, gd_block.KDA_WINDOW, gd_block.KDA_WINDOW + 3, T):
            assert np.abs(core.matrix(st) - reference(t + 1)[1]).max() < 1e-4, f"after {t + 1}"
    # a prompt after decoded tokens (pending window) continues from the same state
    o2, st = core(qkv[:7], fb[:7], consts, st)
    assert np.all(np.isfinite(o2)) and st[5][0] == 0


def test_fields_left_out_take_the_converters_defaults_in_the_reference(built, tmp_path):
    """A config without a field the converter has a default for converts with that default; the
    reference (verify) reads the same default instead of failing with a KeyError."""
    import json
    import shutil

    from edgevl.verification.verify import compare

    ck = tmp_path / "ck"
    shutil.copytree(built[CONFIGS[0]][0], ck)
    cfg = json.loads((ck / "config.json").read_text())
    for k in ("routed_scaling_factor", "linear_conv_kernel_dim", "num_shared_experts"):
        assert cfg.pop(k) is not None
    (ck / "config.json").write_text(json.dumps(cfg))
    pkg = edgevl.convert(ck, tmp_path / "pk", dtype="fp32", progress=False)
    assert compare(pkg, ck, "Hi.", max_new_tokens=4).identical


def test_verify_judges_an_fp32_package_with_int8_experts_by_the_reduced_rule(built, tmp_path):
    """--experts q8 in an fp32 package rounds the experts: verify names them and applies the
    reduced-precision rule (first token, logits cosine), not token-exactness."""
    from edgevl.verification.verify import compare

    ck = built[CONFIGS[0]][0]
    pkg = edgevl.convert(ck, tmp_path / "pk", dtype="fp32", experts="q8", progress=False)
    lines = []
    rep = compare(pkg, ck, "Hi.", max_new_tokens=2, log=lines.append)
    assert rep.threshold().startswith("reduced precision"), rep.threshold()
    assert any("package (fp32, experts q8)" in line for line in lines), lines
    exact = compare(built[CONFIGS[0]][1], ck, "Hi.", max_new_tokens=2)
    assert exact.threshold().startswith("fp32"), exact.threshold()


def test_a_config_in_the_older_rope_layout_gives_the_same_settings():
    """rope_scaling (the older layout) stands for rope_parameters whole, sections included, as it
    does for the Qwen3.5 families; the sections were read from rope_parameters only."""
    cfg = R.make_config()
    rp = cfg.pop("rope_parameters")
    section = [rp["mrope_section"][2], rp["mrope_section"][0], rp["mrope_section"][1]]
    new = Y.TextArgs.from_config(dict(cfg, rope_parameters=dict(rp, mrope_section=section)))
    old = Y.TextArgs.from_config(dict(cfg, rope_scaling=dict(rp, mrope_section=section),
                                      rope_parameters={"rope_theta": 1.0e6, "mrope_section": rp["mrope_section"]}))
    assert section != rp["mrope_section"] and old.mrope_section == new.mrope_section == section
    assert old.rope_theta == new.rope_theta == rp["rope_theta"]
