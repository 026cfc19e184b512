"""The checkpoint's generation_config.json sets the generation defaults, read as transformers
reads it; a flag or argument overrides it, and --verbose says where each setting came from."""

import json

import pytest

import edgevl
from edgevl import cli
from edgevl.demo import DEMO_CHECKPOINT
from edgevl.errors import EdgevlError
from support.youtu import make_youtu


@pytest.fixture(scope="module")
def penalised(tmp_path_factory):
    root = tmp_path_factory.mktemp("gencfg")
    ck = make_youtu(root / "ck", seed=3)
    cfg = json.loads((ck / "generation_config.json").read_text())
    (ck / "generation_config.json").write_text(json.dumps({**cfg, "repetition_penalty": 1.3}))
    return edgevl.convert(ck, root / "pk", dtype="fp32", progress=False)


def test_generation_config_penalty_applies_unless_temperature_0(penalised, capsys):
    m = edgevl.load(penalised)
    prompt = "The quick brown fox"
    ids = m.tokenizer.encode(prompt)
    greedy = list(m.generate_tokens(ids, 24, reuse_cache=False))
    penalised_ids = list(m.generate_tokens(ids, 24, repetition_penalty=1.3, reuse_cache=False))
    assert greedy != penalised_ids  # the penalty changes this model's answer
    text = lambda toks: m.tokenizer.decode([t for t in toks if t not in m.eos_ids])  # noqa: E731

    def run(*flags):
        assert cli.main(["run", str(penalised), "--raw", "--prompt", prompt, "--max-new-tokens", "24",
                         *flags]) == 0
        out = capsys.readouterr()
        return out.out[:-1], out.err

    assert run()[0] == text(penalised_ids)                       # no flags: the checkpoint's penalty
    assert run("--temperature", "0")[0] == text(greedy)          # plain greedy
    assert run("--repetition-penalty", "1")[0] == text(greedy)   # a flag overrides the config
    assert edgevl.generate(m, prompt, raw=True, max_new_tokens=24) == text(penalised_ids)
    assert edgevl.generate(m, prompt, raw=True, max_new_tokens=24, temperature=0) == text(greedy)
    err = run("--verbose")[1]
    assert "greedy: repetition_penalty 1.3 (generation_config.json)" in err, err
    err = run("--verbose", "--temperature", "0.5", "--top-p", "0.9")[1]
    assert "sampling: temperature 0.5 (given), top_k 0 (default), top_p 0.9 (given), " \
           "repetition_penalty 1.3 (generation_config.json)" in err, err


def test_sampling_settings_follow_transformers_reading_of_the_config():
    from edgevl.sample import resolve

    official = {"do_sample": True, "temperature": 0.1, "top_p": 0.001, "repetition_penalty": 1.05}
    s = resolve(official)
    assert (s.temperature, s.top_k, s.top_p, s.repetition_penalty) == (0.1, 50, 0.001, 1.05)  # top_k: HF's 50
    s = resolve({"temperature": 0.7, "top_p": 0.8})        # do_sample absent: greedy, as transformers
    assert s.temperature == 0 and s.repetition_penalty == 1.0
    s = resolve(official, temperature=0)
    assert s.kwargs() == {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}
    assert resolve({}).kwargs() == resolve(None).kwargs() == s.kwargs()
    with pytest.raises(EdgevlError, match="top_p must be in"):
        resolve(official, top_p=0)
    # min_p, as transformers reads it from the config; a value given wins; plain greedy drops it
    s = resolve({**official, "min_p": 0.1})
    assert (s.min_p, s.source["min_p"], s.kwargs()["min_p"]) == (0.1, "generation_config.json", 0.1)
    assert "min_p 0.1 (generation_config.json)" in s.describe()
    assert resolve({**official, "min_p": 0.1}, min_p=0.3).min_p == 0.3
    assert "min_p" not in resolve({**official, "min_p": 0.1}, temperature=0).kwargs()
    with pytest.raises(EdgevlError, match="min_p must be in"):
        resolve(official, min_p=1.5)


def test_demo_generation_config_keeps_the_quickstart_greedy():
    """The README's quick start answer is greedy output; the demo's config must not change that."""
    from edgevl.sample import resolve

    cfg = json.loads((DEMO_CHECKPOINT / "generation_config.json").read_text())
    assert resolve(cfg).kwargs() == resolve(None).kwargs()


def _eos_cases():
    """(family, edit of config.json, generation_config.json or None: removed)."""
    return [
        ("youtu", lambda c: {**c, "eos_token_id": 7}, {"eos_token_id": [9]}),      # the generation config's list
        ("youtu", lambda c: {**c, "eos_token_id": 7}, None),                        # no file: the model config's
        # a file without eos: transformers' generate would stop on nothing; edgevl takes the model config's
        ("youtu", lambda c: {**c, "eos_token_id": 7}, {"temperature": 0.5}),
        ("qwen3_5", lambda c: {**{k: v for k, v in c.items() if k != "eos_token_id"},   # only in text_config
                               "text_config": {**c["text_config"], "eos_token_id": 5}}, None),
        ("qwen3_5", lambda c: {**c, "text_config": {**c["text_config"], "eos_token_id": 5}}, {"eos_token_id": [6, 8]}),
    ]


@pytest.mark.parametrize("case", range(5))
def test_the_answers_end_tokens_are_those_transformers_generate_stops_on(tmp_path, case):
    """The generation config's eos list when it has one, else the model config's, else the text
    config's (vision-language configs keep it there): a checkpoint without generation_config.json
    still stops where transformers stops, and two lists are not merged."""
    import torch
    from transformers import AutoModelForCausalLM

    from support.qwen import load_hf as load_qwen
    from support.qwen import make_qwen3_5

    family, edit, gen = _eos_cases()[case]
    ck = make_youtu(tmp_path / "ck", seed=3) if family == "youtu" else make_qwen3_5(tmp_path / "ck", seed=3)
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps(edit(cfg)))
    if gen is None:
        (ck / "generation_config.json").unlink(missing_ok=True)
    else:
        (ck / "generation_config.json").write_text(json.dumps(gen))
    hf = (AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32) if family == "youtu" else load_qwen(ck))
    want = hf.generation_config.eos_token_id
    want = set(want if isinstance(want, list) else [want])
    if want == {None}:
        want = {7} if case == 2 else want
    assert None not in want
    m = edgevl.load(edgevl.convert(ck, tmp_path / "pk", dtype="fp32", progress=False))
    assert m.eos_ids == want
