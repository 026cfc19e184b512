"""Gemm row tiles (runtime.Net.fit_rows): before a forward the Gemms get the row tile that splits
their rows evenly among the threads; reloading their params that way keeps every other param, so
a net that switches tiles computes the same bits as one that never does."""

import numpy as np
import pytest

from edgevl import ncnn_graph as G
from edgevl import runtime

K, N = 48, 40


def toy(tmp_path, dtype: str):
    """y = Gemm2(Gemm1(x) with a bias) in ``dtype``, the second an int8 Gemm with row scales
    (its quant param must survive a reload), the first writing fp32 output."""
    rng = np.random.default_rng(3)
    w1, b1 = rng.standard_normal((N, K)).astype(np.float32) * 0.2, rng.standard_normal(N).astype(np.float32)
    w2, b2 = rng.standard_normal((K, N)).astype(np.float32) * 0.2, rng.standard_normal(K).astype(np.float32)
    g = G.Graph(tmp_path / f"toy_{dtype}.bin")
    x = g.input("x")
    h = G.gemm(g, x, w1, dtype, bias=b1, name="one", fp32_output=True)
    G.gemm(g, h, w2, dtype, bias=b2, quant=G.INT8, name="two", out="y")
    g.save(tmp_path / f"toy_{dtype}.param")
    return str(tmp_path / f"toy_{dtype}.param"), str(tmp_path / f"toy_{dtype}.bin"), (w1, b1, w2, b2)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_nets_that_switch_row_tiles_compute_the_same_bits(tmp_path, dtype):
    param, binfile, (w1, b1, w2, b2) = toy(tmp_path, dtype)
    fitted = runtime.Net(param, binfile, 2, dtype)
    plain = runtime.Net(param, binfile, 2, dtype)
    assert [len(v) for v in fitted.gemms.values()] == [2, 2]     # both Gemms found, per tile
    plain.gemms = {}                                              # never reloads
    rng = np.random.default_rng(0)
    seen = set()
    for rows in (40, 64, 1, 20, 300, 40, 96, 3):
        x = rng.standard_normal((rows, K)).astype(np.float32)
        fitted.fit_rows(rows)
        seen.add(fitted.row_tile)
        got = fitted.run({"x": x}, ["y"])[0]
        want = plain.run({"x": x}, ["y"])[0]
        assert np.array_equal(got, want), (rows, fitted.row_tile)
        ref = (x @ w1.T + b1) @ w2.T + b2                           # the biases and int8 scales still apply
        assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max(), rows
    assert seen == {0, runtime.SINGLE_TILE}                       # both tilings ran


def test_row_tile_rule():
    """ncnn's own row tile for M rows on T threads is M/T rounded up to the SIMD granule: one
    tile of all rows wherever that leaves one thread most of the work."""
    tile = runtime.gemm_row_tile
    single = runtime.SINGLE_TILE
    assert tile(40, 2, 16) == single          # ncnn: tiles of 32 and 8
    assert tile(20, 2, 16) == single          # 16 and 4
    assert tile(80, 2, 16) == single          # 48 and 32
    assert tile(64, 2, 16) == 0               # 32 and 32: even
    assert tile(96, 2, 16) == 0               # 48 and 48
    assert tile(300, 2, 16) == 0              # past one tile's rows: ncnn's
    assert tile(16, 2, 16) == 0               # one tile whichever way: ncnn's
    assert tile(40, 1, 16) == 0               # one thread: nothing to split
    assert tile(40, 4, 8) == 0                # 3 tiles for 4 threads: ncnn splits columns itself
    assert tile(40, 2, 8) == single           # 24 and 16 with 8-row granules
    assert tile(48, 2, 8) == 0                # 24 and 24
