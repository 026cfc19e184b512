"""User-facing errors.

Everything a user can get wrong (paths, configs, images, prompts) raises ``EdgevlError`` with a
one-line message that names the problem and the fix. The CLI prints it without a traceback and
exits non-zero; library users can catch it.

``PackageError`` is the subclass for faults of the converted package on disk that show up while
it runs (an expert block whose bytes changed, a file cut short or replaced): not the request's
fault, so the server answers them with a 5xx instead of a 4xx. ``ShuttingDown`` is a request
cut short because the engine is closing: the server answers it with a 503, which clients retry.
"""


class EdgevlError(Exception):
    """A problem with the user's input, stated in one line with the fix."""


class PackageError(EdgevlError):
    """The package on disk is damaged or changed under a running model, stated in one line with
    how to recover."""


class ShuttingDown(EdgevlError):
    """The engine closed before or while the request ran: not the request's fault."""
