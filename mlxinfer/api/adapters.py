"""`POST /v1/adapters`: load and unload LoRA adapters while the server runs. Each loaded
adapter is served as the model `BASE:NAME` (`/v1/models` lists them; a request's `model`
chooses one: `openai.adapter_of`). The count is bounded (`ServerConfig.max_adapters`), the
route sits behind the API key with the rest of /v1, and the work runs on the engine thread
between steps, so no step sees a half-loaded adapter."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from ..adapters import load_adapter, unload_adapter
from ..models.lora import adapters_of
from .common import Context, RequestError, body_of


class AdapterCommand(BaseModel):
    """`{"action": "load", "name": N, "path": DIR}` or `{"action": "unload", "name": N}`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    action: Literal["load", "unload"]
    name: str
    path: str | None = None


def loaded(model) -> list[str]:
    found = adapters_of(model)
    return sorted(found.slots) if found is not None else []


def router(ctx: Context) -> APIRouter:
    api = APIRouter()
    config, engine, model = ctx.config, ctx.engine, ctx.model

    def listing() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": f"{config.model_name}:{n}", "object": "adapter", "name": n}
                                           for n in loaded(model)]}

    def load(command: AdapterCommand) -> None:
        if len(loaded(model)) >= config.max_adapters:
            raise RequestError(f"{config.max_adapters} adapters are loaded, the most this server keeps "
                               "(--max-adapters); unload one first", "name", status=409)
        load_adapter(model, command.path, command.name)

    def unload(command: AdapterCommand) -> None:
        if command.name not in loaded(model):
            raise RequestError(f"no adapter named '{command.name[:100]}' is loaded", "name", status=404,
                               kind="not_found_error")
        if engine.engine.uses_adapter(command.name):
            raise RequestError(f"adapter '{command.name[:100]}' is in use by requests in flight; unload it "
                               "when they end", "name", status=409)
        unload_adapter(model, command.name)

    @api.get("/adapters")
    async def adapters():
        return listing()

    @api.post("/adapters")
    async def command(request: Request):
        try:
            parsed = AdapterCommand.model_validate_json(await body_of(request, config.max_body))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or None
            raise RequestError(f"{where}: {first['msg']}" if where else first["msg"], where) from None
        if not parsed.name or ":" in parsed.name or "/" in parsed.name:
            raise RequestError("name must be a non-empty adapter name without ':' or '/'", "name")
        if parsed.action == "load" and not parsed.path:
            raise RequestError("loading an adapter needs its folder: path", "path")
        await engine.call(lambda: (load if parsed.action == "load" else unload)(parsed))
        return listing()

    return api
