"""Speculative decoding with a package's own multi-token-prediction (MTP) block.

Decoding reads every weight once per token, so it runs at the memory-bandwidth ceiling; a
forward of a few rows reads them once too. A cycle here: the MTP block drafts k tokens after the
pending token (its argmax; k > 1 by feeding the block its own output), the decoder runs the
pending token and the drafts in one forward, the sampler checks the drafts in order
(``Sampler.check``: the argmax when greedy, the rejection rule when sampling — either way the
output is what plain decoding gives, or has its distribution) and the decoder takes back the
rows after the first rejection (``runtime.Decoder.undo``). A cycle yields the accepted drafts
and one token of the decoder's own.

The block's row j pairs the embedding of token j+1 with the decoder's final hidden state at j,
at j's rotary position, and attends over its own KV cache of the rows before. Its rows follow the
decoder's: a prompt's rows are fed once its next token is known, a cycle's kept rows before the
next draft, and the rows a recursive draft adds are taken back after it. docs/speculative.md
describes the state handling and the measurements behind the defaults.
"""

from __future__ import annotations

import bisect

import numpy as np

from .blocks.base import DRAFT_HEAD_ROWS
from .errors import EdgevlError
from .runtime import Decoder, LMHead, layer_outputs
from .sample import check, sample

MODES = ("none", "mtp")
# The most grammar-forced tokens fed in one pass (:func:`forced`; 0: none, each takes a step):
# within the masks a constraint keeps, and a pass of 9 rows still costs far less than 9 steps.
FORCED_MAX = 8
# When drafting stops paying (docs/speculative.md, "When it turns itself off"): after
# AUTO_OFF_CYCLES steps in a row without an accepted draft, or when fewer than AUTO_OFF_RATE of
# the drafts were accepted once AUTO_OFF_AFTER were made, decoding goes on plainly, and tries
# drafting again after RETRY_AFTER plain tokens (text changes: a list, then prose, then code).
AUTO_OFF_CYCLES = 3
AUTO_OFF_RATE = 0.3
AUTO_OFF_AFTER = 16
RETRY_AFTER = 64


def missing_block(manifest: dict, low_memory: bool = False) -> tuple[str, str | None]:
    """Why a loaded package has no MTP block to draft with, and what would give it one (None:
    nothing, its checkpoint has none)."""
    if "mtp" in manifest["graphs"] and low_memory:
        return "low_memory leaves it unloaded", "load without low_memory"
    mtp = manifest.get("mtp")
    if isinstance(mtp, dict) and mtp.get("converted") is False:  # the checkpoint had one
        return "it was converted with --no-mtp", "convert it again without --no-mtp"
    return "its checkpoint has none", None


def check_options(mode, draft_tokens, draft_vocab, has_block: bool, undo_rows: int,
                  missing: tuple[str, str | None] = ("its checkpoint has none", None),
                  ) -> tuple[str, int, int | None, bool]:
    """(mode, draft tokens, draft vocabulary, adaptive) checked; mode None means "mtp" where the
    package has the block; draft tokens None means up to DEFAULT_DRAFT_TOKENS (as many as the
    package allows), as many as pay (adaptive, :meth:`Trial.length`). ``missing``: why a package
    without the block lacks it and the fix (:func:`missing_block`)."""
    if mode is None:
        mode = "mtp" if has_block and undo_rows >= 2 else "none"
    if mode not in MODES:
        raise EdgevlError(f"speculative must be one of {', '.join(MODES)}, got {mode!r:.40}")
    why, fix = missing
    if mode == "mtp" and not has_block:
        raise EdgevlError("speculative='mtp' needs a multi-token-prediction (MTP) block, which this package lacks "
                          f"({why}); use speculative='none' (--speculative none)" + (f" or {fix}" if fix else ""))
    # the draft options only shape drafting: without a block a limit of "1 to 1" would hide why
    for name, value in (("draft_tokens", draft_tokens), ("draft_vocab", draft_vocab)):
        if value is not None and not has_block:
            raise EdgevlError(f"{name} drafts with a multi-token-prediction (MTP) block, and this package has no MTP "
                              f"block ({why}); drop {name} (--{name.replace('_', '-')})"
                              + (f" or {fix}" if fix else ""))
    limit = max(1, undo_rows - 1)
    k = min(DEFAULT_DRAFT_TOKENS, limit) if draft_tokens is None else draft_tokens
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= limit:
        raise EdgevlError(f"draft_tokens must be an integer from 1 to {limit} for this model, got {k!r:.40}")
    if mode == "mtp" and undo_rows < 2:
        raise EdgevlError("speculative decoding needs the KV cache to be cut back, which this ncnn build does not "
                          "do; use speculative='none' (--speculative none)")
    v = DEFAULT_DRAFT_VOCAB if draft_vocab is None else draft_vocab
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise EdgevlError(f"draft_vocab must be an integer >= 0 (0: the whole vocabulary), got {draft_vocab!r:.40}")
    return mode, int(k), int(v) or None, draft_tokens is None


# By default up to 3 drafts per decoder pass, each further draft only while the ones before it are
# accepted often enough to pay for it (Trial.length; docs/speculative.md, "How many drafts").
DEFAULT_DRAFT_TOKENS = 3
# A further draft is made while the estimated chance that it and every draft before it are
# accepted is at least MIN_REACH: a draft costs a block pass and a draft head, about a tenth of a
# step at the 0.8B shape (the verify pass of 4 rows costs what 2 cost), and an accepted one saves
# a whole token's share of a step. 0.25 with this prior came out at or near the best of fixed 1,
# fixed 3 and thresholds 0.2-0.3 at every acceptance in a simulation with the measured step costs
# (docs/speculative.md, "How many drafts").
MIN_REACH = 0.25
PRIOR_RATE, PRIOR_STEPS = 2 / 3, 3
# Drafts among the first 64k vocabulary rows: the head's other rows cost a decoder step's worth of
# reading for little (docs/speculative.md, "The draft head").
DEFAULT_DRAFT_VOCAB = DRAFT_HEAD_ROWS


class DraftHead:
    """The argmax of the lm_head over its first ``rows`` vocabulary rows: the lm_head graph's
    row shards are separate Gemms, so extracting only the first shards' outputs computes only
    those (no second copy of the head). BPE vocabularies put frequent tokens first."""

    def __init__(self, head, rows: int | None = None):
        self.head = head
        shards = (head.info.get("extra") or {}).get("shards") or []
        self.blobs = None
        if rows is not None and len(shards) > 1 and rows < shards[-1]["rows"][1]:
            n = next(i for i, s in enumerate(shards) if s["rows"][1] >= rows) + 1
            outs = layer_outputs(head.net.where)
            self.blobs = [outs[f"lm_head.{i}"][0] for i in range(n)]
            self.rows = shards[n - 1]["rows"][1]

    def __call__(self, hidden: np.ndarray, allowed: np.ndarray | None = None) -> int | None:
        """The draft: the argmax, among the ``allowed`` tokens if given (None: none of them is
        in the rows this head covers)."""
        return self.many(np.atleast_2d(hidden)[-1:], [allowed])[0]

    def many(self, hidden: np.ndarray, allowed: list) -> list:
        """The draft of each row of ``hidden`` [B, H] (one head pass for all), row b's among the
        tokens ``allowed[b]`` allows where that is not None."""
        hidden = np.ascontiguousarray(hidden, np.float32)
        if self.blobs is None:
            lg = self.head(hidden)
        else:
            name = self.head.info["inputs"]["hidden"]
            res = self.head.net.run({name: hidden}, self.blobs)
            lg = np.concatenate([r.reshape(len(hidden), -1) for r in res], axis=1)
        out = []
        for row, ok in zip(lg, allowed):
            if ok is not None:
                n = min(len(row), len(ok))
                row = np.where(ok[:n], row[:n], -np.inf)
                if not np.isfinite(row).any():
                    out.append(None)
                    continue
            out.append(int(np.argmax(row)))
        return out


# the block's per-sequence fields (Mtp.new_state)
STATE_FIELDS = ("cache", "rows", "embeds", "hidden", "positions", "js")
# waiting rows past which the block catches up in chunks: a prompt's, never a decoding cycle's
# (a few drafts and the tokens a grammar forced after them)
CATCH_UP_ROWS = 64


class Mtp:
    """A package's MTP block: its decoder driver (sharing the main decoder's rope tables and host
    hooks, e.g. the expert store), its KV cache and the rows waiting to be fed."""

    def __init__(self, model, draft_tokens: int = DEFAULT_DRAFT_TOKENS, draft_vocab: int | None = None,
                 adaptive: bool = False):
        info = model.manifest["graphs"]["mtp"]
        # adaptive: up to draft_tokens, as many as pay (Trial.length)
        self.model, self.k, self.adaptive = model, int(draft_tokens), bool(adaptive)
        self.decoder = Decoder(model.open_net("mtp"), info, model.decoder.rope, model.decoder.hooks)
        head = model.head
        small = model.manifest["graphs"].get("draft_head")   # int8 first rows (float packages)
        vocab = model.head.info["extra"]["shards"][-1]["rows"][1]
        if small is not None and draft_vocab and min(draft_vocab, vocab) <= small["extra"]["shards"][-1]["rows"][1]:
            head = LMHead(model.open_net("draft_head"), small)
        self.head = DraftHead(head, draft_vocab)
        self.pad = model.decoder.undo_rows >= 4     # a verify pass of 3 rows may take a 4th
        self.drafted = self.accepted = 0
        self.reset()

    def reset(self) -> None:
        self.__dict__.update(self.new_state())

    def new_state(self) -> dict:
        """The block's per-sequence state, empty (the fields ``reset`` sets; an engine keeps one
        per slot and swaps it in)."""
        # rows: the decoder position of each cached row; the rest: the rows waiting (``_clear``)
        return {"cache": self.decoder.new_cache(), **{f: [] for f in STATE_FIELDS[1:]}}

    def _clear(self) -> None:
        # rows waiting to be fed: row j needs the embedding of token j+1, so the last one waits
        # for the next token (embeds has one row fewer than hidden)
        self.embeds, self.hidden, self.positions, self.js = [], [], [], []

    def keep_before(self, j: int) -> None:
        """Keep only the rows before decoder position ``j`` (what a prompt that shares the
        first ``j + 1`` tokens with the cache leaves unchanged) and drop those waiting."""
        self._clear()
        n = bisect.bisect_left(self.rows, j)
        if n == 0:
            self.cache = self.decoder.new_cache()
            self.rows = []
        elif n < self.cache.length:      # (a recursive draft that failed may have left its row)
            self.cache.rollback(n)
            del self.rows[n:]

    def add(self, embeds, hidden, positions, first: int, token: int | None = None) -> None:
        """Rows ``first``, ``first + 1`` ... waiting: the decoder's hidden states [n, H] at those
        positions ([axes, n]) and the embeddings of the tokens after each but the last ([n - 1, H];
        the last row's comes with the next token). ``token``: the one at ``first``, which rows
        still waiting before it need (a cycle that did not draft left them)."""
        if self.js and self.js[-1] + 1 != first:
            self._clear()        # not contiguous (a plain step in between): start again here
        elif self.js and token is not None:
            self.embeds.append(self.model.embedding([token])[0])
        elif self.js:
            self._clear()
        if not self.js and self.rows and self.rows[-1] >= first:
            return
        self.embeds += list(np.asarray(embeds, np.float32).reshape(-1, hidden.shape[1]))
        self.hidden += list(hidden)
        positions = np.asarray(positions)
        self.positions += [positions[:, i] for i in range(positions.shape[1])]
        self.js += range(first, first + len(hidden))

    def draft(self, token: int, m: int, constraint=None) -> list[int]:
        """Feed the waiting rows (the last one with ``token``, the decoder's pending token) and
        draft up to ``m`` tokens after it; with a ``constraint`` (its state after ``token``) each
        draft is the block's best among the tokens the grammar allows after the drafts before it
        (a draft it forbids could only be rejected)."""
        state = {f: getattr(self, f) for f in STATE_FIELDS}
        try:
            return self.draft_rows([state], [token], [m], [constraint])[0]
        finally:
            self.__dict__.update(state)

    def draft_rows(self, states: list, tokens: list, ms: list, constraints: list) -> list:
        """:meth:`draft` for several sequences at once (the block's per-sequence ``states``, as
        :meth:`new_state` makes them, updated in place): each block pass and each draft head runs
        once over one row of every sequence still drafting. Returns each one's drafts."""
        model = self.model
        drafts: list = [[] for _ in states]
        go = [b for b, st in enumerate(states) if ms[b] > 0 and st["js"]]
        if not go:
            return drafts
        for b in go:
            self._catch_up(states[b])
        xs, poss = [], []
        for b in go:
            st = states[b]
            axes = max(len(p) for p in st["positions"])
            xs.append(np.concatenate([np.stack(st["embeds"] + [model.embedding([tokens[b]])[0]]),
                                      np.stack(st["hidden"])], 1))
            poss.append(np.stack([np.broadcast_to(p, (axes,)) for p in st["positions"]], 1))
        out = self._forward([states[b]["cache"] for b in go], xs, poss)
        nxt, lasts, at = {}, {}, 0
        for b, x, pos in zip(go, xs, poss):
            st = states[b]
            st["rows"] += st["js"]
            st["embeds"], st["hidden"], st["positions"], st["js"] = [], [], [], []
            nxt[b] = int(pos[:, -1].max()) + 1
            at += len(x)
            lasts[b] = out[at - 1]
        taken = dict.fromkeys(go, 0)
        live = list(go)
        try:
            for i in range(max(ms[b] for b in go)):
                if i:   # recursive: the block's own output and draft as the next row
                    out = self._forward([states[b]["cache"] for b in live],
                                        [np.concatenate([model.embedding([drafts[b][-1]]), lasts[b][None]], 1)
                                         for b in live],
                                        [np.full((1, 1), nxt[b] + i - 1, np.int64) for b in live])
                    lasts.update(zip(live, out))
                if any(constraints[b] is not None and constraints[b].done for b in live):
                    live = [b for b in live if constraints[b] is None or not constraints[b].done]
                if not live:
                    break
                got = self.head.many(np.stack([lasts[b] for b in live]),
                                     [None if constraints[b] is None else constraints[b].allowed() for b in live])
                for b, d in zip(live, got):
                    if d is None:
                        continue
                    drafts[b].append(d)
                    if constraints[b] is not None and i + 1 < ms[b]:
                        constraints[b].advance(d)
                        taken[b] += 1
                live = [b for b, d in zip(live, got) if d is not None and i + 1 < ms[b]]
                if not live:
                    break
        finally:
            for b in go:
                if taken[b]:
                    constraints[b].rollback(taken[b])
        for b in go:
            if ms[b] > 1:
                states[b]["cache"].rollback(len(states[b]["rows"]))
        return drafts

    def _catch_up(self, st: dict) -> None:
        """Feed a sequence's waiting rows but the last ``prefill_step`` in chunks of that many, as
        the prompt they came from was prefilled: a long prompt's rows in one pass took memory
        that grew with its square (the mask and attention scores; 9 GB at 28k tokens)."""
        # (never a decoding cycle's few rows, whatever a small prefill_chunk says)
        step = max(self.model.prefill_step, CATCH_UP_ROWS)
        done = len(st["js"]) - step        # the last rows go with the drafting pass
        if done <= 0:
            return
        axes = max(len(p) for p in st["positions"])
        hint = len(st["rows"]) + len(st["js"])     # the KV room the whole prompt takes, allocated once
        for s in range(0, done, step):
            e = min(done, s + step)
            x = np.concatenate([np.stack(st["embeds"][s:e]), np.stack(st["hidden"][s:e])], 1)
            pos = np.stack([np.broadcast_to(p, (axes,)) for p in st["positions"][s:e]], 1)
            self.decoder.forward(x, st["cache"], pos, kv_hint=hint)
        st["rows"] += st["js"][:done]
        for f in STATE_FIELDS[2:]:
            del st[f][:done]
        self.decoder.release_pools()    # drafting needs a small part of a chunk's buffers

    def _forward(self, caches: list, xs: list, positions: list) -> np.ndarray:
        """The block over each sequence's rows ``xs[b]`` at ``positions[b]`` on ``caches[b]``:
        their outputs, in order (one sequence: a plain forward)."""
        if len(caches) == 1:
            return self.decoder.forward(xs[0], caches[0], positions[0])[0]
        axes = max(len(p) for p in positions)
        pos = np.concatenate([np.broadcast_to(p, (axes, p.shape[1])) for p in positions], 1)
        return self.decoder.forward_rows(np.concatenate(xs), [(c, len(x)) for c, x in zip(caches, xs)], pos)


class Trial:
    """Whether to draft in the next step: on until drafting stops paying, then off for
    ``RETRY_AFTER`` tokens, then on again with a fresh count."""

    def __init__(self):
        self.active, self.drafted, self.accepted, self.dry, self.plain = True, 0, 0, 0, 0
        self.reached, self.kept = [], []    # per draft position: cycles that drafted it, accepted it

    def length(self, k: int, min_reach: float | None = None) -> int:
        """How many drafts (1 to ``k``) to make: the longest run whose last draft is estimated to
        be accepted, every draft before it too, with a chance of at least ``min_reach`` (default
        MIN_REACH). Each
        position's acceptance rate given the ones before it were accepted is counted since this
        trial began, starting from PRIOR_STEPS steps at the rate of the position before it (2/3
        for the first): a position seldom reached goes as the one before it until it has its own
        count, so one rejection there does not bar it for good."""
        floor = MIN_REACH if min_reach is None else min_reach
        n, reach, rate = 1, 1.0, PRIOR_RATE
        for i in range(k):
            seen, kept = (self.reached[i], self.kept[i]) if i < len(self.reached) else (0, 0)
            rate = (kept + PRIOR_STEPS * rate) / (seen + PRIOR_STEPS)
            reach *= rate
            if reach < floor:
                break
            n = i + 1
        return n

    def update(self, drafted: int, accepted: int, tokens: int) -> bool:
        """Count a step (its drafts, the accepted ones, the tokens it gave); returns whether the
        block follows the decoder for the next step (drafting is on)."""
        if not self.active:
            self.plain += tokens
            if self.plain >= RETRY_AFTER:
                self.__init__()
            return self.active
        for i in range(min(drafted, accepted + 1)):   # positions the verifier looked at
            if i == len(self.reached):
                self.reached.append(0)
                self.kept.append(0)
            self.reached[i] += 1
            self.kept[i] += i < accepted
        self.drafted += drafted
        self.accepted += accepted
        self.dry = 0 if accepted else self.dry + 1
        if (self.dry >= AUTO_OFF_CYCLES and not self.accepted) or (
                self.drafted >= AUTO_OFF_AFTER and self.accepted < AUTO_OFF_RATE * self.drafted):
            self.active, self.plain = False, 0
        return self.active


def block_outputs(mtp: Mtp, embeds_next, hidden, positions) -> np.ndarray:
    """The block's outputs [n, H] for rows given at once (row j: the embedding of token j+1,
    the decoder's hidden state at j, j's position), in a cache of their own (verification)."""
    out, _ = mtp.decoder.forward(np.concatenate([embeds_next, hidden], 1), mtp.decoder.new_cache(), positions)
    return out


def generate(model, mtp: Mtp, sampler, logits, history: list, stops: set, max_new_tokens: int, constraint=None):
    """``Model.generate_tokens``'s loop with drafting: yields the same tokens as plain decoding
    (greedy), or tokens of the same distribution (sampling). ``constraint``
    (``edgevl.structured.Constraint``): drafts it forbids are dropped before the verify pass, every
    token is taken among the ones it allows, and tokens past the answer's end are taken back."""
    mtp.drafted = mtp.accepted = 0
    trial = Trial()
    left = int(max_new_tokens)
    tok = sample(sampler, constraint, logits, history)
    yield tok
    left -= 1
    if tok in stops or len(model.cache_keys) + 1 >= model.max_context or left <= 0:
        return
    history.append(tok)
    while True:
        emit, end = cycle(model, mtp, sampler, tok, history, stops, left, trial, constraint)
        yield from emit
        history += emit
        left -= len(emit)
        if end:
            return
        tok = emit[-1]


def forced(model, constraint, left: int, fed: int, after: list | None = None) -> list[int]:
    """The tokens a ``constraint``'s grammar forces after the pending token (a key's name, the
    punctuation between fields), to feed with it in one pass as drafts that cannot be rejected:
    each is the only token allowed where it stands, so sampling there takes it, and the pass
    gives the token after them too. Up to FORCED_MAX, and only where the decoder can take rows
    back (``fed``: the tokens in the cache; ``left``: the answer's budget). ``after``: the
    block's drafts (allowed), which the forced tokens follow: they stand or fall with them."""
    after = after or []
    if constraint is None or FORCED_MAX <= 0:
        return []
    n = len(after)
    limit = min(FORCED_MAX, model.undo_limit - 1 - n, left - 1 - n, model.max_context - fed - 2 - n)
    if limit <= 0:
        return []
    for d in after:
        constraint.advance(d)
    try:
        return constraint.forced(limit)
    finally:
        constraint.rollback(n)


def cycle(model, mtp: Mtp | None, sampler, tok: int, history: list, stops: set, left: int, trial: Trial | None,
          constraint=None, jump: list | None = None) -> tuple:
    """One draft-and-verify cycle from ``tok``, the newest token not yet fed to the decoder:
    (the tokens it decides, 1 to K+1, and whether the answer ends with them). ``history``
    holds the tokens up to ``tok`` (not the ones decided here); ``constraint`` as in
    :func:`generate`. Where the grammar forces the next tokens, they are the drafts
    (``jump``, else :func:`forced` finds them); without a block (``mtp`` None), only they are."""
    if jump is None:
        jump = forced(model, constraint, left, len(model.cache_keys))
    rows, own = ([tok, *jump], 0) if jump or mtp is None else propose(model, mtp, tok, left, trial, constraint)
    # ncnn's Gemm runs 3 rows slower than 4 (bf16: 2 + 1 rows, the weights read twice): a
    # 4th row (taken back with the rejected ones) costs less than it saves
    fed_rows = rows + rows[-1:] if len(rows) == 3 and model.undo_limit >= 4 else rows
    start = model.cache.next_position
    pos = np.arange(start, start + len(fed_rows), dtype=np.int64)[None]
    with model._whole_or_nothing():
        hidden, _ = model.decoder.forward(model.embedding(fed_rows), model.cache, pos, undoable=len(rows) > 1)
        return settle(model, mtp, sampler, rows, len(fed_rows), hidden, model.logits(hidden), pos, history, stops,
                      left, trial, constraint, own)


def propose(model, mtp: Mtp, tok: int, left: int, trial: Trial, constraint=None) -> tuple[list[int], int]:
    """A cycle's rows: ``tok`` and the drafts after it (as many as ``trial`` says pay, none while
    drafting is off; with a ``constraint``, only those the grammar allows, then the tokens it
    forces after them), and how many of the drafts are the block's."""
    m = draft_count(model, mtp, left, len(model.cache_keys), trial)
    drafts = allowed(mtp.draft(tok, m, constraint=constraint) if m > 0 else [], constraint)
    tail = forced(model, constraint, left, len(model.cache_keys), drafts) if drafts else []
    return [tok, *drafts, *tail], len(drafts)


def draft_count(model, mtp: Mtp, left: int, fed: int, trial: Trial) -> int:
    """How many drafts to make after ``fed`` tokens with ``left`` to go."""
    k = trial.length(mtp.k) if mtp.adaptive else mtp.k
    return min(k, left, model.max_context - fed - 1) if trial.active else 0


def allowed(drafts: list, constraint=None) -> list:
    """The drafts up to the first one the grammar forbids (which could only be rejected)."""
    if constraint is not None and drafts:
        return drafts[:constraint.valid_prefix(drafts)]
    return drafts


def settle(model, mtp: Mtp | None, sampler, rows: list, fed_rows: int, hidden, lg, pos, history: list, stops: set,
           left: int, trial: Trial | None, constraint=None, own: int | None = None) -> tuple:
    """The verify pass's outcome for the ``rows`` of :func:`propose` (fed first among the
    ``fed_rows`` rows the decoder took; ``hidden``, logits ``lg`` and positions ``pos`` of
    those): the drafts checked in order, the rows after the first rejection (or past the
    answer's end) taken back, the block given the kept rows. Returns as :func:`cycle`.
    ``own``: how many of the drafts are the block's (None: all); the rest are the grammar's
    (:func:`forced`), which count as plain tokens, not in the block's acceptance."""
    fed = len(model.cache_keys)
    drafts = rows[1:]
    out = []
    for i, d in enumerate(drafts):
        out.append(check(sampler, constraint, lg[i], history + out, d))
        if out[-1] != d:
            break
    else:
        out.append(sample(sampler, constraint, lg[len(drafts)], history + out))
    accepted = len(out) - 1
    # where the answer ends inside this cycle (a stop token, the context, the budget)
    end = next((i + 1 for i, t in enumerate(out)
                if t in stops or fed + i + 2 >= model.max_context or i + 1 >= left), None)
    emit = out[:end] if end else out
    if constraint is not None:
        constraint.rollback(len(out) - len(emit))
    keep = len(emit) if end else accepted + 1      # rows fed before the last emitted token
    model.decoder.undo(model.cache, fed_rows, fed_rows - keep)
    model.cache_keys.extend(rows[:keep])
    model.note_hidden(hidden[keep - 1])
    if mtp is None:
        return emit, bool(end)
    own = len(drafts) if own is None else own
    if not own:     # the block still follows the decoder while drafting is on
        follow = trial.active or trial.update(0, 0, len(emit))
    else:
        # a draft counts where its target is part of the answer (not past its end)
        mine = min(accepted, own)
        d, a = (min(own, len(emit)), min(mine, len(emit))) if end else (own, mine)
        mtp.drafted += d
        mtp.accepted += a
        follow = trial.update(d, a, len(emit))
    if follow:
        mtp.add(model.embedding(rows[1:keep]), hidden[:keep], pos[:, :keep], fed, rows[0])
    return emit, bool(end)
