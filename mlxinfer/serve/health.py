"""How the server is doing, for those who watch it, at its root: `GET /health` (open to all, for
probes: the loaded models' engine snapshots, summed and each on its own, their limits, the memory
this process peaked at) and `GET /metrics` (behind the API key, where Prometheus looks by
default: the counts `metrics.Metrics` keeps, one for every model's engine)."""

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
        """The loaded models' engines summed, each one's own under `models`, and the limits
        (per model: each has its own engine)."""
        models, config = self.ctx.models, self.ctx.config
        return {"status": "ok", "model": models.default, **models.health(), "limits": models.limits,
                "peak_rss_bytes": peak_rss_bytes(), "api_key_required": config.api_key is not None}


class MetricsApi(Api):
    """`GET /metrics`, in Prometheus's text format."""

    prefix = ""

    def routes(self) -> tuple[Route, ...]:
        return (Route("/metrics", self.metrics, ("GET",)),)

    async def metrics(self) -> Response:
        models = self.ctx.models
        return Response(models.metrics.text(models.health()), media_type=CONTENT_TYPE)


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB
