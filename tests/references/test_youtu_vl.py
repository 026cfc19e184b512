"""Tests of the PyTorch reference of Youtu-VL (edgevl/verification/references/youtu_vl.py), on tiny
models; sections are those of docs/models/youtu_vl.md."""

import json
import math
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from edgevl.verification.references.youtu_vl import (  # noqa: E402
    VisionConfig,
    YoutuVLForConditionalGeneration,
    make_config,
    make_random,
    text_config_from_dict,
    vision_rope_angles,
    window_partition,
)

VOCAB = 300


@pytest.fixture(scope="module")
def cfg():
    return make_config(vocab_size=VOCAB)


@pytest.fixture(scope="module")
def model(cfg):
    return make_random(cfg, seed=0)


def _pixels(gh, gw, b=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(b, gh * gw, 768, generator=g) * 2 - 1)


def _prompt(cfg, n_img, text=(5, 6, 7)):
    return (
        [cfg["bos_token_id"], 11, 12, cfg["vision_start_token_id"]]
        + [cfg["image_token_id"]] * n_img
        + [cfg["vision_end_token_id"], *text]
    )


# ---- configuration ---------------------------------------------------------------------------


def test_text_config_rope_theta_is_taken_from_config(cfg):
    assert text_config_from_dict(cfg).rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}
    c2 = dict(cfg)
    del c2["rope_theta"]
    c2["rope_parameters"] = {"rope_type": "default", "rope_theta": 1234.0}
    assert text_config_from_dict(c2).rope_parameters["rope_theta"] == 1234.0
    del c2["rope_parameters"]
    with pytest.raises(ValueError, match="rope_theta"):
        text_config_from_dict(c2)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        text_config_from_dict({**cfg, "num_key_value_heads": 1})
    tc = text_config_from_dict(cfg)
    assert tc.num_key_value_heads == tc.num_attention_heads == 4
    assert tc.qk_head_dim == 16 and tc.head_dim == 8 and tc.tie_word_embeddings


def test_make_config_overrides():
    c = make_config(vocab_size=100, hidden_size=64,
                    vision_config={"num_hidden_layers": 2, "fullatt_block_indexes": [1]})
    assert c["vision_config"]["out_hidden_size"] == 64
    assert c["vision_config"]["hidden_size"] == 32  # untouched keys survive the merge
    assert c["image_token_id"] < 100
    v = VisionConfig.from_dict(c["vision_config"])
    assert (v.num_hidden_layers, v.fullatt_block_indexes, v.window_cells) == (2, [1], 8)


# ---- vision geometry (sections 4.3, 4.4) -----------------------------------------------------


@pytest.mark.parametrize(
    "grid, cu",
    [
        ((36, 20), [0, 256, 320, 576, 640, 704, 720]),
        ((30, 40), [0, 256, 512, 640, 864, 1088, 1200]),
        ((16, 16), [0, 256]),
        ((62, 2), [0, 32, 64, 96, 124]),
        ((8, 4), [0, 32]),
    ],
)
def test_window_partition(grid, cu):
    idx, cuw = window_partition(*grid, window_cells=VisionConfig().window_cells)
    assert cuw.tolist() == cu
    assert sorted(idx.tolist()) == list(range(grid[0] * grid[1] // 4))
    if grid == (36, 20):
        assert idx[:16].tolist() == list(range(0, 8)) + list(range(10, 18))


def test_vision_rope_angles():
    gh, gw, d = 4, 6, 16
    ang = vision_rope_angles(gh, gw, d)
    inv = 10000.0 ** (-torch.arange(4, dtype=torch.float64) / 4)
    # processor index 5 = group 1 (merged row 0, col 1), sub-patch TR -> patch (0, 3)
    # processor index 14 = group 3 (merged row 1, col 0), sub-patch BL -> patch (3, 0)
    for p, (r, c) in [(0, (0, 0)), (5, (0, 3)), (14, (3, 0)), (23, (3, 5))]:
        torch.testing.assert_close(ang[p].double(), torch.cat([r * inv, c * inv]), rtol=1e-6, atol=1e-6)


# ---- checkpoint keys and I/O (section 8) -----------------------------------------------------


def _expected_keys(cfg, untied=False):
    v = cfg["vision_config"]
    p = "siglip2.vision_model."
    keys = [p + "embeddings.patch_embedding.weight", p + "embeddings.patch_embedding.bias"]
    for i in range(v["num_hidden_layers"]):
        lp = f"{p}encoder.layers.{i}."
        for n in ["layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.out_proj", "mlp.fc1", "mlp.fc2"]:
            keys += [lp + n + ".weight", lp + n + ".bias"]
    keys += [p + "post_layernorm.weight", p + "post_layernorm.bias", "merger.ln_q.weight"]
    keys += ["merger.mlp.0.weight", "merger.mlp.0.bias", "merger.mlp.2.weight", "merger.mlp.2.bias"]
    keys += ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg["num_hidden_layers"]):
        lp = f"model.layers.{i}."
        for n in ["input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                  "self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.q_b_proj",
                  "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm", "self_attn.kv_b_proj",
                  "self_attn.o_proj"]:
            keys.append(lp + n + ".weight")
    if untied:
        keys.append("lm_head.weight")
    return set(keys)


def test_key_names_and_shapes(cfg, model):
    sd = model.checkpoint_state_dict()
    assert set(sd) == _expected_keys(cfg)
    assert sd["siglip2.vision_model.embeddings.patch_embedding.weight"].shape == (32, 768)
    assert sd["merger.mlp.0.weight"].shape == (128, 128)
    assert sd["merger.mlp.2.weight"].shape == (48, 128)
    assert sd["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (16 + 8, 48)
    assert sd["model.layers.0.self_attn.kv_b_proj.weight"].shape == (4 * (8 + 12), 16)
    untied = make_config(vocab_size=VOCAB, tie_word_embeddings=False, num_hidden_layers=1)
    assert set(make_random(untied, 0).checkpoint_state_dict()) == _expected_keys(untied, untied=True)


def test_make_random_deterministic_and_not_trivial(cfg, model):
    again = make_random(cfg, seed=0)
    other = make_random(cfg, seed=1)
    sd, sd2, sd3 = model.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert not torch.equal(sd["merger.ln_q.weight"], sd3["merger.ln_q.weight"])
    for k, v in sd.items():
        if "norm" in k and k.endswith("weight") or k == "merger.ln_q.weight":
            assert not torch.allclose(v, torch.ones_like(v)), k
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _round_bf16(m):
    r = make_random(m.config_dict, 0)
    r.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in m.state_dict().items()})
    return r


@pytest.mark.parametrize("shard", [None, "40KB"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_roundtrip(tmp_path, cfg, model, shard, dtype):
    model.save_pretrained(tmp_path, max_shard_size=shard, dtype=dtype)
    files = sorted(os.listdir(tmp_path))
    if shard is None:
        assert files == ["config.json", "model.safetensors"]
    else:
        shards = [f for f in files if f.startswith("model-")]
        assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == _expected_keys(cfg)
    saved_cfg = json.loads((tmp_path / "config.json").read_text())
    assert saved_cfg["model_type"] == "youtu_vl" and "vision_config" in saved_cfg
    assert saved_cfg["architectures"] == ["YoutuVLForConditionalGeneration"]

    loaded = YoutuVLForConditionalGeneration.from_pretrained(tmp_path)
    ref = model if dtype == torch.float32 else _round_bf16(model)
    ids = torch.tensor([_prompt(cfg, 8)])
    pv, ss = _pixels(8, 4), [[8, 4]]
    assert torch.equal(loaded(ids, pv, ss).logits, ref(ids, pv, ss).logits)
    if dtype == torch.bfloat16 and shard is None:
        lb = YoutuVLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.bfloat16)
        assert lb.lm_head.weight.dtype == torch.bfloat16
        ref_bf16 = _round_bf16(model).to(torch.bfloat16)  # the same weights, run in bf16
        assert torch.equal(lb(ids, pv, ss).logits, ref_bf16(ids, pv, ss).logits)


def test_load_key_variants_and_errors(tmp_path, cfg, model):
    sd = model.checkpoint_state_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # bare "siglip2." prefix, an unused position embedding and a duplicated tied lm_head load fine
    variant = {k.replace("siglip2.vision_model.", "siglip2."): v for k, v in sd.items()}
    variant["siglip2.embeddings.position_embedding.weight"] = torch.zeros(256, 32)
    variant["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(variant, str(tmp_path / "model.safetensors"))
    loaded = YoutuVLForConditionalGeneration.from_pretrained(tmp_path)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(loaded(ids).logits, model(ids).logits)

    missing = dict(sd)
    del missing["merger.ln_q.weight"]
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="1 missing.*merger.ln_q.weight"):
        YoutuVLForConditionalGeneration.from_pretrained(tmp_path)
    extra = {**sd, "merger.extra.weight": torch.zeros(2)}
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="1 unexpected.*merger.extra.weight"):
        YoutuVLForConditionalGeneration.from_pretrained(tmp_path)


# ---- vision tower (section 4) ----------------------------------------------------------------


def _with_fullatt(model, fullatt):
    c = json.loads(json.dumps(model.config_dict))
    c["vision_config"]["fullatt_block_indexes"] = fullatt
    m = YoutuVLForConditionalGeneration(c)
    m.load_state_dict(model.state_dict())
    return m.eval()


def test_window_attention_vs_full(model):
    all_full = _with_fullatt(model, list(range(4)))
    one = _pixels(16, 16)  # a single 16x16-patch window: window == full, and no reordering
    assert torch.equal(model.vision_features(one, [[16, 16]]), all_full.vision_features(one, [[16, 16]]))
    two = _pixels(16, 32)  # two windows side by side
    a, b = model.vision_features(two, [[16, 32]]), all_full.vision_features(two, [[16, 32]])
    assert (a - b).abs().max() > 1e-3


def _naive_tower(model, pv, gh, gw, fullatt):
    """Independent tower: processor order throughout (never permuted), dense additive masks."""
    vc = model.vision_config
    vm = model.siglip2.vision_model
    n, hd, nh = gh * gw, vc.head_dim, vc.num_attention_heads
    # raster id of every processor-order patch, straight from the section 3.5 reshape
    raster = torch.arange(n).reshape(gh // 2, 2, gw // 2, 2).permute(0, 2, 1, 3).reshape(-1)
    r, c = (raster // gw).double(), (raster % gw).double()
    inv = 1.0 / (vc.rope_theta ** (torch.arange(0, hd // 2, 2, dtype=torch.float64) / (hd // 2)))
    ang = torch.cat([r[:, None] * inv, c[:, None] * inv], dim=1)
    ang = torch.cat([ang, ang], dim=1)
    cos, sin = ang.cos().float(), ang.sin().float()
    wp = vc.window_size // vc.patch_size  # window side in patches
    win = (r // wp) * 1000 + (c // wp)
    win_mask = torch.where(win[:, None] == win[None, :], 0.0, float("-inf"))

    def rope(t):
        t1, t2 = t[..., : hd // 2], t[..., hd // 2:]
        return t * cos + torch.cat([-t2, t1], dim=-1) * sin

    x = F.linear(pv, vm.embeddings.patch_embedding.weight, vm.embeddings.patch_embedding.bias)
    states = [x]
    for i, L in enumerate(vm.encoder.layers):
        h = F.layer_norm(x, (vc.hidden_size,), L.layer_norm1.weight, L.layer_norm1.bias, vc.layer_norm_eps)
        a = L.self_attn
        q, k, v = (F.linear(h, p.weight, p.bias).view(n, nh, hd).transpose(0, 1)
                   for p in (a.q_proj, a.k_proj, a.v_proj))
        s = rope(q) @ rope(k).transpose(-1, -2) / math.sqrt(hd)
        if i not in fullatt:
            s = s + win_mask
        o = (s.softmax(-1) @ v).transpose(0, 1).reshape(n, -1)
        x = x + F.linear(o, a.out_proj.weight, a.out_proj.bias)
        h = F.layer_norm(x, (vc.hidden_size,), L.layer_norm2.weight, L.layer_norm2.bias, vc.layer_norm_eps)
        x = x + F.linear(F.gelu(F.linear(h, L.mlp.fc1.weight, L.mlp.fc1.bias), approximate="tanh"),
                         L.mlp.fc2.weight, L.mlp.fc2.bias)
        states.append(x)
    return (F.layer_norm(x, (vc.hidden_size,), vm.post_layernorm.weight, vm.post_layernorm.bias, vc.layer_norm_eps),
            states)


@pytest.mark.parametrize("fullatt", [[0, 1, 2, 3], [1, 3]])
def test_tower_matches_unpermuted_naive(model, fullatt):
    """Window permutation + un-permute (and RoPE permutation) against a never-permuted version."""
    m = _with_fullatt(model, fullatt)
    gh, gw = 36, 20  # 3x2 windows, partial last row and column
    pv = _pixels(gh, gw, seed=3)
    with torch.no_grad():
        out, naive_states = _naive_tower(m, pv[0], gh, gw, set(fullatt))
        merged, hidden = m.vision_features(pv, [[gh, gw]], output_hidden_states=True)
    assert len(hidden) == 4 + 3
    for got, want in zip(hidden[:5], naive_states):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(hidden[5], out, atol=2e-5, rtol=1e-5)
    assert torch.equal(hidden[6], merged) and merged.shape == (gh * gw // 4, 48)
    # section 5 by hand: RMSNorm, concatenate groups of 4, Linear-GELU(erf)-Linear
    z = m.merger.ln_q.weight * (out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6))
    z = z.reshape(-1, 128)
    mlp = m.merger.mlp
    want = F.linear(F.gelu(F.linear(z, mlp[0].weight, mlp[0].bias)), mlp[2].weight, mlp[2].bias)
    torch.testing.assert_close(merged, want, atol=2e-5, rtol=1e-5)


# ---- fusion and LM (sections 6, 7) -----------------------------------------------------------


def test_fusion_count_mismatch_raises(cfg, model):
    pv = _pixels(8, 4)
    with pytest.raises(ValueError, match="image token count mismatch"):
        model(torch.tensor([_prompt(cfg, 7)]), pv, [[8, 4]])
    with pytest.raises(ValueError, match="no pixel_values"):
        model(torch.tensor([_prompt(cfg, 8)]))


def test_fusion_places_image_rows_in_order(cfg, model):
    ids = _prompt(cfg, 8)
    pv = _pixels(8, 4)
    states = model.text_hidden_states(ids, pv, [[8, 4]])
    assert len(states) == cfg["num_hidden_layers"] + 2
    img = model.vision_features(pv, [[8, 4]])
    pos = [i for i, t in enumerate(ids) if t == cfg["image_token_id"]]
    assert torch.equal(states[0][pos], img)
    assert torch.equal(states[0][0], model.model.embed_tokens.weight[ids[0]])
    logits = model(torch.tensor([ids]), pv, [[8, 4]]).logits[0]
    assert torch.equal(model.lm_head(states[-1]), logits)


def test_lm_matches_transformers_causal_lm(cfg, model):
    from transformers import YoutuForCausalLM

    hf = YoutuForCausalLM(text_config_from_dict(cfg)).eval()
    sd = {k: v for k, v in model.state_dict().items() if k.startswith(("model.", "lm_head."))}
    hf.load_state_dict(sd, strict=True)
    ids = torch.tensor([[cfg["bos_token_id"], 3, 17, 99, 250, 4, 4, 8]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=0, rtol=0)


def test_batch_matches_single_and_loss(cfg, model):
    pv = _pixels(8, 4, b=2, seed=5)
    rows = [_prompt(cfg, 8, text=(5, 6, 7)), _prompt(cfg, 8, text=(40, 41, 42))]
    ids = torch.tensor(rows)
    out = model(ids, pv, [[8, 4], [8, 4]])
    for b in range(2):
        single = model(ids[b:b + 1], pv[b], [[8, 4]]).logits[0]
        torch.testing.assert_close(out.logits[b], single, atol=1e-5, rtol=1e-5)
    labels = ids.clone()
    labels[ids == cfg["image_token_id"]] = -100
    out = model(ids, pv, [[8, 4], [8, 4]], labels=labels)
    keep = labels[:, 1:] != -100
    want = F.cross_entropy(out.logits[:, :-1][keep], labels[:, 1:][keep])
    torch.testing.assert_close(out.loss, want)
    out.loss.backward()
    g = model.siglip2.vision_model.embeddings.patch_embedding.weight.grad
    assert g is not None and g.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_greedy_generate_cache_matches_recompute(cfg, model):
    ids = _prompt(cfg, 8)
    pv = _pixels(8, 4)
    a = model.greedy_generate(ids, pv, [[8, 4]], max_new_tokens=16)
    b = model.greedy_generate(ids, pv, [[8, 4]], max_new_tokens=16, use_cache=False)
    assert a == b and len(a) == 16
    assert len(set(a)) > 3  # a random model that is useful for parity tests does not loop on one token
    stop = model.greedy_generate(ids, pv, [[8, 4]], max_new_tokens=16, eos_token_id=a[2])
    assert stop == a[: a.index(a[2]) + 1]


def test_real_layout_config_builds_real_shapes():
    """The real config.json values (section 2) give the section 8 tensor shapes; built on meta, so it
    is free."""
    real = make_config(
        vocab_size=283386, hidden_size=2560, intermediate_size=9728, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=32, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=32768,
        bos_token_id=128000, eos_token_id=128001, pad_token_id=128001, vision_start_token_id=128262,
        vision_end_token_id=128263, image_token_id=128264, video_token_id=128265,
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                           num_attention_heads=16, fullatt_block_indexes=[7, 15, 23, 26], out_hidden_size=2560),
    )
    with torch.device("meta"):
        m = YoutuVLForConditionalGeneration(real)
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    want = {
        "siglip2.vision_model.embeddings.patch_embedding.weight": (1152, 768),
        "siglip2.vision_model.encoder.layers.26.mlp.fc1.weight": (4304, 1152),
        "merger.ln_q.weight": (1152,),
        "merger.mlp.0.weight": (4608, 4608),
        "merger.mlp.2.weight": (2560, 4608),
        "model.embed_tokens.weight": (283386, 2560),
        "model.layers.39.self_attn.q_b_proj.weight": (6144, 1536),
        "model.layers.39.self_attn.kv_a_proj_with_mqa.weight": (576, 2560),
        "model.layers.39.self_attn.kv_b_proj.weight": (8192, 512),
        "model.layers.39.self_attn.o_proj.weight": (2560, 4096),
        "model.layers.39.mlp.gate_proj.weight": (9728, 2560),
    }
    assert {k: shapes[k] for k in want} == want
    assert "siglip2.vision_model.encoder.layers.27.mlp.fc1.weight" not in shapes
    assert m.model.layers[0].self_attn.scaling == pytest.approx(192 ** -0.5)
    assert m.vision_config.window_cells == 8 and m.vision_config.head_dim == 72
    assert m.text_config.rope_parameters["rope_theta"] == 500000.0
