"""User-facing errors.

Everything a user can get wrong (paths, configs, images, prompts) raises ``EdgevlError`` with a
one-line message that names the problem and the fix. The CLI prints it without a traceback and
exits non-zero; library users can catch it.

``PackageError`` is the subclass for faults of the converted package on disk that show up while
it runs (an expert block whose bytes changed, a file cut short or replaced): not the request's
fault, so the server answers them with a 5xx instead of a 4xx. ``ShuttingDown`` is a request
cut short because the engine is closing: the server answers it with a 503, which clients retry.
"""

import errno
import os


class EdgevlError(Exception):
    """A problem with the user's input, stated in one line with the fix."""


class PackageError(EdgevlError):
    """The package on disk is damaged or changed under a running model, stated in one line with
    how to recover."""


class ShuttingDown(EdgevlError):
    """The engine closed before or while the request ran: not the request's fault."""


class ContextOverflow(EdgevlError):
    """A prompt's videos, counted from their headers, leave no room in the context (a chat drops
    its oldest turns on it)."""


def os_error_line(e: OSError) -> str:
    """What went wrong and the fix where one is known, in one line."""
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    fix = {errno.ENOSPC: "; free some space on that disk (or write elsewhere) and run it again",
           errno.EDQUOT: "; free some space within your quota (or write elsewhere) and run it again",
           errno.EFBIG: "; a file grew past the largest size allowed here (ulimit -f, or the file system's limit)",
           errno.EACCES: "; check the permissions (read access to what it reads, write access to where it "
                         "writes)",
           errno.EROFS: "; the file system is read-only: choose another folder",
           errno.ENOTDIR: "; a part of that path is a file, not a folder: choose another path"}.get(e.errno, "")
    if e.errno == errno.EEXIST and e.filename and os.path.isfile(e.filename):   # mkdir over a file
        fix = "; that is a file, not a folder: choose another path"
    if "No usable temporary directory" in str(e):   # tempfile found no writable folder
        return ("no writable temporary folder (TMPDIR, /tmp, /var/tmp, the current folder); set TMPDIR to a "
                "writable folder (edgevl writes some model graphs there while loading)")
    if not where and e.errno == errno.ENOENT and not _cwd_exists():
        fix = " (the current folder was deleted); cd to a folder that exists and run it again"
    if not where and e.errno in (errno.ENOSPC, errno.EDQUOT):
        import tempfile

        fix = (f"; free some space on the disk of the output folder or of the temporary folder "
               f"({tempfile.gettempdir()}; TMPDIR moves it) and run it again")
    return f"{e.strerror or e}{where}{fix}"


def _cwd_exists() -> bool:
    try:
        os.getcwd()
        return True
    except OSError:
        return False
