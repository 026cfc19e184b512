"""The decoder's state kinds and host hooks on a toy graph: recurrent state carried across calls,
snapshots and rollback, host passes that replace a blob or see the rows' token ids, and the KV
truncation probe with its fallback."""

import numpy as np
import pytest

from edgevl import ncnn_graph as G
from edgevl import runtime
from edgevl.errors import EdgevlError

H = 6


def toy_decoder(tmp_path, passes=()):
    """mid = s_in + running (inclusive) row sums of embeds; s_out = s_in + the chunk's column sums
    (a recurrent running sum, so any chunking gives the same result); hidden = mid + causal
    self-attention over mid, with a KV cache."""
    g = G.Graph(tmp_path / "toy.bin")
    x, mask = g.input("embeds"), g.input("mask")
    g.input("rope_cos")
    g.input("rope_sin")
    s_in, ck, cv = g.input("s_in"), g.input("cache_k0"), g.input("cache_v0")
    total = g.layer("Reduction", [x], {0: 0, 1: 0, 3: [0], 4: 1, 5: 1}, name="colsum")  # sum over rows
    G.binary(g, s_in, total, "add", out="s_out")
    running = g.layer("CumulativeSum", [x], {0: 0}, name="cumsum")                    # over rows
    mid = G.binary(g, running, s_in, "add", out="mid")
    q = G.reshape(g, mid, H, -1, 1, name="q")
    o, _, _ = G.sdpa(g, q, q, q, mask, cache=[ck, cv], cache_out=["out_cache_k0", "out_cache_v0"], name="att")
    o = G.reshape(g, o, H, -1, name="o")
    G.binary(g, mid, o, "add", out="hidden")
    g.save(tmp_path / "toy.param")
    info = {"inputs": {"embeds": "embeds", "mask": "mask", "cos": "rope_cos", "sin": "rope_sin"},
            "outputs": {"hidden": "hidden"}, "passes": list(passes),
            "state": [{"kind": "recurrent", "inputs": ["s_in"], "outputs": ["s_out"], "shapes": [[1, H]]},
                      {"kind": "kv", "inputs": ["cache_k0", "cache_v0"], "outputs": ["out_cache_k0", "out_cache_v0"],
                       "floats_per_token": 2 * H}]}
    net = runtime.Net(str(tmp_path / "toy.param"), str(tmp_path / "toy.bin"), 1)
    rope = lambda pos: (np.zeros((pos.shape[1], 1), np.float32),) * 2  # noqa: E731 - unused by the toy
    return net, info, rope


def run_all(dec, xs, cache):
    outs = []
    for x in xs:
        pos = np.arange(cache.length, cache.length + x.shape[0])[None]
        outs.append(dec.forward(x, cache, pos)[0])
    return np.concatenate(outs)


def test_recurrent_state_snapshots_and_rollback(tmp_path):
    net, info, rope = toy_decoder(tmp_path)
    dec = runtime.Decoder(net, info, rope)
    x = np.random.default_rng(0).standard_normal((9, H)).astype(np.float32)
    fresh = run_all(dec, [x[:4], x[4:7], x[7:8], x[8:9]], dec.new_cache())
    # the same tokens in other chunkings give the same result (state carried across calls)
    assert np.allclose(fresh, run_all(dec, [x[:9]], dec.new_cache()), atol=1e-5)
    cache = dec.new_cache()
    assert not cache.truncatable
    run_all(dec, [x[:4]], cache)
    cache.snapshot()                               # a turn boundary at 4 tokens
    other = np.ones((3, H), np.float32)
    run_all(dec, [other], cache)                   # a different continuation
    assert cache.rollback_point(6) == 4 and cache.rollback_point(3) == 0
    cache.rollback(4)
    assert cache.length == 4 and cache.next_position == 4
    again = run_all(dec, [x[4:9]], cache)
    assert np.allclose(again, fresh[4:], atol=1e-5)
    with pytest.raises(ValueError):
        cache.rollback(2)                          # no snapshot there
    cache.rollback(0)
    assert cache.length == 0 and np.allclose(run_all(dec, [x[:9]], cache), fresh, atol=1e-5)
    assert runtime.state_bytes(info["state"], 10) == 4 * H + 10 * 2 * H * 4


def _attention(m):
    """One-head causal self-attention with q = k = v = m, as the toy's SDPA computes it."""
    sc = m @ m.T / np.sqrt(m.shape[1]) + np.triu(np.full((len(m), len(m)), -np.inf), 1)
    p = np.exp(sc - sc.max(1, keepdims=True))
    return (p / p.sum(1, keepdims=True)) @ m


def test_host_hook_pass_replaces_a_blob(tmp_path):
    seen = []

    def double(blobs, seq):
        seen.append(seq)
        return {"mid": 2 * blobs["mid"]}

    net, info, rope = toy_decoder(tmp_path, passes=[{"extract": ["mid"], "hook": "double", "when": "prefill"}])
    dec = runtime.Decoder(net, info, rope, {"double": double})
    x = np.random.default_rng(1).standard_normal((3, H)).astype(np.float32)
    mid = np.cumsum(x, 0)
    h = dec.forward(x, dec.new_cache(), np.arange(3)[None])[0]
    assert seen == [3]
    assert np.allclose(h, 2 * mid + _attention(2 * mid), atol=1e-4)
    plain = runtime.Decoder(net, dict(info, passes=[]), rope)
    assert np.allclose(plain.forward(x, plain.new_cache(), np.arange(3)[None])[0], mid + _attention(mid), atol=1e-4)
    cache = dec.new_cache()
    dec.forward(x[:1], cache, np.array([[0]]))     # one token: the prefill-only hook does not run
    assert seen == [3]
    with pytest.raises(EdgevlError, match="host step 'missing'"):
        runtime.Decoder(net, dict(info, passes=[{"extract": ["mid"], "hook": "missing"}]), rope, {})


def test_host_hook_gets_the_rows_token_ids_when_it_asks(tmp_path):
    seen = []

    def hook(blobs, seq, ids=None):
        seen.append(None if ids is None else ids.tolist())
        return {}

    passes = [{"extract": ["mid"], "hook": "ids", "ids": True}, {"extract": ["mid"], "hook": "plain"}]
    net, info, rope = toy_decoder(tmp_path, passes=passes)
    dec = runtime.Decoder(net, info, rope, {"ids": hook, "plain": lambda blobs, seq, **kw: seen.append(kw) or {}})
    x = np.random.default_rng(2).standard_normal((3, H)).astype(np.float32)
    cache = dec.new_cache()
    dec.forward(x, cache, np.arange(3)[None], ids=[7, 8, 9])
    dec.forward(x[:1], cache, np.array([[3]]))          # a decode step passes none
    assert seen == [[7, 8, 9], {}, None, {}]
    with pytest.raises(ValueError, match="2 token ids for 3 rows"):
        dec.forward(x, dec.new_cache(), np.arange(3)[None], ids=[1, 2])


def test_kv_truncation_probe_and_fallback(monkeypatch):
    assert runtime.kv_truncation_works()
    monkeypatch.setattr(runtime, "_KV_TRUNCATION_OK", False)
    cache = runtime.Cache([{"kind": "kv", "inputs": ["a", "b"], "outputs": ["c", "d"], "floats_per_token": 1}])
    cache.length = 5
    assert cache.rollback_point(3) == 0            # an ncnn where truncation broke: recompute
