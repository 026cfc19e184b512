"""The repository stands on its own: nothing in it cites documents a user does not have (issue
numbers, the section signs of outside specifications, their paths) or a development machine's
absolute paths, and the README is a user's document whose links all resolve."""

import re

from support.common import ROOT

CHECKED = ["edgevl", "tests", "benchmarks", "scripts", "docs"]
# built from pieces so that this file does not match itself
OUTSIDE = re.compile("issue" + r" [0-9]+|" + "\u00a7" + "|shared" + "/specs")
MACHINE = re.compile(r"(?<![\w.])/(?:work|home|root)/")


def files():
    yield ROOT / "README.md"
    for top in CHECKED:
        for p in sorted((ROOT / top).rglob("*")):
            demo_data = (ROOT / "edgevl" / "demo" / "model") in p.parents   # the shipped model's files
            if p.is_file() and p.suffix in (".py", ".md", ".sh", ".json", ".toml", ".txt", ".jinja") and not demo_data:
                yield p


def test_nothing_cites_outside_documents_or_machine_paths():
    outside, machine = [], []
    for p in files():
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            where = f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}"
            if OUTSIDE.search(line):
                outside.append(where)
            if MACHINE.search(line):
                machine.append(where)
    assert not outside, "cites documents a user does not have:\n" + "\n".join(outside)
    assert not machine, "absolute paths of a development machine:\n" + "\n".join(machine)


def test_readme_is_a_short_users_document_whose_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 400
    for heading in ("## Install", "## Quick start", "## Supported models", "## Converting real checkpoints",
                    "## Command line", "## Python API", "## OpenAI-compatible server", "## Batch", "## Verifying",
                    "## Benchmark", "## ARM boards", "## Known limits", "## Set up and test"):
        assert heading in readme, heading
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")) and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)
    for name in ("architecture.md", "benchmarks.md"):
        assert (ROOT / "docs" / name).is_file(), name
