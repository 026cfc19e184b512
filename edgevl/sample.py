"""Token selection from logits: greedy, or seeded sampling with the usual processors.

Order follows transformers' generate: repetition penalty, then temperature, top-k, top-p, min-p;
OpenAI's presence and frequency penalties come after the repetition penalty (vLLM's order).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from .errors import EdgevlError

# OpenAI's bound on top_logprobs
MAX_TOP_LOGPROBS = 20
# OpenAI's floor for a log-probability too small to show (and for a broken row)
LOGPROB_FLOOR = -9999.0

# below this, sampling is greedy: logits up to ~1e4 divided by it stay far inside float64's range
MIN_TEMPERATURE = 1e-100


def finite_number(v) -> bool:
    if not isinstance(v, (int, float, np.integer, np.floating)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:   # an integer past float's range (JSON allows any number of digits)
        return False


# the sampling settings' ranges: name -> (whether a finite value is allowed, what it must be)
SETTINGS = {
    "temperature": (lambda v: v >= 0, "a finite number >= 0 (0 = greedy)"),
    "top_k": (lambda v: v >= 0, ">= 0 (0 = off)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "repetition_penalty": (lambda v: v > 0, "a finite number > 0 (1 = off)"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1] (0 = off)"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "a number from -2 to 2 (0 = off)"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "a number from -2 to 2 (0 = off)"),
}


def check_seed(seed) -> None:
    """A seed is None or an integer >= 0, else a one-line EdgevlError."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
        raise EdgevlError(f"seed must be an integer >= 0, got {seed!r:.40}")


def check_setting(name: str, v) -> None:
    """A sampling setting in its range (``SETTINGS``), else a one-line EdgevlError naming it."""
    ok, what = SETTINGS[name]
    if not finite_number(v) or not ok(v):
        raise EdgevlError(f"{name} must be {what}, got {v!r:.40}")


class Sampler:
    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 repetition_penalty: float = 1.0, seed: int | None = None, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, prompt_tokens: int = 0, logprobs: Logprobs | None = None,
                 logit_bias: dict | None = None, min_p: float = 0.0):
        for name, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                        ("repetition_penalty", repetition_penalty), ("min_p", min_p),
                        ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            check_setting(name, v)
        check_seed(seed)
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.repetition_penalty = float(repetition_penalty)
        self.min_p = float(min_p)
        # OpenAI's penalties count the tokens generated so far: the history after the prompt
        self.presence_penalty, self.frequency_penalty = float(presence_penalty), float(frequency_penalty)
        self.prompt_tokens = int(prompt_tokens)
        self.rng = np.random.default_rng(seed)
        bias = check_logit_bias(logit_bias)
        self.bias = None if bias is None else (np.array(list(bias), np.int64),
                                               np.array(list(bias.values()), np.float32))
        self.logprobs = logprobs    # where each token taken is noted with its log-probability, if asked

    @property
    def greedy(self) -> bool:
        # A temperature so small (1e-320, a denormal) that logits / temperature overflows is
        # greedy in the limit; dividing would give inf - inf = NaN probabilities.
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    def __call__(self, logits: np.ndarray, history=()) -> int:
        if self.greedy:
            return int(np.argmax(self._penalized(logits, history)))
        return self._draw(self.distribution(logits, history))

    def _draw(self, p: np.ndarray) -> int:
        """``rng.choice(len(p), p=p)``: the same token for the same random draw, computed over the
        tokens with mass only (2 ms a draw over a 248k vocabulary becomes a few us after top-k or
        top-p). Its cumulative sum is sequential, so at those tokens it is the whole row's."""
        nz = np.flatnonzero(p)
        cdf = np.cumsum(p if nz.size == p.size else p[nz])
        if not nz.size or not cdf[-1] > 0 or not np.isfinite(cdf[-1]):
            return int(self.rng.choice(p.shape[0], p=p))    # a broken row: numpy's own error
        cdf /= cdf[-1]
        return int(nz[np.searchsorted(cdf, self.rng.random(), side="right")])

    def check(self, logits: np.ndarray, history, draft: int) -> int:
        """The token to take where a drafter proposed ``draft`` (speculative decoding; the
        drafter picks one token, its argmax): ``draft`` itself if accepted. The position is
        decided as without a draft — greedy: the argmax; sampling: one draw from p — and the
        draft is accepted iff it is that token. For a drafter that proposes a single token this
        is the usual rule (accept with probability p(draft), else draw from p without it), and a
        seeded answer takes the same draws, so the same tokens, whether or not drafts were made."""
        return self(logits, history)

    def _penalized(self, logits, history) -> np.ndarray:
        x = np.asarray(logits, dtype=np.float32).copy()
        if self.bias is not None:    # OpenAI's logit_bias: added to the model's logits first
            ids, v = self.bias
            keep = ids < x.shape[0]
            x[ids[keep]] += v[keep]
        if self.repetition_penalty != 1.0 and len(history):
            ids = np.unique(np.asarray(history, dtype=np.int64))
            ids = ids[(ids >= 0) & (ids < x.shape[0])]
            v = x[ids]
            with np.errstate(over="ignore", divide="ignore"):  # an absurd penalty may overflow to inf
                x[ids] = np.where(v > 0, v / self.repetition_penalty, v * self.repetition_penalty)
        if (self.presence_penalty or self.frequency_penalty) and len(history) > self.prompt_tokens:
            ids, counts = np.unique(np.asarray(history[self.prompt_tokens:], dtype=np.int64), return_counts=True)
            keep = (ids >= 0) & (ids < x.shape[0])
            x[ids[keep]] -= (self.frequency_penalty * counts[keep] + self.presence_penalty).astype(np.float32)
        return x

    def distribution(self, logits: np.ndarray, history=()) -> np.ndarray:
        """The probabilities (float64) sampling draws from: every processor applied. Not for
        greedy."""
        x = self._penalized(logits, history)
        n, idx = x.shape[0], None
        if 0 < self.top_k < n:
            # the k largest, found among the float32 logits: dividing by a temperature of at
            # least MIN_TEMPERATURE keeps their order (and ties) exactly; the rest have no mass,
            # so only these k go through float64 and exp
            kth = np.partition(x, n - self.top_k)[n - self.top_k]
            idx = np.flatnonzero(~(x < kth))
            x = x[idx]
        with np.errstate(over="ignore"):
            x = x.astype(np.float64) / self.temperature
        top = x.max()
        # overflowed logits (inf - inf would be NaN): the infinite ones share all the mass
        q = (x == top).astype(np.float64) if np.isinf(top) else np.exp(x - top)
        if idx is None:
            p = q
        else:
            p = np.zeros(n)
            p[idx] = q
        p /= p.sum()
        if self.top_p < 1.0:
            order = _by_mass(p, self.top_p)
            cum = np.cumsum(p[order])
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            keep = order[: int(np.searchsorted(cum, self.top_p) + 1)]
            mask = np.zeros_like(p, dtype=bool)
            mask[keep] = True
            p = np.where(mask, p, 0.0)
            p /= p.sum()
        if self.min_p > 0:    # tokens below min_p times the likeliest one's probability go
            p = np.where(p >= self.min_p * p.max(), p, 0.0)
            p /= p.sum()
        return p


# tokens sorted for top-p at first: the largest ones, enough for any top_p a model uses
_HEAD = 4096


MAX_LOGIT_BIAS = 100.0


def check_logit_bias(logit_bias, vocab: int | None = None) -> dict | None:
    """OpenAI's ``logit_bias`` ({token id: -100..100}; ids as ints or digit strings, as JSON keys
    are) checked, as {int: float}; None when empty. ``vocab``: ids must be below it."""
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise EdgevlError("logit_bias must be an object mapping token ids to numbers from -100 to 100")
    out = {}
    for k, v in logit_bias.items():
        i = int(k) if isinstance(k, str) and k.isdecimal() and len(k) <= 20 else k
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0 or (vocab is not None and i >= vocab):
            span = "(integers >= 0)" if vocab is None else f"from 0 to {vocab - 1}"
            raise EdgevlError(f"logit_bias keys must be token ids {span}, got {k!r}")
        if not finite_number(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise EdgevlError(f"logit_bias values must be numbers from -100 to 100, got {v!r} for token {k}")
        out[int(i)] = float(v)
    return out or None


class Logprobs:
    """Each token taken, with its log-probability and the ``top`` most likely tokens' (OpenAI's
    ``logprobs`` / ``top_logprobs``): ``entries[i]`` = (token, logprob, [(token, logprob), ...])
    for the i-th token of the answer. The log-probabilities are the model's own — a log-softmax
    of the logits before penalties, temperature and constraint masks (vLLM's default) — so they
    say how likely the model found a token, whatever the settings that picked it."""

    def __init__(self, top: int = 0):
        if isinstance(top, bool) or not isinstance(top, (int, np.integer)) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise EdgevlError(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top!r}")
        self.top = int(top)
        self.entries: list[tuple[int, float, list]] = []

    def note(self, logits: np.ndarray, token: int) -> None:
        x = np.asarray(logits, dtype=np.float32)
        m = float(x.max())
        with np.errstate(invalid="ignore", over="ignore"):
            lse = m + math.log(float(np.exp(x - m).sum(dtype=np.float64))) if math.isfinite(m) else math.nan

        def lp(i) -> float:
            v = float(x[i]) - lse
            return v if v >= LOGPROB_FLOOR else LOGPROB_FLOOR   # NaN (a broken row) too

        top = []
        if self.top:
            n = x.shape[0]
            k = min(self.top, n)
            idx = np.argpartition(x, n - k)[n - k:] if k < n else np.arange(n)
            idx = idx[np.lexsort((idx, -x[idx]))]     # most likely first, ties by id
            top = [(int(i), lp(i)) for i in idx]
        self.entries.append((int(token), lp(token), top))


def _by_mass(p: np.ndarray, mass: float) -> np.ndarray:
    """The tokens in the order ``np.argsort(-p, kind="stable")`` gives (falling p, ties by id),
    as far as their running sum reaches ``mass``, else every token with p > 0: the same prefix,
    without sorting a 248k-token row (8 ms) where a few tokens carry the mass."""
    nz = np.flatnonzero(p)
    # (a row so flat that _HEAD tokens cannot carry the mass goes straight to the whole sort)
    if nz.size > _HEAD and _HEAD * p.max() >= mass:
        tau = np.partition(p[nz], nz.size - _HEAD)[nz.size - _HEAD]
        head = nz[p[nz] >= tau]          # every token outside has less mass than every one inside
        order = head[np.argsort(-p[head], kind="stable")]
        if np.cumsum(p[order])[-1] >= mass:
            return order
    return nz[np.argsort(-p[nz], kind="stable")]


def sample(sampler: Sampler, constraint, logits: np.ndarray, history=()) -> int:
    """The next token of one sequence: drawn among the tokens its ``constraint``
    (``edgevl.structured.Constraint``; None: every token) allows, which then takes it."""
    if constraint is None:
        tok = sampler(logits, history)
    else:
        tok = sampler(constraint.apply(logits), history)
        constraint.advance(tok)
    if sampler.logprobs is not None:
        sampler.logprobs.note(logits, tok)
    return tok


def check(sampler: Sampler, constraint, logits: np.ndarray, history, draft: int) -> int:
    """``Sampler.check`` among the tokens ``constraint`` allows (the drafts were cut to the ones
    it allows before the verify pass), which then takes the token kept."""
    if constraint is None:
        tok = sampler.check(logits, history, draft)
    else:
        tok = sampler.check(constraint.apply(logits), history, draft)
        constraint.advance(tok)
    if sampler.logprobs is not None:
        sampler.logprobs.note(logits, tok)
    return tok


# -- defaults: the checkpoint's generation_config.json, then what the caller sets -------------------

# What transformers' generate uses for a key a generation_config.json leaves out.
HF_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "repetition_penalty")


@dataclass
class Settings:
    """Sampling settings in effect, and where each value came from."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    source: dict = field(default_factory=dict)   # key -> "given" | "generation_config.json" | "default"

    def kwargs(self) -> dict:
        out = {k: getattr(self, k) for k in SAMPLING_KEYS}
        if self.min_p:
            out["min_p"] = self.min_p
        return out

    def describe(self) -> str:
        if self.temperature == 0 or self.top_k == 1:
            head = "greedy"
            shown = ["repetition_penalty"] if self.repetition_penalty != 1.0 else []
        else:
            head = "sampling"
            shown = list(SAMPLING_KEYS) + (["min_p"] if self.min_p else [])
        parts = [f"{k} {getattr(self, k):g} ({self.source.get(k, 'default')})" for k in shown]
        return head + (": " + ", ".join(parts) if parts else "")


def resolve(generation_config: dict | None, temperature=None, top_k=None, top_p=None,
            repetition_penalty=None, min_p=None) -> Settings:
    """The settings for one generation: each value given (not None) wins; the rest come from the
    checkpoint's ``generation_config.json`` read as transformers reads it (``do_sample`` false means
    greedy; ``repetition_penalty`` applies either way; missing keys take transformers' defaults);
    without one, greedy. ``temperature=0`` given means plain greedy: the config's values are dropped
    and only the other values given apply."""
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "repetition_penalty": repetition_penalty,
             "min_p": min_p}
    for k, v in given.items():   # "0.7" from a form field: a number is asked for, not converted
        if v is not None and (isinstance(v, (bool, complex)) or not isinstance(v, numbers.Number)):
            raise EdgevlError(f"{k} must be a number, got {v!r:.40}")
    cfg = generation_config or {}
    edgevl_default = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0, "min_p": 0.0}
    use_cfg = bool(generation_config) and not (temperature is not None and temperature == 0)
    base, source = {}, {}
    for k in (*SAMPLING_KEYS, "min_p"):
        if use_cfg and k in cfg and cfg[k] is not None:
            base[k], source[k] = cfg[k], "generation_config.json"
        else:
            base[k], source[k] = edgevl_default[k], "default"
    if use_cfg:
        if not cfg.get("do_sample", HF_DEFAULTS["do_sample"]):
            base["temperature"], source["temperature"] = 0.0, "generation_config.json"  # do_sample false
        elif "temperature" not in cfg or cfg["temperature"] is None:
            base["temperature"], source["temperature"] = HF_DEFAULTS["temperature"], "generation_config.json"
        if cfg.get("do_sample") and cfg.get("top_k") is None:
            base["top_k"], source["top_k"] = HF_DEFAULTS["top_k"], "generation_config.json"
    for k, v in given.items():
        if v is not None:
            base[k], source[k] = v, "given"
    s = Settings(float(base["temperature"]), int(base["top_k"]), float(base["top_p"]),
                 float(base["repetition_penalty"]), float(base["min_p"]), source)
    Sampler(**s.kwargs())  # bad values fail here, with the one-line message
    return s
