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
