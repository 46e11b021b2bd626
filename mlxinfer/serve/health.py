"""How the server is doing, for those who watch it: `GET /metrics`, at the server's root (where
Prometheus looks by default), the counts `metrics.Metrics` keeps in its text format."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from .api import Context
from .metrics import CONTENT_TYPE


def router(ctx: Context) -> APIRouter:
    """`GET /metrics`, at the server's root (where Prometheus looks by default)."""
    api = APIRouter()

    @api.get("/metrics")
    async def metrics():
        return Response(ctx.engine.metrics.text(ctx.engine.health), media_type=CONTENT_TYPE)

    return api
