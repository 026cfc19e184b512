"""The Youtu MoE reference (edgevl/verification/references/youtu_moe.py) against the transformers
blocks it is composed from, and against the llama.cpp patch's formulas (docs/models/youtu_moe.md,
sections 2 to 5)."""

import functools
import json
import types

import numpy as np
import pytest
import torch

from edgevl.blocks import moe
from edgevl.verification.references import youtu_moe as R


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():  # per test: a global switch would break later tests that train
        yield


@functools.lru_cache(maxsize=2)
def tiny(seed=0, deepstack=False):
    cfg = R.make_config(vision_config={"deepstack_visual_indexes": [0] if deepstack else []})
    return cfg, R.make_random(cfg, seed)


def _copy_into(dst, src):
    dst.load_state_dict(src.state_dict(), strict=True)
    return dst


def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if "norm" in name else 0.0))
    return module


# -- KDA ----------------------------------------------------------------------------------------


def _run_linear(layer, x, steps):
    """Prefill x[:, :-steps] then decode the rest one by one with transformers' hybrid cache:
    exercises the chunked and the recurrent KDA paths and both conv paths."""
    from transformers import DynamicCache

    cfg = layer._cfg
    cache = DynamicCache(config=cfg)
    n = x.shape[1] - steps
    outs = [layer(x[:, :n], cache=cache)]
    for t in range(n, x.shape[1]):
        outs.append(layer(x[:, t:t + 1], cache=cache))
    return torch.cat(outs, 1), cache


def test_kda_equals_kimi_linear_with_softplus_gate():
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    tc = R.text_configs(R.make_config())
    kimi = _randomize(KimiLinearDeltaAttention(tc.kimi, 0), 1).eval()
    ours = _copy_into(R.KDAttention(tc.kimi, 0, lower_bound=None), kimi).eval()
    kimi._cfg = ours._cfg = tc.kimi
    x = torch.randn(1, 11, tc.kimi.hidden_size, generator=torch.Generator().manual_seed(2))
    a, ca = _run_linear(kimi, x, 3)
    b, cb = _run_linear(ours, x, 3)
    assert torch.equal(a, b)
    assert torch.equal(ca.get_recurrent_state(0, state_idx=0), cb.get_recurrent_state(0, state_idx=0))
    assert torch.equal(ca.get_conv_state(0, state_idx=0), cb.get_conv_state(0, state_idx=0))
    # the lower-bounded gate is a different layer (the test above is not vacuous)
    bounded = _copy_into(R.KDAttention(tc.kimi, 0, lower_bound=-5.0), kimi).eval()
    bounded._cfg = tc.kimi
    c, _ = _run_linear(bounded, x, 3)
    assert (a - c).abs().max() > 1e-2


def test_lower_bound_gate_formula_and_transformers_safe_gate():
    """g = -5 · sigmoid(exp(A_log) · (f_b(f_a x) + dt_bias)), per channel; equal to glm5_next's
    safe gate (fla's naive_kda_lowerbound_gate) with the same weights."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextForgetGate

    tc = R.text_configs(R.make_config())
    gate = _randomize(R.LowerBoundForgetGate(tc.kimi, -5.0), 3)
    x = torch.randn(1, 5, tc.kimi.hidden_size, generator=torch.Generator().manual_seed(4))
    H, D = tc.kimi.linear_num_heads, tc.kimi.linear_head_dim
    f = gate.f_b_proj(gate.f_a_proj(x)) + gate.dt_bias
    want = -5.0 * torch.sigmoid(gate.A_log.reshape(H, 1).exp() * f.view(1, 5, H, D))
    got = gate(x)
    assert got.shape == (1, 5, H, D)
    assert torch.allclose(got, want, atol=1e-6)
    assert float(got.min()) > -5.0 and float(got.max()) < 0.0
    glm = Glm5NextTextForgetGate(types.SimpleNamespace(linear_head_dim=D, linear_num_heads=H,
                                                       hidden_size=tc.kimi.hidden_size, linear_lower_bound=-5.0))
    sd = dict(gate.state_dict())
    sd["A_log"] = sd["A_log"].reshape(H)
    glm.load_state_dict(sd)
    assert torch.allclose(glm(x), got, atol=1e-6)


# -- gated MLA with interleaved M-RoPE ----------------------------------------------------------


def _run_attention(layer, rope, x, positions, steps, cfg):
    """Prefill then decode with a KV cache; rope(x, positions [3|1, 1, L]) gives (cos, sin)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=cfg)
    n = x.shape[1] - steps
    outs = []
    for s, e in [(0, n)] + [(t, t + 1) for t in range(n, x.shape[1])]:
        L = e - s
        mask = torch.triu(torch.full((L, e), torch.finfo(x.dtype).min), diagonal=s + 1)[None, None]
        outs.append(layer(x[:, s:e], rope(x, positions[..., s:e]), mask, cache=cache)[0])
    return torch.cat(outs, 1)


def test_mla_equals_youtu_without_gate_and_mrope():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding
    from transformers.models.youtu.modeling_youtu import YoutuAttention, YoutuRotaryEmbedding

    tc = R.text_configs(R.make_config())
    youtu = _randomize(YoutuAttention(tc.mla, 3), 5).eval()
    ours = _copy_into(R.GatedMLA(tc.mla, 3, gate=None), youtu).eval()
    x = torch.randn(1, 9, tc.mla.hidden_size, generator=torch.Generator().manual_seed(6))
    text = torch.arange(9)[None]                                      # [1, L]
    plain = YoutuRotaryEmbedding(tc.mla)
    mrope = Qwen3VLTextRotaryEmbedding(tc.rope)
    a = _run_attention(youtu, lambda x, p: plain(x, p), x, text, 3, tc.kimi)
    b = _run_attention(ours, lambda x, p: mrope(x, p.expand(3, 1, -1)), x, text, 3, tc.kimi)
    assert torch.allclose(a, b, atol=1e-6)                            # text: M-RoPE == 1-D RoPE

    # the gate: sigmoid(g_proj x), one scalar per head, multiplies that head's attention output
    gated = R.GatedMLA(tc.mla, 3, gate="headwise")
    gated.load_state_dict(youtu.state_dict(), strict=False)
    _randomize(gated.g_proj, 7)
    seen = []
    youtu.o_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    _run_attention(youtu, lambda x, p: plain(x, p), x, text, 0, tc.kimi)
    heads, vd = tc.mla.num_attention_heads, tc.mla.v_head_dim
    gate = torch.sigmoid(gated.g_proj(x)).repeat_interleave(vd, dim=-1)
    want = youtu.o_proj(seen[-1] * gate)
    got = _run_attention(gated, lambda x, p: mrope(x, p.expand(3, 1, -1)), x, text, 0, tc.kimi)
    assert torch.allclose(got, want, atol=1e-5)
    assert gated.g_proj.weight.shape == (heads, tc.mla.hidden_size)

    # image-like positions (distinct T/H/W) change the result: M-RoPE is really on
    pos3 = torch.stack([torch.arange(9), torch.arange(9) * 2, torch.arange(9) * 3])[:, None]
    c = _run_attention(ours, lambda x, p: mrope(x, p), x, pos3, 0, tc.kimi)
    assert (c - a).abs().max() > 1e-3


def test_mrope_frequency_assignment_matches_hf_semantics():
    """mrope_section [12, 10, 10] over 32 rope frequencies: H at 1, 4, ... < 30, W at 2, 5, ...
    < 30, T elsewhere (incl. 30 and 31; docs/models/youtu_moe.md section 2: llama.cpp needed
    [11, 10, 10] for this)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    cfg = R.make_config(qk_rope_head_dim=64, rope_parameters={"mrope_section": [12, 10, 10], "rope_theta": 1e6})
    tc = R.text_configs(cfg)
    rope = Qwen3VLTextRotaryEmbedding(tc.rope)
    t, h, w = 5.0, 7.0, 11.0
    cos, sin = rope(torch.zeros(1), torch.tensor([[[t]], [[h]], [[w]]]))
    angle = torch.atan2(sin[0, 0, :32], cos[0, 0, :32]).double()
    inv = rope.inv_freq.double()
    axis = ["T"] * 32
    for j in range(1, 30, 3):
        axis[j] = "H"
    for j in range(2, 30, 3):
        axis[j] = "W"
    want = torch.tensor([{"T": t, "H": h, "W": w}[a] for a in axis], dtype=torch.float64) * inv
    wrapped = torch.remainder(want + np.pi, 2 * np.pi) - np.pi
    assert torch.allclose(angle, wrapped, atol=1e-4)
    assert axis[30] == axis[31] == "T"


def test_rope_positions_match_transformers_get_rope_index():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    img = 99
    grids = torch.tensor([[1, 6, 8], [1, 4, 4]])
    ids = [1, 2] + [img] * 12 + [3, 4, 5] + [img] * 4 + [6]
    fake = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=2)),
        get_vision_position_ids=functools.partial(Qwen3VLModel.get_vision_position_ids, None))
    tt = torch.tensor([[1 if t == img else 0 for t in ids]])
    want, _ = Qwen3VLModel.get_rope_index(fake, torch.tensor([ids]), tt, image_grid_thw=grids)
    got = R.rope_positions(ids, grids, img, merge=2)
    assert torch.equal(got, want[:, 0])
    with pytest.raises(ValueError, match="placeholder"):
        R.rope_positions(ids[:-3], grids, img)


# -- routing (the patch's formula) --------------------------------------------------------------


def _patch_routing(logits, qb_beta, modality, k, scale):
    """The llama.cpp patch's routing, spelled out row by row in plain Python."""
    idx, weights = [], []
    for row, m in zip(logits.tolist(), modality):
        sel = [v - b for v, b in zip(row, qb_beta[m].tolist())]
        top = sorted(range(len(sel)), key=lambda e: -sel[e])[:k]
        s = [1 / (1 + np.exp(-row[e])) for e in top]
        idx.append(top)
        weights.append([v / (sum(s) + 1e-20) * scale for v in s])
    return np.array(idx), np.array(weights)


def _sorted(idx, w):
    order = np.argsort(idx, axis=1)
    return np.take_along_axis(idx, order, 1), np.take_along_axis(w, order, 1)


def test_router_matches_patch_formula_per_modality():
    cfg, model = tiny()
    router = model.model.layers[1].mlp.gate
    x = torch.randn(6, cfg["hidden_size"], generator=torch.Generator().manual_seed(8))
    modality = torch.tensor([0, 0, 0, 1, 1, 1])
    logits, w, idx = router(x, modality)
    want_idx, want_w = _patch_routing(logits.numpy(), router.qb_beta, modality.tolist(),
                                      cfg["num_experts_per_token"], 2.83)
    gi, gw = _sorted(idx.numpy(), w.numpy())
    wi, ww = _sorted(want_idx, want_w)
    assert np.array_equal(gi, wi) and np.allclose(gw, ww, atol=1e-6)
    assert np.allclose(gw.sum(1), 2.83, atol=1e-5)                     # normalised, then scaled
    # the host router (edgevl.blocks.moe) gives the same experts and weights
    hi, hw = _sorted(*moe.sigmoid_topk_biased(logits.numpy(), cfg["num_experts_per_token"], router.qb_beta.numpy(),
                                              modality.numpy(), 2.83))
    assert np.array_equal(hi, wi) and np.allclose(hw, ww, atol=1e-6)


def test_text_and_image_rows_pick_different_experts_when_qb_beta_rows_differ():
    cfg, model = tiny()
    router = model.model.layers[2].mlp.gate
    x = torch.randn(16, cfg["hidden_size"], generator=torch.Generator().manual_seed(9))
    _, w_text, i_text = router(x, torch.zeros(16, dtype=torch.long))
    _, w_img, i_img = router(x, torch.ones(16, dtype=torch.long))
    differ = [set(a) != set(b) for a, b in zip(i_text.tolist(), i_img.tolist())]
    assert sum(differ) >= 8, "qb_beta rows differ by ~0.5: most rows should change experts"
    # equal rows: the modality no longer matters
    saved = router.qb_beta.clone()
    try:
        router.qb_beta[1] = router.qb_beta[0]
        _, _, i_same = router(x, torch.ones(16, dtype=torch.long))
        assert [set(a) for a in i_same.tolist()] == [set(a) for a in i_text.tolist()]
    finally:
        router.qb_beta.copy_(saved)
    # selection is biased, the weights are not: an expert chosen in both keeps its sigmoid score
    lg = torch.nn.functional.linear(x, router.weight)
    for r in range(16):
        both = set(i_text[r].tolist()) & set(i_img[r].tolist())
        for e in both:
            wt = w_text[r, i_text[r].tolist().index(e)] / 2.83 * (torch.sigmoid(lg[r, i_text[r]]).sum() + 1e-20)
            assert torch.allclose(wt, torch.sigmoid(lg[r, e]), atol=1e-5)


def test_modality_comes_from_image_rows():
    cfg, model = tiny()
    ids = [5, cfg["vision_start_token_id"], cfg["image_token_id"], cfg["image_token_id"], cfg["vision_end_token_id"], 7]
    assert model.modality(ids).tolist() == [[0, 0, 1, 1, 0, 0]]
    router = moe.Router({"kind": "sigmoid_biased", "top_k": 2, "scale": 2.83,
                         "modality_token_ids": [cfg["image_token_id"], cfg["video_token_id"]]})
    assert router.modality(ids, len(ids)).tolist() == [0, 0, 1, 1, 0, 0]
    assert router.modality(None, 3).tolist() == [0, 0, 0]


# -- the whole model ------------------------------------------------------------------------------


def test_greedy_with_cache_equals_recompute_text_and_image():
    from PIL import Image

    cfg, model = tiny(1, deepstack=True)
    ids = list(range(5, 40))
    assert (model.greedy_generate(ids, max_new_tokens=10)
            == model.greedy_generate(ids, max_new_tokens=10, use_cache=False))
    im = Image.fromarray((np.random.default_rng(0).random((70, 100, 3)) * 255).astype("uint8"))
    pv, grid = R.preprocess([im], R.make_preprocessor_config(cfg))
    n = int(grid.prod()) // 4
    ids = ([cfg["vision_start_token_id"]] + [cfg["image_token_id"]] * n + [cfg["vision_end_token_id"]]
           + list(range(9, 20)))
    a = model.greedy_generate(ids, pv, grid, max_new_tokens=10)
    assert a == model.greedy_generate(ids, pv, grid, max_new_tokens=10, use_cache=False)
    assert len(set(a)) > 3, f"random tiny model should decode varied tokens, got {a}"
    states, logits = model.text_states(ids, pv, grid)
    assert len(states) == cfg["num_hidden_layers"] + 2 and logits.shape == (len(ids), cfg["vocab_size"])
    # the image changes the continuation (its rows, positions and modality all enter)
    assert a != model.greedy_generate([cfg["vision_start_token_id"], cfg["vision_end_token_id"]] + list(range(9, 20)),
                                      max_new_tokens=10)


def test_save_load_round_trip(tmp_path):
    cfg, model = tiny()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "youtu_vl_moe" and saved["architectures"] == ["YoutuVLMoEForConditionalGeneration"]
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert tuple(f.get_slice("model.layers.1.mlp.experts.gate_up_proj").get_shape()) == (16, 64, 64)
    for k in ["model.layers.0.self_attn.forget_gate.A_log", "model.layers.0.self_attn.conv1d.weight",
              "model.layers.3.self_attn.g_proj.weight", "model.layers.3.self_attn.kv_b_proj.weight",
              "model.layers.1.mlp.gate.qb_beta", "model.layers.1.mlp.shared_experts.down_proj.weight",
              "model.layers.0.mlp.gate_proj.weight", "visual.blocks.0.attn.qkv.weight", "lm_head.weight"]:
        assert k in keys, k
    again = R.YoutuVLMoEForConditionalGeneration.from_pretrained(tmp_path)
    ids = list(range(3, 30))
    assert torch.equal(again.forward(ids), model.forward(ids))
    (tmp_path / "model.safetensors").rename(tmp_path / "x")
    with pytest.raises(FileNotFoundError):
        R.YoutuVLMoEForConditionalGeneration.from_pretrained(tmp_path)


def test_other_checkpoint_layout_needs_only_the_table(tmp_path):
    """A checkpoint with Kimi's on-disk names and per-expert tensors loads by changing only the
    layout table."""
    kimi_disk = R.CheckpointLayout(renames=((r"\.forget_gate\.", "."),
                                            (r"\.mlp\.(experts|gate|shared)", r".block_sparse_moe.\1")),
                                   experts="per_expert", expert_names=("w1", "w3", "w2"))
    cfg, model = tiny()
    model.save_pretrained(tmp_path, layout=kimi_disk)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.15.w2.weight" in keys
    assert "model.layers.0.self_attn.A_log" in keys and not any("gate_up_proj" in k for k in keys)
    again = R.YoutuVLMoEForConditionalGeneration.from_pretrained(tmp_path, layout=kimi_disk)
    ids = list(range(3, 30))
    assert torch.equal(again.forward(ids), model.forward(ids))
    with pytest.raises(ValueError, match="lacks model.layers.1.block_sparse_moe.experts.0.gate_proj.weight"):
        R.YoutuVLMoEForConditionalGeneration.from_pretrained(tmp_path, layout=R.CheckpointLayout(
            renames=kimi_disk.renames, experts="per_expert"))
