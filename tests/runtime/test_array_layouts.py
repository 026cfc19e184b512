"""Arrays handed to ncnn arrive intact whatever their layout: non-contiguous, transposed, sliced,
fp64, fp16, broadcast or misaligned views, through every input path (``to_mat``, ``Net.execute``,
``SectionedNet``), with other arrays allocated in between (a freed temporary would be reused)."""

import numpy as np
import pytest

from edgevl import ncnn_graph as G
from edgevl.runtime import Net, SectionedNet, from_mat, to_mat


def _variants():
    rng = np.random.default_rng(7)
    base = rng.standard_normal((48, 96)).astype(np.float32)
    cube = rng.standard_normal((3, 40, 24)).astype(np.float32)
    raw = np.zeros(48 * 96 * 4 + 1, np.uint8)
    misaligned = np.frombuffer(raw.data, np.float32, count=48 * 96, offset=1).reshape(48, 96)
    raw[1:] = base.view(np.uint8).ravel()
    return {
        "contiguous": base,
        "transposed": base.T,
        "row_slice": base[5:41],
        "column_slice": base[:, 7:71],
        "strided": base[::3, ::2],
        "reversed": base[::-1, ::-1],
        "fortran": np.asfortranarray(base),
        "fp64": rng.standard_normal((33, 65)),
        "fp64_transposed": rng.standard_normal((65, 33)).T,
        "fp16": rng.standard_normal((40, 64)).astype(np.float16),
        "fp16_sliced": rng.standard_normal((40, 64)).astype(np.float16)[:, 1::3],
        "bf16_widened": G.bf16_bits_to_f32(G.f32_to_bf16_bits(base))[:, :50],
        "broadcast": np.broadcast_to(base[0], (30, 96)),
        "int32": rng.integers(-1000, 1000, (20, 30)).astype(np.int32),
        "misaligned": misaligned,
        "3d_permuted": cube.transpose(2, 0, 1),
        "3d_sliced": cube[:, ::2, 3:],
        "1d_strided": base.ravel()[::5],
        "recurrent_tail": rng.standard_normal((64, 9)).astype(np.float32)[:, -3:],  # conv[:, -3:]
    }


VARIANTS = _variants()


def expected(a):
    return np.ascontiguousarray(a, dtype=np.float32)


def churn(n=40):
    """Allocate and fill arrays of the sizes just freed, so a dangling buffer gets overwritten."""
    junk = [np.full(s, 1e30, np.float32) for s in (48 * 96, 33 * 65, 40 * 64, 64 * 9, 3 * 40 * 24) * (n // 5)]
    return sum(float(j[0]) for j in junk)


def test_to_mat_copies_every_layout_exactly():
    mats = {}
    for name, a in VARIANTS.items():
        mats[name] = to_mat(a)
        churn()  # other arrays allocated between the conversions
    for name, a in VARIANTS.items():
        got = from_mat(mats[name]).reshape(expected(a).shape)
        assert got.tobytes() == expected(a).tobytes(), name


@pytest.fixture(scope="module")
def identity_graph(tmp_path_factory):
    """Two inputs, two sections, each output = input * 1 (exact in fp32)."""
    root = tmp_path_factory.mktemp("identity")
    g = G.Graph(root / "id.bin")
    x1, x2 = g.input("x1"), g.input("x2")
    g.section("first")
    g.layer("BinaryOp", [x1], {0: 2, 1: 1, 2: 1.0}, outputs=["y1"], name="times_one_a")
    g.section("second")
    g.layer("BinaryOp", [x2], {0: 2, 1: 1, 2: 1.0}, outputs=["y2"], name="times_one_b")
    sections = g.save(root / "id.param", keep=["y1", "y2"])
    return root, sections


def _pairs():
    names = list(VARIANTS)
    return [(a, b) for a, b in zip(names, names[1:] + names[:1])]


def _check_outputs(res, a, b, label):
    for key, src in (("y1", a), ("y2", b)):
        want = expected(src)
        got = from_mat(res[key]).reshape(want.shape)
        assert got.tobytes() == want.tobytes(), (label, key)


@pytest.mark.parametrize("pair", _pairs(), ids=lambda p: f"{p[0]}+{p[1]}")
def test_net_execute_feeds_every_layout_exactly(identity_graph, pair):
    root, _ = identity_graph
    net = Net(str(root / "id.param"), str(root / "id.bin"), threads=1)
    a, b = (VARIANTS[n] for n in pair)
    res = net.execute({"x1": a, "x2": b}, [("y1", 0), ("y2", 0)])
    churn()
    _check_outputs(res, a, b, pair)


def test_sectioned_net_feeds_every_layout_exactly(identity_graph):
    root, sections = identity_graph
    assert len(sections) == 2
    net = SectionedNet(str(root), str(root / "id.bin"), sections, threads=1)
    for pair in _pairs():
        a, b = (VARIANTS[n] for n in pair)
        res = net.execute({"x1": a, "x2": b}, [("y1", 0), ("y2", 0)])
        churn(10)
        _check_outputs(res, a, b, pair)


def test_net_run_returns_owned_arrays(identity_graph):
    """Outputs survive the net and later allocations (copied out of ncnn)."""
    root, _ = identity_graph
    net = Net(str(root / "id.param"), str(root / "id.bin"), threads=1)
    outs = [net.run({"x1": VARIANTS[n], "x2": VARIANTS["fp64"]}, ["y1"])[0] for n in VARIANTS]
    del net
    churn()
    for n, got in zip(VARIANTS, outs):
        assert got.reshape(expected(VARIANTS[n]).shape).tobytes() == expected(VARIANTS[n]).tobytes(), n
