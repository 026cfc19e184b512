"""The Qwen3.5 / Qwen3.5-MoE multi-token-prediction reference (edgevl/verification/references/qwen3_5_mtp.py)
and the tiny checkpoints that carry the block: the block is transformers' own layer, norms and M-RoPE
in the documented order, causal; checkpoints with it load in transformers unchanged; a missing tensor
is refused in one line; brief training makes drafts agree with the main model's greedy tokens; the
speculative-decoding counts follow the acceptance rule."""

import importlib
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from edgevl import verification
from edgevl.errors import EdgevlError
from edgevl.verification.references import qwen3_5_mtp as M
from edgevl.verification.tiny import CORPUS
from support.common import smooth_image
from support.qwen import hf_inputs, hf_processor

FAMILIES = ["qwen3_5", "qwen3_5_moe"]
MTP_TRAIN_STEPS = 15
N_NEW = 48


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():  # per test: a global switch would break later tests that train
        yield


def _prefix(tensors):
    return "model.language_model." if any(k.startswith("model.language_model.") for k in tensors) else "model."


def _unit_rows(n, H, seed):
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(seed))
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def _mrope_positions(n):
    """Three axes that differ (an image-like run in the middle), as M-RoPE gives them."""
    t = torch.arange(n)
    pos = torch.stack([t, t, t])
    pos[1, 3:7] = torch.tensor([3, 3, 4, 4])
    pos[2, 3:7] = torch.tensor([3, 4, 3, 4])
    pos[:, 7:] = pos[:, 7:] - 2
    return pos


@pytest.mark.parametrize("family", FAMILIES)
def test_block_is_transformers_layer_in_documented_order(family, tmp_path):
    """A one-layer, full-attention main model; the MTP block gets that layer's tensors (renamed to
    mtp.layers.0.* as on disk, the MoE experts one tensor each), the final norm as mtp.norm and an fc
    that passes one normalised half through: on unit-RMS rows the block's output equals the main
    model's normed last hidden state on the same rows and M-RoPE positions, whichever half carries
    them (the embedding half first), and the other half has no effect."""
    from transformers import AutoModelForCausalLM

    fam = verification.get(family)
    ck = fam.make_tiny(tmp_path / "ck", seed=11, num_hidden_layers=1, full_attention_interval=1, text_only=True)
    main = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32).eval()
    cfg = main.config
    assert cfg.layer_types == ["full_attention"]
    tensors = load_file(str(ck / "model.safetensors"))
    pre = _prefix(tensors)
    H = cfg.hidden_size
    n = 12
    x, other = _unit_rows(n, H, 1), 3.0 * _unit_rows(n, H, 2)
    pos = _mrope_positions(n)
    want = main.model(inputs_embeds=x[None], position_ids=pos[:, None]).last_hidden_state[0]
    eye, zero = torch.eye(H), torch.zeros(H, H)
    for half in ("embedding", "hidden"):
        mtp = {"mtp.layers.0." + k[len(pre + "layers.0."):]: v for k, v in tensors.items()
               if k.startswith(pre + "layers.0.")}
        mtp["mtp.norm.weight"] = tensors[pre + "norm.weight"]
        mtp["mtp.fc.weight"] = torch.cat([eye, zero] if half == "embedding" else [zero, eye], dim=1)
        mtp[f"mtp.pre_fc_norm_{half}.weight"] = torch.zeros(H)
        mtp[f"mtp.pre_fc_norm_{'hidden' if half == 'embedding' else 'embedding'}.weight"] = torch.randn(H)
        if family == "qwen3_5_moe":
            assert "mtp.layers.0.mlp.experts.7.down_proj.weight" in mtp and "mtp.layers.0.mlp.gate.weight" in mtp
        block = M.Qwen3_5Mtp(cfg, M.is_moe(cfg)).load_checkpoint_tensors(mtp).eval()
        assert type(block.layers[0]).__module__.startswith("transformers.models.qwen3_5")
        assert block.state_dict_for_checkpoint().keys() == mtp.keys()
        args = (x, other, pos) if half == "embedding" else (other, x, pos)
        got = block(*args)
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-5), f"{half}: max diff {(got - want).abs().max():.3g}"
        changed = (3.0 * _unit_rows(n, H, 3), args[1], pos) if half == "hidden" else (args[0], -args[1], pos)
        assert torch.allclose(block(*changed), got, atol=1e-6), f"{half}: the other half leaks into the output"
        # the logits helper is the main model's head
        assert torch.allclose(block.logits(got, main.lm_head), main.lm_head(want), atol=1e-4)


def _tiny_checkpoints(tmp_path_factory, name, seed, seed_step, **kwargs):
    """(family, its verification, a tiny checkpoint of its first variant) for each family."""
    root = tmp_path_factory.mktemp(name)
    for i, family in enumerate(FAMILIES):
        fam = verification.get(family)
        yield family, fam, fam.make_tiny(root / family, next(iter(fam.tiny_variants)), seed=seed + seed_step * i,
                                         **kwargs)


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
    """{family: (checkpoint, reference)} with an untrained MTP block."""
    return {family: (ck, fam.reference(ck))
            for family, fam, ck in _tiny_checkpoints(tmp_path_factory, "mtp-random", 21, 1, mtp=True)}


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_see_only_earlier_rows(family, random_mtp):
    _, ref = random_mtp[family]
    block = ref.mtp()
    H, n, k = block.config.hidden_size, 10, 6
    g = torch.Generator().manual_seed(5)
    e, h = torch.randn(n, H, generator=g), torch.randn(n, H, generator=g)
    pos = _mrope_positions(n)
    base = block(e, h, pos)
    e2, h2 = e.clone(), h.clone()
    e2[k:] = torch.randn(n - k, H, generator=g)
    h2[k + 1:] = torch.randn(n - k - 1, H, generator=g)
    moved = block(e2, h2, pos)
    assert torch.equal(moved[:k], base[:k]) or torch.allclose(moved[:k], base[:k], atol=1e-6)
    assert (moved[k:] - base[k:]).abs().amax(-1).min() > 1e-3, "a changed row did not change"
    # batched rows are the same rows
    batched = block(torch.stack([e, e2]), torch.stack([h, h2]), pos[:, None].expand(3, 2, n))
    assert torch.allclose(batched[0], base, atol=1e-6) and torch.allclose(batched[1], moved, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_with_mtp_loads_in_transformers_unchanged(family, random_mtp, tmp_path):
    """The main model of a checkpoint with the block is the one without it (same seed): transformers
    loads it with no missing weights and the same logits; the block round-trips through the file."""
    import transformers

    fam = verification.get(family)
    cls = getattr(transformers, importlib.import_module(f"edgevl.verification.families.{family}").HF_CLASSES["vlm"])
    ck, ref = random_mtp[family]
    plain = fam.make_tiny(tmp_path / "plain", next(iter(fam.tiny_variants)), seed=21 + FAMILIES.index(family))
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1
    assert "mtp_num_hidden_layers" not in json.loads((plain / "config.json").read_text())["text_config"]
    on_disk = load_file(str(ck / "model.safetensors"))
    mtp = {k: v for k, v in on_disk.items() if k.startswith("mtp.")}
    assert mtp and not any(k.startswith("mtp.") for k in load_file(str(plain / "model.safetensors")))
    model, info = cls.from_pretrained(ck, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    without = cls.from_pretrained(plain, dtype=torch.float32).eval()
    a, b = model.state_dict(), without.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the same logits up to the last bits: the weights are memory-mapped and the longer header moves
    # their alignment, which some CPU kernels' summation order follows
    ids = torch.tensor([list(range(3, 40))])
    got, want = model.eval()(input_ids=ids).logits, without(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-5), (got - want).abs().max()
    written = ref.mtp().state_dict_for_checkpoint()
    assert written.keys() == mtp.keys() and all(torch.equal(written[k], mtp[k]) for k in mtp)
    # zero-centred norm weights near zero (gains near one), none exactly zero: a wrong load shows
    norms = [v for k, v in mtp.items() if "norm" in k]
    assert norms and all(0 < v.abs().max() < 0.6 for v in norms)
    assert mtp["mtp.fc.weight"].shape == (model.config.text_config.hidden_size,
                                          2 * model.config.text_config.hidden_size)


@pytest.mark.parametrize("family", FAMILIES)
def test_load_refuses_missing_and_unused_tensors_in_one_line(family, random_mtp, tmp_path):
    ck, ref = random_mtp[family]
    cfg = ref._lm().config
    tensors = load_file(str(ck / "model.safetensors"))
    gone = "mtp.layers.0.mlp.experts.3.up_proj.weight" if family == "qwen3_5_moe" else "mtp.layers.0.mlp.up_proj.weight"
    k_norm = "mtp.layers.0.self_attn.k_norm.weight"
    cases = {   # what the one line says: the tensor it is about
        f"lacks {gone}": {k: v for k, v in tensors.items() if k != gone},
        f"lacks {k_norm}": {k: v for k, v in tensors.items() if k != k_norm},
        "unused MTP tensor mtp.layers.1.": {**tensors, "mtp.layers.1.input_layernorm.weight": torch.zeros(8)},
        "has no MTP tensors": {k: v for k, v in tensors.items() if not k.startswith("mtp.")},
        "mtp.fc.weight has shape": {**tensors, "mtp.fc.weight": torch.zeros(cfg.hidden_size, cfg.hidden_size)},
    }
    for i, (expect, t) in enumerate(cases.items()):
        folder = tmp_path / str(i)
        folder.mkdir()
        save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(EdgevlError) as err:
            M.load_mtp(folder, cfg)
        msg = str(err.value)
        assert "\n" not in msg and expect in msg, msg
    assert M.load_mtp(ck, cfg) is not None


def _chat_prompts(ck):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ck)
    out = []
    for think in (False, True):
        for text in ("Describe it.", "What is this?", CORPUS[0], CORPUS[1], CORPUS[3]):
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, enable_thinking=think)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@pytest.fixture(scope="module")
def trained_mtp(tmp_path_factory):
    """{family: (reference, [(prompt, greedy continuation)])}: a briefly trained main model and MTP block."""
    out = {}
    for family, fam, ck in _tiny_checkpoints(tmp_path_factory, "mtp-trained", 31, 2, train_steps=50,
                                             mtp_train_steps=MTP_TRAIN_STEPS):
        ref = fam.reference(ck)
        out[family] = (ref, [(p, ref.greedy(p, N_NEW)) for p in _chat_prompts(ck)])
    return out


def _agreement(ref, runs):
    return float(np.mean([ref.draft_agreement(p, g) for p, g in runs]))


@pytest.mark.parametrize("family", FAMILIES)
def test_brief_training_makes_drafts_agree(family, trained_mtp):
    """Trained, the block's argmax at row i is the main model's greedy token i+2 on most rows of chat
    continuations (not all: tests of the runtime need rejected drafts too); an untrained block of the
    same shape almost never agrees."""
    ref, runs = trained_mtp[family]
    trained = _agreement(ref, runs)
    counts = [ref.speculative_counts(p, g, draft_tokens=k) for k in (1, 2) for p, g in runs]
    drafted, accepted = sum(c["drafted"] for c in counts), sum(c["accepted"] for c in counts)
    loaded = ref.mtp()
    try:
        cfg = ref._lm().config
        ref.mtp_block = M.init_random(M.Qwen3_5Mtp(cfg, M.is_moe(cfg)), seed=7).eval()
        untrained = _agreement(ref, runs)
    finally:
        ref.mtp_block = loaded
    print(f"{family}: draft agreement {untrained:.3f} untrained, {trained:.3f} after {MTP_TRAIN_STEPS} steps; "
          f"accepted {accepted} of {drafted} drafts (1 and 2 per step)")
    assert trained > 0.5 and trained > untrained + 0.4, (trained, untrained)
    assert 0 < accepted < drafted


def test_counts_follow_the_acceptance_rule():
    """Hand-computed: prompt of 3, 7 generated tokens (T[3] from the prefill)."""
    T = [10, 11, 12, 20, 21, 22, 23, 24, 25, 26]
    calls = []

    def table(tab):
        def draft(p, m):
            calls.append((p, m))
            return tab[p][:m]
        return draft

    # one draft a step: p=3 drafts T[4] (right: +bonus, p=5); p=5 drafts T[6] (wrong, p=6);
    # p=6 drafts T[7] (right, p=8); p=8 drafts T[9] (right, p=10: done)
    one = table({3: [21], 5: [99], 6: [24], 8: [26]})
    assert M.count_speculative(T, 3, one) == {"drafted": 4, "accepted": 3}
    assert calls == [(3, 1), (5, 1), (6, 1), (8, 1)]
    # three a step: p=3 targets T[4..6], 2 right (p=6); p=6 targets T[7..9], only the first right
    # (a later match after a miss is not accepted; p=8); p=8 has one target left (right; p=10)
    calls.clear()
    three = table({3: [21, 22, 99], 6: [24, 0, 26], 8: [26, 5, 5]})
    assert M.count_speculative(T, 3, three, draft_tokens=3) == {"drafted": 7, "accepted": 4}
    assert calls == [(3, 3), (6, 3), (8, 1)]
    # nothing to draft: no generated token after the prefill's, or none at all
    assert M.count_speculative(T[:4], 3, one) == {"drafted": 0, "accepted": 0}
    assert M.count_speculative(T[:3], 3, one) == {"drafted": 0, "accepted": 0}
    # every draft wrong: one token a step
    assert M.count_speculative(T, 3, lambda p, m: [-1] * m) == {"drafted": 6, "accepted": 0}


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_counts_and_recursive_drafts_follow_mtp_states(family, trained_mtp):
    """speculative_counts' drafts are the argmax of mtp_states' rows: row p-1 for the first draft and,
    recursively, the rows mtp_states(tokens[:p+1], drafts=1) appends for the second."""
    ref, runs = trained_mtp[family]
    prompt, gen = runs[0]
    T = prompt + gen
    _, logits = ref.mtp_states(T)
    assert logits.shape == (len(T) - 1, ref.model.config.text_config.vocab_size)
    first = logits.argmax(-1)
    want = M.count_speculative(T, len(prompt), lambda p, m: [first[p - 1]])
    assert ref.speculative_counts(prompt, gen) == want

    def two(p, m):
        return mtp_rows(p).argmax(-1)[p - 1:p - 1 + m]

    def mtp_rows(p):
        hidden, lg = ref.mtp_states(T[:p + 1], drafts=1)
        assert hidden.shape[0] == lg.shape[0] == p + 1
        return lg

    assert ref.speculative_counts(prompt, gen, draft_tokens=2) == M.count_speculative(T, len(prompt), two, 2)
    # appended rows leave the others as they were
    h0, l0 = ref.mtp_states(T[:20])
    h2, l2 = ref.mtp_states(T[:20], drafts=2)
    assert h2.shape[0] == 21 and np.allclose(h2[:19], h0, atol=1e-6) and np.allclose(l2[:19], l0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_recursive_rows_take_the_argmax_embedding_and_the_previous_output(family, random_mtp):
    """mtp_states(ids, drafts=2): rows n-1 and n are what the block gives when its inputs are extended
    by hand with (the embedding of the row before's argmax, the row before's output) at the next
    positions (text: one more on every axis)."""
    _, ref = random_mtp[family]
    ids = list(range(5, 30))
    n = len(ids)
    hidden, logits = ref.mtp_states(ids, drafts=2)
    assert hidden.shape[0] == logits.shape[0] == n + 1
    lm = ref.model.model.language_model
    t = torch.tensor(ids)
    ref.model.model.rope_deltas = None
    e, h = lm.embed_tokens(t), lm(input_ids=t[None]).last_hidden_state[0]
    block = ref.mtp()
    out = torch.from_numpy(hidden)
    for j in range(2):
        rows = n - 1 + j
        e_ext = torch.cat([e[1:], lm.embed_tokens(torch.tensor(logits[n - 2:rows].argmax(-1)))])
        h_ext = torch.cat([h[:-1], out[n - 2:rows]])
        pos = torch.arange(rows + 1)[None].expand(3, -1)
        want = block(e_ext, h_ext, pos)
        assert torch.allclose(want[-1], out[rows], atol=1e-5), f"recursive row {j}"
        assert torch.allclose(ref.model.lm_head(want[-1]), torch.from_numpy(logits[rows]), atol=1e-4)


def test_image_rows_use_merged_embeddings_and_mrope_positions(random_mtp):
    """With an image, the rows take the main model's merged embeddings (transformers' own first
    hidden state) and its M-RoPE positions (get_rope_index), not the raw image-pad embeddings."""
    ck, ref = random_mtp["qwen3_5"]
    proc = hf_processor(ck)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    ids, enc = hf_inputs(proc, msgs, [smooth_image(64, 96, 4)])
    images = [(enc["pixel_values"], enc["image_grid_thw"])]
    hidden, logits = ref.mtp_states(ids, images)
    model = ref.model
    model.model.rope_deltas = None
    r = model(**{k: v for k, v in enc.items() if k != "attention_mask"}, output_hidden_states=True)
    embeds = r.hidden_states[0][0]
    pos, _ = model.model.get_rope_index(enc["input_ids"], enc["mm_token_type_ids"],
                                        image_grid_thw=enc["image_grid_thw"])
    assert not torch.equal(pos[0], pos[1])   # the image's rows have their own H and W positions
    normed = model.model.language_model.norm(_last_layer_output(model, enc))[0]
    want = ref.mtp()(embeds[1:], normed[:-1], pos[:, 0, :-1])
    assert np.allclose(hidden, want.numpy(), atol=1e-5)
    assert np.allclose(logits, model.lm_head(want).numpy(), atol=1e-4)
    raw = ref.mtp()(model.model.language_model.embed_tokens(enc["input_ids"][0])[1:], normed[:-1], pos[:, 0, :-1])
    image_rows = (enc["input_ids"][0][1:] == model.config.image_token_id).nonzero()[:, 0]
    assert len(image_rows) > 0 and not np.allclose(hidden[image_rows], raw[image_rows].numpy(), atol=1e-3)


def _last_layer_output(model, enc):
    outs = []
    hook = model.model.language_model.layers[-1].register_forward_hook(lambda _m, _i, o: outs.append(o))
    try:
        model.model.rope_deltas = None
        model(**{k: v for k, v in enc.items() if k != "attention_mask"})
    finally:
        hook.remove()
    return outs[0][0] if isinstance(outs[0], tuple) else outs[0]
