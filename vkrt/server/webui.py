"""The chat and status page at / (`vkrt serve --disable-ui` turns it off).

Three static files shipped in the package (vkrt/server/ui/): no build step, nothing fetched
from elsewhere at run time. The page itself is public, so a browser can load it and ask for
the API key; everything it then calls (/v1/models, /v1/chat/completions, /metrics) goes
through the middleware's key check like any other client's request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

from vkrt.errors import VkrtError

UI_DIR = Path(__file__).parent / "ui"

# URL path -> (file under UI_DIR, content type). Nothing else is served from that folder.
UI_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
}
UI_PATHS = frozenset(UI_FILES)

# The page loads its own script and style and talks to this server only; no inline script,
# no framing by other sites.
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def read_ui_files(directory: Path = UI_DIR) -> dict[str, tuple[bytes, str]]:
    """URL path -> (body, content type); a file missing from the install is one clear error."""
    files = {}
    for path, (name, media_type) in UI_FILES.items():
        try:
            files[path] = ((directory / name).read_bytes(), media_type)
        except OSError as exc:
            raise VkrtError(f"the web page's file {name} cannot be read from {directory} ({exc.strerror or exc}); "
                            "reinstall vkrt, or start the server with --disable-ui") from exc
    return files


def add_ui_routes(app: FastAPI, directory: Path = UI_DIR) -> None:
    """GET / and the page's script and style, read once when the app is built."""
    for path, (body, media_type) in read_ui_files(directory).items():
        app.add_api_route(path, _static(body, media_type), methods=["GET"], include_in_schema=False)


def _static(body: bytes, media_type: str) -> Callable[[], Awaitable[Response]]:
    async def serve_file() -> Response:
        return Response(body, media_type=media_type, headers=_HEADERS)

    return serve_file


def page_url(host: str, port: int) -> str:
    """The address to open in a browser: a wildcard listen address is reached on loopback."""
    shown = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, host)
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/"
