"""Driving converted ncnn graphs from Python: nets, per-layer state, embeddings, the lm_head.

Nothing here knows a model family: the manifest declares each decoder layer's state kind
(attention KV, or recurrent), and the architecture supplies rope tables and host hooks.

The ncnn facts this relies on are in docs/ncnn.md (sections 7 and 11): KV caches are extracted
with type=1 into a Mat we own and fed back unchanged; numpy inputs are cloned into ncnn before
``ex.input``; SDPA appends into the old cache in place, so a KV cache is linear (branching from a
prefix means re-prefilling).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import os
import platform

import ncnn
import numpy as np

from . import team
from .errors import EdgevlError
from .ncnn_graph import bf16_bits_to_f32
from .owner import checkpoint

TIMED_ROWS = 16     # forwards of up to this many rows are decode steps whose times choose the team


def max_threads() -> int:
    """The most threads accepted: ncnn crashed (segfault) when asked for 100000."""
    return 4 * (os.cpu_count() or 1)


def check_threads(n, what: str = "threads") -> int:
    limit = max_threads()
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limit:
        raise EdgevlError(f"{what} must be between 1 and {limit} (4 x the {os.cpu_count() or 1} CPUs here; "
                          f"best: the free physical cores), got {n!r:.40}")
    return n


def default_threads() -> int:
    """EDGEVL_THREADS, else the physical core count (more threads than free cores stalls ncnn)."""
    env = os.environ.get("EDGEVL_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise EdgevlError(f"EDGEVL_THREADS must be an integer, got {env!r}") from None
        return check_threads(n, "EDGEVL_THREADS")  # 0 is a mistake, as for --threads
    return usable_cores()


def usable_cores() -> int:
    """The physical cores this process may use: ncnn's count of the machine's, bounded by
    :func:`usable_cpus`."""
    try:
        n = int(ncnn.get_physical_cpu_count())
    except Exception:  # noqa: BLE001 - very old wheels
        n = 0
    n = n or (os.cpu_count() or 1)
    usable = usable_cpus()
    return max(1, min(n, usable) if usable else n)


def usable_cpus() -> int | None:
    """The CPUs this process may run on, where it is told: its affinity (``taskset``, a
    container's cpuset) and a CPU quota (``docker --cpus``, cgroup v2 or v1). ncnn counts the
    machine's cores, and a team of more threads than that waits for the scheduler at every layer."""
    n = None
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    quota = cpu_quota()
    if quota:
        n = min(n, quota) if n else quota
    return n


def cpu_quota(root: str = "/sys/fs/cgroup") -> int | None:
    """CPUs a cgroup quota allows (rounded up), or None without one."""
    import math

    for path, period_path in ((f"{root}/cpu.max", None),
                              (f"{root}/cpu/cpu.cfs_quota_us", f"{root}/cpu/cpu.cfs_period_us")):
        try:
            with open(path) as f:
                words = f.read().split()
            if period_path:
                with open(period_path) as f:
                    words += f.read().split()
            quota, period = words[0], float(words[1])
            if quota in ("max", "-1") or period <= 0:
                return None
            return max(1, math.ceil(float(quota) / period))
        except (OSError, ValueError, IndexError):
            continue
    return None


def to_mat(a: np.ndarray) -> ncnn.Mat:
    """A Mat that owns a float32 copy of ``a`` (any dtype, layout or view).

    ncnn.Mat(numpy) borrows the buffer without keeping a reference, so the contiguous array must
    stay alive until ``clone()`` has copied it: when ``ascontiguousarray`` has to copy (a view,
    a transpose, fp64), a temporary freed before the clone would be read after free."""
    buf = np.ascontiguousarray(a, dtype=np.float32)
    mat = ncnn.Mat(buf).clone()
    del buf  # only now may the buffer go
    return mat


def from_mat(m: ncnn.Mat) -> np.ndarray:
    return np.array(m, dtype=np.float32, copy=True)


def set_net_options(opt, threads: int, dtype: str, packing: bool = True) -> None:
    """ncnn options of a net in the package's precision (before its param and weights load)."""
    opt.num_threads = int(threads)  # before load: Gemm keeps the load-time value
    # packing off keeps blobs in the plain layout numpy reads: no repacking copies of large
    # host-held states between runs (for small weightless nets that pass a state through)
    opt.use_packing_layout = bool(packing)
    # fp16 packages on 64-bit ARM keep weights and activations in fp16 (half the memory and
    # bandwidth; the conversion is base ARMv8), and compute in fp16 where the CPU can (ARMv8.2
    # asimdhp: Cortex-A55/A76, RK3568/RK3588, Pi 5) — accuracy measured in docs/arm.md, section 4.
    # On x86 ncnn widens them to fp32. Everything else stays off: ncnn's own defaults would run
    # fp32 packages in fp16 on ARM.
    fp16 = dtype == "fp16" and platform.machine().lower() in ("aarch64", "arm64")
    opt.use_fp16_storage = fp16
    opt.use_fp16_packed = fp16
    opt.use_fp16_arithmetic = fp16 and bool(getattr(ncnn, "cpu_support_arm_asimdhp", lambda: 0)())
    # bf16 storage halves weight memory and bandwidth; fp32 packages stay exact.
    opt.use_bf16_storage = dtype == "bf16"
    opt.use_bf16_packed = dtype == "bf16"
    # ncnn's SIMD-packed blob layout (elempack 4/8/16) made every layout change (Reshape,
    # Permute, Crop, Slice between Gemms) a slow repacking pass: with it off the vision tower ran
    # 26.4 -> 19.6 CPU-s per 1024x768 image and a 128-token prefill 3.4 -> 2.4 CPU-s (1 thread);
    # Gemm and SDPA pack their operands themselves. Results are the same (docs/ncnn.md, section 12).
    opt.use_packing_layout = False


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4


@contextlib.contextmanager
def load_arena():
    """Let ncnn's load reuse freed memory instead of faulting in fresh pages.

    Loading a bf16 Gemm weight passes it through several large temporaries (a read buffer, an
    fp32 copy, a bf16 copy) before the packed copy it keeps. glibc serves blocks that large with
    mmap and unmaps them on free, so every temporary of every layer faulted in fresh zeroed pages:
    about 5 bytes of new memory per weight byte, and page faults were most of the load time
    (docs/benchmarks.md, section 7). With mmap off and no trimming during the load, each layer's temporaries
    reuse the previous layer's; afterwards the free memory goes back to the OS (malloc_trim) and
    the thresholds are set to where glibc's dynamic threshold ends up after such frees anyway
    (mmap above 32 MiB). No-op outside glibc."""
    try:
        libc = ctypes.CDLL(None)
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        yield
        return
    mallopt(_M_MMAP_MAX, 0)
    mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1)
    try:
        yield
    finally:
        mallopt(_M_MMAP_MAX, 65536)
        mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        mallopt(_M_TRIM_THRESHOLD, 64 << 20)
        trim(0)


_MALLINFO = None


def heap_info() -> tuple[int, int] | None:
    """(bytes in use, bytes free) of glibc's malloc (mallinfo2: the heap and its mmapped blocks);
    None outside glibc."""
    global _MALLINFO
    if _MALLINFO is None:
        try:
            class MallInfo2(ctypes.Structure):
                _fields_ = [(n, ctypes.c_size_t) for n in
                            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

            fn = ctypes.CDLL("libc.so.6").mallinfo2
            fn.restype = MallInfo2
            _MALLINFO = fn
        except (OSError, AttributeError):
            _MALLINFO = False
    if not _MALLINFO:
        return None
    m = _MALLINFO()
    return int(m.uordblks + m.hblkhd), int(m.fordblks)


def available_memory() -> int | None:
    """Bytes the system can still hand out without swapping (Linux ``MemAvailable``); None
    where that is unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def trim_heap(min_free: int = 0) -> None:
    """Give the C heap's free pages back to the system (glibc keeps freed blocks below its mmap
    threshold otherwise), if at least ``min_free`` bytes are free. No-op outside glibc."""
    if min_free:
        info = heap_info()
        if info is None or info[1] < min_free:
            return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def open_net(param, binfile, threads: int, dtype: str = "fp32", light_mode: bool = True,
             packing: bool = True) -> Net:
    """An ncnn graph with explicit options (e.g. an architecture's small fp32 helper nets, which
    load in fp32 with packing off whatever the package's dtype)."""
    return Net(str(param), str(binfile), threads, dtype, light_mode, packing)


# ncnn's Gemm splits a product among its threads by row tiles when there are at least as many
# tiles as threads, else by column tiles. Its own row tile for M rows is M / threads rounded up to
# the SIMD width (16 rows with AVX-512, 8 with AVX or NEON), so 40 rows on 2 threads became tiles
# of 32 and 8 and one thread did 4/5 of the work: any M just past a multiple of 32 cost as much as
# the next multiple (docs/ncnn.md, section 8). One tile as tall as the rows makes ncnn split the
# columns instead: linear in M, though about 12 % slower per row than an even split by rows.
SINGLE_TILE = 256           # rows of that one tile (param 20 of Gemm: constant_TILE_M)
_COLUMN_SPLIT_COST = 1.12   # a row's cost split by columns against split by rows (measured, bf16 and int8)


@functools.cache
def _simd_rows() -> int:
    """The granule ncnn rounds Gemm row tiles to on this CPU."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686", "x86"):
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((ln for ln in f if ln.startswith("flags")), "")
        except OSError:
            flags = ""
        return 16 if " avx512f" in flags else 8 if " avx" in flags else 4
    return 8 if machine in ("aarch64", "arm64") else 4


def gemm_row_tile(rows: int, threads: int, granule: int | None = None) -> int:
    """The Gemm row tile (param 20) for a forward over ``rows`` rows on ``threads`` threads:
    ``SINGLE_TILE`` (one tile of all the rows) where ncnn's own tiles would leave one thread
    most of the work, else 0 (ncnn's own; also for a few rows, where a decode step ran about
    3 % faster with ncnn's small tile than inside the tall one, best of 12)."""
    g = granule or _simd_rows()
    if threads < 2 or rows <= g or rows > SINGLE_TILE:
        return 0
    def up(x):
        return -(-x // g) * g
    tile = up(max(1, up(rows) // threads))     # ncnn's row tile for these rows
    tiles = -(-rows // tile)
    if tiles < threads:
        return 0                                # ncnn already splits by columns
    busiest = min(rows, -(-tiles // threads) * tile)
    return SINGLE_TILE if _COLUMN_SPLIT_COST * rows / threads < busiest else 0


def _param_value(text: str):
    return float(text) if any(c in text for c in ".eE") else int(text)


class Net:
    """One ncnn network with the package's precision options."""

    pools: tuple = ()
    gemms: dict = {}    # row tile -> (Gemm layer, its ParamDict with that tile) pairs (fit_rows)
    row_tile = 0        # the tile the Gemms were last loaded with

    def __init__(self, param: str, binfile: str, threads: int, dtype: str = "fp32", light_mode: bool = True,
                 packing: bool = True):
        self.net = ncnn.Net()
        set_net_options(self.net.opt, threads, dtype, packing)
        self.light_mode = light_mode
        self.where = param  # for error messages
        if self.net.load_param(param) != 0:
            raise EdgevlError(f"ncnn could not parse {param}; the package is corrupt — convert the model again")
        self.order, self.leaves = blob_order(param)
        with load_arena():
            ok = self.net.load_model(binfile) == 0
        if not ok:
            raise EdgevlError(f"ncnn could not load {binfile}; the package is corrupt — convert the model again")
        self._own_pools()
        self.threads = int(threads)
        if self.threads > 1:
            self._find_gemms(param)

    def _find_gemms(self, param: str) -> None:
        """Each Gemm layer with its params, as two ParamDicts (ncnn's row tiles, one tile)."""
        params = {name: p for typ, name, _, _, p in param_layers(param) if typ == "Gemm" and "20" not in p}
        layers = [(layer, params[layer.name]) for layer in self.net.layers()
                  if layer.type == "Gemm" and layer.name in params]
        self.gemms = {}
        for tile in (0, SINGLE_TILE):
            pairs = []
            for layer, p in layers:
                pd = ncnn.ParamDict()
                for k, v in p.items():
                    pd.set(int(k), _param_value(v))
                if tile:
                    pd.set(20, tile)
                pairs.append((layer, pd))
            self.gemms[tile] = pairs

    def fit_rows(self, rows: int) -> None:
        """Before a forward over ``rows`` rows: give the Gemms the row tile that splits them
        evenly among the threads (:func:`gemm_row_tile`). Reloading a Gemm's params changes
        only how it tiles (its packed weights stay; results are the same bits); it happens when
        the choice changes and takes about 30 µs for a 0.8B decoder's 132 Gemms."""
        if not self.gemms:
            return
        tile = gemm_row_tile(rows, self.threads)
        if tile == self.row_tile:
            return
        for layer, pd in self.gemms[tile]:
            if layer.load_param(pd) != 0:
                raise EdgevlError(f"ncnn refused the Gemm params of {layer.name} in {self.where}")
        self.row_tile = tile

    def _own_pools(self) -> None:
        """``execute`` takes activation buffers from pools this object owns: ncnn's own per-net
        pools keep the largest prompt's buffers for the net's lifetime (290 MB after a 600-token
        prompt at a 2048-wide MoE), and ``release`` returns these. Outputs are cloned out of
        them, as ncnn does for its own, so no Mat outlives them (``extractor()`` keeps ncnn's
        pools, for callers that hold its Mats)."""
        self.pools = (ncnn.PoolAllocator(), ncnn.PoolAllocator())
        for p in self.pools:
            # reuse a free buffer only for a request of at least 3/4 its size: ncnn's own pools
            # take any buffer large enough, so small blobs held big ones and big requests grew
            # the pool (a 128-token prefill at the 35B-A3B layer shapes peaked 1412 -> 1336 MB)
            p.set_size_compare_ratio(0.75)

    def release(self) -> None:
        """Free the pooled activation buffers (e.g. after a prompt: decoding needs far fewer)."""
        for p in self.pools:
            p.clear()

    def extractor(self) -> ncnn.Extractor:
        ex = self.net.create_extractor()
        # Late extraction of intermediate blobs needs light mode off (docs/ncnn.md, section 11).
        ex.set_light_mode(self.light_mode)
        return ex

    def execute(self, feeds: dict, wanted: list[tuple[str, int]], passes=(), kv_hint: int = 0) -> dict:
        """Feed Mats/arrays by blob name; extract ``(name, type)`` pairs in order (type 1: caches).
        ``kv_hint``: the tokens a KV cache will hold after this run and the ones to follow it
        (ncnn reserves that much at once instead of regrowing the cache run by run).

        ``passes``: (blob names, fn[, mats]) tuples run first, in order: the blobs are extracted,
        ``fn`` gets them as arrays (as ncnn Mats if ``mats``) and returns arrays (or Mats) to feed
        by blob name (intermediate blobs too). Blobs a pass extracted are returned as well if
        ``wanted`` names them (extracting a state output in the pass that computes it keeps it
        from being freed in light mode)."""
        checkpoint()   # an interrupted caller stops the owner thread here or between passes
        ex = self.extractor()
        if self.pools:
            ex.set_blob_allocator(self.pools[0])
            ex.set_workspace_allocator(self.pools[1])
        if kv_hint:
            ex.set_kvcache_max_seqlen_hint(int(kv_hint))
        _feed(ex, feeds)
        done, keep, got = {}, {n for n, _ in wanted}, None
        try:
            for i, p in enumerate(passes):
                checkpoint()
                names, fn = p[0], p[1]
                got = _extract(ex, [(n, 0) for n in names], self.where)
                # only what the caller wants is kept past its pass
                done.update((n, m) for n, m in got.items() if n in keep)
                raw = len(p) > 2 and p[2]  # the hook takes the Mats themselves (no copies)
                _feed(ex, fn(got if raw else {n: from_mat(m) for n, m in got.items()}))
                got = None
                # a blob no layer consumes stays in the extractor until it is destroyed (light
                # mode frees a blob when its consumers have run): drop the host passes' leaves
                # now (a 128-token prefill at the 35B-A3B layer shapes, 16 layers: peak 1484 ->
                # 1412 MB)
                later = {n for q in passes[i + 1:] for n in q[0]}
                for n in names:
                    if n in self.leaves and n not in later:
                        ex.input(n, ncnn.Mat())
        except BaseException:
            # A traceback kept after a failed pass (pytest.raises, a notebook's last error) holds
            # this frame: its extractor and Mats would outlive the pools they came from, and
            # ncnn aborts when the pools go first. Drop them before the exception leaves; the
            # hook's frames (also in the traceback) hold the very dict of Mats it was handed,
            # so it is emptied, not just let go of here.
            if got is not None:
                got.clear()
            ex = done = got = None
            raise
        # in graph order: in light mode a blob is freed once its consumers ran, and extracting
        # it after that recomputes from freed inputs (docs/ncnn.md, section 11: late extraction crashed)
        rest = sorted((w for w in wanted if w[0] not in done), key=lambda w: self.order.get(w[0], 0))
        out = _extract(ex, rest, self.where)
        out.update({n: done[n] for n, _ in wanted if n in done})
        del ex, done
        return {n: _detach(m, self.pools) for n, m in out.items()}

    def run(self, inputs: dict, outputs: list[str]) -> list[np.ndarray]:
        res = self.execute(inputs, [(n, 0) for n in outputs])
        return [from_mat(res[n]) for n in outputs]


def blob_order(param_path) -> tuple[dict, set]:
    """From a .param file: blob name -> index of the layer producing it, and the blobs some
    layer produces but none consumes."""
    order, used = {}, set()
    with open(param_path) as f:
        lines = f.read().split("\n")[2:]
    for i, line in enumerate(lines):
        parts = line.split()
        if len(parts) < 4:
            continue
        n_in, n_out = int(parts[2]), int(parts[3])
        used.update(parts[4: 4 + n_in])
        for b in parts[4 + n_in: 4 + n_in + n_out]:
            order[b] = i
    return order, set(order) - used


def param_layers(param_path) -> list[tuple[str, str, list, list, dict]]:
    """From a .param file: (type, name, input blobs, output blobs, {param id: value text}) per
    layer, in graph order."""
    out = []
    with open(param_path) as f:
        for line in f.read().split("\n")[2:]:
            parts = line.split()
            if len(parts) >= 4:
                n_in, n_out = int(parts[2]), int(parts[3])
                params = dict(kv.split("=", 1) for kv in parts[4 + n_in + n_out:] if "=" in kv)
                out.append((parts[0], parts[1], parts[4: 4 + n_in], parts[4 + n_in: 4 + n_in + n_out], params))
    return out


def layer_outputs(param_path) -> dict:
    """From a .param file: layer name -> its output blob names."""
    out = {}
    with open(param_path) as f:
        for line in f.read().split("\n")[2:]:
            parts = line.split()
            if len(parts) >= 4:
                n_in, n_out = int(parts[2]), int(parts[3])
                out[parts[1]] = parts[4 + n_in: 4 + n_in + n_out]
    return out


def _detach(m: ncnn.Mat, pools) -> ncnn.Mat:
    """A Mat allocated from one of ``pools``, cloned out of it (the pool may be cleared or go
    first). Others are kept as they are: SDPA's KV caches come from the system allocator with
    spare rows to append into, and a clone of one corrupted it (docs/ncnn.md, section 7)."""
    a = m.allocator
    return m.clone() if a is not None and any(a is p for p in pools) else m


def _feed(ex, feeds: dict) -> None:
    for k, v in feeds.items():
        ex.input(k, v if isinstance(v, ncnn.Mat) else to_mat(v))


def _extract(ex, wanted, where: str) -> dict:
    out = {}
    for name, typ in wanted:
        m = ncnn.Mat()
        if ex.extract(name, m, typ) != 0:
            pkg = os.path.dirname(where) or "."
            raise EdgevlError(f"ncnn failed to compute blob {name!r} of {os.path.basename(where)} in package {pkg}; "
                              f"the package may be damaged — check it with: edgevl check {pkg} (or convert again)")
        out[name] = m
    return out


class SectionedNet(Net):
    """Low-memory mode: runs a graph section by section (a decoder layer, an lm_head shard),
    loading each section's weights only while it runs. Peak memory is about one section's
    weights instead of the model's, at the cost of re-reading the weights on every call."""

    def __init__(self, folder: str, binfile: str, sections: list, threads: int, dtype: str = "fp32"):
        self.folder, self.binfile, self.sections = folder, binfile, sections
        self.threads, self.dtype, self.light_mode = threads, dtype, True

    def _load(self, sec) -> Net:
        net = Net.__new__(Net)
        net.net, net.light_mode = ncnn.Net(), True
        net.where = os.path.join(self.folder, sec["param"])
        set_net_options(net.net.opt, self.threads, self.dtype)
        with open(self.binfile, "rb") as f:
            f.seek(sec["bin"][0])
            data = f.read(sec["bin"][1] - sec["bin"][0])
        if net.net.load_param(os.path.join(self.folder, sec["param"])) != 0 or (
                data and net.net.load_model_mem(data) not in (0, None)):  # this binding returns None
            raise EdgevlError(f"ncnn could not load section {sec['name']} of {self.binfile}; convert the model again")
        return net

    def execute(self, feeds: dict, wanted: list[tuple[str, int]], passes=(), kv_hint: int = 0) -> dict:
        assert not passes, "Decoder refuses host passes in low-memory mode"
        checkpoint()
        blobs = dict(feeds)
        types = dict(wanted)
        for sec in self.sections:
            net = self._load(sec)
            ex = net.extractor()
            for name in sec["inputs"]:
                if name in blobs:  # absent cache inputs stay empty (first prefill)
                    v = blobs[name]
                    ex.input(name, v if isinstance(v, ncnn.Mat) else to_mat(v))
            blobs.update(_extract(ex, [(n, types.get(n, 0)) for n in sec["outputs"]], net.where))
            del ex, net
        return {n: blobs[n] for n, _ in wanted}


# ---------------------------------------------------------------------------------------------
# per-layer state kinds (declared in the manifest's decoder graph: ``state``)


# rows of SDPA's KV panels, a multiple of every width it uses (2 to 16 rows)
KV_PANEL_ROWS = 64


class KVState:
    """Attention KV of one layer: SDPA's cache Mats, extracted with type 1 (ncnn's packed,
    backend-specific layout) and fed back unchanged. Truncatable (see ``truncate``)."""

    kind = "kv"
    truncatable = True

    def __init__(self, spec: dict):
        self.inputs, self.outputs = list(spec["inputs"]), list(spec["outputs"])
        self.mats: tuple | None = None

    def feeds(self) -> dict:
        return {} if self.mats is None else dict(zip(self.inputs, self.mats))  # first prefill: none

    def wanted(self) -> list:
        return [(n, 1) for n in self.outputs]

    def update(self, res: dict) -> None:
        self.mats = tuple(res[n] for n in self.outputs)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens.

        SDPA keeps its cache as Mats whose ``h`` is the number of valid tokens and appends the
        next tokens after row ``h`` (into spare capacity, or a grown copy), so lowering ``h``
        drops the tail. ncnn does not document this; ``kv_truncation_works`` checks it on the
        installed ncnn once per process and the cache falls back to recomputing if it fails."""
        if self.mats is None:
            return
        if n == 0:
            self.mats = None
            return
        for m in self.mats:
            m.h = n

    def bytes(self) -> int:
        # w*h*d*c counts packs and elemsize is bytes per pack: their product is the data size
        return 0 if self.mats is None else int(sum(m.w * m.h * m.d * m.c * m.elemsize for m in self.mats))

    def clone(self) -> KVState:
        """A copy that grows apart: Mats of its own (SDPA appends in place only within the Mat
        it was handed). SDPA keeps the rows in panels of up to 16 (its SIMD width), the last one
        partly filled, so the copy takes whole panels, not only ``h`` rows."""
        new = copy.copy(self)
        if self.mats is not None:
            out = []
            for m in self.mats:
                h = m.h
                m.h = min(m.cstep // max(m.w, 1), -(-h // KV_PANEL_ROWS) * KV_PANEL_ROWS)
                try:
                    c = m.clone()
                finally:
                    m.h = h
                c.h = h
                out.append(c)
            new.mats = tuple(out)
        return new


class Column:
    """A window state's next column (the channels of one new time step), as a state output:
    ``RecurrentState.update`` appends it."""

    __slots__ = ("values",)

    def __init__(self, values: np.ndarray):
        self.values = values


class RecurrentState:
    """A recurrent layer's fixed-size state (e.g. a conv window and a matrix per head): fed in
    (zeros at the start), extracted as plain fp32 Mats (or float32 arrays, where the host
    computed it: ``Decoder.forward_rows`` extends conv windows itself). Not truncatable: going back to an
    earlier length restores a snapshot taken there."""

    kind = "recurrent"
    truncatable = False

    def __init__(self, spec: dict):
        self.inputs, self.outputs = list(spec["inputs"]), list(spec["outputs"])
        self.shapes = [tuple(int(x) for x in s) for s in spec["shapes"]]  # numpy (c, h, w) order
        self.mats: tuple | None = None
        # a window (the last columns of a channels x time input, e.g. a causal conv's): the
        # last rows of a forward can be dropped from it, given the state before (``undo``)
        self.window = bool(spec.get("window")) and all(len(sh) == 2 for sh in self.shapes)
        self.before: tuple | None = None

    # A window that decode steps extend on the host (``Decoder.forward_rows``) is kept as a ring
    # of time-major rows: a step then writes one row instead of copying the whole window, and
    # the conv reads contiguous rows. ``mats`` turns it back into channels x time on first use.
    _ring = None

    @property
    def mats(self):
        if self._ring is not None:
            arrs, head = self._ring
            self._ring = None
            self._mats = tuple(np.ascontiguousarray(np.concatenate([a[head:], a[:head]]).T) for a in arrs)
        return self._mats

    @mats.setter
    def mats(self, value) -> None:
        self._mats, self._ring = value, None

    def ring(self) -> tuple:
        """The window as ``(arrays [width, channels], head)``: row ``head`` is the oldest."""
        if self._ring is None:
            mats = self.mats
            self._ring = ([np.zeros(sh[::-1], np.float32) for sh in self.shapes] if mats is None else
                          [np.asarray(m, np.float32).reshape(sh).T.copy() for m, sh in zip(mats, self.shapes)], 0)
            self._mats = None
        return self._ring

    def undo(self, rows: int, r: int) -> None:
        """Drop the last ``r`` of the ``rows`` rows the last forward fed (a window state, at most
        its width of rows; ``before`` holds the state from before that forward)."""
        if not self.window or rows > min(sh[1] for sh in self.shapes):
            raise ValueError("this state cannot take rows back")
        old = self.before or tuple(np.zeros(sh, np.float32) for sh in self.shapes)
        out = []
        for b, a, (_, w) in zip(old, self.mats, self.shapes):
            new = from_mat(a).reshape(-1, w)[:, w - rows: w - r]    # the rows kept, as columns
            out.append(to_mat(np.concatenate([np.asarray(b, np.float32).reshape(-1, w), new], 1)[:, -w:]))
        self.mats = tuple(out)

    def feeds(self) -> dict:
        if self.mats is None:
            return {n: np.zeros(s, np.float32) for n, s in zip(self.inputs, self.shapes)}
        return dict(zip(self.inputs, self.mats))

    def wanted(self) -> list:
        return [(n, 0) for n in self.outputs]

    def update(self, res: dict) -> None:
        got = [res[n] for n in self.outputs]
        if got and all(isinstance(g, Column) for g in got):
            arrs, head = self.ring()
            for a, g in zip(arrs, got):
                a[head] = g.values
            self._ring = (arrs, (head + 1) % arrs[0].shape[0])
        else:
            self.mats = tuple(got)

    def snapshot(self):
        return None if self.mats is None else tuple(from_mat(m) for m in self.mats)

    def restore(self, snap) -> None:
        self.mats = None if snap is None else tuple(to_mat(a) for a in snap)

    def bytes(self) -> int:
        return int(sum(4 * np.prod(s) for s in self.shapes))

    def clone(self):
        """A copy that grows apart (hooks and decode steps update these arrays in place)."""
        new = copy.copy(self)
        new._mats = None if self._mats is None else tuple(_own(m) for m in self._mats)
        if self._ring is not None:
            new._ring = ([a.copy() for a in self._ring[0]], self._ring[1])
        new.before = None if self.before is None else tuple(_own(m) for m in self.before)
        return new


def _own(m):
    """A copy of a state Mat or array that shares no memory with it."""
    return np.array(m, copy=True) if isinstance(m, np.ndarray) else m.clone()


class HostState(RecurrentState):
    """A fixed-size state that lives on the host, not in the graph: a host hook (a decoder
    ``passes`` entry naming this state) reads it with ``get`` and replaces it with ``set``
    (e.g. a linear-attention matrix that a separate fp32 net updates). Not truncatable, like
    ``recurrent``: snapshots restore it."""

    kind = "host"
    # handed out by ``get`` during a forward that has not completed: hooks update the arrays in
    # place, so the state may be ahead of the cache's length until ``update`` marks it whole
    dirty = False

    def feeds(self) -> dict:
        return {}

    def wanted(self) -> list:
        return []

    def update(self, res: dict) -> None:
        self.dirty = False

    def restore(self, snap) -> None:
        super().restore(snap)
        self.dirty = False

    def get(self) -> tuple:
        """The state Mats (zeros before the first update)."""
        if self.mats is None:
            self.mats = tuple(to_mat(np.zeros(s, np.float32)) for s in self.shapes)
        self.dirty = True
        return self.mats

    def set(self, mats) -> None:
        self.mats = tuple(mats)


STATE_KINDS = {"kv": KVState, "recurrent": RecurrentState, "host": HostState}

# Snapshots of recurrent state kept per cache (each is the whole fixed-size state): enough for
# the turn boundaries a chat or a resent conversation rolls back to.
MAX_SNAPSHOTS = 4


class Cache:
    """The decoder's state for one sequence: per-layer states, the token count, each cached
    token's next rotary position, and snapshots of recurrent state at turn boundaries."""

    def __init__(self, specs: list):
        for s in specs:
            if s.get("kind") not in STATE_KINDS:
                raise EdgevlError(f"unknown state kind {s.get('kind')!r} in manifest.json; "
                                  "upgrade edgevl or convert the model again")
        self.specs = specs
        self.layers = [STATE_KINDS[s["kind"]](s) for s in specs]
        self.length = 0
        self.next_positions: list[int] = []
        self._snapshots: dict[int, list] = {}

    @property
    def truncatable(self) -> bool:
        return all(s.truncatable for s in self.layers)

    def rollback_point(self, n: int) -> int:
        """The largest length <= n this cache can go back to (0: start over)."""
        if n >= self.length:
            return self.length
        if self.truncatable:
            return n if kv_truncation_works() else 0
        if any(s.truncatable for s in self.layers) and not kv_truncation_works():
            return 0
        points = [k for k in self._snapshots if k <= n]
        return max(points, default=0)

    def rollback(self, n: int) -> None:
        if n == self.length:
            return
        if n == 0:
            self.__init__(self.specs)
            return
        if self.rollback_point(n) != n:
            raise ValueError(f"this cache cannot go back to {n} tokens")
        self._go_back(n)

    def _go_back(self, n: int) -> None:
        """Truncate KV to ``n`` tokens and restore the other states' snapshot taken at ``n``."""
        snap = self._snapshots.get(n)
        for s in self.layers:
            if s.truncatable:
                s.truncate(n)
        if snap is not None:
            for s, a in zip((s for s in self.layers if not s.truncatable), snap):
                s.restore(a)
        self.drop_snapshots_after(n)
        self.length = n
        del self.next_positions[n:]

    def drop_snapshots_after(self, n: int) -> None:
        self._snapshots = {k: v for k, v in self._snapshots.items() if k <= n}

    def recover(self, n: int) -> int:
        """After a forward that failed part-way (an exception, a Ctrl-C): go back to a state
        that is whole, at length ``n`` (where the failed call started) or the nearest earlier
        point kept; returns that length. KV and in-graph recurrent states change only when a
        forward completes, but host states are updated in place layer by layer, so a failure
        inside a forward leaves them ahead of ``length``: they come back from a snapshot."""
        if n == self.length and not any(getattr(s, "dirty", False) for s in self.layers):
            return n
        if n < self.length:
            p = self.rollback_point(n)
        elif any(s.truncatable for s in self.layers) and not kv_truncation_works():
            p = 0
        else:   # host state ahead of the length: only a snapshot at or before it is whole
            p = max((k for k in self._snapshots if k <= n), default=0)
        if p == 0:
            self.__init__(self.specs)
        else:
            self._go_back(p)
        return p

    def clone(self) -> Cache:
        """A copy of this sequence's state that another sequence goes on from (the snapshots'
        arrays are shared: a restore never writes into them)."""
        new = copy.copy(self)
        new.layers = [s.clone() for s in self.layers]
        new.next_positions = list(self.next_positions)
        new._snapshots = {k: list(v) for k, v in self._snapshots.items()}
        return new

    def keep_windows(self) -> None:
        """Before a forward whose last rows may be taken back: each window state keeps what it
        holds now (``RecurrentState.undo`` rebuilds from it)."""
        for s in self.layers:
            if isinstance(s, RecurrentState) and not isinstance(s, HostState):
                s.before = s.mats

    def snapshot(self) -> None:
        """Remember the recurrent state at the current length (a turn boundary)."""
        if self.truncatable or self.length == 0 or self.length in self._snapshots:
            return
        self._snapshots[self.length] = [s.snapshot() for s in self.layers if not s.truncatable]
        while len(self._snapshots) > MAX_SNAPSHOTS:
            del self._snapshots[min(self._snapshots)]

    def feeds(self) -> dict:
        out = {}
        for s in self.layers:
            out.update(s.feeds())
        return out

    def wanted(self) -> list:
        return [w for s in self.layers for w in s.wanted()]

    def update(self, res: dict, next_positions) -> None:
        for s in self.layers:
            s.update(res)
        self.length += len(next_positions)
        self.next_positions.extend(int(p) for p in next_positions)

    @property
    def next_position(self) -> int:
        return self.next_positions[-1] if self.next_positions else 0

    def bytes(self) -> int:
        return sum(s.bytes() for s in self.layers)

    def state_arrays(self) -> dict:
        """{(layer, name): array} of the fixed-size states whose manifest entry names its layer
        and parts (``"layer"``, ``"names"``), for comparison with a reference's cache."""
        out = {}
        for spec, s in zip(self.specs, self.layers):
            if s.truncatable or s.mats is None or "layer" not in spec:
                continue
            for name, m in zip(spec.get("names", range(len(s.mats))), s.mats):
                a = from_mat(m)
                # a window wider than the columns its layer reads (kept for undo): those columns
                out[(int(spec["layer"]), str(name))] = a[..., -int(spec["reads"]):] if "reads" in spec else a
        return out


def state_bytes(specs: list, n_tokens: int, kv_elem_bytes: int = 4) -> int:
    """Bytes of a model's decoder state for a context of ``n_tokens`` (KV grows, recurrent is fixed),
    from the manifest's per-layer declarations; KV elements are 2 bytes in bf16 nets."""
    total = 0
    for s in specs:
        if s["kind"] == "kv":
            total += int(s["floats_per_token"]) * kv_elem_bytes * int(n_tokens)
        else:
            total += int(sum(4 * np.prod(sh) for sh in s["shapes"]))
    return total


_KV_TRUNCATION_OK: bool | None = None


def kv_truncation_works() -> bool:
    """Check once per process that lowering a KV Mat's ``h`` rolls SDPA's cache back on the
    installed ncnn (a 3-token cache cut to 1, then 2 tokens appended, must equal 3 fresh
    tokens). Costs about a millisecond; False makes every rollback recompute instead."""
    global _KV_TRUNCATION_OK
    if _KV_TRUNCATION_OK is None:
        _KV_TRUNCATION_OK = _probe_kv_truncation()
    return _KV_TRUNCATION_OK


def _probe_kv_truncation() -> bool:
    import tempfile

    from . import ncnn_graph as G

    d = 8
    with tempfile.TemporaryDirectory() as tmp:
        g = G.Graph(os.path.join(tmp, "p.bin"))
        q, k, v, mask = g.input("q"), g.input("k"), g.input("v"), g.input("mask")
        g.input("ck")
        g.input("cv")
        G.sdpa(g, q, k, v, mask, cache=["ck", "cv"], cache_out=["ok", "ov"], out="o")
        g.save(os.path.join(tmp, "p.param"))
        net = Net(os.path.join(tmp, "p.param"), os.path.join(tmp, "p.bin"), 1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, d)).astype(np.float32)  # (c=2 heads, h=4 tokens, w=d)

    def run(tokens, past):
        seq = tokens.shape[1]
        length = 0 if past is None else past[0].h
        feeds = {"q": tokens, "k": tokens, "v": tokens, "mask": causal_mask(length, seq)}
        if past is not None:
            feeds.update(ck=past[0], cv=past[1])
        r = net.execute(feeds, [("o", 0), ("ok", 1), ("ov", 1)])
        return from_mat(r["o"]), (r["ok"], r["ov"])

    fresh, _ = run(x[:, :3], None)
    _, cache = run(x[:, [0, 3, 3]], None)   # tokens 1, 2 differ from the fresh run's
    for m in cache:
        m.h = 1
    again, _ = run(x[:, 1:3], cache)
    return bool(np.allclose(again, fresh[:, 1:3], atol=1e-5))


# ---------------------------------------------------------------------------------------------


class Embedding:
    """Row lookup in an on-disk [rows, dim] table via mmap: only touched rows enter memory.

    The table may be stored in row segments (the shards of a tied lm_head), each contiguous.
    """

    def __init__(self, path: str, segments: list, rows: int, dim: int, dtype: str):
        np_dtype = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16}[dtype]
        self.dtype, self.rows, self.dim = dtype, rows, dim
        size = os.path.getsize(path)
        for s in segments:  # np.memmap would fail with a bare ValueError
            end = s["offset"] + (s["rows"][1] - s["rows"][0]) * dim * np.dtype(np_dtype).itemsize
            if end > size:
                raise EdgevlError(f"the embedding table {path} has {size} bytes but rows {s['rows'][0]}.."
                                  f"{s['rows'][1]} of {dim} {dtype} values need {end}; the package is corrupt — "
                                  "convert the model again")
        self.starts = np.array([s["rows"][0] for s in segments], np.int64)
        self.tables = [np.memmap(path, dtype=np_dtype, mode="r", offset=s["offset"],
                                 shape=(s["rows"][1] - s["rows"][0], dim)) for s in segments]

    def __call__(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.rows):
            bad = int(ids[(ids < 0) | (ids >= self.rows)][0])
            raise EdgevlError(f"token id {bad} is outside the vocabulary (0..{self.rows - 1}); "
                              "the tokenizer does not match the model")
        seg = np.searchsorted(self.starts, ids, side="right") - 1
        raw = np.empty((ids.size, self.dim), self.tables[0].dtype)
        for k in np.unique(seg):
            sel = seg == k
            raw[sel] = self.tables[k][ids[sel] - self.starts[k]]
        if self.dtype == "bf16":
            return bf16_bits_to_f32(raw)
        return raw.astype(np.float32)


def causal_mask(past: int, seq: int) -> np.ndarray:
    """(h=seq, w=past+seq) additive mask: query i sees keys 0..past+i."""
    m = np.zeros((seq, past + seq), np.float32)
    if seq > 1:
        m[:, past:] = np.triu(np.full((seq, seq), -np.inf, np.float32), 1)
    return m


class Decoder:
    """Drives a decoder graph: embeddings, mask, rope tables and per-layer state in; the final
    hidden states and the updated state out. One graph serves prefill and decode.

    ``info["passes"]`` (optional) lets an architecture run host work inside a forward: each pass
    extracts some blobs, hands them to ``hooks[pass["hook"]](blobs, **pass.get("args", {}))``
    and feeds the arrays it returns back into the graph by blob name (ncnn skips a fed blob's
    producer), before the next pass or the final extraction — e.g. routing to experts in numpy.
    A pass with ``"when": "prefill"`` runs only for inputs of more than one token; a pass with
    ``"state": k`` also hands the hook ``state=`` the cache's k-th state (``info["state"][k]``),
    e.g. a ``host`` state the hook reads and replaces; with ``"mats": true`` the hook gets the
    extracted blobs as ncnn Mats (valid during the call; no numpy copies); with ``"ids": true``
    it also gets ``ids=``, the token ids of the rows, e.g. to tell image-embedding rows from text
    rows: a prompt's rows carry them; None when the caller gave none (a decode step, whose row
    is a text embedding whatever its id). A state's hook may also have ``undo(state, r)`` (take
    the last rows back) and ``rows(blobs, states, **args)`` (one row of each of several sequences
    at once, for :meth:`forward_rows`)."""

    def __init__(self, net: Net, info: dict, rope, hooks: dict | None = None):
        self.net, self.info = net, info
        self.rope = rope  # callable(positions [axes, seq]) -> (cos, sin)
        self.hooks = hooks or {}
        self.passes = info.get("passes") or []
        for p in self.passes:
            if p["hook"] not in self.hooks:
                raise EdgevlError(f"the decoder graph needs host step {p['hook']!r}, which this edgevl "
                                  "does not have; upgrade edgevl or convert the model again")
        if self.passes and isinstance(net, SectionedNet):
            raise EdgevlError("low-memory mode does not support this architecture's decoder yet; "
                              "run without --low-memory")

    def new_cache(self) -> Cache:
        return Cache(self.info["state"])

    @property
    def undo_rows(self) -> int:
        """The most rows of one forward that :meth:`undo` can take back (0: none): every state
        must allow it — KV caches (when truncation works), window states (up to their width
        of rows), host states whose hook has an ``undo``."""
        if not kv_truncation_works():
            return 0
        limit = 1 << 30
        for i, spec in enumerate(self.info["state"]):
            if spec["kind"] == "recurrent":
                st = RecurrentState(spec)
                limit = min(limit, min(sh[1] for sh in st.shapes) if st.window else 0)
            elif spec["kind"] == "host":
                hooks = [self.hooks[p["hook"]] for p in self.passes if p.get("state") == i]
                limit = min(limit, limit if hooks and all(hasattr(h, "undo") for h in hooks) else 0)
        return limit

    def undo(self, cache: Cache, rows: int, r: int) -> None:
        """Take back the last ``r`` of the ``rows`` rows of the last forward (an ``undoable``
        one): the cache is as if only the others had been fed."""
        if r <= 0:
            return
        n = cache.length - r
        for i, s in enumerate(cache.layers):
            if s.truncatable:
                s.truncate(n)
            elif isinstance(s, HostState):
                for p in self.passes:
                    if p.get("state") == i:
                        self.hooks[p["hook"]].undo(s, r)
                s.dirty = False
            else:
                s.undo(rows, r)
        cache.length = n
        del cache.next_positions[n:]
        cache.drop_snapshots_after(n)

    def forward(self, embeds: np.ndarray, cache: Cache, positions: np.ndarray,
                extract: list[str] = (), ids=None, kv_hint: int = 0,
                undoable: bool = False) -> tuple[np.ndarray, dict]:
        """Run ``embeds`` [S, H] at rotary ``positions`` [axes, S] on top of ``cache`` (updated
        in place); returns the final hidden states [S, H] and the blobs named in ``extract``.
        ``ids``: the rows' token ids (for passes that ask for them). ``kv_hint``: the cache
        length a chunked prompt will reach (KV caches are then allocated once). ``undoable``:
        the last rows may be taken back afterwards (:meth:`undo`; up to ``undo_rows`` rows)."""
        seq, past = embeds.shape[0], cache.length
        if undoable:
            cache.keep_windows()
        positions = np.asarray(positions).reshape(-1, seq)
        cos, sin = self.rope(positions)
        names = self.info["inputs"]
        feeds = {names["embeds"]: embeds, names["mask"]: causal_mask(past, seq), names["cos"]: cos,
                 names["sin"]: sin, **cache.feeds()}
        if ids is not None and len(ids) != seq:
            raise ValueError(f"{len(ids)} token ids for {seq} rows")
        passes = [(p["extract"], self._hook(p, seq, cache, ids, undoable), bool(p.get("mats"))) for p in self.passes
                  if p.get("when", "always") == "always" or seq > 1]
        # intermediate blobs first (they must be extracted before consumers free them); state
        # outputs with their kind's extraction type
        hidden = self.info["outputs"]["hidden"]
        wanted = [(n, 0) for n in extract] + [(hidden, 0)] + cache.wanted()
        if kv_hint and seq > 1:
            self.release_pools()
        self.net.fit_rows(seq)
        res = self._run(seq, lambda: self.net.execute(feeds, wanted, passes, kv_hint=kv_hint))
        extra = {n: from_mat(res[n]) for n in extract}
        cache.update(res, positions.max(axis=0) + 1)
        return from_mat(res[hidden]), extra

    def forward_rows(self, embeds: np.ndarray, parts: list, positions: np.ndarray, ids=None,
                     undoable: bool = False, kv_hints=None) -> np.ndarray:
        """One forward over the rows of several sequences: ``parts`` lists ``(cache, rows)`` in
        row order, ``positions`` [axes, rows] and ``ids`` (or None) cover all rows. Every weight
        is read once for all of them; what belongs to one sequence — its attention over its own
        KV cache, its conv window and host state — runs per sequence on the same graph (a
        sub-run fed that layer's inputs runs only that layer). Each cache is updated in place;
        returns the final hidden states [rows, H]. ``undoable``: as in :meth:`forward`, each
        cache's last rows may be taken back afterwards (:meth:`undo`). ``kv_hints``: per part,
        as ``kv_hint`` of :meth:`forward` (a prompt's chunk beside other sequences' rows)."""
        if isinstance(self.net, SectionedNet):
            raise EdgevlError("low-memory mode runs one sequence at a time; run without --low-memory "
                              "to decode several together")
        if undoable:
            for cache, _ in parts:
                cache.keep_windows()
        plan = self.row_plan()
        hints = list(kv_hints) if kv_hints is not None else [0] * len(parts)
        total = int(embeds.shape[0])
        bounds = np.cumsum([0] + [int(n) for _, n in parts])
        if bounds[-1] != total:
            raise ValueError(f"{bounds[-1]} rows in parts for {total} embedding rows")
        positions = np.asarray(positions).reshape(-1, total)
        cos, sin = self.rope(positions)
        names = self.info["inputs"]
        new = [{} for _ in parts]       # each sequence's state outputs, applied when the forward is whole

        def rows(a, b):
            return a[(slice(None),) * (a.ndim - 2) + (slice(bounds[b], bounds[b + 1]),)]

        def take(a, idx):
            """The rows ``idx`` of ``a`` (rows on the same axis as :func:`rows` reads)."""
            return np.take(a, idx, axis=max(a.ndim - 2, 0))

        def attention(step):
            (q, k, v), (o, ko, vo), mask, state = step["extract"], step["outputs"], step["mask"], step["state"]

            def run(blobs):
                outs = []
                for b, (cache, n) in enumerate(parts):
                    feeds = {q: rows(blobs[q], b), k: rows(blobs[k], b), v: rows(blobs[v], b),
                             **cache.layers[state].feeds()}
                    if mask:
                        feeds[mask] = causal_mask(cache.length, n)
                    r = self.net.execute(feeds, [(o, 0), (ko, 1), (vo, 1)], kv_hint=hints[b])
                    new[b].update({ko: r[ko], vo: r[vo]})
                    outs.append(from_mat(r[o]))
                return {o: np.concatenate(outs, axis=outs[0].ndim - 2)}
            return run

        def recurrent(step):
            """Two host passes: the rows entering the conv go out, each sequence's window is
            extended on the host, and the columns the conv reads go back in for all sequences
            side by side (the valid conv then runs once, as in one graph; the outputs that
            straddle two sequences are skipped); then each sequence's rows of the conv output
            take its host step. The conv stays ncnn's: the host only moves columns."""
            p, pre, post, conv, k = step["pass"], step["extract"][0], step["post"], step["conv"], step["kernel"]
            rest, hook, args = step["extract"][1:], self.hooks[p["hook"]], p.get("args", {})
            undo = {"undoable": True} if undoable else {}
            kept = {}

            def widen(blobs):
                # each sequence's segment is the k - 1 newest columns of its window and then its
                # rows, built time-major (its rows as they come out of the graph), all segments
                # side by side; sequence b's conv outputs start where its segment does
                x = blobs[pre].reshape(total, -1)
                lens = [n + k - 1 for _, n in parts]
                cols = np.empty((sum(lens), x.shape[1]), np.float32)
                back = np.arange(1 - k, 0)      # the k - 1 newest rows of a ring, oldest first
                at = 0
                for b, (cache, n) in enumerate(parts):
                    window, mine = cache.layers[conv], rows(x, b)
                    if n == 1:
                        # a decode row (beside others or a prompt's chunk): the window is a ring
                        # of time-major rows (RecurrentState.ring) that takes the new row; no
                        # window is copied whole
                        (ring, *_), head = window.ring()
                        cols[at:at + k - 1] = ring[(head + back) % len(ring)]
                        new[b][window.outputs[0]] = Column(mine[0])
                    else:
                        old = window.feeds()[window.inputs[0]]
                        old = old if isinstance(old, np.ndarray) else from_mat(old)
                        w = old.shape[-1]
                        old = old.reshape(-1, w)
                        cols[at:at + k - 1] = old[:, w - (k - 1):].T
                        new[b][window.outputs[0]] = np.concatenate([old, mine.T], axis=1)[:, -w:]
                    cols[at + k - 1:at + lens[b]] = mine
                    at += lens[b]
                kept["starts"] = np.cumsum([0] + lens[:-1])
                kept.update((r, blobs[r]) for r in rest)
                return {step["reads"]: cols.T}

            def core(blobs):
                y, outs, starts = blobs[post], {}, kept.pop("starts")
                # the sequences with one row (decoding) take the host step together
                ones = [b for b, (_, n) in enumerate(parts) if n == 1] if hasattr(hook, "rows") and not undoable else []
                if len(ones) > 1 or len(ones) == len(parts):
                    got = hook.rows({post: y[starts[ones]], **{x: take(kept[x], bounds[ones]) for x in rest}},
                                    states=[parts[b][0].layers[int(p["state"])] for b in ones], **args)
                    if len(ones) == len(parts):
                        kept.clear()
                        return got
                    for i, b in enumerate(ones):
                        outs[b] = {x: take(v, [i]) for x, v in got.items()}
                for b, (cache, n) in enumerate(parts):
                    if b in outs:
                        continue
                    at = int(starts[b])
                    got = hook({post: y[at:at + n], **{x: rows(kept[x], b) for x in rest}}, seq=n,
                               state=cache.layers[int(p["state"])], **args, **undo)
                    outs[b] = {x: v if isinstance(v, np.ndarray) else from_mat(v) for x, v in got.items()}
                kept.clear()
                outs = [outs[b] for b in range(len(parts))]
                return {x: np.concatenate([o[x] for o in outs], axis=outs[0][x].ndim - 2) for x in outs[0]}
            return [(step["extract"], widen), ([post], core)]

        passes = []
        for step in plan:
            if step["kind"] == "attention":
                passes.append((step["extract"], attention(step)))
            elif step["kind"] == "recurrent":
                passes += recurrent(step)
            elif step["pass"].get("when", "always") == "always" or total > 1:
                passes.append((step["extract"], self._hook(step["pass"], total, None, ids)))
        hidden = self.info["outputs"]["hidden"]
        if any(hints):
            self.release_pools()
        self.net.fit_rows(total)
        res = self._run(total, lambda: self.net.execute({names["embeds"]: embeds, names["cos"]: cos, names["sin"]: sin},
                                                        [(hidden, 0)], passes))
        for b, ((cache, _), out) in enumerate(zip(parts, new)):
            cache.update(out, positions[:, bounds[b]:bounds[b + 1]].max(axis=0) + 1)
        return from_mat(res[hidden])

    def release_pools(self) -> None:
        """Free the net's pooled activation buffers (a low-memory net pools none). Done before each
        chunk of a longer prompt: the last chunk's buffers are too small for this one's attention
        (it sees more keys), and pooled beside it they added up to the square of the prompt (an
        fp32 package, 16k tokens in 64-row chunks: 0.89 GB at peak, 0.11 GB now)."""
        if hasattr(self.net, "release"):
            self.net.release()

    def _run(self, rows: int, fn):
        """A forward; decode-sized ones are timed for the OpenMP team's size (``team``)."""
        if rows > TIMED_ROWS:
            return fn()
        return team.timed((id(self), rows), fn, getattr(self.net, "threads", 1))

    def row_plan(self) -> list:
        """The steps :meth:`forward_rows` takes, in graph order (from the graph's param file and
        the manifest): ``attention`` for each SDPA layer with a KV cache (its q, k, v extracted),
        ``recurrent`` for each host pass with a state (the rows entering its conv window
        extracted, then conv and host step per sequence), ``pass`` for the other host passes
        (e.g. MoE routing), which work row by row already."""
        if getattr(self, "_row_plan", None) is not None:
            return self._row_plan
        layers = param_layers(self.net.where)
        producer = {b: lay for lay in layers for b in lay[3]}
        consumers: dict = {}
        for lay in layers:
            for b in lay[2]:
                consumers.setdefault(b, []).append(lay)
        state_in = {n: k for k, spec in enumerate(self.info["state"]) for n in spec["inputs"]}
        state_out = {n: k for k, spec in enumerate(self.info["state"]) for n in spec["outputs"]}
        plan = []
        for kind, _, ins, outs, _ in layers:
            if kind != "SDPA":
                continue
            if len(ins) < 5 or ins[-1] not in state_in:
                raise EdgevlError("this decoder graph has attention without a cache; it cannot decode "
                                  "several sequences together")
            plan.append({"kind": "attention", "extract": ins[:3], "outputs": outs[:3],
                         "mask": ins[3] if len(ins) == 6 else None, "state": state_in[ins[-1]]})
        for p in self.passes:
            if "state" not in p:
                plan.append({"kind": "pass", "extract": list(p["extract"]), "pass": p})
                continue
            # a recurrent layer: extract[0] is its conv window's output, extract[1] the conv's
            # output (the core's first input); the window's input joins the rows in a Concat,
            # whose last columns (through Split/Crop) the depthwise conv reads
            conv = state_out[p["extract"][0]]
            window_in = self.info["state"][conv]["inputs"][0]
            concat = next(lay for lay in consumers[window_in] if lay[0] == "Concat")
            pre = producer[next(b for b in concat[2] if b != window_in)][2][0]
            seen, todo, dw = set(), list(concat[3]), None
            while todo and dw is None:
                for lay in consumers.get(todo.pop(0), []):
                    if lay[0] == "ConvolutionDepthWise1D":
                        dw = lay
                    elif lay[0] in ("Split", "Crop") and lay[1] not in seen:
                        seen.add(lay[1])
                        todo += lay[3]
            if dw is None or any(dw[4].get(k, d) != d for k, d in (("2", "1"), ("3", "1"), ("4", "0"))):
                raise EdgevlError("this decoder graph's recurrent layer has no plain causal conv; it "
                                  "cannot decode several sequences together")
            plan.append({"kind": "recurrent", "extract": [pre, *p["extract"][2:]], "post": p["extract"][1],
                         "conv": conv, "reads": dw[2][0], "kernel": int(dw[4].get("1", "1")), "pass": p})
        order = self.net.order
        plan.sort(key=lambda st: max(order.get(b, 0) for b in st["extract"]))
        self._row_plan = plan
        return plan

    def _hook(self, p: dict, seq: int, cache: Cache, ids=None, undoable: bool = False):
        fn, args = self.hooks[p["hook"]], dict(p.get("args", {}))
        if "state" in p:
            args["state"] = cache.layers[int(p["state"])]
            if undoable:
                args["undoable"] = True
        if p.get("ids"):
            args["ids"] = None if ids is None else np.asarray(ids, np.int64)
        return lambda blobs: fn(blobs, seq=seq, **args)


class LMHead:
    def __init__(self, net: Net, info: dict):
        self.net, self.info = net, info

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        (logits,) = self.net.run({self.info["inputs"]["hidden"]: np.atleast_2d(hidden)},
                                 [self.info["outputs"]["logits"]])
        return logits
