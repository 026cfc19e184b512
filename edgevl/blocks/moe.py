"""Mixture-of-experts layers on ncnn, shared by the MoE architectures (Qwen3.5-MoE, Youtu MoE).

An MoE layer is split between the decoder graph and the host:

- in the graph: the router Gemm (logits out, fp32) and the shared expert (with Qwen's sigmoid
  gate), emitted by :func:`emit_sparse_moe`; the routed experts' output is a blob the host
  feeds back (``runtime.Decoder`` passes: ncnn skips a fed blob's producer);
- on the host, per forward (:func:`moe_hook`): top-k routing in numpy (:class:`Router`), then the
  chosen experts run as small ncnn nets (:class:`ExpertStore`), tokens grouped by expert, and
  their weighted sum goes back into the graph.

Experts are stored outside the decoder graph, in ``experts.bin`` (one byte range per expert,
every expert of a package the same size) with one shared ``experts.param`` (gate_up Gemm,
SiLU·mul, down Gemm). The store loads an expert's net from its byte range when it is first
chosen and keeps at most ``cache_mb`` of expert weights resident (an even share per MoE layer,
least recently used first out), so a model whose experts do not fit in RAM still runs; tokens
do not depend on the budget. Experts are read for the life of the process, long after loading
verified the package's files, so each expert block carries a checksum from conversion that a
load checks before ncnn parses the bytes, and a load first checks that ``experts.bin`` is still
the file loaded (same size; a file renamed over it is reopened and checked the same way).

No numpy matrix product runs in the hot loop (routing is a softmax/sigmoid and a partial sort
over one row of E logits, the weighted sum is elementwise), so numpy's BLAS threads never
compete with ncnn's.
"""

from __future__ import annotations

import ctypes
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import ncnn
import numpy as np

from .. import ncnn_graph as G
from ..errors import EdgevlError, PackageError
from ..package import EXPERT_CHECKSUMS, EXPERT_ROUTING
from ..runtime import available_memory, from_mat, heap_info, set_net_options, to_mat, trim_heap
from .base import Q8_QUANT, Ctx, RowStack, swiglu_mlp
from .vocabulary import GGUF_OF_DTYPE, BenchProfile, Option, RuntimeOption

# ---------------------------------------------------------------------------------------------
# routing (host side)


def softmax_topk(logits: np.ndarray, k: int, renormalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Qwen-MoE routing: softmax over all experts in fp32, the top ``k`` probabilities,
    renormalised to sum to 1. Returns (expert ids [n, k], weights [n, k] fp32)."""
    z = np.asarray(logits, np.float32)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    idx = _topk(p, k)
    w = np.take_along_axis(p, idx, axis=1)
    if renormalize:
        w /= w.sum(axis=1, keepdims=True)
    return idx, w.astype(np.float32)


def sigmoid_topk_biased(logits: np.ndarray, k: int, bias: np.ndarray, modality: np.ndarray,
                        scale: float, eps: float = 1e-20) -> tuple[np.ndarray, np.ndarray]:
    """Quantile-balanced routing (Youtu MoE; docs/models/youtu_moe.md, section 5): experts chosen by the top ``k`` of
    ``logits - bias[modality]`` (one bias row per modality: 0 text, 1 image), weighted by the
    *unbiased* ``sigmoid(logits)`` of the chosen ones, normalised (+eps) and scaled."""
    z = np.asarray(logits, np.float32)
    sel = z - np.asarray(bias, np.float32)[np.asarray(modality, np.int64)]
    idx = _topk(sel, k)
    s = 1.0 / (1.0 + np.exp(-np.take_along_axis(z, idx, axis=1)))
    w = s / (s.sum(axis=1, keepdims=True) + np.float32(eps)) * np.float32(scale)
    return idx, w.astype(np.float32)


def _topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest entries per row (in no particular order)."""
    if k >= x.shape[1]:
        return np.broadcast_to(np.arange(x.shape[1]), x.shape).copy()
    return np.argpartition(-x, k - 1, axis=1)[:, :k]


ROUTING_KINDS = tuple(EXPERT_ROUTING)


class Router:
    """The manifest's ``experts.routing`` made callable: ``router(layer, logits, modality)``.

    ``softmax``: {"top_k", "renormalize"}; ``sigmoid_biased``: {"top_k", "scale", "eps",
    "modality_token_ids"} with a per-layer bias [modalities, E] stored in experts.bin."""

    def __init__(self, spec: dict, biases: dict | None = None):
        if spec.get("kind") not in ROUTING_KINDS:
            raise EdgevlError(f"unknown expert routing {spec.get('kind')!r} in manifest.json; "
                              "upgrade edgevl or convert the model again")
        self.spec, self.kind, self.k = spec, spec["kind"], int(spec["top_k"])
        self.biases = biases or {}
        self.modality_ids = np.asarray(spec.get("modality_token_ids", []), np.int64)

    def modality(self, ids, n: int) -> np.ndarray:
        """Per-row modality: 1 for rows whose token id is an image/video placeholder (the rows
        that carry vision embeddings), else 0; all 0 when the ids are unknown."""
        if ids is None or not self.modality_ids.size:
            return np.zeros(n, np.int64)
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size != n:
            raise ValueError(f"{ids.size} token ids for {n} rows")
        return np.isin(ids, self.modality_ids).astype(np.int64)

    def __call__(self, layer: int, logits: np.ndarray, modality: np.ndarray | None = None):
        if self.kind == "softmax":
            return softmax_topk(logits, self.k, bool(self.spec.get("renormalize", True)))
        if modality is None:
            modality = np.zeros(len(logits), np.int64)
        return sigmoid_topk_biased(logits, self.k, self.biases[layer], modality, float(self.spec["scale"]),
                                   float(self.spec.get("eps", 1e-20)))


def group_by_expert(idx: np.ndarray, weights: np.ndarray):
    """Yield (expert, rows, row weights) for every expert chosen by some row, experts ascending
    (the order transformers accumulates in). A row picks an expert at most once."""
    n, k = idx.shape
    flat = idx.reshape(-1)
    order = np.argsort(flat, kind="stable")
    experts, starts = np.unique(flat[order], return_index=True)
    bounds = list(starts[1:]) + [flat.size]
    w = weights.reshape(-1)
    for e, s, t in zip(experts, starts, bounds):
        sel = order[s:t]
        yield int(e), sel // k, w[sel]


# ---------------------------------------------------------------------------------------------
# graph emitters (decoder side)


def emit_router(ctx: Ctx, x: str, name: str, num_experts: int, hidden: int, out: str | None = None) -> str:
    """Router logits [seq, E]: never quantized, and fp32 out (a bf16 logit would reorder
    near-tied experts)."""
    return ctx.linear(x, name, num_experts, hidden, out=out, quantize=False, fp32_output=True)


def emit_shared_expert(ctx: Ctx, x: str, prefix: str, hidden: int, inter: int, gate: str | None = None) -> str:
    """The always-on SwiGLU expert; with ``gate`` (Qwen's ``shared_expert_gate``, a Linear
    H -> 1) it is scaled by sigmoid(gate(x)) per row."""
    g = ctx.g
    s = swiglu_mlp(ctx, x, prefix, hidden, inter)
    if gate is None:
        return s
    gl = ctx.linear(x, gate, 1, hidden, quantize=False)                 # (h=seq, w=1)
    gl = G.sigmoid(g, gl, name=f"{gate}.sigmoid")
    return G.binary(g, s, gl, "mul", name=f"{gate}.mul")                 # broadcast over w


def emit_sparse_moe(ctx: Ctx, x: str, layer: int, prefix: str, hidden: int, num_experts: int,
                    shared: dict | None = None, hook: str = "moe") -> tuple[str, dict]:
    """A sparse MoE block on the normed input blob ``x`` (give it a stable name: the host
    extracts it). Returns (output blob = routed + shared, the decoder ``passes`` entry).

    ``shared``: {"prefix", "inter", "gate"} of the shared expert, or None. The routed output is
    a placeholder (x·0) that the host hook replaces by feeding ``layer{i}.moe_routed``."""
    g = ctx.g
    logits = emit_router(ctx, x, f"{prefix}.gate", num_experts, hidden, out=f"layer{layer}.router_logits")
    routed = G.binary_scalar(g, x, "mul", 0.0, name=f"{prefix}.routed_placeholder", out=f"layer{layer}.moe_routed")
    out = routed
    if shared:
        s = emit_shared_expert(ctx, x, shared["prefix"], hidden, int(shared["inter"]), shared.get("gate"))
        out = G.binary(g, routed, s, "add", name=f"{prefix}.add_shared")
    spec = {"extract": [x, logits], "hook": hook,
            "args": {"layer": int(layer), "input": x, "logits": logits, "output": routed}}
    return out, spec


# ---------------------------------------------------------------------------------------------
# expert storage (conversion side)

# Storage of expert weights. "auto": q8 in every reduced-precision package (experts are ~95 %
# of an MoE model's bytes), fp32 in fp32 packages (exact parity runs).
EXPERT_DTYPES = ("auto", "q8", "bf16", "fp16", "fp32")
# what conversion hashes each expert block with (package.EXPERT_CHECKSUMS): the runtime checks a
# block when it reads it, since experts are read for the life of the process, long after the
# package's files were verified at load
EXPERT_CHECKSUM = "sha256-128"


def dense_float_layers(package_dtype: str, choice: str = "auto"):
    """The ``float_layers`` policy (``base.weight_ctx``) of an MoE decoder's dense path: in q8
    packages bf16 by default (its error moves the router's input, and with activations quantized
    per row, ncnn's int8 Gemm, near-tied experts flipped often enough to put a token outside the
    reference's top 3 on the conformance models), int8 like the experts with ``dense`` q8.
    The router and Qwen's shared-expert gate are never quantized (``emit_router``,
    ``emit_shared_expert``)."""
    if choice == "q8" and package_dtype != "q8":
        raise EdgevlError(f"--dense q8 makes a q8 package's dense path int8; it needs --dtype q8 (got {package_dtype})")
    return None if choice == "q8" else (lambda name: True)


def expert_dtype(package_dtype: str, choice: str = "auto") -> str:
    if choice not in EXPERT_DTYPES:
        raise EdgevlError(f"experts must be one of {', '.join(EXPERT_DTYPES)}, got {choice!r}")
    if choice != "auto":
        return choice
    return "fp32" if package_dtype == "fp32" else "q8"


def emit_expert(g: G.Graph, x: str, gate_up, down, inter: int, dtype: str, name: str = "",
                out: str | None = None) -> str:
    """One routed expert: down(silu(gate x) * up x) with gate and up as ONE Gemm (rows
    [gate; up]), so x is read once."""
    quant = Q8_QUANT if dtype == "q8" else None
    store = "bf16" if dtype == "q8" else dtype
    p = f"{name}." if name else ""
    h = G.gemm(g, x, gate_up, store, quant=quant, name=f"{p}gate_up")
    gate, up = G.slice_(g, h, [inter, inter], axis=1, name=f"{p}split")
    gate = G.swish(g, gate, name=f"{p}silu")
    h = G.binary(g, gate, up, "mul", name=f"{p}mul")
    return G.gemm(g, h, down, store, quant=quant, name=f"{p}down", out=out)


class ExpertSlice:
    """Rows [r0, r1) of expert ``e`` of a fused [E, R, K] checkpoint tensor, as a lazy [r1-r0, K]
    matrix (reads only those rows from the file)."""

    def __init__(self, t, e: int, r0: int = 0, r1: int | None = None):
        if len(t.shape) != 3:
            raise EdgevlError(f"tensor {t.name} has shape {list(t.shape)}; expected [experts, rows, cols]")
        self.t, self.e = t, int(e)
        self.r0, self.r1 = int(r0), int(t.shape[1] if r1 is None else r1)
        self.shape = (self.r1 - self.r0, int(t.shape[2]))

    def read_rows(self, a: int, b: int) -> np.ndarray:
        first = self.e * self.t.shape[1] + self.r0     # in rows of width K
        return self.t.read_rows(first + a, first + b, self.shape[1], f"{self.t.name} (expert {self.e})", self.r0 + a)


def fused_expert(ctx_or_ckpt, gate_up_name: str, down_name: str, e: int, hidden: int, inter: int,
                 num_experts: int, progress=None):
    """(gate_up [2I, H], down [H, I]) of expert ``e`` from fused [E, 2I, H] / [E, H, I] tensors
    (transformers' in-memory expert layout; gate rows first)."""
    ckpt = getattr(ctx_or_ckpt, "ckpt", ctx_or_ckpt)
    gu = ckpt.get(gate_up_name, (num_experts, 2 * inter, hidden))
    dn = ckpt.get(down_name, (num_experts, hidden, inter))
    if progress is not None:
        progress(gu)
        progress(dn)
    return ExpertSlice(gu, e), ExpertSlice(dn, e)


def split_expert(ckpt, prefix: str, hidden: int, inter: int, progress=None,
                 names=("gate_proj", "up_proj", "down_proj")):
    """(gate_up, down) of one expert stored as separate Linear weights ``{prefix}.{name}.weight``
    (Qwen-MoE checkpoints on disk)."""
    g = ckpt.get(f"{prefix}.{names[0]}.weight", (inter, hidden))
    u = ckpt.get(f"{prefix}.{names[1]}.weight", (inter, hidden))
    d = ckpt.get(f"{prefix}.{names[2]}.weight", (hidden, inter))
    if progress is not None:
        for t in (g, u, d):
            progress(t)
    return RowStack([g, u], f"{prefix} expert gate/up"), d


@dataclass
class ExpertWriter:
    """Writes ``experts.bin`` (every expert's Gemm weights, streamed) and ``experts.param``.

    Call ``add_layer(layer, experts, bias)`` per MoE layer with the layer's experts in order
    (each a (gate_up, down) pair of lazy [2I, H] / [H, I] sources), then ``finish(routing)`` for
    the manifest's ``experts`` section."""
    out: Path
    hidden: int
    inter: int
    num_experts: int
    dtype: str                                   # q8 | bf16 | fp16 | fp32 (see expert_dtype)
    layers: dict = field(default_factory=dict)
    _g: G.Graph | None = None
    _expert_bytes: int | None = None
    _rfd: int | None = None

    def __post_init__(self):
        self.out = Path(self.out)
        if self.dtype not in EXPERT_DTYPES[1:]:
            raise EdgevlError(f"unknown expert dtype {self.dtype!r}")
        self._g = G.Graph(self.out / "experts.bin")

    def add_layer(self, layer: int, experts, bias: np.ndarray | None = None) -> None:
        g, count, start, hashes = self._g, 0, None, []
        for e, (gate_up, down) in enumerate(experts):
            name = f"l{layer}.e{e}"
            x = g.input(f"{name}.x")
            before = len(g.weight_offsets)
            emit_expert(g, x, gate_up, down, self.inter, self.dtype, name)
            # the expert's bytes: every weight its layers wrote (written back to back)
            new = list(islice(reversed(g.weight_offsets.values()), len(g.weight_offsets) - before))
            s, end = min(o for o, _ in new), max(o + n for o, n in new)
            size = end - s
            if self._expert_bytes is None:
                self._expert_bytes = size
            if size != self._expert_bytes or (start is not None and s != start + e * size):
                raise EdgevlError("experts of one package must have equal shapes; the checkpoint is inconsistent")
            start = s if start is None else start
            hashes.append(self._digest(s, size))
            count += 1
        if count != self.num_experts:
            raise EdgevlError(f"layer {layer} has {count} experts but config.json says {self.num_experts}")
        entry = {"layer": int(layer), "offset": int(start)}
        if bias is not None:
            b = np.ascontiguousarray(bias, np.float32)
            G.memory_data(g, b, name=f"l{layer}.bias")  # fp32, after a 4-byte type tag
            entry["bias"] = {"offset": int(g.weight_offsets[f"l{layer}.bias"][0]) + 4,
                             "shape": [int(s) for s in b.shape]}
        entry["hashes"] = hashes
        self.layers[int(layer)] = entry

    def _digest(self, start: int, size: int) -> str:
        """The checksum of the expert block just written at ``start``, read back while the page
        cache still holds it."""
        self._g._bin.flush()
        if self._rfd is None:
            self._rfd = os.open(self._g.bin_path, os.O_RDONLY)
        new, keep = EXPERT_CHECKSUMS[EXPERT_CHECKSUM]
        return new(os.pread(self._rfd, size, start)).digest()[:keep].hex()

    def finish(self, routing: dict) -> dict:
        if routing.get("kind") not in ROUTING_KINDS:
            raise EdgevlError(f"unknown routing kind {routing.get('kind')!r}")
        self._g.close()
        if self._rfd is not None:
            os.close(self._rfd)
            self._rfd = None
        pg = G.Graph(os.devnull)  # the one expert net every byte range loads into
        x = pg.input("x")
        emit_expert(pg, x, np.zeros((2 * self.inter, self.hidden), np.float32),
                    np.zeros((self.hidden, self.inter), np.float32), self.inter, self.dtype, out="y")
        pg.save(self.out / "experts.param")
        return {"file": "experts.bin", "param": "experts.param", "dtype": self.dtype,
                "hidden_size": self.hidden, "intermediate_size": self.inter, "num_experts": self.num_experts,
                "expert_bytes": int(self._expert_bytes or 0), "routing": dict(routing), "checksum": EXPERT_CHECKSUM,
                "layers": [self.layers[k] for k in sorted(self.layers)]}


# ---------------------------------------------------------------------------------------------
# expert store (runtime side)


class ExpertStore:
    """Runs chosen experts as ncnn nets loaded on demand from ``experts.bin``.

    ``cache_mb``: the most expert memory kept resident (MiB); None keeps every expert once
    loaded. The budget is split evenly between the MoE layers, and each layer drops its least
    recently used experts first, before a new one loads, so the budget is never exceeded. One
    LRU over all layers would evict, at every miss, the experts the layers sweep back to next
    (a forward visits the layers in order): with a cache smaller than one token's working set
    (layers x top-k experts) it kept almost no hits (1.3 % on the 449 M benchmark package with a
    100 MB cache); per layer it keeps about a layer's share of its experts (docs/moe.md, section 8). A decode
    step runs its cached experts before loading the missing ones, so a load never evicts an
    expert the step still needs. An expert's cost is what its loaded net holds, measured on the first load
    (the C heap's growth; ~1.12x its bytes in the package for q8), never less than those bytes.
    A miss loads into the net of the expert it evicts (ncnn refills the same weight buffers),
    so a small cache does not fragment the heap. With a budget, a prompt's pass through a layer
    ends by giving the heap's free pages back (``trim_heap``). All nets share one pair of pool
    allocators for activations, emptied after every call, so no net keeps buffers of its own.
    A miss checks the expert's bytes against its checksum before anything is evicted for it
    (``_read``); a damaged or changed file is a ``PackageError``.
    ``stats()`` reports hits, misses, evictions and the resident bytes (now and peak)."""

    def __init__(self, folder, spec: dict, threads: int = 1, cache_mb: float | None = None):
        self.folder, self.spec = Path(folder), spec
        self.hidden, self.inter = int(spec["hidden_size"]), int(spec["intermediate_size"])
        self.num_experts, self.expert_bytes = int(spec["num_experts"]), int(spec["expert_bytes"])
        self.threads = int(threads)
        if cache_mb is not None and cache_mb < 0:
            raise EdgevlError(f"expert cache size must be >= 0 MB, got {cache_mb}")
        self.budget = None if cache_mb is None else int(float(cache_mb) * (1 << 20))
        self.layers = {int(entry["layer"]): entry for entry in spec["layers"]}
        self.param = (self.folder / spec["param"]).read_text()
        self.dtype = spec["dtype"]
        # bf16 experts keep bf16 in memory; q8 and fp32 experts run with fp32 activations (q8
        # loads faster that way and quantizes its activations per call anyway).
        self.net_dtype = "bf16" if self.dtype == "bf16" else "fp32"
        self.path = self.folder / spec["file"]
        self._fd = os.open(self.path, os.O_RDONLY)
        st = os.fstat(self._fd)
        self._file_id, self.file_bytes = (st.st_dev, st.st_ino), st.st_size
        # per layer the expert blocks' digests (None: a package converted before checksums)
        self._check, self._digests = None, None
        if spec.get("checksum") is not None:
            if spec["checksum"] not in EXPERT_CHECKSUMS:
                raise EdgevlError(f"unknown expert checksum {spec['checksum']!r} in manifest.json; upgrade edgevl "
                                  "or convert the model again")
            self._check = EXPERT_CHECKSUMS[spec["checksum"]]
            self._digests = {layer: [bytes.fromhex(h) for h in entry["hashes"]] for layer, entry in self.layers.items()}
        if self.budget is not None:
            _fixed_mmap_threshold()
        self._blob_pool, self._work_pool = ncnn.PoolAllocator(), ncnn.PoolAllocator()
        # per layer: expert -> net, least recently used first; each layer's share of the budget
        self._nets: dict[int, OrderedDict] = {layer: OrderedDict() for layer in self.layers}
        self.share = None if self.budget is None else self.budget / max(1, len(self.layers))
        self.cost = self.expert_bytes       # resident bytes per loaded expert (measured at first load)
        self._replaced = False              # experts.bin was reopened after a replacement (_source)
        self._staging = None                # an expert's bytes while they are checked (_verified)
        self._measured = False
        self.hits = self.misses = self.evictions = 0
        self.resident = self.peak_resident = 0

    def close(self) -> None:
        for nets in self._nets.values():    # nets first: they use the pools
            nets.clear()
        self.resident = 0
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit anything may be gone already
            pass

    def read_bias(self, layer: int) -> np.ndarray | None:
        b = self.layers[layer].get("bias")
        if b is None:
            return None
        n = int(np.prod(b["shape"])) * 4
        return np.frombuffer(os.pread(self._fd, n, int(b["offset"])), "<f4").reshape(b["shape"]).copy()

    def _read(self, layer: int, e: int) -> tuple[int, memoryview | None]:
        """Where expert ``e`` of ``layer`` starts in experts.bin, after checking that the file is
        still the one loaded, and with checksums its bytes, verified (else None: ncnn reads them
        from the file itself)."""
        entry = self.layers.get(layer)
        if entry is None or not 0 <= e < self.num_experts:
            raise EdgevlError(f"no expert {e} in layer {layer} of this package; convert the model again")
        off = int(entry["offset"]) + e * self.expert_bytes
        fd = self._source()
        if off + self.expert_bytes > self.file_bytes:
            raise PackageError(f"{self.path} ends inside expert {e} of layer {layer}: it is shorter than the "
                               "manifest says; convert the model again or restore the file")
        # with checksums, the expert is checked before ncnn parses a byte of it (ncnn trusts the
        # type tags inside the weights: damaged ones make it read other byte counts, print raw
        # errors and pack garbage) and before anything is evicted for it. It waits in one kept
        # expert-sized buffer that ncnn's buffers are then filled from: a copy of ~0.3 ms next to
        # a 3-4 ms load of a 3 MB expert, where hashing it costs ~1.8 ms.
        return off, None if self._digests is None else self._verified(fd, layer, e, off)

    def _load(self, layer: int, e: int, off: int, data: memoryview | None,
              into: ncnn.Net | None = None) -> ncnn.Net:
        """Expert ``e`` of ``layer`` as a net, from ``data`` (see ``_read``) or the file at
        ``off``: loaded into ``into`` (an evicted expert's net, whose weight buffers ncnn then
        refills in place) or a new one."""
        before = None if self._measured else _heap_bytes()
        net = into
        if net is None:
            net = ncnn.Net()
            set_net_options(net.opt, self.threads, self.net_dtype)
            net.opt.blob_allocator, net.opt.workspace_allocator = self._blob_pool, self._work_pool
            if net.load_param_mem(self.param) != 0:
                raise EdgevlError(f"ncnn could not parse {self.spec['param']}; convert the model again")
        if _SpanReader.usable():
            reader = _SpanReader(self._fd, off, self.expert_bytes) if data is None else \
                _SpanReader(None, 0, self.expert_bytes, data)
            ok = net.load_model(reader) == 0 and reader.pos == reader.end
        else:       # a wheel whose DataReader cannot hand out its buffer: one copy more
            data = os.pread(self._fd, self.expert_bytes, off) if data is None else bytes(data)
            ok = len(data) == self.expert_bytes
            if ok:
                net.load_model_mem(data)   # the binding copies the bytes; packing happens inside the call
        del data
        if not ok:      # bytes that fit no net: damaged, in a package without checksums
            raise PackageError(f"{self.path}: expert {e} of layer {layer} does not load as {self.spec['param']} says "
                               "(the file changed after conversion); convert the model again or restore the file")
        if before is not None:
            after = _heap_bytes()
            if before and after:
                self.cost = max(self.expert_bytes, after - before)
            self._measured = True
        return net

    def _verified(self, fd: int, layer: int, e: int, off: int) -> memoryview:
        """Expert ``e`` of ``layer`` read into the staging buffer, checked against its digest."""
        if self._staging is None:
            self._staging = bytearray(self.expert_bytes)
        view = memoryview(self._staging)
        try:
            n = os.preadv(fd, [view], off)
        except OSError as exc:
            raise PackageError(f"{self.path}: reading expert {e} of layer {layer} failed ({exc.strerror or exc}); "
                               "check the disk, restore the file or convert the model again") from None
        new, keep = self._check
        if n != self.expert_bytes or new(view).digest()[:keep] != self._digests[layer][e]:
            why = ("the file was replaced while the model runs" if self._replaced
                   else "the file changed after conversion")
            raise PackageError(f"{self.path}: expert {e} of layer {layer} does not match its checksum ({why}); "
                               "convert the model again or restore the file")
        return view

    def _source(self) -> int:
        """The descriptor to read a missing expert from, once two syscalls have checked that
        experts.bin is still the file the model loaded: one replaced (a new file renamed over it)
        is reopened, its experts then checked against the manifest's digests as they load, and
        one whose size changed (cut short, rewritten) is refused before ncnn reads from it."""
        try:
            st = os.stat(self.path)
        except OSError:     # removed: the open descriptor still reads the bytes verified at load
            st = None
        # without digests a new file cannot be checked, while the old descriptor still reads
        # the bytes verified at load: keep reading those
        if st is not None and (st.st_dev, st.st_ino) != self._file_id and self._digests is not None:
            if st.st_size != self.file_bytes:
                raise PackageError(f"{self.path} was replaced while the model runs by a file of {st.st_size} "
                                   f"bytes, not the package's {self.file_bytes}; restore the package's file or "
                                   "convert the model again")
            try:
                fd = os.open(self.path, os.O_RDONLY)
            except OSError:     # gone again: the old descriptor still reads the verified bytes
                fd = None
            if fd is not None:
                os.close(self._fd)
                st = os.fstat(fd)
                self._fd, self._file_id, self._replaced = fd, (st.st_dev, st.st_ino), True
        now = os.fstat(self._fd).st_size
        if now != self.file_bytes:
            raise PackageError(f"{self.path} is {now} bytes, not the {self.file_bytes} it had when the model loaded "
                               "(cut short or rewritten while the model runs); restore the file or convert the "
                               "model again")
        return self._fd

    def cached(self, layer: int, e: int) -> bool:
        return e in self._nets.get(layer, ())

    def net(self, layer: int, e: int) -> ncnn.Net:
        nets = self._nets.get(layer)
        net = None if nets is None else nets.get(e)
        if net is not None:
            self.hits += 1
            nets.move_to_end(e)
            return net
        self.misses += 1
        off, data = self._read(layer, e)    # a damaged expert fails here and costs the cache nothing
        spare = []
        if self.budget is not None:  # make room first: memory stays within the budget
            # this layer's share first; then (a share smaller than one expert) the fullest layer's
            while nets and (len(nets) + 1) * self.cost > self.share:
                spare.append(self._evict(nets))
            while self.resident + self.cost > self.budget and self.resident:
                spare.append(self._evict(max(self._nets.values(), key=len)))
        # The new expert loads into an evicted one's net: every expert has the same shapes, so
        # ncnn refills the same weight buffers. Freeing them and allocating new ones left the C
        # heap ever more fragmented (a 300 MB cache at the 35B-A3B layer shapes: 171 MB free
        # in 953 holes after 10 tokens; docs/moe.md, section 7).
        into = spare.pop() if spare else None
        del spare
        net = self._load(layer, e, off, data, into)
        nets[e] = net
        self.resident += self.cost
        self.peak_resident = max(self.peak_resident, self.resident)
        return net

    def _evict(self, nets: OrderedDict) -> ncnn.Net:
        _, net = nets.popitem(last=False)
        self.resident -= self.cost
        self.evictions += 1
        return net

    def preload(self, progress: bool = False) -> None:
        """Load every expert that fits, each layer up to its share of the budget (all-resident
        runs: no loading inside timed work or a server's first requests)."""
        from ..progress import Progress

        bar = Progress(len(self.layers) * self.num_experts, "loading experts", unit="experts", enabled=progress)
        try:
            for layer in sorted(self.layers):
                for e in range(self.num_experts):
                    if self.budget is not None and (len(self._nets[layer]) + 1) * self.cost > self.share:
                        break
                    if not self.cached(layer, e):   # a second preload counts no hits
                        self.net(layer, e)
                    bar.update(1)
        finally:
            bar.close()

    def run(self, layer: int, e: int, x) -> np.ndarray:
        """Expert ``e`` of ``layer`` on rows x [n, H] (an array or an input Mat) -> [n, H]."""
        ex = self.net(layer, e).create_extractor()
        ex.input("x", x if isinstance(x, ncnn.Mat) else to_mat(x))
        m = ncnn.Mat()
        if ex.extract("y", m) != 0:
            raise RuntimeError(f"ncnn failed to run expert {e} of layer {layer}")
        return from_mat(m).reshape(-1, self.hidden)  # a copy: m's buffer returns to the pool

    def compute(self, layer: int, x: np.ndarray, idx: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Σ_k weights[:, k] · expert_{idx[:, k]}(x) per row; each chosen expert runs once on all
        the rows that chose it, experts in ascending order (transformers' summation order)."""
        x = np.ascontiguousarray(x, np.float32).reshape(-1, self.hidden)
        try:
            if len(x) == 1:  # decode: the chosen experts all read the one row, fed once
                xm = to_mat(x)
                chosen = dict(zip(idx[0].tolist(), weights[0].tolist()))
                # cached experts first: loading the others may then evict only experts already run
                run = sorted(chosen, key=lambda e: not self.cached(layer, e))
                outs = {e: self.run(layer, e, xm) for e in run}
                y = np.zeros_like(x)
                for e in sorted(chosen):        # summed in ascending order all the same
                    y += outs[e] * chosen[e]
                return y
            y = np.zeros_like(x)
            for e, rows, w in group_by_expert(idx, weights):
                y[rows] += self.run(layer, e, x[rows]) * w[:, None]
            if self.budget is not None:
                # a prompt's temporaries freed between the loads of the experts it chose stay
                # resident as heap holes until the prompt ends; a memory budget bounds them per
                # layer (35B-A3B layer shapes, 300 MB cache, 128 tokens: peak 1598 -> 1548 MB,
                # prefill 1.43 -> 1.52 s)
                trim_heap()
            return y
        finally:
            self._blob_pool.clear()
            self._work_pool.clear()

    def stats(self) -> dict:
        calls = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "hit_rate": self.hits / calls if calls else 0.0, "resident_bytes": self.resident,
                "peak_resident_bytes": self.peak_resident, "budget_bytes": self.budget,
                "expert_bytes": self.expert_bytes, "expert_cost_bytes": self.cost}

    def summary(self) -> str:
        """One line for users: hit rate and resident memory against the budget."""
        s = self.stats()
        def mb(n):   # budgets under 1 MB are not "0 MB"
            return f"{n / 2**20:.0f}" if n >= 2**20 or n == 0 else f"{n / 2**20:.2g}"

        budget = "no limit" if self.budget is None else f"{mb(self.budget)} MB budget"
        over = ("; the expert being computed stays resident over a smaller budget"
                if self.budget is not None and s["peak_resident_bytes"] > self.budget else "")
        return (f"experts: {s['hits']} hits, {s['misses']} loads ({100 * s['hit_rate']:.1f} % hit rate), "
                f"{mb(s['peak_resident_bytes'])} MB resident at most ({budget}{over})")


class _SpanReader(ncnn.DataReader):
    """Feeds ncnn's model loader one byte range of a file (or of ``data``), read straight into
    the buffers ncnn allocates for the weights. ``load_model_mem`` needed the range as Python
    bytes and copied it again inside the binding: two expert-sized temporaries per load, which
    cost time on every cache miss (64 tokens with a 100 MB cache on the 449 M package, 1 thread,
    median of 3: 4.6 s instead of 5.5 s; same tokens)."""

    _usable = None

    def __init__(self, fd, offset: int, size: int, data=None):
        super().__init__()
        self.fd, self.data, self.pos, self.end = fd, data, int(offset), int(offset) + int(size)

    def scan(self, fmt, p) -> int:      # only load_param reads text
        return 0

    def read(self, buf, size) -> int:
        # called from inside ncnn's C++ loader: an exception must not cross it, so any failure
        # is a short read, which ncnn reports as a failed load
        try:
            size = min(int(size), self.end - self.pos)
            ptr = _capsule_pointer(buf) if size > 0 else None
            if not ptr:
                return 0
            view = memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")
            if self.data is not None:
                view[:] = self.data[self.pos:self.pos + size]
                n = size
            else:
                n = os.preadv(self.fd, [view], self.pos)
        except Exception:  # noqa: BLE001 - inside ncnn's loader: a short read is how a failure is reported
            return 0
        self.pos += n
        return n

    @classmethod
    def usable(cls) -> bool:
        """Whether this ncnn wheel hands a Python reader its buffer as a capsule: checked once by
        loading a two-value MemoryData net through one and reading the values back."""
        if cls._usable is None:
            try:
                want = np.array([1.5, -2.0], np.float32)
                net = ncnn.Net()
                net.load_param_mem("7767517\n1 1\nMemoryData data 0 1 data 0=2\n")
                ok = net.load_model(cls(None, 0, want.nbytes, want.tobytes())) == 0
                out = ncnn.Mat()
                ok = ok and net.create_extractor().extract("data", out) == 0
                cls._usable = bool(ok and np.array_equal(np.array(out).reshape(-1), want))
            except Exception:  # noqa: BLE001 - any failure means this wheel cannot do it
                cls._usable = False
        return cls._usable


# private prototypes (not ctypes.pythonapi's shared ones, whose argtypes other code may set)
_capsule_pointer_of = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))


def _capsule_pointer(capsule) -> int | None:
    """The address a pybind11 capsule holds (ncnn's buffer for a DataReader.read)."""
    return _capsule_pointer_of(capsule, _capsule_name(capsule))


def _heap_bytes() -> int:
    """Bytes glibc's malloc has handed out (mallinfo2), or 0 where that is not available."""
    info = heap_info()
    return 0 if info is None else info[0]


def _fixed_mmap_threshold(nbytes: int = 256 << 10) -> None:
    """Make glibc serve every allocation >= 256 KiB with its own mmap, returned to the system
    on free. By default glibc raises that threshold to the largest block freed so far (up to
    32 MiB), after which evicted experts' buffers stay in the heap: with a 24 MB cache the
    process grew by 58 MB instead of 39 (measured). No-op off glibc.

    In a loaded model this holds only until the next graph loads: ``runtime.load_arena`` sets
    32 MiB on exit, and this runs once per process. Expert memory then comes from the heap;
    a miss refills an evicted expert's buffers (``ExpertStore.net``), so evictions leave no
    holes there (docs/moe.md, section 7). Keeping 256 KiB made a small-cache decode 3-5x
    slower on the 2-core VM, where a fresh page costs ~12 us of kernel time, so it was left as
    it is."""
    global _MMAP_FIXED
    if _MMAP_FIXED:
        return
    _MMAP_FIXED = True
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, int(nbytes))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


_MMAP_FIXED = False


def make_router(store: ExpertStore) -> Router:
    spec = store.spec["routing"]
    biases = {layer: store.read_bias(layer) for layer in store.layers} if spec["kind"] == "sigmoid_biased" else {}
    return Router(spec, biases)


# ---------------------------------------------------------------------------------------------
# what an MoE architecture offers and runs (its family composes these: options, runtime
# options, the expert store per loaded package, statistics, preloading, the llama.cpp profile)

OPTIONS = {"experts": Option(EXPERT_DTYPES, "auto",
                             "storage of the routed experts (auto: q8 in bf16/fp16/q8 packages, fp32 in fp32 ones)",
                             label="{value} experts"),
           "dense": Option(("auto", "q8"), "auto",
                           "the dense path of a q8 package (attention, linear-attention projections, shared "
                           "expert): auto keeps it bf16; q8 makes its Gemms int8 like the experts' (faster; flips "
                           "more near-tied expert choices; the router stays bf16)", label="{value} dense")}
RUNTIME_OPTIONS = {"expert_cache_mb": RuntimeOption(
    float, "keep at most this many MB of routed-expert weights in memory, loading the others from the package "
           "when chosen (an even share per MoE layer, least recently used out first; default: no limit when they "
           "fit in 80%% of the memory available, else that much)", "MB", minimum=0)}
# llama.cpp's names of the routed experts' tensors (a GGUF may store them in their own type)
LLAMACPP_PARTS = {"experts": r"_exps\.weight$"}


def open_experts(pkg) -> ExpertStore:
    """The package's expert store, from the manifest's ``experts`` section (checked: listed,
    inside the package, verified), kept in ``pkg.resources`` for statistics and preloading."""
    spec = pkg.manifest.get("experts")
    if not isinstance(spec, dict) or "layers" not in spec:
        raise EdgevlError("manifest.json lacks the experts section of a mixture-of-experts package; "
                          "convert the model again")
    for key, what in (("file", "experts file"), ("param", "experts graph")):
        pkg.file(spec.get(key), what)
    cache = pkg.options.get("expert_cache_mb")
    if cache is None:
        cache = auto_cache_mb(pkg, spec)
    store = ExpertStore(pkg.path, spec, threads=pkg.threads, cache_mb=cache)
    pkg.resources["experts"] = store
    return store


def llamacpp_type(manifest: dict) -> str | None:
    """Experts stored apart from the dense path's dtype pair with a GGUF whose routed experts
    (and, for a q8 package, the head: int8 here too) are q8_0 and the rest bf16/f16."""
    dtype, opts = manifest.get("dtype"), manifest.get("options") or {}
    experts = GGUF_OF_DTYPE.get((manifest.get("experts") or {}).get("dtype"))
    base, head = GGUF_OF_DTYPE.get(dtype), None
    if base is None:
        return None
    if dtype == "q8" and opts.get("dense") != "q8":
        base, head = "bf16", "q8_0"   # the dense path stays bf16 (dense_float_layers)
    apart = {}   # type -> the parts stored in it, when not the base type
    for t, part in ((experts, "experts"), (head, "head")):
        if t not in (None, base):
            apart.setdefault(t, []).append(part)
    return base + "".join(f"+{t}-{'-'.join(parts)}" for t, parts in apart.items())


def bench_profile(convert_args: tuple = (), convert_args_of=None) -> BenchProfile:
    return BenchProfile(convert_args=convert_args, convert_args_of=convert_args_of, parts=LLAMACPP_PARTS,
                        type_of=llamacpp_type)


def runtime_stats(pkg) -> dict:
    store = pkg.resources.get("experts")
    return {} if store is None else {"experts": dict(store.stats(), summary=store.summary())}


def preload(pkg, progress: bool = False) -> None:
    """Every expert, when the model keeps them all resident (no ``expert_cache_mb``); with a
    cache, nothing: which experts to keep is better learnt from the requests."""
    store = pkg.resources.get("experts")
    if store is not None and store.budget is None:
        store.preload(progress)


AUTO_SHARE = 0.8       # of the memory available: the rest for activations, the system, other programs
COST_MARGIN = 1.15     # a loaded expert holds up to ~1.12x its bytes in the package (ExpertStore.cost)


def auto_cache_mb(pkg, spec: dict) -> float | None:
    """The expert cache when none was asked for: no limit (None) if every routed expert fits in
    ``AUTO_SHARE`` of the memory available now (the decoder is loaded by then; the graphs still to
    load are counted), else that much, said once on stderr. A model whose experts do not fit
    would otherwise load them until the system runs out of memory."""
    import sys

    avail = available_memory()
    if avail is None:
        return None
    pending = 0
    for name in pkg.manifest.get("graphs", {}):
        f = pkg.path / f"{name}.bin"
        if name != "decoder" and f.is_file():
            pending += f.stat().st_size
    room = AUTO_SHARE * avail - pending
    total = int(spec["expert_bytes"]) * int(spec["num_experts"]) * len(spec["layers"])
    if total * COST_MARGIN <= room:
        return None
    mb = max(0.0, room) / (1 << 20)

    def size(n):
        return f"{n / 2 ** 30:.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MB"

    print(f"note: the routed experts ({size(total)}) do not fit in the memory available ({size(avail)}); "
          f"keeping at most {size(max(0.0, room))} of them loaded (--expert-cache-mb N, Python "
          f"expert_cache_mb=N, to choose)", file=sys.stderr)
    return mb


def moe_hook(store: ExpertStore, router: Router | None = None):
    """The host function a decoder ``passes`` entry of :func:`emit_sparse_moe` names: routes the
    extracted rows and returns the routed experts' output blob. ``ids`` (the rows' token ids, if
    the runtime hands them over) give each row's modality for biased routing."""
    router = router or make_router(store)

    def hook(blobs: dict, seq: int, layer: int, input: str, logits: str, output: str, ids=None) -> dict:
        x = blobs[input].reshape(-1, store.hidden)
        lg = blobs[logits].reshape(len(x), -1)
        idx, w = router(layer, lg, router.modality(ids, len(x)))
        return {output: store.compute(layer, x, idx, w)}

    return hook
