"""Converted packages: a folder of ncnn graphs, tokenizer files and ``manifest.json``.

The manifest records the architecture, config, dtype, every file with its sha256, the sha256 of
the source checkpoint files and the edgevl/ncnn versions. Conversion writes into a hidden
temporary folder and renames it into place only after the manifest is written, so a folder
without a valid manifest is never a package. ``--force`` replaces only an existing package,
never a folder that holds the checkpoint, and swaps the new one in atomically; hidden work
folders of a killed conversion are cleaned up by the next conversion into the same parent.

Loading re-hashes a file only when its size or mtime changed since it was last verified (a small
stamp file in the user cache); ``check_package`` re-hashes everything. Every file the runtime
opens is named by a manifest-relative path that must stay inside the package and be listed (so
verified): ``package_path``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import EdgevlError
from .weights import SIDE_FILES, sha256_file

MANIFEST = "manifest.json"
FORMAT = "edgevl-package"
# 2: the model protocol (architecture + options, per-layer decoder state, context)
FORMAT_VERSION = 2

# The ``experts`` section of a mixture-of-experts package (models/moe.py), checked here at load
# without importing ncnn: storage dtypes, routing kinds with the keys each needs, and per-expert
# checksum kinds (experts.checksum) -> (hash, digest bytes kept). Each layer's ``hashes`` lists one
# hex digest per expert block; sha256 runs on the CPU's SHA instructions where it has them (on a
# 3 MB expert 2x faster than blake2b). Packages converted before checksums have neither key.
EXPERT_DTYPES = ("q8", "bf16", "fp16", "fp32")
EXPERT_ROUTING = {"softmax": ("top_k",), "sigmoid_biased": ("top_k", "scale")}
EXPERT_CHECKSUMS = {"sha256-128": (hashlib.sha256, 16)}


def cache_dir() -> Path:
    base = os.environ.get("EDGEVL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "edgevl")
    return Path(base).expanduser()   # EDGEVL_CACHE="~/c" quoted in a unit file or .env: not a folder named ~


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("edgevl", "ncnn"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def is_package(folder: Path) -> bool:
    """True if ``folder`` holds an edgevl manifest (the only kind of folder ``--force`` replaces)."""
    try:
        m = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and m.get("format") == FORMAT


def check_output(out_dir: Path, overwrite: bool, protected=()) -> None:
    """Refuse an output folder whose creation or replacement could destroy anything but an old
    package: an existing folder without an edgevl manifest, or one that is, holds or lies inside
    a ``protected`` path (the checkpoint folder and its files, symlinks resolved)."""
    out = out_dir.resolve()
    for p in protected:
        p = Path(p).resolve()
        if out == p or out in p.parents:
            raise EdgevlError(f"the output folder {out_dir} contains the checkpoint ({p}); choose an output "
                              "folder outside the checkpoint")
    if not (out_dir.exists() or out_dir.is_symlink()):
        return
    if not overwrite:
        raise EdgevlError(f"{out_dir} already exists; choose another output folder or pass --force "
                          "(overwrite=True in convert()) to replace the package there")
    if out_dir.is_symlink() or not out_dir.is_dir():
        raise EdgevlError(f"{out_dir} is not a package folder (a file or a symlink); --force replaces only an "
                          "edgevl package folder — choose another output folder")
    if not is_package(out_dir):
        raise EdgevlError(f"{out_dir} is not an edgevl package (no edgevl manifest.json); --force replaces only "
                          "a package folder — choose another output folder, or remove it yourself")
    for p in protected:
        if Path(p).resolve() in out.parents:
            raise EdgevlError(f"{out_dir} lies inside the checkpoint folder; --force does not replace folders "
                              "there — choose an output folder outside the checkpoint")


# hidden work folders next to the output: .NAME.partial-PID.N (being written), .NAME.old-PID.N
# (replaced); N counts the process's conversions, so two threads converting into one folder never
# share one (older versions wrote .NAME.partial-PID)
_WORK_DIR = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>[0-9]{1,9})(?:\.[0-9]{1,9})?$")
_WORK_SEQ = itertools.count(1)


def _work_dir(out_dir: Path, kind: str) -> Path:
    return out_dir.parent / f".{out_dir.name}.{kind}-{os.getpid()}.{next(_WORK_SEQ)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's process (or not ours to judge): leave its folder alone
    return True


def _only_package_files(folder: Path) -> bool:
    """True if every entry is a plain file of the kinds a conversion writes: a folder of that name
    pattern made by other software (anything else inside) is never deleted."""
    try:
        return all(p.is_file() and not p.is_symlink() and p.suffix in (".param", ".bin", ".json", ".jinja")
                   for p in folder.iterdir())
    except OSError:
        return False


def clean_stale(parent: Path) -> list[Path]:
    """Remove the work folders of conversions into ``parent`` whose process is gone (a SIGKILL,
    a power cut). An ``.old-`` folder whose package was never replaced (killed between the two
    renames of the fallback swap) is renamed back instead. Returns the folders handled."""
    done = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return done
    for p in entries:
        m = _WORK_DIR.match(p.name)
        if not m or int(m["pid"]) == os.getpid() or _pid_alive(int(m["pid"])):
            continue
        if p.is_symlink() or not p.is_dir() or not _only_package_files(p):
            continue
        target = parent / m["name"]
        if m["kind"] == "old" and not (target.exists() or target.is_symlink()) and is_package(p):
            try:
                p.rename(target)
                done.append(p)
                continue
            except OSError:
                pass
        shutil.rmtree(p, ignore_errors=True)
        done.append(p)
    return done


def temp_dir_for(out_dir: Path) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out_dir.parent)
    tmp = _work_dir(out_dir, "partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def manifest_digest(manifest: dict) -> str:
    """The sha256 of a manifest's content (its own digest left out, keys sorted): the manifest
    says how to read every other file (dtypes, byte ranges, RoPE), so an edit to it must not
    pass where a changed weight file would not."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def source_file_changed(package, folder, newer_than: float | None = None) -> tuple[str, bool] | None:
    """The first weight file recorded when ``package`` was converted that ``folder`` no longer holds
    as it was: (name, False) when it is not there, (name, True) when its sha256 differs; None when
    all are as recorded (or nothing was). ``newer_than``: only files modified after that time are
    hashed, the others taken as unchanged."""
    recorded = (read_manifest(package).get("source") or {}).get("files") or {}
    for name, digest in sorted(recorded.items()):
        f = Path(folder) / name
        if not f.is_file():
            return name, False
        if (newer_than is None or f.stat().st_mtime > newer_than) and sha256_file(f) != digest:
            return name, True
    return None


@contextlib.contextmanager
def signals_deferred():
    """Ctrl-C and SIGTERM wait until the block is done, then act as they would have: what the
    block writes is written whole (a batch's Parquet output when the job stops, a converted
    package swapped in for an old one). Only the main thread can set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got = []
    handlers = {n: signal.signal(n, lambda signum, frame: got.append(signum)) for n in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for n, h in handlers.items():
            signal.signal(n, h)
    if got:
        h = handlers[got[0]]
        if callable(h):
            h(got[0], None)
        elif h == signal.SIG_DFL:
            os.kill(os.getpid(), got[0])


def finalize(tmp: Path, out_dir: Path, manifest: dict, overwrite: bool) -> Path:
    """Hash every file, write the manifest last, then move the folder into place.

    An existing package is replaced atomically where the OS allows (one exchange of the two
    folders), else by two renames; the old package is deleted only once the new one is in place."""
    files = {}
    for p in sorted(tmp.iterdir()):
        if p.name == MANIFEST or not p.is_file():
            continue
        files[p.name] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    manifest = dict(manifest, format=FORMAT, format_version=FORMAT_VERSION, files=files,
                    versions=versions(), created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=False))
    with signals_deferred():    # a stop now would leave the old package half deleted beside the new one
        return _swap_in(tmp, out_dir, overwrite)


def _swap_in(tmp: Path, out_dir: Path, overwrite: bool) -> Path:
    if not (out_dir.exists() or out_dir.is_symlink()):
        try:
            tmp.rename(out_dir)
            return out_dir
        except OSError as e:   # another conversion's package arrived there meanwhile: replace it as below
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    check_output(out_dir, overwrite)  # again: the folder may have changed during the conversion
    old = _work_dir(out_dir, "old")
    if _exchange(tmp, out_dir):
        tmp.rename(old)  # tmp now holds the old package
    else:
        out_dir.rename(old)
        try:
            tmp.rename(out_dir)
        except OSError:
            old.rename(out_dir)
            raise
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
        if any(path.glob("*.param")) and not any(path.glob("*.safetensors")):
            raise EdgevlError(f"{path} holds ncnn graphs but no manifest.json: an edgevl package that lost its "
                              "manifest; convert the model again")
        if (path / "config.json").is_file():
            raise EdgevlError(f"{path} is a Hugging Face checkpoint, not a converted package; "
                              f"convert it first: edgevl convert {path} OUT_DIR")
        raise EdgevlError(f"{path} is not an edgevl package (no manifest.json); "
                          "create one with: edgevl convert HF_DIR OUT_DIR")
    try:
        m = json.loads(mf.read_text())
    except (ValueError, RecursionError):  # bad JSON, bad UTF-8, absurd nesting
        raise EdgevlError(f"{mf} is not valid JSON; the package is corrupt — convert the model again") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise EdgevlError(f"{mf} is not an edgevl manifest; convert the model again")
    v = m.get("format_version")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise EdgevlError(f"{mf}: format_version must be a positive integer, got {_short(v)}; the package is "
                          "corrupt — convert the model again")
    if v > FORMAT_VERSION:
        raise EdgevlError(f"{path} was written by a newer edgevl (format {v}); upgrade edgevl")
    if v < FORMAT_VERSION:
        src = (m.get("source") or {}).get("path") if isinstance(m.get("source"), dict) else None
        raise EdgevlError(f"{path} was converted by an older edgevl (package format {v}); "
                          f"convert it again: edgevl convert {src or 'HF_DIR'} {path} --force")
    check_manifest(m, path)
    return m


def _short(v, n: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def _is_int(v, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def check_manifest(m: dict, path) -> None:
    """Types of the generic manifest fields the runtime relies on (one line per problem)."""
    def bad(what, v, need):
        raise EdgevlError(f"manifest.json of {path}: {what} must be {need}, got {_short(v)}; the package is "
                          "corrupt — convert the model again")

    for key, kind in (("architecture", str), ("dtype", str), ("config", dict), ("graphs", dict), ("files", dict),
                      ("embedding", dict), ("options", dict)):
        if key in m and not isinstance(m[key], kind):
            bad(key, m[key], "an object" if kind is dict else "a string")
    if "context" in m and not _is_int(m["context"], 1):
        bad("context", m["context"], "a positive integer")
    for name, meta in m.get("files", {}).items():
        if not (isinstance(meta, dict) and isinstance(meta.get("sha256"), str) and _is_int(meta.get("bytes"))):
            bad(f"files[{name!r}]", meta, "an object with sha256 (a string) and bytes (an integer >= 0)")
    for g, info in m.get("graphs", {}).items():
        if not isinstance(info, dict):
            bad(f"graphs.{g}", info, "an object")
        for key, kind in (("inputs", dict), ("outputs", dict), ("state", list), ("passes", list), ("extra", dict)):
            if key in info and not isinstance(info[key], kind):
                bad(f"graphs.{g}.{key}", info[key], "an object" if kind is dict else "a list")
        for key in ("inputs", "outputs"):  # blob names, or lists of them
            for k, v in info.get(key, {}).items():
                if not (isinstance(v, str) or isinstance(v, list) and all(isinstance(n, str) for n in v)):
                    bad(f"graphs.{g}.{key}.{k}", v, "a blob name or a list of them")
        for i, st in enumerate(info.get("state", [])):
            if not (isinstance(st, dict) and isinstance(st.get("kind"), str)
                    and all(isinstance(st.get(k), list) and all(isinstance(n, str) for n in st[k])
                            for k in ("inputs", "outputs"))):
                bad(f"graphs.{g}.state[{i}]", st, "an object with kind, inputs and outputs (blob names)")
        sections = info.get("extra", {}).get("sections")
        if sections is None:
            continue
        if not isinstance(sections, list):
            bad(f"graphs.{g}.extra.sections", sections, "a list")
        for i, sec in enumerate(sections):
            ok = (isinstance(sec, dict) and isinstance(sec.get("name"), str) and isinstance(sec.get("param"), str)
                  and isinstance(sec.get("bin"), list) and len(sec["bin"]) == 2
                  and all(_is_int(b) for b in sec["bin"]) and sec["bin"][0] <= sec["bin"][1]
                  and all(isinstance(sec.get(k), list) and all(isinstance(n, str) for n in sec[k])
                          for k in ("inputs", "outputs")))
            if not ok:
                bad(f"graphs.{g}.extra.sections[{i}]", sec,
                    "an object with name, param, bin [start, end], inputs and outputs")
    e = m.get("embedding")
    if e is not None:
        if e.get("dtype") not in ("fp32", "fp16", "bf16"):
            bad("embedding.dtype", e.get("dtype"), "fp32, fp16 or bf16")
        for key in ("rows", "dim"):
            if not _is_int(e.get(key), 1):
                bad(f"embedding.{key}", e.get(key), "a positive integer")
        segs = e.get("segments")
        if not isinstance(segs, list) or not segs:
            bad("embedding.segments", segs, "a non-empty list")
        expect = 0
        for i, seg in enumerate(segs):
            r = seg.get("rows") if isinstance(seg, dict) else None
            if not (isinstance(r, list) and len(r) == 2 and all(_is_int(x) for x in r) and r[0] == expect
                    and r[1] > r[0] and _is_int(seg.get("offset"))):
                bad(f"embedding.segments[{i}]", seg, f"an object with rows [{expect}, end] and offset >= 0")
            expect = r[1]
        if expect != e["rows"]:
            bad("embedding.segments", segs, f"row ranges covering all {e['rows']} rows")
    if "experts" in m:
        check_experts(m, path)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_experts(m: dict, path) -> None:
    """The ``experts`` section of a mixture-of-experts package, whole (one line per problem): a
    wrong value here would otherwise surface mid-generation as a traceback or, for overlapping
    ranges or a zero top_k, as silently wrong answers."""
    def bad(what, v, need):
        raise EdgevlError(f"manifest.json of {path}: experts.{what} must be {need}, got {_short(v)}; the package "
                          "is corrupt — convert the model again")

    x = m["experts"]
    if not isinstance(x, dict):
        raise EdgevlError(f"manifest.json of {path}: experts must be an object, got {_short(x)}; the package is "
                          "corrupt — convert the model again")
    for key in ("file", "param"):
        if not isinstance(x.get(key), str):
            bad(key, x.get(key), "a file name")
    if x.get("dtype") not in EXPERT_DTYPES:
        bad("dtype", x.get("dtype"), ", ".join(EXPERT_DTYPES[:-1]) + " or " + EXPERT_DTYPES[-1])
    for key in ("hidden_size", "intermediate_size", "num_experts", "expert_bytes"):
        if not _is_int(x.get(key), 1):
            bad(key, x.get(key), "a positive integer")
    n, size = x["num_experts"], x["expert_bytes"]
    dim = m.get("embedding", {}).get("dim")
    if dim is not None and x["hidden_size"] != dim:
        bad("hidden_size", x["hidden_size"], f"the model's hidden size {dim} (embedding.dim)")
    r = x.get("routing")
    if not isinstance(r, dict):
        bad("routing", r, "an object")
    if r.get("kind") not in EXPERT_ROUTING:
        raise EdgevlError(f"manifest.json of {path}: unknown expert routing {_short(r.get('kind'))}; upgrade "
                          "edgevl or convert the model again")
    for key in EXPERT_ROUTING[r["kind"]]:
        if key not in r:
            bad(f"routing.{key}", None, f"given for {r['kind']} routing")
    if not _is_int(r["top_k"], 1) or r["top_k"] > n:
        bad("routing.top_k", r["top_k"], f"an integer from 1 to num_experts ({n})")
    if "renormalize" in r and not isinstance(r["renormalize"], bool):
        bad("routing.renormalize", r["renormalize"], "true or false")
    for key in ("scale", "eps"):
        if key in r and not (_is_num(r[key]) and r[key] >= 0):
            bad(f"routing.{key}", r[key], "a finite number >= 0")
    ids = r.get("modality_token_ids", [])
    if not (isinstance(ids, list) and all(_is_int(i) for i in ids)):
        bad("routing.modality_token_ids", ids, "a list of token ids")
    checksum = x.get("checksum")
    if checksum is not None and checksum not in EXPERT_CHECKSUMS:
        raise EdgevlError(f"manifest.json of {path}: unknown expert checksum {_short(checksum)}; upgrade edgevl "
                          "or convert the model again")
    digits = 2 * EXPERT_CHECKSUMS[checksum][1] if checksum else 0
    layers = x.get("layers")
    if not isinstance(layers, list) or not layers:
        bad("layers", layers, "a non-empty list")
    meta = m.get("files", {}).get(x["file"])
    file_bytes = meta["bytes"] if isinstance(meta, dict) else None   # unlisted: package_path refuses it
    spans, seen = [], set()   # (start, end, what) of every byte range the section names in the file
    for i, entry in enumerate(layers):
        w = f"layers[{i}]"
        if not isinstance(entry, dict):
            bad(w, entry, "an object with layer and offset")
        if not _is_int(entry.get("layer")) or entry["layer"] in seen:
            bad(f"{w}.layer", entry.get("layer"), "a layer number >= 0 that no other entry has")
        seen.add(entry["layer"])
        if not _is_int(entry.get("offset")):
            bad(f"{w}.offset", entry.get("offset"), "an integer >= 0")
        spans.append((entry["offset"], entry["offset"] + n * size, f"the {n} experts of experts.{w}"))
        hashes = entry.get("hashes")
        if checksum is None and hashes is not None:
            bad("checksum", None, f"named when the layers list hashes ({w}.hashes)")
        if checksum is not None and not (isinstance(hashes, list) and len(hashes) == n and all(
                isinstance(h, str) and len(h) == digits and all(c in "0123456789abcdef" for c in h) for h in hashes)):
            bad(f"{w}.hashes", hashes, f"a list of {n} hex digests of {digits} digits (one per expert)")
        b = entry.get("bias")
        if r["kind"] == "sigmoid_biased" or b is not None:
            rows = 2 if ids else 1   # a modality per row: 0 text, 1 image (models/moe.py: Router)
            if not (isinstance(b, dict) and _is_int(b.get("offset")) and isinstance(b.get("shape"), list)
                    and len(b["shape"]) == 2 and _is_int(b["shape"][0], rows) and b["shape"][1] == n):
                bad(f"{w}.bias", b, f"an object with offset >= 0 and shape [modalities >= {rows}, {n}]")
            spans.append((b["offset"], b["offset"] + 4 * b["shape"][0] * n, f"experts.{w}.bias"))
    spans.sort()
    for (s0, e0, a), (s1, e1, b) in itertools.pairwise(spans):
        if s1 < e0:
            raise EdgevlError(f"manifest.json of {path}: {a} (bytes {s0}..{e0}) and {b} (bytes {s1}..{e1}) "
                              f"overlap in {x['file']}; the package is corrupt — convert the model again")
    if file_bytes is not None and spans[-1][1] > file_bytes:
        s, e, what = spans[-1]
        raise EdgevlError(f"manifest.json of {path}: {what} (bytes {s}..{e}) lie past the end of {x['file']} "
                          f"({file_bytes} bytes); the package is corrupt — convert the model again")
    moe_layers = {p["args"].get("layer") for info in m.get("graphs", {}).values() for p in info.get("passes", [])
                  if isinstance(p, dict) and p.get("hook") == "moe" and isinstance(p.get("args"), dict)}
    missing = sorted(k for k in moe_layers - seen if _is_int(k))
    if missing:
        raise EdgevlError(f"manifest.json of {path}: the decoder routes layer {missing[0]} to experts that "
                          "experts.layers does not list; the package is corrupt — convert the model again")


def package_path(folder, name, manifest: dict | None = None, what: str = "file") -> Path:
    """The path of a package file named in manifest.json.

    The name must be relative, without ``..``, stay inside the package after symlinks are resolved
    and (given the manifest) be listed in its ``files``, so that loading has verified it."""
    folder = Path(folder)
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise EdgevlError(f"manifest.json of {folder} names a {what} {_short(name)} that is not a file name; the "
                          "package is corrupt — convert the model again")
    rel = PurePosixPath(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise EdgevlError(f"manifest.json of {folder} points outside the package ({what} {name!r}); refusing to "
                          "load it — convert the model again")
    full = folder / name
    try:
        inside = full.resolve(strict=False).is_relative_to(folder.resolve())
    except (OSError, RuntimeError) as e:  # a symlink loop (RuntimeError before Python 3.13), or unreadable
        if isinstance(e, OSError) and e.errno != errno.ELOOP:
            raise EdgevlError(f"package file {name} of {folder} cannot be read ({e.strerror or e}); check its "
                              "permissions") from None
        raise EdgevlError(f"package file {name} of {folder} is a symlink loop (it leads back to itself); the "
                          "package is corrupt — convert the model again") from None
    if not inside:
        raise EdgevlError(f"package file {name} of {folder} is a symlink leading outside the package; refusing "
                          "to load it — convert the model again")
    if manifest is not None and name not in manifest.get("files", {}):
        raise EdgevlError(f"package file {name} is not listed in manifest.json of {folder}, so it cannot be "
                          "verified; the package is corrupt or was modified — convert the model again")
    return full


def _stamp_path() -> Path:
    return cache_dir() / "verified.json"


STAMPS_KEPT = 256


def _read_stamps(stamp_file: Path) -> dict:
    """The verified-file stamps; anything unreadable or of the wrong shape counts as none (the
    file is rewritten after the next verification) — a broken cache must never stop loading."""
    try:
        stamps = json.loads(stamp_file.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return stamps if isinstance(stamps, dict) else {}


def verify_files(path, manifest: dict, full: bool = False) -> tuple[int, int]:
    """Refuse a package whose files are missing or differ from the manifest's sha256.

    ``full`` re-hashes every file whatever the stamps say. Returns (files, bytes) checked."""
    path = Path(path).resolve()
    stamp_file = _stamp_path()
    stamps = _read_stamps(stamp_file)
    mine = stamps.get(str(path))
    if not isinstance(mine, dict):
        mine = {}
    changed = False
    total = 0
    recorded = manifest.get("manifest_sha256")   # packages written before it have none
    if recorded is not None and recorded != manifest_digest(manifest):
        raise EdgevlError(f"{path / MANIFEST} was changed after conversion (it no longer matches its own "
                          "digest); the package is corrupt or was modified — convert the model again")
    for name, meta in manifest.get("files", {}).items():
        p = package_path(path, name)
        if not p.is_file():
            raise EdgevlError(f"package file {name} is missing from {path}; convert the model again")
        st = p.stat()
        total += st.st_size
        if st.st_size != meta["bytes"]:
            raise EdgevlError(f"package file {name} has {st.st_size} bytes but the manifest says "
                              f"{meta['bytes']}; the package is corrupt — convert the model again")
        key = [st.st_size, st.st_mtime_ns, meta["sha256"]]
        if not full and mine.get(name) == key:
            if not os.access(p, os.R_OK):   # chmod keeps the stamp; ncnn's own read would say "corrupt"
                raise EdgevlError(f"package file {p} cannot be read (Permission denied); check its permissions")
            continue
        if sha256_file(p) != meta["sha256"]:
            raise EdgevlError(f"package file {name} does not match its sha256 in manifest.json; "
                              "the package is corrupt or was modified — convert the model again")
        mine[name] = key
        changed = True
    if changed or stamps.get(str(path)) is not mine:
        stamps.pop(str(path), None)
        stamps[str(path)] = mine    # the newest last: the file keeps the STAMPS_KEPT last loaded
        # (packages moved or deleted would grow it for ever, and every load that adds one rewrites
        # it; one on a disk not mounted now keeps its stamps)
        stamps = dict(list(stamps.items())[-STAMPS_KEPT:])
        try:
            stamp_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = stamp_file.with_suffix(f".tmp{os.getpid()}-{next(_WORK_SEQ)}")   # one per writer, threads too
            tmp.write_text(json.dumps(stamps))
            tmp.replace(stamp_file)
        except OSError:
            pass  # a read-only cache only costs re-hashing next time
    return len(manifest.get("files", {})), total


# files beside the graphs that the runtime reads when present (tokenizer, templates, configs)
RUNTIME_FILES = SIDE_FILES


def check_listed(path, manifest: dict, names=RUNTIME_FILES) -> None:
    """Every one of ``names`` present in the package folder must be listed (and so verified)."""
    path = Path(path)
    for name in names:
        if (path / name).exists() or (path / name).is_symlink():
            package_path(path, name, manifest)


def check_package(path) -> tuple[int, int]:
    """``edgevl check``: the manifest, every path in it, and every file re-hashed (no stamp cache)."""
    m = read_manifest(path)
    check_listed(path, m)
    e = m.get("embedding")
    if isinstance(e, dict):
        package_path(path, e.get("file"), m, "embedding file")
    for g, info in m.get("graphs", {}).items():
        for suffix in (".param", ".bin"):
            package_path(path, g + suffix, m, "graph file")
        for sec in info.get("extra", {}).get("sections") or []:
            package_path(path, sec["param"], m, "section file")
    x = m.get("experts")
    if isinstance(x, dict):
        for key, what in (("file", "experts file"), ("param", "experts graph")):
            package_path(path, x[key], m, what)
    return verify_files(path, m, full=True)


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
