"""A built wheel holds every file the package reads: setuptools ships a package's Python modules
and, of its other files, only those its package-data patterns name (globbed from the package's
folder), so a data file no pattern names works in a checkout and is missing from every install."""

import glob

import pytest

from support.common import ROOT

try:
    import tomllib
except ModuleNotFoundError:   # Python 3.10
    tomllib = pytest.importorskip("tomli")


def test_package_data_names_every_data_file_of_the_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["edgevl"]
    package = ROOT / "edgevl"
    shipped = {p for pattern in patterns for p in glob.glob(pattern, root_dir=package)}
    for pattern in patterns:
        assert glob.glob(pattern, root_dir=package), f"package-data pattern {pattern!r} names no file"
    data = sorted(str(p.relative_to(package)) for p in package.rglob("*")
                  if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts)
    assert data, "no data files found"
    missing = [p for p in data if p not in shipped]
    assert not missing, "files no package-data pattern ships:\n" + "\n".join(missing)
