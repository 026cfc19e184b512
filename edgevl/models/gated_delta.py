"""Delta-rule linear attention (Gated DeltaNet) on ncnn, for every recurrent architecture.

Hold it next to transformers' ``modeling_qwen3_5.py`` (``Qwen3_5GatedDeltaNet``,
``torch_recurrent_gated_delta_rule``, ``torch_chunk_gated_delta_rule``) and spec
qwen3_5_and_youtu_moe.md §1.3 and §3. The work is split three ways:

- **In the decoder graph** (the package's storage precision): the projections, the causal
  depthwise conv with its conv-state window (:func:`emit_causal_conv`) and, after the core, the
  gated RMSNorm (:func:`emit_gated_norm`).
- **In two core nets**, always fp32 and without weights (constant masks only), shared by every
  layer: the gates (beta and the log-decay), the l2norm of q and k, the key-head expansion and
  the delta rule itself — one token per run (the *step* net, decoding) or one chunk of ``CHUNK``
  tokens (the *chunk* net, prefill, with the block-doubling inverse). The recurrent state
  S [Hv, Dk, Dv] lives only there: in a bf16-storage net every BinaryOp rounds its output to bf16
  (measured: 0.4 % per update), which would compound over a conversation.
- **On the host**, :class:`DeltaRuleCore` runs a core net between two passes of the decoder
  graph: the decoder driver extracts a layer's conv output and gate logits, runs the core, and
  feeds the core's output into the same extractor (the decoder graph has a placeholder input
  blob there), so one extractor and one copy of the weights serve prefill and decode.

Kimi-style KDA (per-channel decay, sigmoid output gate) can reuse the conv, the l2norm, the gated
norm (``gate_act="sigmoid"``) and :func:`emit_delta_step` (a decay of shape (c=H, h=Dk, w=1)
broadcasts the same way); its chunked form is not practical in ncnn (spec §3.1), so it would
prefill with the step net or a per-channel variant of the chunk net.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import ncnn_graph as G
from .base import heads_first, heads_last

# Prefill runs the chunk net once per CHUNK tokens (the last chunk zero-padded). transformers uses
# 64; 32 measured 20 % faster on 128 tokens and 2-3x on a 24-token chat turn (0.8B layer, 1
# thread): the block-doubling inverse costs chunk^3 and short prompts pad less. Same math.
CHUNK = 32
WINDOW = 16                 # decoded tokens whose state updates are deferred (folded into S0 together)
L2NORM_EPS = 1e-6           # transformers' l2norm (FLA's), inside the kernel
MASKED = -1e30              # additive mask: exp() of it is exactly 0


@dataclass(frozen=True)
class DeltaDims:
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int = 4

    @property
    def keys(self) -> int:          # Kd
        return self.key_heads * self.key_dim

    @property
    def values(self) -> int:        # Vd
        return self.value_heads * self.value_dim

    @property
    def conv_channels(self) -> int:  # q, k and v go through the conv together
        return 2 * self.keys + self.values

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.value_heads, self.key_dim, self.value_dim)

    def host_state_shapes(self, window: int) -> list:
        """The host-held state of one layer (see :class:`DeltaRuleCore`): the matrix S0, the
        pending keys, deltas and cumulative log-decays of up to ``window`` decoded tokens, the
        log-decay since S0, and the number pending."""
        hv = self.value_heads
        return [list(self.state_shape), [hv, window, self.key_dim], [hv, window, self.value_dim],
                [hv, 1, window], [hv, 1, 1], [1]]

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        # transformers keeps K columns; the conv reads only the last K-1
        return (self.conv_channels, self.conv_kernel - 1)

    def to_dict(self) -> dict:
        return {"key_heads": self.key_heads, "value_heads": self.value_heads, "key_dim": self.key_dim,
                "value_dim": self.value_dim, "conv_kernel": self.conv_kernel}


# ---------------------------------------------------------------------------------------------
# decoder-graph emitters


def emit_causal_conv(g: G.Graph, x: str, weight: np.ndarray, state_in: str, state_out: str, name: str) -> str:
    """SiLU(causal depthwise conv) over time with a carried window (``causal_conv1d_update``).

    x (h=seq, w=channels); ``state_in`` (h=channels, w=K-1) holds the previous K-1 raw columns
    (zeros at the start), ``state_out`` gets the last K-1 raw columns after this input."""
    k = int(weight.shape[1])
    xt = G.permute(g, x, 1, name=f"{name}.to_time")                        # (h=channels, w=seq)
    full = G.concat(g, [state_in, xt], axis=1, name=f"{name}.window")      # (h=channels, w=K-1+seq)
    G.crop_last(g, full, k - 1, axis=-1, name=f"{name}.state", out=state_out)
    y = G.conv_dw1d(g, full, weight, name=f"{name}.conv")                   # (h=channels, w=seq)
    y = G.swish(g, y, name=f"{name}.silu")
    return G.permute(g, y, 1, name=f"{name}.to_rows")                      # (h=seq, w=channels)


def emit_gated_norm(g: G.Graph, o: str, gate: str, weight: np.ndarray, heads: int, eps: float, name: str,
                    gate_act: str = "silu") -> str:
    """Per-head RMSNorm(o) * w * act(gate) (``Qwen3_5RMSNormGated``; KDA uses a sigmoid gate).

    o and gate are (h=seq, w=heads*dv); the weight is a plain [dv] scale (not 1 + w)."""
    dv = int(weight.shape[0])
    rows = G.reshape(g, o, dv, -1, name=f"{name}.heads")                    # one row per (token, head)
    rows = G.rms_norm(g, rows, weight, eps, name=f"{name}.rms")
    z = G.reshape(g, gate, dv, -1, name=f"{name}.gate_heads")
    z = G.swish(g, z, name=f"{name}.gate_act") if gate_act == "silu" else G.sigmoid(g, z, name=f"{name}.gate_act")
    y = G.binary(g, rows, z, "mul", name=f"{name}.gate")
    return G.reshape(g, y, heads * dv, -1, name=f"{name}.flat")            # (h=seq, w=heads*dv)


# ---------------------------------------------------------------------------------------------
# the core nets (fp32, weightless apart from constant masks)


def _columns_to_heads(g: G.Graph, x: str, heads: int, rows: int, name: str) -> str:
    """(h=rows, w=heads) -> (c=heads, h=rows, w=1): one value per head and token."""
    x = G.permute(g, x, 1, name=f"{name}.t")                               # (h=heads, w=rows)
    return G.reshape(g, x, 1, rows, heads, name=f"{name}.heads")


def emit_gates(g: G.Graph, ba: str, neg_a: str, dt_bias: str, heads: int, rows: int, valid: str | None,
               name: str) -> tuple[str, str]:
    """beta = sigmoid(b), log-decay = -exp(A_log) * softplus(a + dt_bias), in fp32 (as transformers).

    ``ba`` (h=rows, w=2*heads) holds the b then a projections; ``neg_a`` = -exp(A_log) and
    ``dt_bias`` are (h=1, w=heads). ``valid`` (h=rows, w=1) zeroes padded rows (beta = 0 and no
    decay: a padded token leaves the state untouched). Returns (beta, g), each (c=heads, h=rows, w=1)."""
    b, a = G.slice_(g, ba, [heads, heads], axis=1, name=f"{name}.split")
    beta = G.sigmoid(g, b, name=f"{name}.beta")
    a = G.binary(g, a, dt_bias, "add", name=f"{name}.dt")
    a = G.bnll(g, a, name=f"{name}.softplus")
    decay = G.binary(g, a, neg_a, "mul", name=f"{name}.log_decay")
    if valid is not None:
        beta = G.binary(g, beta, valid, "mul", name=f"{name}.beta_valid")
        decay = G.binary(g, decay, valid, "mul", name=f"{name}.decay_valid")
    return (_columns_to_heads(g, beta, heads, rows, f"{name}.beta"),
            _columns_to_heads(g, decay, heads, rows, f"{name}.g"))


def emit_l2norm_heads(g: G.Graph, x: str, d: DeltaDims, rows: int, scale: float, name: str) -> str:
    """(h=rows, w=Hk*Dk) -> l2norm(x) * scale per head, expanded to the value heads (c=Hv, h=rows, w=Dk).

    l2norm is one RMSNorm: x*rsqrt(sum x^2 + eps) = RMSNorm(eps/D) with gamma 1/sqrt(D) (spec §3.1);
    ``scale`` folds q's 1/sqrt(Dk) into gamma. Value head h reads key head h // (Hv/Hk)
    (``repeat_interleave``): Tile repeats whole blocks, so each head is tiled as one block."""
    dk, hk, hv = d.key_dim, d.key_heads, d.value_heads
    x = heads_first(g, x, dk, hk, name)                                    # (c=Hk, h=rows, w=Dk)
    gamma = np.full(dk, scale / np.sqrt(dk), np.float32)
    x = G.rms_norm(g, x, gamma, L2NORM_EPS / dk, name=f"{name}.l2norm")
    if hv != hk:
        x = G.reshape(g, x, rows * dk, 1, hk, name=f"{name}.block")
        x = G.tile(g, x, [1, hv // hk, 1], name=f"{name}.repeat")
        x = G.reshape(g, x, dk, rows, hv, name=f"{name}.expanded")
    return x


def emit_core_inputs(g: G.Graph, d: DeltaDims, rows: int, valid: str | None = None):
    """The shared front of both core nets: q, k, v (c=Hv, h=rows, w=D), beta and log-decay."""
    qkv, ba = g.input("qkv"), g.input("ba")
    neg_a, dt_bias = g.input("neg_a"), g.input("dt_bias")
    q, k, v = G.slice_(g, qkv, [d.keys, d.keys, d.values], axis=1, name="split")
    q = emit_l2norm_heads(g, q, d, rows, d.key_dim ** -0.5, "q")
    k = emit_l2norm_heads(g, k, d, rows, 1.0, "k")
    v = heads_first(g, v, d.value_dim, d.value_heads, "v")
    beta, decay = emit_gates(g, ba, neg_a, dt_bias, d.value_heads, rows, valid, "gates")
    return q, k, v, beta, decay


def emit_delta_step(g: G.Graph, q: str, k: str, v: str, beta: str, decay_log: str, state: str,
                    d: DeltaDims) -> tuple[str, str]:
    """One token (``torch_recurrent_gated_delta_rule``), all heads at once:
    S' = e^g S + k delta^T with delta = beta (v - k^T e^g S), and o = q^T S'.

    q^T S and k^T S come from one MatMul over S, and o = e^g q^T S + (q.k) delta needs no pass
    over S'. q, k (c=Hv, h=1, w=Dk), v (c=Hv, h=1, w=Dv), beta and g (c=Hv, h=1, w=1),
    S (c=Hv, h=Dk, w=Dv). (The decode net, :func:`emit_deferred_step`, defers the update.)"""
    decay = G.unary(g, decay_log, "exp", name="decay")
    qk = G.concat(g, [q, k], axis=1, name="qk")                            # (c=Hv, h=2, w=Dk)
    q_s, k_s = G.slice_(g, G.matmul(g, qk, state, name="read"), [1, 1], axis=1, name="read_split")
    u = G.binary(g, k_s, decay, "mul", name="read_decay")
    delta = G.binary(g, G.binary(g, v, u, "sub", name="delta"), beta, "mul", name="delta_beta")
    kt = G.reshape(g, k, 1, d.key_dim, d.value_heads, name="k_col")        # (c=Hv, h=Dk, w=1)
    qdotk = G.matmul(g, q, kt, name="q_dot_k")                             # (c=Hv, h=1, w=1)
    o = G.binary(g, G.binary(g, q_s, decay, "mul", name="out_decay"),
                 G.binary(g, delta, qdotk, "mul", name="out_new"), "add", name="out")
    s = G.binary(g, state, decay, "mul", name="state_decay")
    s = G.binary(g, s, G.matmul(g, kt, delta, name="write"), "add", name="state_update", out="state_out")
    return o, s


def emit_deferred_step(g: G.Graph, q: str, k: str, v: str, beta: str, decay_log: str, d: DeltaDims):
    """One decode token against S0 plus a window of W pending updates, without writing S.

    The state after the pending tokens j (cumulative log-decays c_j since S0) and this one is
    S_t = e^(c_t) S0 + sum_j e^(c_t - c_j) k_j delta_j^T + k_t delta_t^T; the step needs only
    q^T and k^T of its first two terms: one read of S0 (1 MiB per layer at 0.8B) and the small
    window, instead of rewriting S every token (decode is memory-bound; the rewrite moved ~7x the
    state's bytes). The host appends (k_t, delta_t, c_t) to the window and folds it into S0 every
    W tokens. Inputs ``state`` S0 (c=Hv, h=Dk, w=Dv), ``window_k`` (c=Hv, h=W, w=Dk),
    ``window_delta`` (c=Hv, h=W, w=Dv), ``window_c`` (c=Hv, h=1, w=W; unused slots: zero keys and
    deltas), ``c_prev`` (c=Hv, h=1, w=1); outputs o, k_t, delta_t and c_t."""
    s0, wk, wd = g.input("state"), g.input("window_k"), g.input("window_delta")
    wc, c_prev = g.input("window_c"), g.input("c_prev")
    ct = G.binary(g, c_prev, decay_log, "add", name="c_now", out="c_out")  # (c=Hv, h=1, w=1)
    qk = G.concat(g, [q, k], axis=1, name="qk")                            # (c=Hv, h=2, w=Dk)
    base = G.binary(g, G.matmul(g, qk, s0, name="read"), G.unary(g, ct, "exp", name="decay_all"), "mul",
                    name="read_decay")                                     # (c=Hv, h=2, w=Dv)
    coef = G.unary(g, G.binary(g, ct, wc, "sub", name="window_age"), "exp", name="window_decay")  # (h=1, w=W)
    dots = G.matmul(g, qk, G.permute(g, wk, 1, name="window_k_t"), name="window_dots")            # (h=2, w=W)
    dots = G.binary(g, dots, coef, "mul", name="window_weights")
    base = G.binary(g, base, G.matmul(g, dots, wd, name="window_read"), "add", name="read_all")
    q_s, k_s = G.slice_(g, base, [1, 1], axis=1, name="read_split")
    delta = G.binary(g, G.binary(g, v, k_s, "sub", name="delta"), beta, "mul", name="delta_beta",
                     out="delta_out")
    kt = G.reshape(g, k, 1, d.key_dim, d.value_heads, name="k_col")        # (c=Hv, h=Dk, w=1)
    qdotk = G.matmul(g, q, kt, name="q_dot_k")                             # (c=Hv, h=1, w=1)
    o = G.binary(g, q_s, G.binary(g, delta, qdotk, "mul", name="out_new"), "add", name="out")
    return o, k


def _block_masks(n: int) -> dict:
    """Constant masks of one chunk: causal additive, identity, and per doubling level b the
    lower-left b x b block inside each diagonal 2b x 2b block."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    masks = {"causal": np.where(i >= j, 0.0, MASKED), "eye": (i == j) * 1.0}
    b = 1
    while b < n:
        masks[f"level{b}"] = ((i // (2 * b) == j // (2 * b)) & ((i // b) % 2 == 1) & ((j // b) % 2 == 0)) * 1.0
        b *= 2
    return {k: v.astype(np.float32)[None] for k, v in masks.items()}   # (c=1, h=n, w=n)


def emit_delta_chunk(g: G.Graph, q: str, k: str, v: str, beta: str, decay_log: str, state: str,
                     d: DeltaDims, n: int) -> tuple[str, str]:
    """One chunk of n tokens in matmul form (``torch_chunk_gated_delta_rule``, spec §1.3):

    c = cumsum(g); D_ij = e^(c_i - c_j) for i >= j; A = (beta k) k^T * D;
    T = (I + strictly_lower(A))^-1 by block doubling (T <- T - T (A*M_b) T for b = 1, 2, 4 ...:
    each level inverts diagonal blocks twice as large; the product form blows up on similar keys);
    U = T (beta v); W = T (beta k e^c); v' = U - W S; o = (q e^c) S + (q k^T * D) v';
    S <- e^(c_last) S + (k e^(c_last - c))^T v'.  Layouts as in :func:`emit_delta_step`, h = n."""
    masks = {name: G.memory_data(g, m, name=f"mask.{name}") for name, m in _block_masks(n).items()}
    c = G.cumsum(g, decay_log, axis=1, name="cum_decay")                   # (c=Hv, h=n, w=1)
    ct = G.permute(g, c, 1, name="cum_decay_t")                            # (c=Hv, h=1, w=n)
    dd = G.binary(g, c, ct, "sub", name="pair_decay")                      # (c=Hv, h=n, w=n)
    dd = G.unary(g, G.binary(g, dd, masks["causal"], "add", name="pair_causal"), "exp", name="pair_exp")
    kt = G.permute(g, k, 1, name="k_t")                                    # (c=Hv, h=Dk, w=n)
    kb = G.binary(g, k, beta, "mul", name="k_beta")
    a = G.binary(g, G.matmul(g, kb, kt, name="kkt"), dd, "mul", name="ut_system")
    t = None
    b = 1
    while b < n:
        ab = G.binary(g, a, masks[f"level{b}"], "mul", name=f"inv{b}.block")
        if t is None:          # level 1 starts from T = I: T - I (A*M) I
            t = G.binary(g, masks["eye"], ab, "sub", name=f"inv{b}")
        else:
            tat = G.matmul(g, G.matmul(g, t, ab, name=f"inv{b}.ta"), t, name=f"inv{b}.tat")
            t = G.binary(g, t, tat, "sub", name=f"inv{b}")
        b *= 2
    ec = G.unary(g, c, "exp", name="exp_cum")
    u = G.matmul(g, t, G.binary(g, v, beta, "mul", name="v_beta"), name="new_values")
    w = G.matmul(g, t, G.binary(g, kb, ec, "mul", name="k_beta_decay"), name="k_cumdecay")
    vn = G.binary(g, u, G.matmul(g, w, state, name="w_state"), "sub", name="v_new")
    o_inter = G.matmul(g, G.binary(g, q, ec, "mul", name="q_decay"), state, name="inter")
    qk = G.binary(g, G.matmul(g, q, kt, name="qkt"), dd, "mul", name="intra_attn")
    o = G.binary(g, o_inter, G.matmul(g, qk, vn, name="intra"), "add", name="chunk_out")
    last = G.crop_last(g, c, 1, axis=1, name="cum_last")                  # (c=Hv, h=1, w=1)
    tail = G.unary(g, G.binary(g, last, c, "sub", name="to_end"), "exp", name="to_end_exp")
    kd = G.permute(g, G.binary(g, k, tail, "mul", name="k_to_end"), 1, name="k_to_end_t")
    s = G.binary(g, state, G.unary(g, last, "exp", name="chunk_decay"), "mul", name="state_decay")
    s = G.binary(g, s, G.matmul(g, kd, vn, name="write"), "add", name="state_update", out="state_out")
    return o, s


def build_core_net(path_param, path_bin, d: DeltaDims, rows: int) -> dict:
    """The step net (rows = 1, :func:`emit_deferred_step`) or the chunk net (rows = CHUNK).
    Inputs: ``qkv`` (h=rows, w=2Kd+Vd, after the conv), ``ba`` (h=rows, w=2Hv),
    ``neg_a``/``dt_bias`` (h=1, w=Hv), ``state`` (c=Hv, h=Dk, w=Dv); the step net also the
    window (see there), the chunk net ``valid`` (h=rows, w=1). Outputs ``o`` (h=rows, w=Vd) and
    ``state_out`` (chunk) or ``k``/``delta``/``c`` (step)."""
    g = G.Graph(path_bin)
    valid = g.input("valid") if rows > 1 else None
    q, k, v, beta, decay = emit_core_inputs(g, d, rows, valid)
    if rows == 1:
        o, k_out = emit_deferred_step(g, q, k, v, beta, decay, d)
        inputs = {"window_k": "window_k", "window_delta": "window_delta", "window_c": "window_c",
                  "c_prev": "c_prev", "state": "state"}
        outputs = {"k": k_out, "delta": "delta_out", "c": "c_out"}
    else:
        o, _ = emit_delta_chunk(g, q, k, v, beta, decay, g.input("state"), d, rows)
        inputs, outputs = {"state": "state", "valid": valid}, {"state": "state_out"}
    o = heads_last(g, o, d.value_dim, d.value_heads, "o")                 # (h=rows, w=Vd)
    g.save(path_param)
    return {"param": Path(path_param).name, "bin": Path(path_bin).name, "rows": rows, "dims": d.to_dict(),
            "window": WINDOW,
            "inputs": {"qkv": "qkv", "ba": "ba", "neg_a": "neg_a", "dt_bias": "dt_bias", **inputs},
            "outputs": {"o": o, **outputs}}


# ---------------------------------------------------------------------------------------------
# host side


class DeltaRuleCore:
    """Runs a layer's delta rule in the fp32 core nets: the step net for one token, the chunk
    net over ``CHUNK``-token chunks (the last one zero-padded, masked by ``valid``) otherwise.

    A layer's state is a tuple of numpy arrays (``DeltaDims.host_state_shapes``): S0 and a
    window of pending decode updates (:func:`emit_deferred_step`). Decoding appends to the
    window and folds it into S0 when full; a prefill folds first, then runs the chunks on S0.
    S0 is handed to ncnn without a copy (the nets read it only through MatMul, never in place);
    open the nets in fp32 with packing off (``runtime.open_net``) so it stays in this layout."""

    def __init__(self, step_net, chunk_net, step_info: dict, chunk_info: dict):
        self.step_net, self.chunk_net = step_net, chunk_net
        self.step_info, self.chunk_info = step_info, chunk_info
        self.d = DeltaDims(**step_info["dims"])
        self.rows = int(chunk_info["rows"])
        self.window = int(step_info["window"])
        # zero keys/deltas in a window slot make its terms vanish: a fixed-size window serves all fills
        self.shapes = self.d.host_state_shapes(self.window)

    @classmethod
    def open(cls, folder, step_info: dict, chunk_info: dict, threads: int) -> "DeltaRuleCore":
        """Load two core nets from a folder (``step_info``/``chunk_info``: their manifest entries)."""
        from ..runtime import open_net

        folder = Path(folder)
        return cls(*(open_net(folder / i["param"], folder / i["bin"], threads, "fp32", packing=False)
                     for i in (step_info, chunk_info)), step_info, chunk_info)

    def new_state(self, matrix=None) -> tuple:
        st = tuple(np.zeros(s, np.float32) for s in self.shapes)
        if matrix is not None:
            st[0][...] = matrix
        return st

    def as_state(self, mats) -> tuple:
        """Own contiguous float32 arrays from what a cache holds (arrays, or Mats after a restore)."""
        if all(isinstance(m, np.ndarray) and m.flags.c_contiguous and m.dtype == np.float32 for m in mats):
            return tuple(mats)
        return tuple(np.array(m, np.float32).reshape(s) for m, s in zip(mats, self.shapes))

    def matrix(self, state) -> np.ndarray:
        """The recurrent matrix S the state stands for (pending updates applied), as a copy."""
        return self.fold(tuple(a.copy() for a in state))[0]

    def fold(self, state) -> tuple:
        """Apply the pending updates to S0 in place: S0 <- e^(c_n) S0 + sum_j e^(c_n - c_j) k_j delta_j^T."""
        s0, wk, wd, wc, c, n = state
        if n[0] == 0:
            return state
        m = int(n[0])
        s0 *= np.exp(c)                                            # (Hv, 1, 1) broadcast
        w = np.exp(c[:, :, :1] - wc[:, 0, :m][:, :, None])         # (Hv, m, 1)
        s0 += np.matmul((wk[:, :m] * w).transpose(0, 2, 1), wd[:, :m])
        wk[:, :m] = 0
        wd[:, :m] = 0
        wc[...] = 0
        c[...] = 0
        n[0] = 0
        return state

    def gate_params(self, neg_a, dt_bias) -> tuple:
        """A layer's constants -exp(A_log) and dt_bias as (h=1, w=Hv) Mats, made once at load."""
        from ..runtime import to_mat

        return (to_mat(np.asarray(neg_a, np.float32)[None]), to_mat(np.asarray(dt_bias, np.float32)[None]))

    def __call__(self, qkv, ba, gates: tuple, state: tuple):
        """qkv [seq, 2Kd+Vd] and ba [seq, 2Hv] (the decoder graph's conv output and gate logits,
        as arrays or Mats); returns (o: a Mat (h=seq, w=Vd) or array [seq, Vd], the new state)."""
        from ..runtime import from_mat

        if (qkv.h if hasattr(qkv, "h") else qkv.shape[0]) == 1:
            return self._step(qkv, ba, gates, state)
        qkv, ba = (x if isinstance(x, np.ndarray) else from_mat(x) for x in (qkv, ba))
        s0 = self.fold(state)[0]
        names, outs = self.chunk_info["inputs"], self.chunk_info["outputs"]
        seq, n = qkv.shape[0], self.rows
        o = np.empty((seq, self.d.values), np.float32)
        mat = _borrow(s0)
        for s in range(0, seq, n):
            r = min(n, seq - s)
            if r == n:
                xc, bc, valid = qkv[s:s + n], ba[s:s + n], np.ones((n, 1), np.float32)
            else:   # zero-padded tail: valid = 0 gives beta = 0 and no decay there
                xc, bc = np.zeros((n, qkv.shape[1]), np.float32), np.zeros((n, ba.shape[1]), np.float32)
                xc[:r], bc[:r] = qkv[s:], ba[s:]
                valid = (np.arange(n) < r).astype(np.float32)[:, None]
            res = self.chunk_net.execute(
                {names["qkv"]: xc, names["ba"]: bc, names["neg_a"]: gates[0], names["dt_bias"]: gates[1],
                 names["state"]: mat, names["valid"]: valid},
                [(outs["state"], 0), (outs["o"], 0)])
            o[s:s + r] = from_mat(res[outs["o"]])[:r]
            mat = res[outs["state"]]
        s0[...] = np.asarray(mat).reshape(s0.shape)
        return o, state

    def _step(self, qkv, ba, gates, state):
        """One token, straight through ncnn (this runs once per recurrent layer per decoded token:
        no generic bookkeeping); then the window takes the token's update."""
        import ncnn

        from ..runtime import to_mat

        s0, wk, wd, wc, c, n = state
        names, outs = self.step_info["inputs"], self.step_info["outputs"]
        ex = self.step_net.extractor()
        for name, v in ((names["qkv"], qkv), (names["ba"], ba), (names["neg_a"], gates[0]),
                        (names["dt_bias"], gates[1]), (names["state"], _borrow(s0)),
                        (names["window_k"], _borrow(wk)), (names["window_delta"], _borrow(wd)),
                        (names["window_c"], _borrow(wc)), (names["c_prev"], to_mat(c))):
            ex.input(name, v if isinstance(v, ncnn.Mat) else to_mat(v))
        got = {}
        for key in ("k", "c", "delta", "o"):   # graph order: light mode frees consumed blobs
            got[key] = ncnn.Mat()
            if ex.extract(outs[key], got[key]) != 0:
                from ..errors import EdgevlError

                raise EdgevlError(f"ncnn failed to run {self.step_net.where}; the package may be damaged — "
                                  "check it with edgevl check (or convert again)")
        del ex
        i = int(n[0])
        wk[:, i] = np.asarray(got["k"]).reshape(wk.shape[0], -1)
        wd[:, i] = np.asarray(got["delta"]).reshape(wd.shape[0], -1)
        c[...] = np.array(got["c"], np.float32).reshape(c.shape)
        wc[:, 0, i] = c[:, 0, 0]
        n[0] = i + 1
        if i + 1 == self.window:
            self.fold(state)
        return got["o"], state


def _borrow(a: np.ndarray):
    """A Mat over ``a``'s memory (no copy): ``a`` must be C-contiguous float32 with each channel a
    multiple of 4 values (ncnn's channel alignment), stay alive and unchanged while ncnn reads it,
    and be read only (never fed to a layer that works in place)."""
    import ncnn

    return ncnn.Mat(a)


def core_hook(core: DeltaRuleCore, gates: dict):
    """The decoder's host pass for a recurrent layer (``runtime.Decoder`` passes): the layer's
    conv output and gate logits in, the delta rule run on its ``host`` state (the matrix),
    the core output fed back by name."""
    def hook(blobs, seq, state, layer, qkv, ba, out):
        o, st = core(blobs[qkv], blobs[ba], gates[layer], core.as_state(state.get()))
        state.set(st)
        return {out: o}
    return hook
