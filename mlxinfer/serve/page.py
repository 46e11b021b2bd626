"""The web app at `/`: a chat page, and "Look inside" each reply (its tokens, the pipeline,
attention), served from the package's `web/` folder as it is written: plain HTML, CSS and
ES modules, no build step and nothing fetched from elsewhere. The page talks to this server's
own APIs (/v1/chat/completions streamed, /tokenize, /v1/inspect, /v1/attention), so it needs
no route of its own beyond its files.

Its Content-Security-Policy lets it load and connect to this origin only: a reply's text
cannot make the browser fetch from anywhere else, even if it slipped past the page's escaping.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi.responses import Response

from .api import Api, Context, Route
from .errors import RequestError

TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
          "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def assets() -> dict[str, tuple[bytes, str]]:
    """Every file of the web app by name, with its content type (read once: a few kilobytes)."""
    folder = files(__package__) / "web"
    return {f.name: (f.read_bytes(), TYPES[f.name[f.name.rindex("."):]]) for f in folder.iterdir()
            if "." in f.name and f.name[f.name.rindex("."):] in TYPES}


class PageApi(Api):
    """GET / (the page) and GET /web/NAME (its scripts and styles), open to all: the page asks
    for the API key itself when the server wants one. HEAD too, as HTTP asks of every GET
    (uvicorn sends its headers without the body): link checkers and uptime probes use it."""

    prefix, keyed = "", False

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.found = assets()

    def routes(self) -> tuple[Route, ...]:
        return Route("/", self.page, ("GET", "HEAD")), Route("/web/{name}", self.asset, ("GET", "HEAD"))

    async def page(self) -> Response:
        return self.served("index.html")

    async def asset(self, name: str) -> Response:
        return self.served(name)

    def served(self, name: str) -> Response:
        if name not in self.found:
            raise RequestError(f"the web app has no file '{name[:100]}'", status=404, kind="not_found_error")
        body, kind = self.found[name]
        return Response(body, media_type=kind, headers={"Content-Security-Policy": POLICY, "Cache-Control": "no-cache",
                                                        "X-Content-Type-Options": "nosniff"})
