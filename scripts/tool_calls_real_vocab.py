"""Tool calls read back through a real Qwen-family vocabulary, not a test's tiny one.

    python scripts/tool_calls_real_vocab.py llama_cpp_python-X.tar.gz

No Qwen3.5 checkpoint can be downloaded here, but llama.cpp's source (vendored in the
llama-cpp-python sdist on PyPI) carries a Qwen vocabulary with the Qwen3.5 pre-tokenizer
(``models/ggml-vocab-qwen35.gguf``: byte-level BPE, 151,936 tokens) and llama.cpp's expected
tokenizations of test strings. This script rebuilds a ``tokenizer.json`` from it, checks it
against every one of those tokenizations, then writes a model answer with text, CJK, accents and
emoji and two calls in the Qwen XML format, encodes it, and reads it back token by token as
``edgevl serve`` does (the answer's incremental decoding, then the streamed call parser), once
with ``<tool_call>`` as a plain added token and once as a special one. It checks that the text
comes back whole, the calls and their typed arguments parse, and the streamed argument
fragments join to each call's arguments; and that tool_choice "required" compiles its grammar
over this vocabulary and allows those calls as the model would write them.
"""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

# the pre-tokenizer regex of Qwen3.5's tokenizer.json (llama.cpp's "qwen35")
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {
        "text": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["text"]}}},
]
ANSWER = ("好的，我来查一下。🌤\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n北京 (Beijing)\n</parameter>\n"
          "<parameter=days>\n3\n</parameter>\n<parameter=hourly>\nfalse\n</parameter>\n</function>\n</tool_call>\n"
          "<tool_call>\n<function=note>\n<parameter=text>\nCafé «naïve» — 1/2 ✓ 🙂\n</parameter>\n<parameter=tags>\n"
          "[\"天气\", \"trip\"]\n</parameter>\n</function>\n</tool_call>")
WANT = [("get_weather", {"city": "北京 (Beijing)", "days": 3, "hourly": False}),
        ("note", {"text": "Café «naïve» — 1/2 ✓ 🙂", "tags": ["天气", "trip"]})]


def extract(sdist: str, into: Path) -> Path:
    """llama.cpp's folder from the sdist: the vocabulary, its test strings and gguf-py."""
    try:
        with tarfile.open(sdist) as tar:
            root = tar.getnames()[0].split("/")[0] + "/vendor/llama.cpp/"
            names = [n for n in tar.getnames() if n.startswith(root + "models/ggml-vocab-qwen35.gguf")
                     or n.startswith(root + "gguf-py/")]
            if root + "models/ggml-vocab-qwen35.gguf" not in names:
                raise SystemExit(f"{sdist} has no {root}models/ggml-vocab-qwen35.gguf; give the llama-cpp-python "
                                 "sdist (pip download llama-cpp-python --no-binary :all: --no-deps)")
            tar.extractall(into, members=[tar.getmember(n) for n in names], filter="data")
    except (OSError, tarfile.TarError) as e:
        why = " ".join(str(e).split())
        raise SystemExit(f"cannot read {sdist} as an sdist archive ({why}); give the llama-cpp-python sdist "
                         "(pip download llama-cpp-python --no-binary :all: --no-deps)") from None
    return into / root


def build(llama: Path, out: Path):
    """tokenizer.json from the GGUF vocabulary; checked against llama.cpp's test tokenizations."""
    sys.path.insert(0, str(llama / "gguf-py"))
    from gguf import GGUFReader
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    r = GGUFReader(str(llama / "models/ggml-vocab-qwen35.gguf"))

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    tokens, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
    f = r.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    tok = Tokenizer(models.BPE(vocab={t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == 1},
                               merges=[tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k != 1])
    tests = (llama / "models/ggml-vocab-qwen35.gguf.inp").read_text("utf-8").split("\n__ggml_vocab_test__\n")
    wants = (llama / "models/ggml-vocab-qwen35.gguf.out").read_text().split("\n")
    pairs = list(zip(tests, wants))
    bad = [t for t, w in pairs if tok.encode(t, add_special_tokens=False).ids != [int(x) for x in w.split()]]
    print(f"vocabulary: {len(tokens)} tokens; llama.cpp's test tokenizations reproduced: "
          f"{len(pairs) - len(bad)} of {len(pairs)}")
    if bad:
        raise SystemExit(f"the rebuilt tokenizer differs from llama.cpp's on {bad[:3]!r}")
    return tok


def read_back(tok, folder: Path, special: bool) -> bool:
    from edgevl import tools
    from edgevl.generate import ReasoningSplitter
    from edgevl.tokenizer import Tokenizer

    (tok.add_special_tokens if special else tok.add_tokens)(list(tools.TAGS))
    tok.save(str(folder / "tokenizer.json"))
    # edgevl's own copy of Qwen3.5's chat template (its tools section and call format)
    shutil.copy(Path(tools.__file__).parent / "models/qwen3_5/chat_template.jinja", folder)
    t = Tokenizer(folder)
    ids = t.encode(ANSWER) + [t.token_to_id("<|im_end|>")]
    spec = tools.ToolSpec(TOOLS, "auto", schemas={x["function"]["name"]: x["function"]["parameters"] for x in TOOLS})
    split, stream, pieces, events = ReasoningSplitter(t, None, []), tools.CallStream(spec), [], []
    for i in ids:
        pieces.append(split.add(i)[0])
        events += stream.feed(pieces[-1])
    pieces.append(split.flush()[0])
    events += stream.feed(pieces[-1], end=True)
    text = "".join(pieces)
    content, calls = tools.parse(text, spec)
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    joined = ["".join(e[2] for e in events if e[0] == "args" and e[1] == k) for k in range(len(calls))]
    ok = (text == ANSWER and content == "好的，我来查一下。🌤" and got == WANT
          and joined == [c["function"]["arguments"] for c in calls])
    # tool_choice "required": the grammar of calls in the model's format, over this vocabulary,
    # takes the two calls as the model would write them (the tags as their own tokens)
    from types import SimpleNamespace

    from edgevl import structured

    model = SimpleNamespace(tokenizer=t, vocab_size=t.vocab_size, eos_ids={t.token_to_id("<|im_end|>")},
                            arch=SimpleNamespace(name="qwen3_5"))
    t0 = time.perf_counter()
    required = tools.prepare(model, TOOLS, "required", True)
    c = structured.compiled(model, required.structure).constraint()
    took = time.perf_counter() - t0
    calls_ids = t.encode(ANSWER[ANSWER.index("<tool_call>"):])
    taken = c.valid_prefix(calls_ids)
    ok = ok and taken == len(calls_ids)
    print(f"  tool_choice='required': grammar compiled in {took * 1e3:.0f} ms; the calls' {len(calls_ids)} tokens "
          f"allowed: {taken == len(calls_ids)}")
    print(f"<tool_call> {'special' if special else 'a plain added token'}: {len(ids)} tokens read one at a time; "
          f"text whole: {text == ANSWER}; calls {[n for n, _ in got]} with typed arguments as written: {got == WANT}; "
          f"streamed fragments join to the arguments: {joined == [c['function']['arguments'] for c in calls]}")
    return ok


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/tool_calls_real_vocab.py llama_cpp_python-X.tar.gz (the "
                         "llama-cpp-python sdist)")
    with tempfile.TemporaryDirectory() as tmp:
        llama = extract(sys.argv[1], Path(tmp))
        results = []
        for special in (False, True):
            folder = Path(tmp) / f"tok-{special}"
            folder.mkdir()
            results.append(read_back(build(llama, folder), folder, special))
    if not all(results):
        raise SystemExit("tool calls did not read back as written")
    print("all read back as written")


if __name__ == "__main__":
    main()
