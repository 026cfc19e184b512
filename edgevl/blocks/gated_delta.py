"""Delta-rule linear attention on ncnn, for every recurrent architecture: Gated DeltaNet (GDN,
the Qwen3.5 family) and, at the end, Kimi delta attention (KDA, the Youtu MoE) side by side.

Hold it next to transformers' ``modeling_qwen3_5.py`` (``Qwen3_5GatedDeltaNet``,
``torch_recurrent_gated_delta_rule``, ``torch_chunk_gated_delta_rule``) and
docs/models/qwen3_5.md, "Gated DeltaNet". The work is split three ways:

- **In the decoder graph** (the package's storage precision): the projections, the causal
  depthwise conv with its conv-state window (:func:`emit_causal_conv`) and, after the core, the
  gated RMSNorm (:func:`emit_gated_norm`).
- **In the chunk net** (prefill), always fp32 and without weights (constant masks only), shared
  by every layer: the gates (beta and the log-decay), the l2norm of q and k, the key-head
  expansion and the delta rule over one chunk of ``CHUNK`` tokens with the block-doubling inverse.
  The recurrent state S [Hv, Dk, Dv] never enters a bf16-storage net: there every BinaryOp rounds
  its output to bf16 (measured: 0.4 % per update), which would compound over a conversation.
- **On the host**, :class:`DeltaRuleCore` runs between two passes of the decoder graph: the
  decoder driver extracts a layer's conv output and gate logits, runs the core, and feeds the
  core's output into the same extractor (the decoder graph has a placeholder input blob there),
  so one extractor and one copy of the weights serve prefill and decode. A decoded token is a
  few small fp32 numpy operations on S (:meth:`DeltaRuleCore._step`): the ncnn step net this
  replaced cost 0.28 ms per layer and token against 0.08 ms in numpy (0.8B shapes, 1 thread, a
  hot cache; 10 vs 7-8 ms per token over 18 layers in a real decode), nearly all of it per-layer
  dispatch over ~50 tiny layers, and a token's work is ~0.5 M multiply-adds.

KDA (per-channel decay, sigmoid output gate) reuses the conv, the l2norm and the gated norm
(``gate_act="sigmoid"``); its chunked form is not practical in ncnn, so its core
(:class:`KdaCore`) runs token by token on the host, prefill too (docs/models/youtu_moe.md, "KDA").
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
# A prompt's last chunk runs in the smallest of these nets (built at first use, from the layer's
# dims alone) that holds its rows: zero-padded rows cost as much as real ones, and a 32-row chunk
# took 2.2x an 8-row one (0.8B layer, 1 thread). The padded rows add exact zeros, so the bits are
# the same whichever net runs the tail.
TAIL_ROWS = (8, 16)
WINDOW = 16                 # decoded tokens whose state updates are deferred (folded into S0 together)
L2NORM_EPS = 1e-6           # transformers' l2norm (FLA's), inside the kernel
MASKED = -1e30              # additive mask: exp() of it is exactly 0
# Columns a conv window keeps in packages that take speculative drafts back: K-1 are read, the
# rest let the runtime drop up to this many rows of a forward (runtime.RecurrentState.undo).
UNDO_ROWS = 8


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

    @property
    def undo_conv_state_shape(self) -> tuple[int, int]:
        """A conv window wide enough to take :data:`UNDO_ROWS` rows of a forward back."""
        return (self.conv_channels, max(self.conv_kernel - 1, UNDO_ROWS))

    def to_dict(self) -> dict:
        return {"key_heads": self.key_heads, "value_heads": self.value_heads, "key_dim": self.key_dim,
                "value_dim": self.value_dim, "conv_kernel": self.conv_kernel}


# ---------------------------------------------------------------------------------------------
# decoder-graph emitters


def emit_causal_conv(g: G.Graph, x: str, weight: np.ndarray, state_in: str, state_out: str, name: str,
                     width: int | None = None) -> str:
    """SiLU(causal depthwise conv) over time with a carried window (``causal_conv1d_update``).

    x (h=seq, w=channels); ``state_in`` (h=channels, w=width, K-1 by default) holds the previous
    raw columns (zeros at the start), ``state_out`` gets the last ``width`` raw columns after this
    input; the conv reads the last K-1 of them."""
    k = int(weight.shape[1])
    width = k - 1 if width is None else int(width)
    xt = G.permute(g, x, 1, name=f"{name}.to_time")                        # (h=channels, w=seq)
    full = G.concat(g, [state_in, xt], axis=1, name=f"{name}.window")      # (h=channels, w=width+seq)
    G.crop_last(g, full, width, axis=-1, name=f"{name}.state", out=state_out)
    if width > k - 1:   # (h=channels, w=K-1+seq)
        full = G.crop_from(g, full, width - (k - 1), axis=-1, name=f"{name}.reads")
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


HOST_STATE_NAMES = ["recurrent", "window_k", "window_delta", "window_c", "c", "pending"]


def declare_recurrent_layer(states: list, i: int, conv_shape, host_shapes, hook: str, args: dict,
                            inputs: list, reads: int | None = None) -> dict:
    """Appends layer ``i``'s two states to the manifest's ``states`` — the conv window (graph
    input/output ``conv_state{i}``) and the host-held matrix with its window of deferred updates
    (``host_shapes``, named :data:`HOST_STATE_NAMES`) — and returns the layer's host pass: it
    extracts the conv window's output first (extracting the core's ``inputs`` runs the conv,
    which consumes and in light mode frees the window the state output is cut from), then the
    core's inputs as Mats, and hands ``hook`` the host state."""
    # "window": the state is the last columns of the (channels x time) input, so the runtime can
    # drop a forward's last rows from it (speculative decoding's rejected drafts)
    # "reads": the columns the conv reads (a wider window only serves ``undo``)
    states.append({"kind": "recurrent", "layer": i, "names": ["conv"], "inputs": [f"conv_state{i}"],
                   "outputs": [f"out_conv_state{i}"], "shapes": [list(conv_shape)], "window": True,
                   "reads": reads or int(conv_shape[1])})
    states.append({"kind": "host", "layer": i, "inputs": [], "outputs": [], "names": list(HOST_STATE_NAMES),
                   "shapes": [list(sh) for sh in host_shapes]})
    return {"extract": [f"out_conv_state{i}", *inputs], "hook": hook, "args": args, "state": len(states) - 1,
            "mats": True}


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

    l2norm is one RMSNorm: x*rsqrt(sum x^2 + eps) = RMSNorm(eps/D) with gamma 1/sqrt(D) (docs/ncnn.md, section 10);
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
    """One chunk of n tokens in matmul form (``torch_chunk_gated_delta_rule``; docs/models/qwen3_5.md, section 4):

    c = cumsum(g); D_ij = e^(c_i - c_j) for i >= j; A = (beta k) k^T * D;
    T = (I + strictly_lower(A))^-1 by block doubling (T <- T - T (A*M_b) T for b = 1, 2, 4 ...:
    each level inverts diagonal blocks twice as large; the product form blows up on similar keys);
    U = T (beta v); W = T (beta k e^c); v' = U - W S; o = (q e^c) S + (q k^T * D) v';
    S <- e^(c_last) S + (k e^(c_last - c))^T v'. q, k (c=Hv, h=n, w=Dk), v (c=Hv, h=n, w=Dv),
    beta and g (c=Hv, h=n, w=1), S (c=Hv, h=Dk, w=Dv)."""
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


def build_core_net(path_param, path_bin, d: DeltaDims, rows: int = CHUNK) -> dict:
    """The chunk net: ``rows`` tokens per run. Inputs: ``qkv`` (h=rows, w=2Kd+Vd, after the
    conv), ``ba`` (h=rows, w=2Hv), ``neg_a``/``dt_bias`` (h=1, w=Hv), ``state`` (c=Hv, h=Dk, w=Dv),
    ``valid`` (h=rows, w=1). Outputs ``o`` (h=rows, w=Vd) and ``state_out``."""
    if rows < 2:
        raise ValueError("the chunk net needs rows >= 2 (decoding runs on the host)")
    g = G.Graph(path_bin)
    valid = g.input("valid")
    q, k, v, beta, decay = emit_core_inputs(g, d, rows, valid)
    o, _ = emit_delta_chunk(g, q, k, v, beta, decay, g.input("state"), d, rows)
    o = heads_last(g, o, d.value_dim, d.value_heads, "o")                 # (h=rows, w=Vd)
    g.save(path_param)
    return {"param": Path(path_param).name, "bin": Path(path_bin).name, "rows": rows, "dims": d.to_dict(),
            "window": WINDOW,
            "inputs": {"qkv": "qkv", "ba": "ba", "neg_a": "neg_a", "dt_bias": "dt_bias", "state": "state",
                       "valid": valid},
            "outputs": {"o": o, "state": "state_out"}}


# ---------------------------------------------------------------------------------------------
# host side


class WindowedCore:
    """What the host delta-rule cores share: a layer's state is a tuple of float32 arrays
    (``self.shapes``), the matrix S0 first and a window of deferred updates after it, which the
    subclass's ``fold`` applies to S0."""

    shapes: list

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
        raise NotImplementedError


class DeltaRuleCore(WindowedCore):
    """Runs a layer's delta rule: one token in numpy (:meth:`_step`), several in the fp32 chunk
    net over ``CHUNK``-token chunks (the last one zero-padded, masked by ``valid``).

    A layer's state is a tuple of numpy arrays (``DeltaDims.host_state_shapes``): S0 and a
    window of pending decode updates. The state after the pending tokens j (cumulative
    log-decays c_j since S0) and this one is S_t = e^(c_t) S0 + sum_j e^(c_t - c_j) k_j delta_j^T
    + k_t delta_t^T, and a step needs only q^T and k^T of its first two terms: one read of S0
    (1 MiB per layer at 0.8B) and the small window instead of rewriting S every token (decode is
    memory-bound; the rewrite moved ~7x the state's bytes). Decoding appends (k_t, delta_t, c_t)
    to the window and folds it into S0 when full; a prefill folds first, then runs the chunks on
    S0. S0 is handed to ncnn without a copy (the chunk net reads it only through MatMul, never in
    place); open the net in fp32 with packing off (``runtime.open_net``) so it stays in this layout."""

    def __init__(self, chunk_net, chunk_info: dict):
        self.chunk_net, self.chunk_info = chunk_net, chunk_info
        self.d = DeltaDims(**chunk_info["dims"])
        self.rows = int(chunk_info["rows"])
        self.window = int(chunk_info.get("window", WINDOW))
        # zero keys/deltas in a window slot make its terms vanish: a fixed-size window serves all fills
        self.shapes = self.d.host_state_shapes(self.window)
        self.tails = None           # rows -> (net, info) for last chunks (TAIL_ROWS), once built

    def _net_for(self, r: int) -> tuple:
        """The chunk net (and its manifest-style info) to run ``r`` rows on: the package's for a
        full chunk, else the smallest tail net that holds them."""
        if r >= self.rows:
            return self.chunk_net, self.chunk_info
        if self.tails is None:
            self.tails = self._build_tails()
        fit = [n for n in sorted(self.tails) if n >= r]
        return self.tails[fit[0]] if fit else (self.chunk_net, self.chunk_info)

    def _build_tails(self) -> dict:
        import tempfile

        from ..runtime import open_net

        threads = self.chunk_net.threads             # as many as the package's chunk net
        tails = {}
        with tempfile.TemporaryDirectory(prefix="edgevl-chunk") as tmp:
            for n in TAIL_ROWS:
                if n < self.rows:
                    info = build_core_net(Path(tmp) / f"c{n}.param", Path(tmp) / f"c{n}.bin", self.d, n)
                    tails[n] = (open_net(Path(tmp) / f"c{n}.param", Path(tmp) / f"c{n}.bin", threads, "fp32",
                                         packing=False), info)
        return tails

    @classmethod
    def open(cls, folder, chunk_info: dict, threads: int) -> DeltaRuleCore:
        """Load the chunk net from a folder (``chunk_info``: its manifest entry)."""
        from ..runtime import open_net

        folder = Path(folder)
        return cls(open_net(folder / chunk_info["param"], folder / chunk_info["bin"], threads, "fp32",
                            packing=False), chunk_info)

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
        """A layer's constants -exp(A_log) and dt_bias, made once at load: as (h=1, w=Hv) Mats for
        the chunk net, and for the decode step -exp(A_log), the per-row scales of the l2-normed
        [q; k] rows (1/sqrt(Dk) for q's heads, 1 for k's), and the sign and offset that turn the
        logits [b, a] into [-b, a + dt_bias] (one softplus then gives both gates)."""
        from ..runtime import to_mat

        d = self.d
        a = np.ascontiguousarray(neg_a, np.float32).reshape(-1)
        b = np.ascontiguousarray(dt_bias, np.float32).reshape(-1)
        qk_scale = np.repeat(np.array([d.key_dim ** -0.5, 1.0], np.float32), d.key_heads)
        sign = np.repeat(np.array([-1.0, 1.0], np.float32), d.value_heads)
        offset = np.concatenate([np.zeros(d.value_heads, np.float32), b])
        return (to_mat(a[None]), to_mat(b[None]), a, qk_scale, sign, offset)

    def __call__(self, qkv, ba, gates: tuple, state: tuple, undoable: bool = False):
        """qkv [seq, 2Kd+Vd] and ba [seq, 2Hv] (the decoder graph's conv output and gate logits,
        as arrays or Mats); returns (o: a Mat (h=seq, w=Vd) or array [seq, Vd], the new state).

        ``undoable``: the rows go through the window one by one (never folded in between), so
        :meth:`drop_last` can take the last of them back — a few rows (speculative decoding's
        drafts); a prompt takes the chunk net."""
        from ..runtime import from_mat

        seq = qkv.h if hasattr(qkv, "h") else qkv.shape[0]
        if seq == 1 and not undoable:
            return self._step(qkv, ba, gates, state)
        qkv, ba = (x if isinstance(x, np.ndarray) else from_mat(x) for x in (qkv, ba))
        if undoable:
            if int(state[5][0]) + seq >= self.window:   # no fold among these rows
                self.fold(state)
            return self._steps(qkv, ba, gates, state)[0], state
        s0 = self.fold(state)[0]
        seq = qkv.shape[0]
        o = np.empty((seq, self.d.values), np.float32)
        mat = _borrow(s0)
        for s in range(0, seq, self.rows):
            r = min(self.rows, seq - s)
            net, info = self._net_for(r)
            names, outs, n = info["inputs"], info["outputs"], int(info["rows"])
            if r == n:
                xc, bc, valid = qkv[s:s + n], ba[s:s + n], np.ones((n, 1), np.float32)
            else:   # zero-padded tail: valid = 0 gives beta = 0 and no decay there
                xc, bc = np.zeros((n, qkv.shape[1]), np.float32), np.zeros((n, ba.shape[1]), np.float32)
                xc[:r], bc[:r] = qkv[s:], ba[s:]
                valid = (np.arange(n) < r).astype(np.float32)[:, None]
            res = net.execute(
                {names["qkv"]: xc, names["ba"]: bc, names["neg_a"]: gates[0], names["dt_bias"]: gates[1],
                 names["state"]: mat, names["valid"]: valid},
                [(outs["state"], 0), (outs["o"], 0)])
            o[s:s + r] = from_mat(res[outs["o"]])[:r]
            mat = res[outs["state"]]
        s0[...] = np.asarray(mat).reshape(s0.shape)
        return o, state

    def _step(self, qkv, ba, gates, state):
        return self.step_rows(qkv, ba, gates, [state]), state

    def step_rows(self, qkv, ba, gates, states: list) -> np.ndarray:
        """One token of each of several sequences (``torch_recurrent_gated_delta_rule`` with the
        update deferred): row b of qkv [B, 2Kd+Vd] and ba [B, 2Hv] on ``states[b]``; returns
        the outputs [B, Vd], row b sequence b's. All heads at once in fp32: the l2norms and gates, q^T S_t
        and k^T S_t from S0 and the window, delta = beta (v - k^T S_t), o = q^T S_t + (q.k) delta;
        the window takes (k, delta, c).

        Written for few numpy calls: a decode step runs with caches cold (the layer's weights
        streamed through them since the last step), where each call costs ~10 us — that, not
        the arithmetic, is most of the 0.3-0.4 ms per layer. What does not read a sequence's
        own state runs once for all rows. Window slots not yet used hold zero keys, so the
        window terms need no slicing to the pending count."""
        d = self.d
        neg_a, qk_scale, sign, offset = gates[2:]
        hk, dk, hv, dv = d.key_heads, d.key_dim, d.value_heads, d.value_dim
        rows = len(states)
        x = np.asarray(qkv, np.float32).reshape(rows, -1)
        qk = x[:, :2 * d.keys].reshape(rows * 2 * hk, 1, dk)          # q's heads, then k's
        r = np.matmul(qk, qk.transpose(0, 2, 1)).reshape(rows, 2 * hk)  # squared norms
        r += L2NORM_EPS
        np.sqrt(r, out=r)
        np.divide(qk_scale, r, out=r)
        qk = (qk.reshape(rows, 2 * hk, dk) * r[:, :, None]).reshape(rows, 2, hk, dk)
        if hv != hk:                            # value head h reads key head h // (Hv/Hk)
            qk = qk.repeat(hv // hk, axis=2)
        qk = qk.transpose(0, 2, 1, 3)                                    # (B, Hv, 2, Dk): q, k
        sp = np.asarray(ba, np.float32).reshape(rows, -1) * sign
        sp += offset
        np.logaddexp(np.float32(0), sp, out=sp)          # [softplus(-b), softplus(a + dt_bias)]
        base = np.empty((rows, hv, 2, dv), np.float32)
        ct = np.empty((rows, hv), np.float32)
        for b, (s0, wk, wd, wc, c, _) in enumerate(states):
            ct[b] = c.reshape(hv) + neg_a * sp[b, hv:]                   # log-decay since S0
            fac = np.exp(ct[b, :, None] - wc[:, 0])                      # (Hv, W): e^(c_t - c_j)
            own = np.matmul(qk[b], s0)                                   # (Hv, 2, Dv)
            own *= np.exp(ct[b])[:, None, None]
            dots = np.matmul(qk[b], wk.transpose(0, 2, 1))               # (Hv, 2, W)
            dots *= fac[:, None, :]
            own += np.matmul(dots, wd)
            base[b] = own
        delta = x[:, 2 * d.keys:].reshape(rows, hv, dv) - base[:, :, 1]
        delta *= np.exp(-sp[:, :hv])[:, :, None]                         # beta = sigmoid(b)
        o = delta * np.matmul(qk[:, :, :1], qk[:, :, 1:].transpose(0, 1, 3, 2)).reshape(rows, hv, 1)
        o += base[:, :, 0]                                               # + (q.k) delta
        for b, (_, wk, wd, wc, c, n) in enumerate(states):
            i = int(n[0])
            wk[:, i] = qk[b, :, 1]
            wd[:, i] = delta[b]
            c[...] = ct[b].reshape(c.shape)
            wc[:, 0, i] = ct[b]
            n[0] = i + 1
            if i + 1 == self.window:
                self.fold(states[b])
        return o.reshape(rows, -1)

    def _steps(self, qkv, ba, gates, state):
        """Several tokens at once, each as :meth:`_step` would run it, for a speculative verify
        pass: S0 and the window are read once for all rows, and the rows' dependence on each
        other (row t sees the updates of the rows before it) is a small unit-lower-triangular
        system per head, delta = (I + A)^-1 u, solved by forward substitution. The window must
        have room for the rows (no fold among them)."""
        d = self.d
        s0, wk, wd, wc, c, n = state
        neg_a, qk_scale, sign, offset = gates[2:]
        hk, dk, hv, dv = d.key_heads, d.key_dim, d.value_heads, d.value_dim
        x = np.asarray(qkv, np.float32).reshape(len(qkv), -1)
        m = x.shape[0]
        qk = x[:, :2 * d.keys].reshape(m * 2 * hk, 1, dk)
        r = np.matmul(qk, qk.transpose(0, 2, 1)).reshape(m, 2 * hk)      # squared norms
        r += L2NORM_EPS
        np.sqrt(r, out=r)
        np.divide(qk_scale, r, out=r)
        qk = (qk.reshape(m, 2 * hk, dk) * r[:, :, None]).reshape(m, 2, hk, dk)
        if hv != hk:
            qk = qk.repeat(hv // hk, axis=2)
        qk = np.ascontiguousarray(qk.transpose(2, 0, 1, 3)).reshape(hv, 2 * m, dk)   # rows (t, q|k)
        keys = qk[:, 1::2]                                                # (Hv, m, Dk)
        sp = np.asarray(ba, np.float32).reshape(m, -1) * sign
        sp += offset
        np.logaddexp(np.float32(0), sp, out=sp)
        ct = (c.reshape(1, hv) + np.cumsum(neg_a * sp[:, hv:], axis=0)).T   # (Hv, m) log-decay since S0
        beta = np.exp(-sp[:, :hv]).T[:, :, None]                          # (Hv, m, 1)
        # what S0 and the pending window give each row (as in _step), all rows in one read
        base = np.matmul(qk, s0).reshape(hv, m, 2, dv)
        base *= np.exp(ct)[:, :, None, None]
        dots = np.matmul(qk, wk.transpose(0, 2, 1)).reshape(hv, m, 2, -1)
        dots *= np.exp(ct[:, :, None] - wc)[:, :, None, :]
        base += np.matmul(dots.reshape(hv, 2 * m, -1), wd).reshape(hv, m, 2, dv)
        # the rows' own updates: decay e^(c_t - c_s) for s <= t (0 above the diagonal)
        gap = ct[:, :, None] - ct[:, None, :]
        decay = np.exp(np.where(np.tri(m, dtype=bool), gap, -np.inf))     # (Hv, m, m)
        inner = np.matmul(qk, keys.transpose(0, 2, 1)).reshape(hv, m, 2, m) * decay[:, :, None]
        u = x[:, 2 * d.keys:].reshape(m, hv, dv).transpose(1, 0, 2) - base[:, :, 1]
        u *= beta
        a = inner[:, :, 1] * beta                                          # k_t.k_s terms, s < t
        delta = u
        for t in range(1, m):
            delta[:, t] -= np.matmul(a[:, t:t + 1, :t], delta[:, :t])[:, 0]
        o = base[:, :, 0] + np.matmul(inner[:, :, 0], delta)               # q_t.k_s terms, s <= t
        i = int(n[0])
        wk[:, i:i + m] = keys
        wd[:, i:i + m] = delta
        wc[:, 0, i:i + m] = ct
        c[...] = ct[:, -1].reshape(c.shape)
        n[0] = i + m
        return o.transpose(1, 0, 2).reshape(m, -1), state

    def drop_last(self, state, r: int) -> None:
        """Take the last ``r`` rows of an ``undoable`` call back: the state is as if they had
        never been fed (their window slots emptied, the log-decay since S0 back to the last kept
        row's)."""
        s0, wk, wd, wc, c, n = state
        m = int(n[0])
        if r > m:
            raise ValueError(f"cannot take back {r} rows: the window holds {m}")
        m -= r
        wk[:, m:m + r] = 0
        wd[:, m:m + r] = 0
        c[...] = wc[:, :, m - 1:m] if m else 0
        wc[:, :, m:m + r] = 0
        n[0] = m


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
    def hook(blobs, seq, state, layer, qkv, ba, out, undoable=False):
        o, st = core(blobs[qkv], blobs[ba], gates[layer], core.as_state(state.get()), undoable)
        state.set(st)
        return {out: o}

    def undo(state, r):
        st = core.as_state(state.get())
        core.drop_last(st, r)
        state.set(st)

    def rows(blobs, states, layer, qkv, ba, out):
        """One token of each of several sequences (row b on ``states[b]``) in one call."""
        sts = [core.as_state(s.get()) for s in states]
        o = core.step_rows(blobs[qkv], blobs[ba], gates[layer], sts)
        for s, st in zip(states, sts):
            s.set(st)
        return {out: o}

    hook.undo, hook.rows = undo, rows
    return hook


# ---------------------------------------------------------------------------------------------
# KDA (Kimi delta attention): the delta rule with a per-channel decay, host-side fp32 numpy

KDA_WINDOW = 16     # decoded tokens whose state updates are deferred (folded into S0 together)


def kda_state_shapes(d: DeltaDims, window: int = KDA_WINDOW) -> list:
    """A KDA layer's host state: S0 [H, Dk, Dv]; the pending keys, deltas and per-channel
    cumulative log-decays of up to ``window`` tokens; the log-decay since S0; the number pending."""
    h, dk, dv = d.value_heads, d.key_dim, d.value_dim
    return [[h, dk, dv], [h, window, dk], [h, window, dv], [h, window, dk], [h, 1, dk], [1]]


class KdaCore(WindowedCore):
    """A KDA layer's delta rule (``recurrent_kimi_delta_attention`` with the lower-bounded gate)
    in fp32 numpy, one token at a time, prefill too: the chunked form needs [C, C, Dk] pairwise
    decays, not practical in ncnn (docs/models/youtu_moe.md, "KDA").

    g = lb * sigmoid(exp(A_log) * (f + dt_bias)) per channel; S <- diag(e^g) S (rows along Dk);
    delta = beta (v - k^T S); S <- S + k delta^T; o = q^T S; q and k l2-normalised (q also
    scaled by Dk^-1/2). As in :class:`DeltaRuleCore`, S is not rewritten every token: with
    per-channel cumulative log-decays c_j since S0, S_t = diag(e^c_t) S0 + sum_j
    diag(e^(c_t - c_j)) k_j delta_j^T, so a token reads S0 once (2 MiB per layer at the real
    shape) plus a small window, and the window folds into S0 every ``KDA_WINDOW`` tokens and at
    the end of a prompt (S0 is then the exact state, as the reference's cache holds it). At the
    real shape (1 thread, caches cold, ``benchmarks/kda_core.py``) a token and layer costs 0.40 ms
    decoding and 0.19 ms in a prompt; the ncnn step net this replaced, which rewrote S every
    token, 0.91 and 0.72 ms."""

    def __init__(self, d: DeltaDims, lower_bound: float, window: int = KDA_WINDOW):
        self.d, self.lower_bound, self.window = d, float(lower_bound), int(window)
        self.shapes = kda_state_shapes(d, self.window)

    def consts(self, rate, dt_bias) -> tuple:
        """A layer's exp(A_log) per channel and dt_bias, as float32 vectors made once at load."""
        return (np.ascontiguousarray(rate, np.float32).reshape(-1),
                np.ascontiguousarray(dt_bias, np.float32).reshape(-1))

    def fold(self, state) -> tuple:
        """S0 <- diag(e^c_n) S0 + sum_j diag(e^(c_n - c_j)) k_j delta_j^T, in place; empties the window."""
        s0, wk, wd, wc, c, n = state
        m = int(n[0])
        if m == 0:
            return state
        s0 *= np.exp(c).transpose(0, 2, 1)                           # (H, Dk, 1): rows along Dk
        kd = wk[:, :m] * np.exp(c - wc[:, :m])                        # (H, m, Dk)
        s0 += np.matmul(kd.transpose(0, 2, 1), wd[:, :m])
        for a in (wk, wd, wc, c):
            a[...] = 0
        n[0] = 0
        return state

    def __call__(self, qkv, fb, consts: tuple, state: tuple):
        """qkv [seq, 3HD] and fb [seq, HD+H] (arrays or Mats); returns (o [seq, HD], the state)."""
        x = np.asarray(qkv, np.float32).reshape(-1, 3 * self.d.keys)
        f = np.asarray(fb, np.float32).reshape(len(x), -1)
        o = np.empty((len(x), self.d.values), np.float32)
        for t in range(len(x)):
            o[t] = self._step(x[t], f[t], consts, state)
        if len(x) > 1:
            self.fold(state)
        return o, state

    def _step(self, x, fb, consts, state) -> np.ndarray:
        d = self.d
        h, dk, hd = d.key_heads, d.key_dim, d.keys
        s0, wk, wd, wc, c, n = state
        q, k, v = (x[j * hd:(j + 1) * hd].reshape(h, dk) for j in range(3))
        q = q * (dk ** -0.5 / np.sqrt(np.einsum("hd,hd->h", q, q) + L2NORM_EPS))[:, None]
        k = k * (1.0 / np.sqrt(np.einsum("hd,hd->h", k, k) + L2NORM_EPS))[:, None]
        rate, dt = consts
        g = self.lower_bound / (1.0 + np.exp(-(rate * (fb[:hd] + dt))))       # lb * sigmoid, (HD,)
        beta = 1.0 / (1.0 + np.exp(-fb[hd:hd + h]))
        ct = c[:, 0] + g.reshape(h, dk)                                       # (H, Dk)
        qk = np.stack((q, k), axis=1)                                         # (H, 2, Dk)
        i = int(n[0])
        base = np.matmul(qk * np.exp(ct)[:, None, :], s0)                     # (H, 2, Dv)
        if i:
            kw = wk[:, :i] * np.exp(ct[:, None, :] - wc[:, :i])               # (H, i, Dk)
            base += np.matmul(np.matmul(qk, kw.transpose(0, 2, 1)), wd[:, :i])
        delta = (v - base[:, 1]) * beta[:, None]
        o = base[:, 0] + delta * np.einsum("hd,hd->h", q, k)[:, None]
        wk[:, i] = k
        wd[:, i] = delta
        wc[:, i] = ct
        c[:, 0] = ct
        n[0] = i + 1
        if i + 1 == self.window:
            self.fold(state)
        return o.reshape(-1)


def kda_hook(core: KdaCore, consts: dict):
    """The decoder's host pass for a KDA layer: conv output and gate logits in, the delta rule
    run on the layer's ``host`` state, the core output fed back by name."""
    def hook(blobs, seq, state, layer, qkv, fb, out):
        o, st = core(blobs[qkv], blobs[fb], consts[layer], core.as_state(state.get()))
        state.set(st)
        return {out: o}
    return hook
