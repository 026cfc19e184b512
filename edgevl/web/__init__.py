"""The chat page ``edgevl serve`` shows at ``/``: the static files of this folder (plain HTML, CSS
and JavaScript; nothing fetched from elsewhere, no build step) and ``props``, what the page needs
to know about the model (``GET /props``). The page talks to the server only through its public
API (``/v1/chat/completions``, streamed)."""

from __future__ import annotations

from pathlib import Path

FOLDER = Path(__file__).parent
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# The page loads only what this server serves (and the data:/blob: URLs of the user's own files):
# model text that slipped past the page's escaping still could not run a script or call out.
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
          "media-src 'self' data: blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
          "frame-ancestors 'none'")


def asset(name: str) -> tuple[bytes, dict] | None:
    """(bytes, headers) of the page's file ``name`` (``index.html`` for ``/``), or None: only the
    files directly in this folder with a known type are served, so no path leaves it."""
    path = FOLDER / name
    if "/" in name or "\\" in name or path.suffix not in TYPES or not path.is_file():
        return None
    headers = {"Content-Type": TYPES[path.suffix], "Cache-Control": "no-cache",
               "X-Content-Type-Options": "nosniff", "Content-Security-Policy": POLICY}
    return path.read_bytes(), headers


def props(server) -> dict:
    """What the model takes and its defaults, for the page's controls (llama-server's ``/props``
    plays this part for its page)."""
    from ..sample import resolve
    from ..tools import call_format

    model = server.model
    arch = model.arch
    on, off = arch.thinking_args(True), arch.thinking_args(False)
    default = server.thinking
    if default is None and on:  # --chat-template-kwargs may set the switch; else templates think
        key = next(iter(on))
        default = server.chat_template_kwargs.get(key, on[key]) == on[key]
    s = resolve(model.generation_config)
    return {
        "model": server.model_id,
        "family": arch.name,
        "context": model.max_context,
        "images": model.vision is not None,
        "video": bool(model.takes_video),
        "needs_image": model.manifest.get("needs_image") is True,
        "tools": call_format(model) is not None,   # the API takes tools (the page itself sends none)
        "thinking": {"reasoning": arch.reasoning_tokens is not None, "switch": bool(on),
                     "default": default, "on": on, "off": off},
        "speculative": model.speculative,
        "max_body": server.max_body,
        "max_image_pixels": server.max_image_pixels,   # per request, all images together
        # sampling as the server applies it when a request leaves a value out
        "defaults": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "max_tokens": None,
                     "seed": None},
    }
