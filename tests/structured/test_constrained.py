"""Constrained answers from a random model: for every schema, greedy and sampled, the answer
parses and validates (the model writes no JSON by itself); regex, choice and grammars hold;
drafting changes nothing; the constraint starts after a thinking model's reasoning."""

import json
import re
import subprocess
import sys
import threading

import jsonschema
import numpy as np
import pytest

import edgevl
from edgevl import speculative, structured
from edgevl.errors import EdgevlError
from support.schemas import SCHEMAS

PROMPT = "Describe the image."


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_schema_answer_parses_and_validates(qwen, name):
    schema = SCHEMAS[name]
    for opts in (dict(temperature=0), dict(temperature=1.0, seed=1), dict(temperature=1.3, top_p=0.95, seed=2),
                 dict(temperature=0.8, top_k=20, repetition_penalty=1.3, seed=3)):
        c = edgevl.complete(qwen, PROMPT, json_schema=schema, thinking=False, max_new_tokens=160, **opts)
        assert c.finish_reason == "stop", (opts, c.text)
        jsonschema.validate(c.json, schema)
        assert json.loads(c.text) == c.json


def test_unconstrained_random_model_writes_no_json(qwen):
    """What makes the tests above prove something."""
    text = edgevl.generate(qwen, PROMPT, thinking=False, max_new_tokens=40, temperature=0)
    with pytest.raises(ValueError):
        json.loads(text)


def test_json_object_is_an_object(qwen):
    # any object: keys are strings of any length, which a random model may run on with (these
    # draws close theirs within the budget)
    for temperature, seed in ((0.3, 3), (0.7, 9), (1.0, 18)):
        c = edgevl.complete(qwen, PROMPT, response_format={"type": "json_object"}, thinking=False,
                            temperature=temperature, seed=seed, max_new_tokens=300)
        assert c.finish_reason == "stop", c.text
        assert isinstance(c.json, dict) and c.json
        # bounded whitespace: only the separators' single spaces, never runs or newlines
        assert "\n" not in c.text and "  " not in re.sub(r'"(\\.|[^"\\])*"', '""', c.text)


def test_openai_response_format_and_pydantic_class(qwen):
    schema = SCHEMAS["meter"]
    rf = {"type": "json_schema", "json_schema": {"name": "meter", "schema": schema, "strict": True}}
    c = edgevl.complete(qwen, PROMPT, response_format=rf, thinking=False, temperature=0)
    jsonschema.validate(c.json, schema)
    pydantic = pytest.importorskip("pydantic")

    class Meter(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        reading: int = pydantic.Field(ge=0, le=999)
        unit: str = pydantic.Field(pattern="^(kWh|L)$")

    c = edgevl.complete(qwen, PROMPT, json_schema=Meter, thinking=False, temperature=1, seed=4)
    Meter.model_validate(c.json)


def test_regex_choice_and_grammars(qwen):
    for seed in range(3):
        kw = dict(thinking=False, temperature=1.0, seed=seed, max_new_tokens=60)
        out = edgevl.generate(qwen, PROMPT, response_format={"type": "regex", "regex": r"[A-Z]{2}-[0-9]{2,4}"}, **kw)
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{2,4}", out), out
        out = edgevl.generate(qwen, PROMPT, response_format={"type": "choice", "choice": ["yes", "no", "n/a"]}, **kw)
        assert out in ("yes", "no", "n/a")
        gbnf = 'root ::= "(" num (("+" | "*") num)* ")"\nnum ::= [1-9] [0-9]?'
        out = edgevl.generate(qwen, PROMPT, response_format={"type": "grammar", "grammar": gbnf}, **kw)
        assert re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?)*\)", out), out
        lark = 'start: word (" " word){0,2}\nword: /[a-z]{1,5}/'
        out = edgevl.generate(qwen, PROMPT, response_format={"type": "grammar", "grammar": lark}, **kw)
        assert re.fullmatch(r"[a-z]{1,5}( [a-z]{1,5}){0,2}", out), out


def test_decomposed_text_the_grammar_forces_comes_out_as_written(qwen):
    """An enum or pattern in NFD (a letter, then its combining mark) is written byte for byte: the
    tokenizer's NFC normalizer must not fold the forced bytes into the precomposed letter."""
    tok = json.loads((qwen.path / "tokenizer.json").read_text())
    assert "NFC" in json.dumps(tok.get("normalizer"))        # what makes this test prove something
    schema = {"type": "object", "properties": {"city": {"enum": ["Zu\u0308rich", "Malmo\u0308"]}},
              "required": ["city"], "additionalProperties": False}
    for seed in range(2):
        c = edgevl.complete(qwen, PROMPT, json_schema=schema, thinking=False, temperature=1.0, seed=seed)
        assert c.json["city"] in ("Zu\u0308rich", "Malmo\u0308"), ascii(c.text)
    out = edgevl.generate(qwen, PROMPT, response_format={"type": "regex", "regex": "cafe\u0301 [0-9]"},
                          thinking=False, temperature=0, max_new_tokens=20)
    assert re.fullmatch("cafe\u0301 [0-9]", out), ascii(out)


def test_drafting_gives_the_same_constrained_answer(qwen, qwen_plain):
    assert qwen.mtp is not None and qwen_plain.mtp is None
    for name in ("receipt", "camera_event", "pattern"):
        kw = dict(json_schema=SCHEMAS[name], thinking=False, temperature=0, max_new_tokens=160)
        assert edgevl.generate(qwen, PROMPT, **kw) == edgevl.generate(qwen_plain, PROMPT, **kw)


def _together(model, engine, asks, kws) -> list:
    """Each ``(prompt, schema)`` of ``asks`` from its own thread at once through ``engine``: the answers."""
    got = [None] * len(asks)

    def ask(i):
        got[i] = edgevl.generate(model, asks[i][0], engine=engine, **kws[i])
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return got


def test_constrained_requests_drafting_together_answer_as_alone(qwen, qwen_plain, monkeypatch):
    """In the engine, every round a drafting round over all requests (their drafts steered by
    each one's own grammar, one verify pass): each answer is the one plain decoding gives alone."""
    from edgevl.engine import Engine

    asks = [(PROMPT, SCHEMAS["receipt"]), ("Name the objects.", SCHEMAS["camera_event"]), ("Say hello.", None)]
    kws = [dict(json_schema=schema, thinking=False, temperature=0, max_new_tokens=120) for _, schema in asks]
    want = [edgevl.generate(qwen_plain, prompt, **kw) for (prompt, _), kw in zip(asks, kws)]
    monkeypatch.setattr(Engine, "_choose", lambda self, decoding, **_: self._run(self._draft, decoding))
    engine = Engine(qwen, parallel=3)
    try:
        assert _together(qwen, engine, asks, kws) == want
        assert engine.cycles > 0 and any(len(s.mtp["rows"]) for s in engine.slots)
    finally:
        engine.close()


def test_the_block_drafts_among_the_tokens_the_grammar_allows(qwen, monkeypatch):
    """Each draft is the block's best token among those the grammar allows after the drafts
    before it (the random block's own best is mostly forbidden), and drafting leaves the
    grammar state as it found it."""
    drafted = []
    real = type(qwen.mtp).draft

    def spy(self, tok, m, constraint=None):
        before = len(constraint.log)
        out = real(self, tok, m, constraint=constraint)
        assert len(constraint.log) == before
        assert constraint.valid_prefix(out) == len(out), out
        drafted.append(out)
        return out

    monkeypatch.setattr(type(qwen.mtp), "draft", spy)
    monkeypatch.setattr(qwen.mtp, "adaptive", False)
    monkeypatch.setattr(speculative, "FORCED_MAX", 0)    # every cycle the block's drafts
    kw = dict(json_schema=SCHEMAS["receipt"], thinking=False, temperature=0, max_new_tokens=160)
    c = edgevl.complete(qwen, PROMPT, **kw)
    jsonschema.validate(c.json, SCHEMAS["receipt"])
    assert sum(map(len, drafted)) > 20


def _oracle_block(qwen, monkeypatch, propose) -> list:
    """Make ``qwen``'s block draft ``propose(g, m)``: up to ``m`` tokens after the pending one, the
    answer's ``g``-th token. Returns the decode passes from then on, as (rows, whether the block
    drafted since the pass before)."""
    start, passes, drafted = {}, [], [False]
    real_forward, real_prefill = qwen.decoder.forward, qwen.prefill

    def draft(tok, m, constraint=None):
        drafted[0] = True
        return propose(len(qwen.cache_keys) - start["n"], m)

    def forward(x, cache, pos, **k):
        if "n" in start and "undoable" in k:      # a decode cycle's pass (not the prompt's)
            passes.append((x.shape[0], drafted[0]))
            drafted[0] = False
        return real_forward(x, cache, pos, **k)

    def prefill(ids, *a, **k):
        out = real_prefill(ids, *a, **k)
        start["n"] = len(ids)
        return out

    monkeypatch.setattr(qwen.mtp, "draft", draft)
    monkeypatch.setattr(qwen.decoder, "forward", forward)
    monkeypatch.setattr(qwen, "prefill", prefill)
    monkeypatch.setattr(qwen.mtp, "adaptive", False)
    return passes


def test_drafts_the_grammar_forbids_never_reach_the_verify_pass(qwen, qwen_plain, monkeypatch):
    """An oracle drafter (the answer's own next tokens, every third one swapped for a token the
    grammar forbids): accepted drafts are kept, forbidden ones are cut before the decoder runs,
    and the answer is the one plain decoding gives."""
    schema = SCHEMAS["receipt"]
    kw = dict(json_schema=schema, thinking=False, temperature=0, max_new_tokens=160)
    want = edgevl.complete(qwen_plain, PROMPT, **kw)
    ref = qwen.tokenizer.encode(want.text) + sorted(qwen.eos_ids)[:1]
    forbidden = qwen.tokenizer.token_to_id("<|vision_start|>")
    calls = []

    def propose(g, m):
        out = list(ref[g + 1:g + 1 + m])
        if len(calls) % 3 == 2 and out:
            out[-1] = forbidden
        calls.append(out)
        return out

    passes = _oracle_block(qwen, monkeypatch, propose)
    monkeypatch.setattr(speculative, "FORCED_MAX", 0)    # every cycle the oracle's drafts
    got = edgevl.complete(qwen, PROMPT, reuse_cache=False, **kw)
    assert got.text == want.text
    assert qwen.mtp.accepted > 0
    assert any(forbidden in c for c in calls)
    # a cycle fed at most the pending token and the allowed drafts (a forbidden one never)
    assert passes and max(n for n, _ in passes) <= 1 + qwen.mtp.k


def test_constraint_starts_after_the_reasoning_block(qwen):
    tok = qwen.tokenizer
    think, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    comp = structured.compiled(qwen, structured.parse({"type": "choice", "choice": ["yes", "no"]}))
    c = comp.constraint((think, end), thinking=True)
    eos = sorted(qwen.eos_ids)[0]
    mask = c.allowed()
    assert mask.sum() == len(mask) - len(qwen.eos_ids) and not mask[eos]   # free text, but no end yet
    words = tok.encode("some free thoughts")
    for t in words:
        c.advance(t)
    c.advance(end)
    allowed = set(np.flatnonzero(c.allowed()))
    assert allowed and allowed <= {t for w in ("yes", "no") for t in range(len(mask))
                                   if w.startswith(tok.decode([t])) and tok.decode([t])}
    c.advance(tok.encode("yes")[0])
    c.rollback(2)                  # back across the end marker: free again
    assert c.free and c.allowed().sum() == len(mask) - len(qwen.eos_ids)
    assert c.valid_prefix([*words, end, tok.encode("no")[0], forbidden_id(tok)]) == len(words) + 2
    # in the answer the markers are never allowed, even where the grammar takes their text
    s = structured.compiled(qwen, structured.parse({"type": "regex", "regex": "[<>/a-z]{1,12}"}))
    marked = s.constraint((think, end), thinking=False)
    assert not marked.allowed()[think] and not marked.allowed()[end]


def test_masks_of_states_seen_before_are_reused_and_right(qwen):
    """A state reached again (drafts taken back, then the verify pass taking the same tokens) reuses
    its mask; every mask, reused or not, is the one a fresh constraint computes on that path."""
    comp = structured.compiled(qwen, structured.parse(None, SCHEMAS["receipt"]))
    c = comp.constraint()

    class Counting:     # the matcher, counting the masks it computes
        def __init__(self, m):
            self.m, self.masks = m, 0

        def unsafe_compute_mask_ptr(self, *a):
            self.masks += 1
            return self.m.unsafe_compute_mask_ptr(*a)

        def __getattr__(self, name):
            return getattr(self.m, name)

    c.matcher = Counting(c.matcher)

    def fresh(path):
        f = comp.constraint()
        for t in path:
            f.advance(t)
        return f.allowed()

    rng = np.random.default_rng(0)
    path = []
    for _ in range(12):     # a draft of 3 tokens, taken back, then 1-3 of them taken again
        drafts = []
        for _ in range(3):
            drafts.append(int(rng.choice(np.flatnonzero(c.allowed()))))
            c.advance(drafts[-1])
        c.rollback(3)
        before = c.matcher.masks
        keep = int(rng.integers(1, 4))
        for t in drafts[:keep]:
            np.testing.assert_array_equal(c.allowed(), fresh(path))
            c.advance(t)
            path.append(t)
        assert c.matcher.masks == before          # every state on the way was seen in drafting
        np.testing.assert_array_equal(c.allowed(), fresh(path))
        if c.done:
            break
    assert len(path) > 8


def forbidden_id(tok):
    return tok.token_to_id("<|vision_start|>")


def test_thinking_model_reasons_freely_then_answers_in_the_schema(qwen):
    schema = SCHEMAS["meter"]
    c = edgevl.complete(qwen, "Hi", json_schema=schema, temperature=0, max_new_tokens=300)
    assert c.reasoning and c.finish_reason == "stop"
    with pytest.raises(ValueError):
        json.loads(c.reasoning)
    jsonschema.validate(c.json, schema)


def test_a_cut_answer_is_an_error_not_half_an_object(qwen):
    c = edgevl.complete(qwen, PROMPT, json_schema=SCHEMAS["receipt"], thinking=False, max_new_tokens=4)
    assert c.finish_reason == "length"
    with pytest.raises(EdgevlError, match="cut by the token limit.*raise max_new_tokens"):
        _ = c.json
    plain = edgevl.complete(qwen, PROMPT, thinking=False, max_new_tokens=2)
    with pytest.raises(EdgevlError, match="not constrained to JSON"):
        _ = plain.json
    # the thinking took the whole budget: the error says so, and how to leave room for the answer
    c = edgevl.complete(qwen, PROMPT, json_schema=SCHEMAS["receipt"], max_new_tokens=3)
    assert c.finish_reason == "length" and c.reasoning and not c.text.strip()
    with pytest.raises(EdgevlError, match="ran out inside the thinking.*raise max_new_tokens or pass thinking=False"):
        _ = c.json


@pytest.mark.parametrize("kwargs, needle", [
    (dict(json_schema={"type": "strnig"}), "Invalid type"),
    (dict(json_schema={"type": "object", "if": {"type": "object"}, "then": {}}), r"does not support \(.*if"),
    (dict(json_schema={"type": "array", "uniqueItems": True}), r"does not support \(.*uniqueItems"),
    (dict(json_schema={"$ref": "#/$defs/missing"}), "does not exist"),
    (dict(json_schema=["not", "a", "schema"]), "must be a JSON schema object"),
    (dict(json_schema="{not json"), "not valid JSON"),
    (dict(json_schema=False), "is false, a schema no answer can match"),
    (dict(json_schema={"enum": [f"value {i} of a long enumeration" for i in range(200_000)]}), "too large"),
    (dict(response_format={"type": "regex", "regex": "[a-z"}), "unclosed character class"),
    (dict(response_format={"type": "regex", "regex": "(?<=a)b"}), "look-around"),
    (dict(response_format={"type": "grammar", "grammar": 'root ::= "yes | "no"'}), "does not parse"),
    (dict(response_format={"type": "grammar", "grammar": 'start: "a" | undefined_rule'}), "unknown name"),
    (dict(response_format={"type": "choice", "choice": []}), "non-empty list"),
    (dict(response_format={"type": "xml"}), "type must be one of"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "with a schema"),
    (dict(response_format={"type": "json_object"}, json_schema={}), "not both"),
    # a value of these would be endless: the engine compiles them to no value at all
    (dict(json_schema={"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}),
     "admits no finite value"),
    (dict(json_schema={"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}),
     r"admits no finite value \(a \$ref cycle .* at #/properties/a\)"),
    (dict(json_schema={"type": "object", "required": ["kids"], "properties": {
        "kids": {"type": "array", "minItems": 1, "items": {"$ref": "#"}}}}), "admits no finite value"),
    (dict(json_schema={"$defs": {"n": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "array", "minItems": 1, "items": {
        "$ref": "#/$defs/n"}}]}}, "$ref": "#/$defs/n"}), "admits no finite value"),
    # past the depth the grammar engine's compile takes (a thousand $defs each holding the next crashed it)
    (dict(json_schema={"$defs": {**{f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}
                                    for i in range(1000)}, "d1000": {"type": "string"}}, "$ref": "#/$defs/d0"}),
     r"chains 1001 \$ref targets one inside another"),
    # what holds a schema, copied from a request, is not one (any value would match it)
    (dict(json_schema={"name": "m", "schema": {"type": "object"}, "strict": True}), "wrapper.*pass its schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "m", "schema": {
        "type": "json_schema", "json_schema": {"schema": {}}}}}), "response_format object, not a schema"),
    (dict(json_schema={"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                                 {"type": "object", "properties": {"b": {"type": "integer"}}}]}),
     "oneOf branches that one value can match both of.*use anyOf"),
])
def test_bad_structures_are_one_line_errors_before_any_work(qwen, kwargs, needle, monkeypatch):
    monkeypatch.setattr(qwen, "prefill", lambda *a, **k: pytest.fail("generation started"))
    with pytest.raises(EdgevlError) as e:
        edgevl.generate(qwen, PROMPT, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    assert re.search(needle, msg), msg


def test_grammar_over_the_engine_limits_is_refused(qwen, monkeypatch):
    monkeypatch.setattr(structured, "GRAMMAR_LIMITS", {"initial_lexer_fuel": 1000})
    with pytest.raises(EdgevlError, match="too large to compile in bounded time and memory") as e:
        edgevl.generate(qwen, PROMPT, json_schema={"enum": [f"v{i}" for i in range(2000)]})
    assert "\n" not in str(e.value)


def test_missing_llguidance_says_how_to_install(qwen, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(EdgevlError, match=r"needs llguidance; pip install 'llguidance>="):
        edgevl.generate(qwen, PROMPT, response_format={"type": "json_object"})


def test_import_stays_light_and_adapter_is_built_once(qwen):
    code = "import sys, edgevl; print('llguidance' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    a, b = structured.tokenizer_for(qwen)[1], structured.tokenizer_for(qwen)[1]
    assert a is b and a.vocab_size == qwen.vocab_size
    s = structured.parse({"type": "json_object"})
    assert structured.compiled(qwen, s).template is structured.compiled(qwen, s).template


def test_sampling_processors_see_only_the_allowed_tokens(qwen):
    """top-k 1 at any temperature is the greedy constrained answer: the one token kept is the best
    allowed one (kept before masking, it would mostly be a forbidden token and leave nothing)."""
    kw = dict(json_schema=SCHEMAS["receipt"], thinking=False, max_new_tokens=160)
    greedy = edgevl.generate(qwen, PROMPT, temperature=0, **kw)
    assert edgevl.generate(qwen, PROMPT, temperature=1.5, top_k=1, seed=9, **kw) == greedy
    assert edgevl.generate(qwen, PROMPT, temperature=1.5, top_p=1e-6, seed=9, **kw) == greedy


def _counting_passes(model, monkeypatch) -> list:
    """The rows of each decoder pass ``model`` runs after a prompt from here on (cleared by the
    next prompt)."""
    passes, decoding = [], [False]
    real, real_prefill = model.decoder.forward, model.prefill

    def forward(x, *a, **k):
        if decoding[0]:
            passes.append(x.shape[0])
        return real(x, *a, **k)

    def prefill(*a, **k):
        decoding[0] = False
        out = real_prefill(*a, **k)
        passes.clear()
        decoding[0] = True
        return out

    monkeypatch.setattr(model.decoder, "forward", forward)
    monkeypatch.setattr(model, "prefill", prefill)
    return passes


@pytest.mark.parametrize("name", ["receipt", "camera_event", "refs"])
def test_tokens_the_grammar_forces_go_in_with_the_token_before_them(qwen_plain, monkeypatch, name):
    """Where the grammar allows a single token (a key's name, the punctuation between fields) it
    goes into the decoder in one pass with the token before it: far fewer passes, and the same
    answer with the same log-probabilities, greedy and with a seed."""
    passes = _counting_passes(qwen_plain, monkeypatch)
    most = speculative.FORCED_MAX
    assert most > 1
    for opts in (dict(temperature=0), dict(temperature=1.0, seed=7), dict(temperature=0.7, top_k=20, seed=2)):
        runs = {}
        for forced in (0, most):
            monkeypatch.setattr(speculative, "FORCED_MAX", forced)
            c = edgevl.complete(qwen_plain, PROMPT, json_schema=SCHEMAS[name], thinking=False, max_new_tokens=160,
                                logprobs=True, top_logprobs=2, reuse_cache=False, **opts)
            jsonschema.validate(c.json, SCHEMAS[name])
            runs[forced] = (c, list(passes))
        (plain, one_each), (jumped, fed) = runs[0], runs[most]
        assert jumped.text == plain.text and jumped.generation_tokens == plain.generation_tokens
        assert set(one_each) == {1} and max(fed) > 2 and len(fed) < 0.7 * len(one_each), (name, opts)
        assert [e["token"] for e in jumped.logprobs] == [e["token"] for e in plain.logprobs]
        np.testing.assert_allclose([e["logprob"] for e in jumped.logprobs], [e["logprob"] for e in plain.logprobs],
                                   atol=1e-4)


def test_forced_tokens_in_the_engine_and_with_drafting_answer_as_plain_decoding(qwen, qwen_plain, monkeypatch):
    """The engine feeds each request's forced tokens with its pending token (requests without
    them take one row in the same pass), with and without the block drafting: every answer is
    the one plain decoding gives alone, one token per pass."""
    from edgevl.engine import Engine

    asks = [(PROMPT, SCHEMAS["receipt"], dict(temperature=0)),
            ("Name the objects.", SCHEMAS["camera_event"], dict(temperature=1.0, seed=3)),
            ("Say hello.", None, dict(temperature=0)),
            ("Where are they?", SCHEMAS["refs"], dict(temperature=0.7, seed=1))]
    kws = [dict(json_schema=schema, thinking=False, max_new_tokens=100, **opts) for _, schema, opts in asks]
    monkeypatch.setattr(speculative, "FORCED_MAX", 0)
    want = [edgevl.generate(qwen_plain, prompt, **kw) for (prompt, _, _), kw in zip(asks, kws)]
    monkeypatch.undo()
    rounds = []
    real = Engine._verify

    def verify(self, streams, rows, owns, **kw):
        rounds.append([len(r) - 1 - own for r, own in zip(rows, owns)])     # each one's forced tokens
        return real(self, streams, rows, owns, **kw)

    monkeypatch.setattr(Engine, "_verify", verify)
    for model in (qwen_plain, qwen):
        rounds.clear()
        engine = Engine(model, parallel=3)
        try:
            assert _together(model, engine, asks, kws) == want, model.speculative
            assert max(n for r in rounds for n in r) > 1, model.speculative
        finally:
            engine.close()
    assert edgevl.generate(qwen, PROMPT, **kws[0]) == want[0]     # a lone cycle of the block's


def test_tokens_forced_after_the_blocks_draft_ride_in_its_pass(qwen, qwen_plain, monkeypatch):
    """An oracle block drafting one token, the answer's own next one: where the grammar forces
    tokens after that draft, they follow it in the same pass (more rows than the block drafted),
    the answer is plain decoding's, and the block's acceptance counts its own drafts only."""
    kw = dict(json_schema=SCHEMAS["receipt"], thinking=False, temperature=0, max_new_tokens=160)
    want = edgevl.complete(qwen_plain, PROMPT, **kw)
    ref = qwen.tokenizer.encode(want.text) + sorted(qwen.eos_ids)[:1]
    own = []

    def propose(g, m):
        own.extend(ref[g + 1:g + 2])
        return list(ref[g + 1:g + 2])

    passes = _oracle_block(qwen, monkeypatch, propose)
    got = edgevl.complete(qwen, PROMPT, reuse_cache=False, **kw)
    assert got.text == want.text
    # a pass after a one-token draft: the pending token, the draft, and the tokens forced after it
    assert max(n for n, after_draft in passes if after_draft) > 2
    assert 0 < qwen.mtp.accepted <= qwen.mtp.drafted <= len(own)


def test_a_schema_nested_past_the_engines_depth_is_one_line(tmp_path, capsys):
    """200 levels of nested objects: the grammar engine refuses them; a one-line error in the API
    and the CLI (it was a ValueError traceback, and a 500 in the server)."""
    from edgevl import structured
    from support.cli import cli, one_line_error

    deep = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    with pytest.raises(EdgevlError, match="cannot be compiled|nested too deeply") as e:
        structured.json_schema(deep)
    assert "\n" not in str(e.value)
    f = tmp_path / "deep.json"
    f.write_text(json.dumps(deep))
    one_line_error(*cli(capsys, "run", "--prompt", "x", "--json-schema", f)[::2], "cannot be compiled")


def test_stop_strings_do_not_cut_a_json_answer(qwen):
    """A stop string inside a JSON answer would leave a prefix that may even parse (``7`` of a
    number the schema wants above 100000); the grammar ends such answers, so stop strings do not."""
    schema = {"type": "object", "properties": {"reading": {"type": "integer", "minimum": 100000}},
              "required": ["reading"], "additionalProperties": False}
    kw = dict(json_schema=schema, thinking=False, temperature=0, max_new_tokens=60)
    want = edgevl.complete(qwen, "Read the meter.", **kw)
    assert want.finish_reason == "stop", want
    for stop in (["5"], ["\""], ["reading"], [":"]):
        c = edgevl.complete(qwen, "Read the meter.", stop=stop, **kw)
        assert c.text == want.text and c.json == want.json, stop
        jsonschema.validate(c.json, schema)


def test_optional_cycles_and_trees_are_taken(qwen):
    """A $ref cycle that a value can leave (an optional property, an empty list, an anyOf branch)
    has finite values: such schemas (trees, OpenAI's UI example) are taken and answered."""
    tree = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                             "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}},
            "required": ["name", "kids"], "additionalProperties": False}
    either = {"$defs": {"n": {"anyOf": [{"type": "null"}, {"type": "array", "minItems": 1, "maxItems": 1,
                                                             "items": {"$ref": "#/$defs/n"}}]}}, "$ref": "#/$defs/n"}
    for schema in (tree, either):
        c = edgevl.complete(qwen, PROMPT, json_schema=schema, max_new_tokens=60, thinking=False)
        if c.finish_reason == "stop":
            jsonschema.validate(c.json, schema)


@pytest.mark.parametrize("fmt, good, bad", [
    ("date", ["2024-02-29", "2000-02-29", "0004-02-29", "2023-04-30", "9999-12-31"],
     ["2023-02-29", "1900-02-29", "2023-04-31", "2023-02-30", "0000-01-01", "2023-13-01"]),
    ("time", ["23:59:59Z", "00:00:00.123456+05:30"], ["22:04:60Z", "24:00:00Z", "12:00:00", "12:00:00.1234567Z"]),
    ("date-time", ["2024-02-29T23:59:59Z"], ["2023-02-29T10:00:00Z", "4699-04-30T05:43:60Z", "2024-01-01t00:00:00Z"]),
])
def test_date_formats_hold_days_and_seconds_that_exist(qwen, fmt, good, bad):
    """The grammar engine's own date formats take 2023-02-29 and a 60th second, which JSON
    Schema's checkers and pydantic refuse: an answer must validate, so the formats are held to the
    days and seconds that exist, in a JSON answer and in a tool call's value alike."""
    from edgevl import tools

    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for value in good:   # the checker's own verdicts agree where it checks the format
        assert checker.conforms(value, fmt), value
    assert fmt != "date" or not any(checker.conforms(value, fmt) for value in bad)
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}, "required": ["v"]}
    c = structured.compiled(qwen, structured.json_schema(schema)).constraint()
    tok = qwen.tokenizer
    for value, ok in [*((v, True) for v in good), *((v, False) for v in bad)]:
        ids = tok.encode(json.dumps({"v": value}), special=False)
        assert (c.valid_prefix(ids) == len(ids)) == ok, value
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    call = structured.compiled(qwen, tools.prepare(qwen, [tool], "required", False).structure).constraint()
    nested = {"type": "function", "function": {"name": "g", "parameters": {   # a JSON value holding one
        "type": "object", "properties": {"o": schema}, "required": ["o"]}}}
    inner = structured.compiled(qwen, tools.prepare(qwen, [nested], "required", False).structure).constraint()
    for value, ok in [(good[0], True), (bad[0], False)]:
        ids = tok.encode(f"<tool_call>\n<function=f>\n<parameter=v>\n{value}\n</parameter>\n</function>\n"
                         "</tool_call>", special=False)
        assert (call.valid_prefix(ids) == len(ids)) == ok, value
        ids = tok.encode(f"<tool_call>\n<function=g>\n<parameter=o>\n{json.dumps({'v': value})}\n</parameter>\n"
                         "</function>\n</tool_call>", special=False)
        assert (inner.valid_prefix(ids) == len(ids)) == ok, value


def test_a_schema_file_holding_false_or_a_wrapper_names_the_file(tmp_path):
    for text, needle in [("false", "false, a schema"), ('{"name": "m", "schema": {}}', "wrapper"),
                         ('{"type": "json_schema", "json_schema": {"schema": {}}}', "response_format object")]:
        f = tmp_path / "s.json"
        f.write_text(text)
        with pytest.raises(EdgevlError, match=f"^--json-schema {re.escape(str(f))} holds .*{needle}"):
            structured.schema_file(f)


def _ring(types: int, reverse: bool = False) -> dict:
    """Types that refer to each other in a ring, every reference optional (an AST, a GraphQL model)."""
    defs = {f"t{i}": {"type": "object", "properties": {
        f"p{k}": {"anyOf": [{"$ref": f"#/$defs/t{(i + k + 1) % types}"}, {"type": "null"}]} for k in range(3)}}
        for i in range(types)}
    return {"$defs": dict(sorted(defs.items(), reverse=reverse)), "$ref": "#/$defs/t0"}


def test_the_ref_chain_bound_is_the_schemas_not_a_walk_order():
    """A ring of 300 types is taken and one of 1,000 (which overflowed the grammar engine's stack)
    refused, whatever order its keys come in, as a response format and as a tool's parameters
    alike; data nested deep (a default) is one line, not a RecursionError."""
    for reverse in (False, True):
        assert structured.schema_problem(_ring(300, reverse)) is None
        structured.json_schema(_ring(300, reverse))
        assert "chains 1000 $ref targets" in structured.schema_problem(_ring(1000, reverse))
        with pytest.raises(EdgevlError, match="chains 1000 \\$ref targets"):
            structured.json_schema(_ring(1000, reverse))
    deep = {"type": "object", "properties": {"a": {"type": "array", "default": json.loads("[" * 900 + "]" * 900)}}}
    assert "nested too deeply" in structured.schema_problem(deep)
