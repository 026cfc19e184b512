"""The delta-rule core (the fp32 chunk net, the numpy decode step) against transformers' own torch kernels."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule

from edgevl.blocks import gated_delta as gd
from edgevl.runtime import from_mat


@pytest.fixture(scope="module", params=[(2, 4, 16, 24), (2, 2, 32, 32)], ids=["Hv=2Hk", "Hv=Hk"])
def core(request, tmp_path_factory):
    hk, hv, dk, dv = request.param
    d = gd.DeltaDims(hk, hv, dk, dv)
    root = tmp_path_factory.mktemp("core")
    info = gd.build_core_net(root / "chunk.param", root / "chunk.bin", d)
    return gd.DeltaRuleCore.open(root, info, 1), d


def _inputs(d, seq, seed, similar=False):
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((seq, d.conv_channels)).astype(np.float32)
    if similar:  # near-identical keys inside a chunk: the case the product-form inverse blew up on
        k0 = d.keys
        qkv[:, k0:2 * k0] = qkv[:1, k0:2 * k0] + 0.01 * qkv[:, k0:2 * k0]
    ba = rng.standard_normal((seq, 2 * d.value_heads)).astype(np.float32) * 2
    a_log = np.log(rng.uniform(0.05, 4, d.value_heads)).astype(np.float32)
    dt = rng.standard_normal(d.value_heads).astype(np.float32)
    return qkv, ba, a_log, dt


def _reference(d, qkv, ba, a_log, dt, state, recurrent):
    x = torch.from_numpy(qkv)[None]
    q, k, v = torch.split(x, [d.keys, d.keys, d.values], -1)
    q = q.reshape(1, -1, d.key_heads, d.key_dim)
    k = k.reshape(1, -1, d.key_heads, d.key_dim)
    v = v.reshape(1, -1, d.value_heads, d.value_dim)
    b, a = torch.from_numpy(ba)[None].split(d.value_heads, -1)
    beta = b.sigmoid()
    g = -torch.from_numpy(a_log).float().exp() * F.softplus(a.float() + torch.from_numpy(dt))
    fn = torch_recurrent_gated_delta_rule if recurrent else torch_chunk_gated_delta_rule
    o, s = fn(q, k, v, g=g, beta=beta, initial_state=None if state is None else torch.from_numpy(state)[None],
              output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0].reshape(qkv.shape[0], -1).numpy(), s[0].numpy()


@pytest.mark.parametrize("seq", [1, 5, 64, 150])
def test_core_matches_transformers(core, seq):
    run, d = core
    qkv, ba, a_log, dt = _inputs(d, seq, seed=seq)
    gates = run.gate_params(-np.exp(a_log), dt)
    state0 = np.random.default_rng(1).standard_normal(d.state_shape).astype(np.float32) * 0.3
    for start in (None, state0):
        o, s = run(qkv, ba, gates, run.new_state(start))
        ref_o, ref_s = _reference(d, qkv, ba, a_log, dt, start, recurrent=(seq == 1 and start is not None))
        assert np.abs(from_mat(o) - ref_o).max() < 1e-5 * max(1, np.abs(ref_o).max())
        assert np.abs(run.matrix(s) - ref_s).max() < 1e-5 * max(1, np.abs(ref_s).max())


def test_last_chunk_in_a_smaller_net_gives_the_same_bits(core):
    """A prompt's last rows run in the smallest tail net that holds them (1-8 rows: 8, 9-16: 16,
    more: the package's net), bit for bit what the zero-padded full chunk gives."""
    run, d = core
    padded = gd.DeltaRuleCore(run.chunk_net, run.chunk_info)
    padded.tails = {}                                     # every chunk in the package's net
    state0 = np.random.default_rng(2).standard_normal(d.state_shape).astype(np.float32) * 0.3
    for seq in (3, 8, 13, 16, 40, 63):
        qkv, ba, a_log, dt = _inputs(d, seq, seed=100 + seq)
        gates = run.gate_params(-np.exp(a_log), dt)
        o, s = run(qkv, ba, gates, run.new_state(state0.copy()))
        po, ps = padded(qkv, ba, gates, padded.new_state(state0.copy()))
        assert np.array_equal(from_mat(o), from_mat(po)) and np.array_equal(run.matrix(s), padded.matrix(ps)), seq
    assert sorted(run.tails) == list(gd.TAIL_ROWS)        # the tail nets ran
    assert [run._net_for(r)[1]["rows"] for r in (1, 8, 9, 16, 17, gd.CHUNK)] == [8, 8, 16, 16, gd.CHUNK, gd.CHUNK]


def test_chunk_inverse_is_stable_on_similar_keys(core):
    run, d = core
    qkv, ba, a_log, dt = _inputs(d, 128, seed=7, similar=True)
    o, s = run(qkv, ba, run.gate_params(-np.exp(a_log), dt), run.new_state())
    ref_o, ref_s = _reference(d, qkv, ba, a_log, dt, None, recurrent=True)
    assert np.abs(from_mat(o) - ref_o).max() < 1e-4 and np.abs(run.matrix(s) - ref_s).max() < 1e-4


def test_steps_equal_one_chunk(core):
    """Token-by-token decoding (updates deferred in a window, folded every WINDOW tokens) and the
    chunked prefill give the same outputs and reach the same state, also mid-window."""
    run, d = core
    qkv, ba, a_log, dt = _inputs(d, 40, seed=3)
    gates = run.gate_params(-np.exp(a_log), dt)
    start = np.random.default_rng(2).standard_normal(d.state_shape).astype(np.float32) * 0.3
    o_chunk, s_chunk = run(qkv, ba, gates, run.new_state(start))
    s = run.new_state(start)
    outs = []
    for t in range(40):
        o, s = run(qkv[t:t + 1], ba[t:t + 1], gates, s)
        outs.append(from_mat(o).reshape(-1))
        if t + 1 in (5, gd.WINDOW, 40):   # mid-window, right after a fold, the end
            _, ref_s = _reference(d, qkv[:t + 1], ba[:t + 1], a_log, dt, start, recurrent=True)
            assert np.abs(run.matrix(s) - ref_s).max() < 1e-5 * max(1, np.abs(ref_s).max()), f"after {t + 1}"
    assert np.abs(np.stack(outs) - o_chunk).max() < 1e-5 * max(1, np.abs(o_chunk).max())
    assert np.abs(run.matrix(s) - run.matrix(s_chunk)).max() < 1e-5
    # a prefill after some decoded tokens folds the pending window first
    o2, s2 = run(qkv[:7], ba[:7], gates, s)
    _, ref_s = _reference(d, np.concatenate([qkv, qkv[:7]]), np.concatenate([ba, ba[:7]]), a_log, dt, start,
                          recurrent=True)
    assert np.abs(run.matrix(s2) - ref_s).max() < 1e-5 * max(1, np.abs(ref_s).max())


@pytest.mark.parametrize("rows", [2, 3, 4, 8])
def test_verify_rows_equal_steps(core, rows):
    """A speculative verify pass (several undoable rows in one call) gives each row what one
    decode step at a time gives, leaves the same window, and its last rows can be taken back."""
    run, d = core
    qkv, ba, a_log, dt = _inputs(d, 5 + rows, seed=rows)
    gates = run.gate_params(-np.exp(a_log), dt)
    start = np.random.default_rng(4).standard_normal(d.state_shape).astype(np.float32) * 0.3
    steps, many = run.new_state(start), run.new_state(start)
    for t in range(5):   # pending updates in the window before the pass
        _, steps = run(qkv[t:t + 1], ba[t:t + 1], gates, steps)
        _, many = run(qkv[t:t + 1], ba[t:t + 1], gates, many)
    want = [from_mat(run(qkv[t:t + 1], ba[t:t + 1], gates, steps)[0]).reshape(-1) for t in range(5, 5 + rows)]
    got, many = run(qkv[5:], ba[5:], gates, many, undoable=True)
    scale = max(1, np.abs(np.stack(want)).max())
    assert np.abs(np.asarray(got) - np.stack(want)).max() < 1e-5 * scale
    for a, b in zip(many, steps):
        assert np.abs(a - b).max() < 1e-5 * max(1, np.abs(b).max())
    _, ref_s = _reference(d, qkv[:6], ba[:6], a_log, dt, start, recurrent=True)
    run.drop_last(many, rows - 1)   # only the first row of the pass kept
    assert np.abs(run.matrix(many) - ref_s).max() < 1e-5 * max(1, np.abs(ref_s).max())
