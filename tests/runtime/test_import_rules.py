"""Rules of the code base: generic modules name no family (they ask the architecture), edgevl has
no import cycles, the model families sit below everything that uses them (and the shared blocks
below the families), the runtime never imports the verification wing (nor torch or
transformers), and only the graph writer spells raw ncnn layer parameters."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import edgevl

ROOT = Path(edgevl.__file__).parent
GENERIC = ["model.py", "runtime.py", "generate.py", "chat.py", "server.py", "bench.py", "batch.py",
           "verification/verify.py", "convert.py", "cli.py", "package.py", "tokenizer.py", "sample.py"]
FAMILY = re.compile(r"youtu|qwen|siglip|deepseek|kimi|\bmla\b", re.I)


@pytest.mark.parametrize("name", GENERIC)
def test_generic_modules_name_no_family(name):
    src = (ROOT / name).read_text()
    hits = [f"{name}:{i}: {line.strip()}" for i, line in enumerate(src.splitlines(), 1) if FAMILY.search(line)]
    assert not hits, "generic modules must ask the architecture, not name a family:\n" + "\n".join(hits)


def _imports(path: Path, module: str) -> set[str]:
    """edgevl modules imported anywhere in a file (top level or inside functions)."""
    pkg = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("edgevl")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.startswith("edgevl"):
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names}
    return out


def test_no_import_cycles():
    files = {p: "edgevl." + ".".join(p.relative_to(ROOT).with_suffix("").parts) for p in ROOT.rglob("*.py")}
    files = {p: m[: -len(".__init__")] if m.endswith(".__init__") else m for p, m in files.items()}
    known = set(files.values())
    graph = {m: {i for i in _imports(p, m) if i in known and i != m} for p, m in files.items()}
    # a package's __init__ importing its own submodules is how packages work, not a cycle
    graph = {m: {i for i in deps if not m.startswith(i + ".")} for m, deps in graph.items()}
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_layer_params_only_in_graph_writer():
    """Architecture files and shared blocks use ncnn_graph's named wrappers: param ids live in one place."""
    for p in [*(ROOT / "models").rglob("*.py"), *(ROOT / "blocks").rglob("*.py")]:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            assert ".layer(" not in line, f"{p.name}:{i} writes a raw ncnn layer: {line.strip()}"


# what sits above the model families: nothing under edgevl/models or edgevl/blocks may import it
ABOVE_FAMILIES = ("edgevl.model", "edgevl.convert", "edgevl.generate", "edgevl.chat", "edgevl.server",
                  "edgevl.batch", "edgevl.bench", "edgevl.cli", "edgevl.verification", "edgevl.demo")


def test_model_families_and_blocks_import_nothing_above_them():
    bad = []
    for p in [*(ROOT / "models").rglob("*.py"), *(ROOT / "blocks").rglob("*.py")]:
        module = "edgevl." + ".".join(p.relative_to(ROOT).with_suffix("").parts)
        # blocks sit below the families too: what both need lives in blocks (or lower)
        above = ABOVE_FAMILIES + (("edgevl.models",) if p.is_relative_to(ROOT / "blocks") else ())
        bad += [f"{p.relative_to(ROOT)} imports {i}" for i in _imports(p, module)
                if any(i == a or i.startswith(a + ".") for a in above)]
    assert not bad, "\n".join(bad)


def test_the_runtime_never_imports_torch_transformers_or_the_verification_wing(tmp_path):
    """``import edgevl``, loading and running the demo model, and importing every family leave
    torch, transformers and every reference, tiny-checkpoint factory and demo-training module out
    of sys.modules (a fresh interpreter: this one has torch loaded)."""
    code = """
import json, sys
import edgevl
from edgevl import models
from edgevl.demo import demo_package
seen = {}
seen["import edgevl"] = sorted(sys.modules)
model = edgevl.load(demo_package())
edgevl.generate(model, "How many shapes are there?", max_new_tokens=2)
seen["load and generate"] = sorted(sys.modules)
for name in models.names():
    models.get(name)
seen["every family"] = sorted(sys.modules)
print(json.dumps(seen))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert "edgevl.models.qwen3_5_moe" in seen["every family"]           # the families did load
    for step, mods in seen.items():
        bad = [m for m in mods if m.split(".")[0] in ("torch", "transformers")
               or m == "edgevl.verification" or m.startswith("edgevl.verification.")]
        assert not bad, f"{step} imported {bad[:5]}"

