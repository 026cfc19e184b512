"""Youtu-LLM: ncnn vs transformers in fp32 on several random configs, both KV-cache layouts:
greedy tokens exact and every layer's cosine (reduced precision: tests/precision/test_youtu.py)."""

import pytest

from edgevl.verification.verify import compare
from support.common import PROMPTS
from support.youtu import CONFIGS, chat_ids, convert_and_load, hf_greedy, load_hf, make_youtu


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("youtu")
    return {name: make_youtu(root / name, seed=i + 1, **cfg) for i, (name, cfg) in enumerate(CONFIGS.items())}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("kv", ["absorbed", "expanded"])
def test_fp32_greedy_token_exact_and_layers(checkpoints, tmp_path_factory, name, kv):
    ck = checkpoints[name]
    model = convert_and_load(ck, tmp_path_factory.mktemp("pk"), "fp32", kv)
    hf = load_hf(ck)
    ids = chat_ids(model, PROMPTS[0])
    ours = list(model.generate_tokens(ids, 48, ignore_eos=True))
    ref = hf_greedy(hf, ids, 48)
    assert len(ours) == 48
    first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    assert first is None, f"{name}/{kv}: first differing token at {first}: ours {ours[first]} vs {ref[first]}"
    rep = compare(model.path, ck, PROMPTS[1], max_new_tokens=8)
    for _sec, layer, cos, diff in rep.rows:
        assert cos >= 0.99999, f"{name}/{kv}: {layer} cosine {cos:.7f} (max diff {diff:.3g})"
    assert rep.identical


def test_verify_warns_when_the_source_folder_holds_another_checkpoint(tmp_path):
    """verify's default reference is the folder the package was converted from: another
    checkpoint written there since fails the comparison, and the warning says why (the weights'
    sha256 recorded at conversion differ), so the package does not take the blame."""
    import edgevl
    from edgevl.verification.verify import source_changed

    ck = make_youtu(tmp_path / "ck", seed=1)
    pkg = edgevl.convert(ck, tmp_path / "pkg", dtype="fp32", progress=False)
    assert source_changed(pkg, ck) is None
    lines = []
    assert compare(pkg, None, PROMPTS[1], max_new_tokens=2, log=lines.append).identical
    assert not any("warning" in line for line in lines)
    make_youtu(tmp_path / "ck", seed=2)      # another checkpoint, same folder
    assert source_changed(pkg, ck) == "model.safetensors differs from the file converted"
    lines = []
    compare(pkg, None, PROMPTS[1], max_new_tokens=2, log=lines.append)
    warned = f"warning: {ck} is not the checkpoint this package was converted from"
    assert any(line.startswith(warned) for line in lines)
    lines = []   # named with --reference: the same warning
    compare(pkg, ck, PROMPTS[1], max_new_tokens=2, log=lines.append)
    assert any(line.startswith(warned) and "pass the original as --reference" in line for line in lines), lines
    from edgevl.errors import EdgevlError

    lines = []   # an empty prompt: refused before either model loads
    with pytest.raises(EdgevlError, match="the prompt is empty"):
        compare(pkg, None, " ", log=lines.append)
    assert not any("loading" in line for line in lines), lines


def test_verify_compares_what_the_context_holds_and_says_so_in_one_line(tmp_path, monkeypatch):
    """Tokens past the context: ours stop there, the reference would go on, so only the tokens the
    context holds are compared (a correct package failed, "first 34 of 40 agree"). A prompt token
    past the embedding is our one line, not torch's IndexError; a reference that cannot run this
    config is one line too."""
    import edgevl
    from edgevl.errors import EdgevlError

    ck = make_youtu(tmp_path / "ck", seed=3, max_position_embeddings=96)
    pkg = edgevl.convert(ck, tmp_path / "pkg", dtype="fp32", progress=False)
    lines = []
    rep = compare(pkg, None, PROMPTS[1], max_new_tokens=200, log=lines.append)
    assert rep.identical and 0 < len(rep.ours) == len(rep.reference) < 96, (len(rep.ours), len(rep.reference))
    assert any(line.startswith("note: the model's context (96) holds") for line in lines), lines

    from edgevl import verification

    def broken(*a, **k):
        raise ValueError("`get_mask_sizes` can only be called\non Attention layers")
    monkeypatch.setattr(type(verification.get("youtu").reference(ck)), "text_states", broken)
    with pytest.raises(EdgevlError, match=r"^the PyTorch reference failed on this checkpoint \(ValueError: "
                                          r"`get_mask_sizes` can only be called on Attention layers\)"):
        compare(pkg, None, PROMPTS[1], max_new_tokens=2)
    monkeypatch.undo()

    small = make_youtu(tmp_path / "small", seed=3, vocab_size=300)   # fewer rows than the tokenizer's
    pkg = edgevl.convert(small, tmp_path / "small-pkg", dtype="fp32", progress=False)
    with pytest.raises(EdgevlError, match=r"token id \d+ is outside the vocabulary \(0\.\.299\)"):
        compare(pkg, None, "hello world", max_new_tokens=2)


def test_a_reference_given_by_hand_must_be_the_packages_checkpoint(tmp_path, capsys):
    """verify --reference with the wrong folder: one line before anything loads (a missing folder,
    a package, another family, other sizes), not a Hub error or a shape compared layers later."""
    import edgevl
    from edgevl.errors import EdgevlError
    from edgevl.verification.families.qwen3_5 import VERIFY as QWEN
    from support.cli import cli, one_line_error

    ck = make_youtu(tmp_path / "ck", seed=1)
    pkg = edgevl.convert(ck, tmp_path / "pkg", dtype="fp32", progress=False)
    other = QWEN.make_tiny(tmp_path / "qwen", seed=0, text_only=True)
    wider = make_youtu(tmp_path / "wide", seed=1, hidden_size=96)
    for ref, words in ((tmp_path / "missing", "does not exist"), (pkg, "is an edgevl package"),
                       (other, "is a qwen3_5 checkpoint but the package is youtu"),
                       (wider, "has hidden_size 96 but the package was converted with")):
        with pytest.raises(EdgevlError, match=words):
            compare(pkg, ref, PROMPTS[1], max_new_tokens=2)
        one_line_error(*cli(capsys, "verify", pkg, "--reference", ref, "--max-new-tokens", "2")[::2], words)
    assert compare(pkg, ck, PROMPTS[1], max_new_tokens=2).identical   # the right one
