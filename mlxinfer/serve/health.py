"""How the server is doing, for those who watch it, at its root: `GET /health` (open to all, for
probes: the engine's snapshot, its limits, the memory this process peaked at) and `GET /metrics`
(behind the API key, where Prometheus looks by default: the counts `metrics.Metrics` keeps)."""

from __future__ import annotations

import resource
import sys
from typing import Any

from fastapi.responses import Response

from .api import Api, Route
from .metrics import CONTENT_TYPE


class HealthApi(Api):
    """`GET /health` (HEAD too: a probe's headers, no body, which uvicorn drops)."""

    prefix, keyed = "", False

    def routes(self) -> tuple[Route, ...]:
        return (Route("/health", self.health, ("GET", "HEAD")),)

    async def health(self) -> dict[str, Any]:
        engine, config = self.ctx.engine, self.ctx.config
        return {"status": "ok", "model": config.model_name, **engine.health, "preparing": engine.preparing,
                "limits": {"max_concurrency": engine.max_batch, "max_queued": engine.max_queued},
                "peak_rss_bytes": peak_rss_bytes(), "api_key_required": config.api_key is not None}


class MetricsApi(Api):
    """`GET /metrics`, in Prometheus's text format."""

    prefix = ""

    def routes(self) -> tuple[Route, ...]:
        return (Route("/metrics", self.metrics, ("GET",)),)

    async def metrics(self) -> Response:
        return Response(self.ctx.engine.metrics.text(self.ctx.engine.health), media_type=CONTENT_TYPE)


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB
