"""Converted packages: a folder of ncnn graphs, tokenizer files and ``manifest.json``.

The manifest records the architecture, config, dtype, every file with its sha256, the sha256 of
the source checkpoint files and the edgevl/ncnn versions. Conversion writes into a hidden
temporary folder and renames it into place only after the manifest is written, so a folder
without a valid manifest is never a package. Loading re-hashes a file only when its size or
mtime changed since it was last verified (a small stamp file in the user cache).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import EdgevlError
from .weights import sha256_file

MANIFEST = "manifest.json"
FORMAT = "edgevl-package"
# 2: the model protocol (architecture + options, per-layer decoder state, context)
FORMAT_VERSION = 2


def cache_dir() -> Path:
    base = os.environ.get("EDGEVL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "edgevl")
    return Path(base)


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("edgevl", "ncnn"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def temp_dir_for(out_dir: Path) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def finalize(tmp: Path, out_dir: Path, manifest: dict, overwrite: bool) -> Path:
    """Hash every file, write the manifest last, then move the folder into place."""
    files = {}
    for p in sorted(tmp.iterdir()):
        if p.name == MANIFEST or not p.is_file():
            continue
        files[p.name] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    manifest = dict(manifest, format=FORMAT, format_version=FORMAT_VERSION, files=files,
                    versions=versions(), created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=False))
    old = None
    if out_dir.exists():
        if not overwrite:
            shutil.rmtree(tmp)
            raise EdgevlError(f"{out_dir} already exists; choose another output folder or pass --force")
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        out_dir.rename(old)
    tmp.rename(out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def read_manifest(path) -> dict:
    path = Path(path)
    if not path.exists():
        raise EdgevlError(f"{path} does not exist; pass a converted edgevl package folder")
    if not path.is_dir():
        raise EdgevlError(f"{path} is not a folder; pass a converted edgevl package folder")
    mf = path / MANIFEST
    if not mf.is_file():
        if (path / "config.json").is_file():
            raise EdgevlError(f"{path} is a Hugging Face checkpoint, not a converted package; "
                              f"convert it first: edgevl convert {path} OUT_DIR")
        raise EdgevlError(f"{path} is not an edgevl package (no manifest.json); "
                          "create one with: edgevl convert HF_DIR OUT_DIR")
    try:
        m = json.loads(mf.read_text())
    except json.JSONDecodeError:
        raise EdgevlError(f"{mf} is not valid JSON; the package is corrupt — convert the model again") from None
    if m.get("format") != FORMAT:
        raise EdgevlError(f"{mf} is not an edgevl manifest; convert the model again")
    if m.get("format_version", 0) > FORMAT_VERSION:
        raise EdgevlError(f"{path} was written by a newer edgevl (format {m.get('format_version')}); upgrade edgevl")
    if m.get("format_version", 0) < FORMAT_VERSION:
        src = (m.get("source") or {}).get("path") or "HF_DIR"
        raise EdgevlError(f"{path} was converted by an older edgevl (package format {m.get('format_version')}); "
                          f"convert it again: edgevl convert {src} {path} --force")
    return m


def _stamp_path() -> Path:
    return cache_dir() / "verified.json"


def verify_files(path, manifest: dict, full: bool = False) -> None:
    """Refuse a package whose files are missing or differ from the manifest's sha256."""
    path = Path(path).resolve()
    stamp_file = _stamp_path()
    try:
        stamps = json.loads(stamp_file.read_text())
    except (OSError, json.JSONDecodeError):
        stamps = {}
    mine = stamps.get(str(path), {})
    changed = False
    for name, meta in manifest.get("files", {}).items():
        p = path / name
        if not p.is_file():
            raise EdgevlError(f"package file {name} is missing from {path}; convert the model again")
        st = p.stat()
        if st.st_size != meta["bytes"]:
            raise EdgevlError(f"package file {name} has {st.st_size} bytes but the manifest says "
                              f"{meta['bytes']}; the package is corrupt — convert the model again")
        key = [st.st_size, st.st_mtime_ns, meta["sha256"]]
        if not full and mine.get(name) == key:
            continue
        if sha256_file(p) != meta["sha256"]:
            raise EdgevlError(f"package file {name} does not match its sha256 in manifest.json; "
                              "the package is corrupt or was modified — convert the model again")
        mine[name] = key
        changed = True
    if changed:
        stamps[str(path)] = mine
        try:
            stamp_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = stamp_file.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(stamps))
            tmp.replace(stamp_file)
        except OSError:
            pass  # a read-only cache only costs re-hashing next time


# -- the cache folder (``edgevl cache``) ---------------------------------------------------------

@dataclass
class CacheEntry:
    path: Path
    bytes: int
    what: str


def _tree_bytes(p: Path) -> int:
    if p.is_file() or p.is_symlink():
        return p.lstat().st_size
    return sum(f.lstat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


def cache_entries() -> list[CacheEntry]:
    """What edgevl itself wrote into the cache folder; anything else there is never touched (the
    folder may be one the user chose with EDGEVL_CACHE)."""
    root = cache_dir()
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.iterdir()):
        n = p.name
        if n.startswith("demo-") and p.is_dir():
            what = "the demo model, converted (edgevl run/chat/serve with no model use it)"
        elif n == "verified.json" or (n.startswith("verified.tmp") and p.is_file()):
            what = "checksums of packages already verified (saves re-hashing at load)"
        elif n.startswith(".demo-") and (".partial-" in n or ".old-" in n):
            what = "left over from an interrupted demo conversion"
        else:
            continue
        out.append(CacheEntry(p, _tree_bytes(p), what))
    return out


def clear_cache(entries: list[CacheEntry] | None = None) -> int:
    """Delete edgevl's cache entries; returns the bytes freed."""
    freed = 0
    for e in cache_entries() if entries is None else entries:
        if e.path.is_dir() and not e.path.is_symlink():
            shutil.rmtree(e.path)
        else:
            e.path.unlink(missing_ok=True)
        freed += e.bytes
    return freed
