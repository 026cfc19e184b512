"""Continuous batching: several requests decode together over one loaded model.

An :class:`Engine` owns ``parallel`` slots, each one sequence's decoder state (KV caches, recurrent
and host states, the MTP block's rows). Requests take a free slot (the one whose cached tokens
share the longest prefix with the prompt, so a repeated system prompt or image is not computed
again; or a copy of a running request's state, where that shares more; answers to one prompt,
``after=``, compute it once and go on from copies), are prefilled a chunk per round (the chunks of
several prompts and a row of each decoding request in one forward, so a long prompt delays the
others by one chunk, not by all of it), and then decode together: each step is one decoder forward
over the newest token of every decoding request (``Decoder.forward_rows``: the weights are read
once for all rows; attention runs per sequence on its own KV cache, the conv windows and delta-rule
steps of all rows together on the host), and each row is sampled with its own request's settings. A
request that ends, is cancelled or whose client went away leaves at the next step; the others go
on. Where the package has an MTP block, a request decoding alone drafts, as a lone ``generate``
does; with several, each round is either a drafting round (each drafts after its pending token, and
one forward verifies the rows of all) or a plain step, whichever has measured faster at that many
requests.

The scheduler runs on its own thread and hands every piece of ncnn work to the model's owner
thread (``edgevl.owner``), one step at a time, so other callers of the model interleave with it.
The server and ``edgevl batch`` are its clients (``Engine.generate_tokens`` takes what
``Model.generate_tokens`` takes and yields the same tokens).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from contextlib import contextmanager

import numpy as np

from . import speculative
from .errors import EdgevlError, ShuttingDown
from .model import check_model, shared_prefix
from .runtime import MAX_SNAPSHOTS, state_bytes
from .sample import Sampler, sample

_END = object()
# with several requests decoding, the slower of drafting and plain steps is measured again after
# this many rounds, and after twice as many each time it is still the slower, up to RECHECK_MAX
RECHECK, RECHECK_MAX = 16, 128
# prompts join one forward while their rows together stay within this many (the first always
# runs, however long its chunk): a few rows cost little more than one (the weights are read once),
# but past a few dozen a forward's time grows with its rows (compute-bound on a CPU: 0.8B shape,
# 2 threads, 32 rows 10 ms a row, 128 rows 8), and putting longer prompts together would only
# delay the first of them
PROMPT_ROWS = 32
# a free slot takes a copy of a running request's state when that gives at least this many more
# of a new prompt's tokens (a copy costs about what computing a few tokens does)
COPY_MIN_TOKENS = 16


class Slot:
    """One sequence's state, kept after its request ends (prefix reuse)."""

    def __init__(self, model):
        self.request = None
        self.used = 0   # when it last served (least recently used slots are taken first)
        self.reset(model)

    def reset(self, model) -> None:
        """Empty the state (after a step that failed may have left it half-written)."""
        self.cache = model.decoder.new_cache()
        self.keys: list = []
        self.hidden_at: dict = {}
        # the MTP block's per-sequence fields (the block's nets are shared)
        self.mtp = None if model.mtp is None else model.mtp.new_state()


@contextmanager
def bound(model, slot: Slot):
    """The model's single-sequence state is the slot's while the block runs (owner thread)."""
    saved = (model.cache, model.cache_keys, model._hidden_at)
    model.cache, model.cache_keys, model._hidden_at = slot.cache, slot.keys, slot.hidden_at
    mtp_saved = None
    if slot.mtp is not None:
        mtp_saved = {f: getattr(model.mtp, f) for f in slot.mtp}
        model.mtp.__dict__.update(slot.mtp)
    try:
        yield
    finally:
        slot.cache, slot.keys, slot.hidden_at = model.cache, model.cache_keys, model._hidden_at
        model.cache, model.cache_keys, model._hidden_at = saved
        if mtp_saved is not None:
            slot.mtp = {f: getattr(model.mtp, f) for f in mtp_saved}
            model.mtp.__dict__.update(mtp_saved)


class Stream:
    """The tokens of one request, as the engine decides them (an iterator; ``close()`` cancels)."""

    def __init__(self, engine, args: dict):
        self.engine, self.args = engine, args
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False
        self.prefill_tokens = 0      # prompt tokens computed (the rest came from a slot's cache)
        self.drafted = self.accepted = 0
        self.done = False            # the consumer's side: nothing more to read
        self.ended = False           # the engine's side: every token is out
        # decoding state (scheduler thread)
        self.slot: Slot | None = None
        self.tok: int | None = None
        self.filling = None          # its prompt's chunks still to run (Model.prompt_chunks)
        self.chunk = None            # and the next of them (a PromptChunk)
        self.left = 0
        self.history: list = []
        self.trial = speculative.Trial()
        # answers to one prompt (``after``): a follower starts from its leader's prompt instead of
        # computing it again; the leader keeps ``fork`` (its state at the prompt's end and the
        # logits there) until each of its ``followers`` has taken a copy
        self.leader: Stream | None = None
        self.followers = 0
        self.fork = None

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if self.done:
            raise StopIteration
        item = self.out.get()
        if item is _END:
            self.done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self.done = True
            raise item
        return item

    def close(self) -> None:
        """Stop generating (a client that went away): the request leaves at the next step."""
        self.done = True
        if not self.ended:
            self.cancelled = True
            self.engine._wake()


class Engine:
    """Decodes the requests of several clients together over ``model`` (see the module doc).
    ``parallel``: sequences decoding at once (slots); more requests wait in order."""

    def __init__(self, model, parallel: int = 4):
        check_model(model)
        if isinstance(parallel, bool) or not isinstance(parallel, int) or not 1 <= parallel <= 256:
            raise EdgevlError(f"parallel (--parallel) must be between 1 and 256, got {parallel!r:.40}")
        if model.low_memory and parallel > 1:
            raise EdgevlError("low-memory mode decodes one sequence at a time; use --parallel 1 or run "
                              "without --low-memory")
        self.model, self.parallel = model, parallel
        self.slots = [Slot(model) for _ in range(parallel)]
        self.waiting: deque = deque()
        self.active: list[Stream] = []
        self.cond = threading.Condition()
        self.closed = False
        self.clock = 0
        self.steps = self.rows = 0     # batched decoder forwards and the rows they carried
        self.cycles = 0                # drafting cycles and rounds
        # tokens/s: of a plain step by its rows, of a drafting round by its requests
        self.rate: dict = {}
        self.first: set = set()        # kinds of round whose first sample was seen (not counted)
        self.checks: dict = {}         # per count of requests: (rounds to the next look at the slower
                                       # kind, rounds between looks, the faster kind)
        self.prompt_rows = PROMPT_ROWS   # prompts join a round while their rows fit (_chunks)
        self.prompts = 0               # forwards that computed prompt chunks, and those chunks
        self.chunks = 0
        self.thread = threading.Thread(target=self._loop, name="edgevl-engine", daemon=True)
        self.thread.start()
        # the model's close() closes its engines too: their thread holds it, so a model dropped
        # with an engine still open is never collected
        model._engines.add(self)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- clients ---------------------------------------------------------------------------------
    def generate_tokens(self, input_ids, max_new_tokens: int = 256, image=None, temperature: float = 0.0,
                        top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
                        seed: int | None = None, stop_ids=None, reuse_cache: bool = True,
                        max_image_patches: int | None = None, ignore_eos: bool = False, constraint=None,
                        presence_penalty: float = 0.0, frequency_penalty: float = 0.0, logprobs=None,
                        logit_bias=None, min_p: float = 0.0, after: Stream | None = None) -> Stream:
        """As ``Model.generate_tokens``: new token ids until eos, ``stop_ids``, the budget or the
        context end; the request decodes alongside the others. ``constraint``
        (``edgevl.structured.Constraint``) is this request's own: its row is sampled among the
        tokens it allows. ``after``: a request of this engine with the same prompt and images
        (another answer to it): this one waits for that one's prompt and goes on from a copy of
        its state there, sampling its own first token from the same logits, instead of computing
        the prompt again."""
        m = self.model
        if max_new_tokens is None or int(max_new_tokens) < 0:
            raise EdgevlError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        rows, infos = m.encode_images(image, max_image_patches)
        ids = [int(t) for t in input_ids]
        stops = (set() if ignore_eos else m.eos_ids) | {int(t) for t in (stop_ids or [])}
        s = Stream(self, {"ids": ids, "rows": rows, "infos": infos, "stops": stops, "reuse": reuse_cache,
                          "sampler": Sampler(temperature, top_k, top_p, repetition_penalty, seed, presence_penalty,
                                             frequency_penalty, prompt_tokens=len(ids), logprobs=logprobs,
                                             logit_bias=logit_bias, min_p=min_p),
                          "max_new": int(max_new_tokens), "constraint": constraint})
        with self.cond:
            if self.closed:
                raise ShuttingDown("the engine is closed")
            if after is not None and after.engine is self and after.args["ids"] == ids and \
                    len(after.args["rows"]) == len(rows) and all(a is b for a, b in zip(after.args["rows"], rows)):
                s.leader = after
                after.followers += 1
            self.waiting.append(s)
            self.cond.notify()
        return s

    def state_bytes(self) -> int:
        """Memory of one slot's decoder state at the full context (KV grows with the tokens), with
        the snapshots of its recurrent state that prefix reuse keeps (``runtime.MAX_SNAPSHOTS``)."""
        specs = self.model.decoder.info["state"]
        return (state_bytes(specs, self.model.max_context, self.model.kv_elem_bytes)
                + MAX_SNAPSHOTS * state_bytes([s for s in specs if s["kind"] != "kv"], 0))

    def close(self) -> None:
        """Stop: requests still waiting or decoding end with ``ShuttingDown``, and the engine's
        thread ends (it holds the model until then). Also ``with Engine(model) as engine:``, and
        the model's own ``close()``."""
        with self.cond:
            self.closed = True
            self.cond.notify()
        if threading.current_thread() is not self.thread:   # (a callback of its own may close it)
            self.thread.join(timeout=30)
        if self.thread.is_alive():   # its closing round still owes the requests their ShuttingDown
            return
        # the slots' states go now, with the model still whole (not whenever a collector finds them)
        self.slots, self.active = [], []
        self.waiting.clear()

    def _wake(self) -> None:
        with self.cond:
            self.cond.notify()

    # -- the scheduler -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            try:
                if not self._round():
                    return
            except Exception as e:  # noqa: BLE001 - a fault of the scheduler itself (not of a step,
                # which _run hands to its requests): the requests under way end with it, not hang
                for s in list(self.active):
                    self._owner_drop(s)
                    s.slot.reset(self.model)
                    s.out.put(EdgevlError(f"the engine failed: {e}"))
                    s.ended = True

    def _round(self) -> bool:
        """One round of the scheduler: admit, drop the finished, run a prompt chunk or a decode
        round. False once the engine is closed."""
        # the requests that ended leave first: a request that came as another ended finds its
        # slot (and the prefix it holds) free
        self._drop_finished()
        with self.cond:
            while not self.closed and not self.waiting and not self.active:
                self.cond.wait()
            if self.closed:
                for s in [*self.waiting, *self.active]:
                    s.out.put(ShuttingDown("the engine was closed before this request ended"))
                    s.cancelled = True
                closing = True
            else:
                closing = False
                self._admit()
        self._drop_finished()
        if closing:
            return False
        fresh = [s for s in self.active if s.tok is None]
        decoding = [s for s in self.active if s.tok is not None]
        chunks = self._chunks(fresh)
        if chunks:
            # prompts' chunks and a row of each decoding request in one forward: a long prompt
            # delays their next token by one chunk, not by all of it
            self._run(self._mixed, chunks + decoding)
            return True
        if not decoding:
            return True
        if self.model.mtp is not None and len(decoding) == 1:
            self._run(self._cycle, decoding)
        elif self.model.mtp is None or not any(s.trial.active for s in decoding):
            self._run(self._step, decoding)
        else:   # every request drafting in one verify pass, or a plain step: the faster, as measured
            self._choose(decoding)
        return True

    def _chunks(self, fresh: list) -> list:
        """The prompts whose next chunks this round computes (with a row of each decoding
        request, in one forward): as many as fit in ``prompt_rows`` rows, in arrival order (the
        first always runs, however long its chunk). Each prompt's chunks come from its own
        ``Model.prompt_chunks``; a prompt that cannot run (e.g. one longer than the context)
        ends only its request."""
        budget, chunks = self.prompt_rows, []
        for s in fresh:
            if s.chunk is None:
                self._run(self._start, [s])
                if s.ended:
                    continue
            rows = len(s.chunk.ids)
            if chunks and rows > budget:
                break
            budget -= rows
            chunks.append(s)
        return chunks

    def _choose(self, decoding: list) -> None:
        """Run whichever gives more tokens per second at this many requests, by the rates
        measured so far: a drafting round (each request's drafts, then one verify pass over all
        of them) or a plain step (one row each). A plain step is measured first; then, where
        both were measured at another count of requests, the nearest such count's winner runs
        (:meth:`_settled`); where neither was, a drafting round. The other kind is tried again
        after ``RECHECK`` rounds, and after twice as many each time it stays behind (up to
        ``RECHECK_MAX``): rates drift with the context lengths and the acceptance of the
        drafts, and a sample is noisy (a look later mends a wrong lead), while each look at the
        slower costs a round at its speed."""
        n = len(decoding)
        step, draft = self.rate.get(n), self.rate.get(("draft", n))
        if step is None:
            self._run(self._step, decoding)
            return
        lead = self._settled(n) if draft is None else "draft" if draft > step else "step"
        if lead is None:
            self._run(self._draft, decoding)
            return
        left, every, before = self.checks.get(n, (RECHECK, RECHECK, lead))
        if lead != before:
            left, every = min(left, RECHECK), RECHECK
        left -= 1
        pick = lead
        if left <= 0:
            every = min(2 * every, RECHECK_MAX)
            pick, left = "step" if lead == "draft" else "draft", every
        self.checks[n] = (left, every, lead)
        self._run(self._draft if pick == "draft" else self._step, decoding)

    def _settled(self, n: int) -> str | None:
        """Which kind won at the nearest count of requests where both were measured (None: none
        was): a count of requests lasts only a few rounds as requests come and go, too few to
        look at the slower kind at each."""
        both = [k for k in self.rate if isinstance(k, int) and ("draft", k) in self.rate]
        if not both:
            return None
        k = min(both, key=lambda k: (abs(k - n), k))
        return "draft" if self.rate[("draft", k)] > self.rate[k] else "step"

    def _measure(self, key, tokens: int, seconds: float) -> None:
        """Tokens per second of a kind of round (exponential average). The first plain step at a
        count of rows and the engine's first drafting round do not count: ncnn sets up new shapes
        and buffers then (seen: 2x a step's time at 8 rows), and would bias the choice for long."""
        rate = tokens / max(seconds, 1e-6)
        old = self.rate.get(key)
        first = key if isinstance(key, int) else "draft"
        if old is None and first not in self.first:
            self.first.add(first)
            return
        self.rate[key] = rate if old is None else 0.7 * old + 0.3 * rate

    def _admit(self) -> None:
        """Free slots to waiting requests, in arrival order (under the lock). A follower waits
        while its leader's prompt is being computed (those behind it may go first)."""
        i = 0
        while i < len(self.waiting):
            s = self.waiting[i]
            if s.cancelled:
                del self.waiting[i]
                self._let_go(s)
                continue
            free = [sl for sl in self.slots if sl.request is None]
            if not free:
                return
            lead = s.leader
            if lead is not None and lead.fork is None and lead.tok is None and not (lead.ended or lead.cancelled):
                i += 1      # its leader's prompt is not computed yet
                continue
            del self.waiting[i]
            self.clock += 1
            if lead is not None and lead.fork is not None:
                slot = min(free, key=lambda sl: sl.used)    # its state is replaced: the least recent
                slot.request, slot.used, s.slot = s, self.clock, slot
                self._follow(s, lead)
            else:
                self._let_go(s)
                keys = self.model._keys(s.args["ids"], s.args["rows"]) if s.args["reuse"] else []
                slot = max(free, key=lambda sl: (shared_prefix(sl.keys, keys), -sl.used))
                slot.request, slot.used, s.slot = s, self.clock, slot
                if keys:
                    self._copy_prefix(slot, keys)
            self.active.append(s)

    def _copy_prefix(self, slot: Slot, keys: list) -> None:
        """Where a running request's state gives more of this prompt than the free ``slot``'s
        cache does (the same system prompt or image, while that request decodes), the slot takes
        a copy of it; the prompt then goes back to what it shares, as from any cache."""
        def reach(sl: Slot) -> int:   # the prompt's tokens this slot's cache can give
            n = min(shared_prefix(sl.keys, keys), len(keys) - 1)
            return sl.cache.rollback_point(n) if n > 0 else 0

        donors = [a.slot for a in self.active if a.tok is not None and a.filling is None and not a.ended]
        donor = max(donors, key=reach, default=None)
        if donor is not None and reach(donor) >= reach(slot) + COPY_MIN_TOKENS:
            # copies of memory, no ncnn compute: here, between rounds, nothing else touches either
            # state (a call to the owner thread while holding the lock could wait on a collector
            # that runs there and needs the lock)
            slot.cache, slot.keys, slot.hidden_at, slot.mtp = _fork(donor.cache, donor.keys, donor.hidden_at,
                                                                    donor.mtp)

    def _let_go(self, s: Stream) -> None:
        """``s`` will not take its leader's state: the leader keeps it for one fewer."""
        lead, s.leader = s.leader, None
        if lead is not None:
            lead.followers -= 1
            if lead.followers <= 0:
                lead.fork = None

    def _follow(self, s: Stream, lead: Stream) -> None:
        """Start ``s`` from its leader's state at the prompt's end (a copy, or the last one's
        the state itself): its first token is sampled from the same logits."""
        state, logits = lead.fork
        last = lead.followers <= 1
        self._let_go(s)
        if not last:
            state = _fork(*state)
        s.slot.cache, s.slot.keys, s.slot.hidden_at, s.slot.mtp = state
        s.history = list(s.args["ids"])
        s.left = s.args["max_new"]
        if s.left <= 0:
            self._emit(s, [], True)
        else:
            self._next(s, logits)

    def _drop_finished(self) -> None:
        for s in [s for s in self.active if s.cancelled or s.ended]:
            self._owner_drop(s)     # a prompt cut short: its slot's cache goes back to whole
            if s.cancelled:     # a reader still waiting (closed from another thread) is let go
                s.out.put(_END)
            self.active.remove(s)
            s.slot.request = None

    def _run(self, fn, streams: list) -> None:
        """``fn(streams)`` on the owner thread; a failure ends those requests (their slots start
        empty again: a failed step may have left a state half-written) and the others go on."""
        try:
            self.model._owner.call(fn, streams)
        except BaseException as e:  # noqa: BLE001 - handed to each client of the failed step
            for s in streams:
                self._owner_drop(s)
                s.slot.reset(self.model)
                s.out.put(e)
                s.ended = True

    def _emit(self, s: Stream, tokens: list, end: bool) -> None:
        for t in tokens:
            s.out.put(int(t))
        if end:
            s.out.put(_END)
            s.ended = True

    def _owner_drop(self, s: Stream) -> None:
        """Let a prompt cut short go: its generator is closed on its own slot's state (the
        cache goes back to as whole as before the prompt), not whenever a collector finds it
        (it would then tidy the model's own cache); if even that fails, the slot starts empty."""
        if s.filling is not None:
            try:
                self.model._owner.call(self._stop_filling, [s])
            except BaseException:  # noqa: BLE001 - nothing of the prompt is kept either way
                s.slot.reset(self.model)
        s.filling = s.chunk = None

    # -- owner-thread work ------------------------------------------------------------------------
    def _start(self, streams: list) -> None:
        """A new prompt: its generator of chunks (``Model.prompt_chunks``) and its first chunk."""
        (s,) = streams
        a = s.args
        with bound(self.model, s.slot):
            s.filling = self.model.prompt_chunks(a["ids"], a["rows"], a["reuse"], images=a["infos"])
            s.chunk = next(s.filling)

    def _stop_filling(self, streams: list) -> None:
        (s,) = streams
        with bound(self.model, s.slot):
            s.filling.close()
        s.filling = None

    def _mixed(self, streams: list) -> None:
        """One forward over the pending chunk of each prompt among ``streams`` and the newest
        token of each decoding one; a prompt whose last chunk this was, and each decoding
        stream, get their next token from one lm_head call over their rows."""
        m = self.model
        prompts = [s for s in streams if s.tok is None]
        decoding = [s for s in streams if s.tok is not None]
        axes = max(len(s.chunk.positions) for s in prompts)
        pos = [np.broadcast_to(s.chunk.positions, (axes, len(s.chunk.ids))) for s in prompts]
        at_pos = np.array([[s.slot.cache.next_position for s in decoding]], np.int64)
        pos.append(np.broadcast_to(at_pos, (axes, len(decoding))))
        embeds = np.concatenate([s.chunk.embeds for s in prompts] + [m.embedding([s.tok for s in decoding])])
        # a decoded token's row is a text embedding, whatever its id (-1: no modality's id)
        ids = [t for s in prompts for t in s.chunk.ids] + [-1] * len(decoding)
        parts = [(s.slot.cache, len(s.chunk.ids)) for s in prompts] + [(s.slot.cache, 1) for s in decoding]
        hidden = self._forward(embeds, parts, np.concatenate(pos, axis=1), ids,
                               [s.chunk.kv_hint for s in prompts] + [0] * len(decoding))
        self.prompts += 1
        self.chunks += len(prompts)
        done, last, at = [], [], 0
        for s in prompts:
            n = len(s.chunk.ids)
            with bound(m, s.slot):
                try:
                    s.chunk = s.filling.send(hidden[at:at + n])
                except StopIteration as end:
                    s.chunk, s.filling = None, None
                    s.prefill_tokens = m.last_prefill_tokens
                    done.append(s)
                    last.append(end.value)
            at += n
        rows = np.concatenate([np.asarray(last, np.float32).reshape(-1, hidden.shape[1]), hidden[at:]])
        logits = m.head(rows) if len(rows) else rows
        for i, s in enumerate(done):
            a = s.args
            if s.followers > 0:   # other answers to this prompt go on from here
                sl = s.slot
                s.fork = (_fork(sl.cache, sl.keys, sl.hidden_at, sl.mtp), np.array(logits[i], np.float32))
            s.history = list(a["ids"])
            s.left = a["max_new"]
            if s.left <= 0:
                self._emit(s, [], True)
            else:
                self._next(s, logits[i])
        if decoding:
            self._decoded(decoding, hidden[at:], logits[len(done):], at_pos)
        if any(s.prefill_tokens > 1 for s in done):
            m.release_buffers()

    def _forward(self, embeds, parts: list, pos, ids=None, hints=None):
        """The decoder over the rows of ``parts`` (``Decoder.forward_rows``); the rows of one
        sequence alone go through its plain forward (the sub-runs per sequence would cost a few
        percent for nothing, and a low-memory model has only that)."""
        dec = self.model.decoder
        if len(parts) == 1:
            return dec.forward(embeds, parts[0][0], pos, ids=ids, kv_hint=hints[0] if hints else 0)[0]
        return dec.forward_rows(embeds, parts, pos, ids=ids, kv_hints=hints)

    def _next(self, s: Stream, logits) -> None:
        """Sample the stream's next token from its logits row and hand it out (with the end, if
        the answer ends there: a stop token, the context, the budget)."""
        a = s.args
        tok = sample(a["sampler"], a["constraint"], logits, s.history)
        s.left -= 1
        s.tok = tok
        self._emit(s, [tok], tok in a["stops"] or len(s.slot.keys) + 1 >= self.model.max_context or s.left <= 0)

    def _step(self, streams: list) -> None:
        """One forward over the newest token of each stream (one row each); where a request's
        grammar forces the tokens after it, they go in with it (:meth:`_verify`)."""
        m = self.model
        jumps = [self._forced(s) for s in streams]
        if any(jumps):
            for s in streams:
                s.history.append(int(s.tok))
            self._verify(streams, [[s.tok, *j] for s, j in zip(streams, jumps)], [0] * len(streams))
            return
        t0 = time.perf_counter()
        caches = [s.slot.cache for s in streams]
        pos = np.array([[c.next_position for c in caches]], np.int64)
        hidden = self._forward(m.embedding([s.tok for s in streams]), [(c, 1) for c in caches], pos)
        self._decoded(streams, hidden, m.head(hidden), pos)
        self._measure(len(streams), len(streams), time.perf_counter() - t0)

    def _decoded(self, streams: list, hidden, logits, pos) -> None:
        """After a forward that took one row of each stream (its pending token): its block's
        next drafts start from the row, and its next token is sampled."""
        m = self.model
        self.steps += 1
        self.rows += len(streams)
        for i, s in enumerate(streams):
            s.slot.keys.append(int(s.tok))
            if s.slot.mtp is not None:
                # the block's next draft starts from this row (the tokens decoded in batches are
                # not fed to it: drafts may be accepted less often, never wrongly)
                with bound(m, s.slot):
                    m.mtp._clear()
                    m.mtp.add(np.zeros((0, hidden.shape[1]), np.float32), hidden[i:i + 1], pos[:, i:i + 1],
                              len(s.slot.keys) - 1)
                    m.note_hidden(hidden[i])
            s.history.append(int(s.tok))
            if not s.trial.active:      # drafting is off: these count towards trying it again
                s.trial.update(0, 0, 1)
            self._next(s, logits[i])

    def _draft(self, streams: list) -> None:
        """A drafting round for several streams: each drafts after its pending token (as many as
        pay for it, none while its drafting is off; the block's passes and draft heads run over
        all of them together), one forward verifies every stream's rows, and each keeps its
        accepted drafts and a token of the decoder's own (speculative.settle, as a lone cycle)."""
        m = self.model
        t0 = time.perf_counter()
        # a request's first drafts feed its whole prompt to the block: not a round's usual cost
        catching_up = any(len(s.slot.mtp["js"]) > m.mtp.k + 1 for s in streams)
        for s in streams:
            s.history.append(int(s.tok))
        # where a grammar forces the next tokens they are the drafts; the block drafts for the
        # others together (each pass over one row of each)
        jumps = [self._forced(s) for s in streams]
        counts = [0 if j else speculative.draft_count(m, m.mtp, s.left, len(s.slot.keys), s.trial)
                  for s, j in zip(streams, jumps)]
        drafts = m.mtp.draft_rows([s.slot.mtp for s in streams], [s.tok for s in streams], counts,
                                  [s.args["constraint"] for s in streams])
        rows, owns = [], []
        for s, d, j in zip(streams, drafts, jumps):
            d = speculative.allowed(d, s.args["constraint"])
            rows.append([s.tok, *(j or d), *(self._forced(s, d) if d else [])])
            owns.append(0 if j else len(d))
        tokens = self._verify(streams, rows, owns, drafting=not all(jumps))
        # a round with forced tokens (a grammar's, not the block's) says nothing of drafting's rate
        if not catching_up and all(len(r) == 1 + own for r, own in zip(rows, owns)):
            self._measure(("draft", len(streams)), tokens, time.perf_counter() - t0)

    def _forced(self, s: Stream, after: list | None = None) -> list:
        """The tokens ``s``'s grammar forces after its pending token (and ``after``, its drafts)."""
        return speculative.forced(self.model, s.args["constraint"], s.left, len(s.slot.keys), after)

    def _verify(self, streams: list, rows: list, owns: list, drafting: bool = False) -> int:
        """One forward over each stream's ``rows`` (its pending token and drafts after it, the
        first ``owns[i]`` of them the block's, the rest forced by its grammar), then each keeps
        its accepted drafts and a token of the decoder's own (speculative.settle, as a lone
        cycle). ``drafting``: a drafting round (counted in ``cycles``). Returns the tokens taken."""
        m = self.model
        caches = [s.slot.cache for s in streams]
        pos = np.concatenate([np.arange(c.next_position, c.next_position + len(r), dtype=np.int64)
                              for c, r in zip(caches, rows)])[None]
        hidden = m.decoder.forward_rows(m.embedding([t for r in rows for t in r]),
                                        [(c, len(r)) for c, r in zip(caches, rows)], pos, undoable=True)
        logits = m.head(hidden)
        self.steps += 1
        self.rows += len(hidden)
        self.cycles += drafting
        at = tokens = 0
        for s, r, own in zip(streams, rows, owns):
            n = len(r)
            with bound(m, s.slot):
                before = (m.mtp.drafted, m.mtp.accepted) if m.mtp is not None else (0, 0)
                emit, end = speculative.settle(m, m.mtp, s.args["sampler"], r, n, hidden[at:at + n],
                                               logits[at:at + n], pos[:, at:at + n], s.history, s.args["stops"],
                                               s.left, s.trial, s.args["constraint"], own)
                if m.mtp is not None:
                    s.drafted += m.mtp.drafted - before[0]
                    s.accepted += m.mtp.accepted - before[1]
            at += n
            tokens += len(emit)
            self._took(s, emit, end)
        return tokens

    def _cycle(self, streams: list) -> None:
        """A lone stream drafts: one draft-and-verify cycle (speculative.cycle)."""
        (s,) = streams
        m = self.model
        with bound(m, s.slot):
            before = (m.mtp.drafted, m.mtp.accepted)
            s.history.append(int(s.tok))
            emit, end = speculative.cycle(m, m.mtp, s.args["sampler"], s.tok, s.history, s.args["stops"],
                                          s.left, s.trial, s.args["constraint"])
            s.drafted += m.mtp.drafted - before[0]
            s.accepted += m.mtp.accepted - before[1]
        self.cycles += 1
        self._took(s, emit, end)

    def _took(self, s: Stream, emit: list, end: bool) -> None:
        """A stream's tokens from a drafting cycle or round: the last is its new pending token."""
        s.history += emit[:-1]
        s.left -= len(emit)
        s.tok = emit[-1]
        self._emit(s, emit, end)


def _fork(cache, keys, hidden_at, mtp) -> tuple:
    """A copy of one sequence's state (a slot's fields) that another sequence goes on from."""
    if mtp is not None:
        mtp = {k: v.clone() if k == "cache" else list(v) for k, v in mtp.items()}
    return cache.clone(), list(keys), dict(hidden_at), mtp
