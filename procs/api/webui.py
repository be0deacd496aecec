"""The web pages (`--webui`, on by default): the chat playground at `/`, the scheduler's live view at
`/dashboard`, and their scripts and styles at `/ui/NAME`.

Every file is read from the package's `webui/` folder once, at start, into a table by name, and only
names in that table are served: a request's path is looked up, never joined to a directory, so nothing
outside the folder can be reached. The pages carry a Content-Security-Policy that runs only these
scripts (no inline script or handler), and write model output as text, never as markup."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from batchserve.procs.api.errors import error_response

WEBUI_DIR = Path(__file__).with_name("webui")
PAGES = {"/": "chat.html", "/dashboard": "dashboard.html"}
CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def webui_files(folder: Path = WEBUI_DIR) -> dict[str, tuple[bytes, str]]:
    """The folder's files by name: (bytes, content type), for the suffixes the pages use."""
    return {
        path.name: (path.read_bytes(), CONTENT_TYPES[path.suffix])
        for path in sorted(folder.iterdir())
        if path.is_file() and path.suffix in CONTENT_TYPES
    }


def add_webui_routes(app: web.Application) -> None:
    files = webui_files()

    def answer(name: str) -> web.Response:
        if name not in files:
            return error_response(404, f"no such file: {name!r}", code="not_found")
        body, content_type = files[name]
        return web.Response(body=body, content_type=content_type, charset="utf-8", headers=SECURITY_HEADERS)

    async def page(request: web.Request) -> web.Response:
        return answer(PAGES[request.path])

    async def asset(request: web.Request) -> web.Response:
        return answer(request.match_info["name"])

    for path in PAGES:
        app.router.add_get(path, page)
    app.router.add_get("/ui/{name}", asset)
