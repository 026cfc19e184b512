"""User-facing errors.

Everything a user can get wrong (paths, configs, images, prompts) raises ``EdgevlError`` with a
one-line message that names the problem and the fix. The CLI prints it without a traceback and
exits non-zero; library users can catch it.
"""


class EdgevlError(Exception):
    """A problem with the user's input, stated in one line with the fix."""
