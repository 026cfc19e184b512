"""The shipped offline demo model: a tiny Youtu-VL trained on synthetic scenes.

``demo_package()`` converts the checkpoint in ``edgevl/demo/model`` once into the user cache
(fp32, so it matches its PyTorch reference token for token) and returns the package folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from pathlib import Path

from ..errors import EdgevlError

DEMO_CHECKPOINT = Path(__file__).parent / "model"


def names_demo(path) -> bool:
    """Whether a model argument means the shipped demo: none, or ``demo`` unless a package folder
    of that name is in the working folder (the one rule of ``edgevl.load`` and every command)."""
    return path is None or (str(path) == "demo" and not (Path("demo") / "manifest.json").is_file())


def demo_checkpoint() -> Path:
    if not (DEMO_CHECKPOINT / "config.json").is_file():
        raise EdgevlError(f"the demo model is missing from {DEMO_CHECKPOINT}; reinstall edgevl "
                          "or pass a converted model folder")
    return DEMO_CHECKPOINT


def demo_package_path() -> Path:
    """Where the converted demo package lives (it may not exist yet)."""
    from .. import __version__
    from ..package import FORMAT_VERSION, cache_dir

    ck = demo_checkpoint()
    h = hashlib.sha256()
    for p in sorted(ck.iterdir()):
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    # keyed by the package format and the edgevl version too: a newer edgevl converts the demo
    # again (about a second) instead of refusing the cached package of an older one, also when a
    # release changes a graph's layout within one format version
    return cache_dir() / f"demo-{h.hexdigest()[:12]}-v{FORMAT_VERSION}-{__version__}"


def demo_package(progress: bool = False) -> Path:
    from ..convert import convert
    from ..package import MANIFEST

    ck = demo_checkpoint()
    out = demo_package_path()
    if (out / MANIFEST).is_file():
        return out
    try:
        # one conversion at a time, in this process and across processes (an app's first requests,
        # its workers starting together): the others wait for it and load what it wrote
        with _CONVERTING, _folder_lock(out.parent):
            if not (out / MANIFEST).is_file():
                _clear_damaged(out)
                # trained on images only (demo/train.py): the package says so, and run and chat
                # note that an answer without an image means nothing
                convert(ck, out, dtype="fp32", progress=progress, overwrite=out.exists(), needs_image=True)
    except EdgevlError:
        if not (out / MANIFEST).is_file():  # another process won the race (where no lock could be taken)
            raise
    except OSError as e:
        # a file of the installed package that cannot be read names its own path; any other (the
        # cache folder, or a folder above it: a HOME that is / or missing) is the cache's place
        where = Path(e.filename) if e.filename else None
        installed = Path(__file__).resolve().parent.parent      # the edgevl package's own files
        if where is not None and where.resolve().is_relative_to(installed):
            raise EdgevlError(f"the demo model cannot be converted: {where} cannot be read "
                              f"({e.strerror or e}); reinstall edgevl") from None
        raise EdgevlError(f"the demo model cannot be converted into the edgevl cache folder {out.parent} "
                          f"({e.strerror or e}); set EDGEVL_CACHE to a writable folder") from None
    return out


_CONVERTING = threading.Lock()


def _clear_damaged(out: Path) -> None:
    """What stands at the demo's cache path without a manifest (a clear cut short, a file put
    there) is no package that anyone uses: removed, so the demo converts again (the name is the
    cache's own; conversions write elsewhere and rename whole packages into place)."""
    import shutil

    from ..package import MANIFEST

    if (out / MANIFEST).is_file():   # another process's conversion just put it there
        return
    if out.is_symlink() or out.is_file():
        out.unlink()
    elif out.is_dir():
        shutil.rmtree(out)


def is_demo_package(path) -> bool:
    """Whether ``path`` is the demo's package in the cache (its damage is fixed by clearing the cache)."""
    try:
        return Path(path).resolve() == demo_package_path().resolve()
    except (OSError, RuntimeError, EdgevlError):
        return False


@contextlib.contextmanager
def _folder_lock(folder: Path):
    """An exclusive lock on ``folder`` (flock on the folder itself: no lock file to leave behind),
    held until the block ends; a no-op where the OS or the file system has no flock."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:   # a file system that locks no folders (NFS, some FUSE): go on unlocked
            pass
        yield
    finally:
        os.close(fd)
