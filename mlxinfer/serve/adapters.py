"""`POST /v1/adapters`: load and unload LoRA adapters while the server runs. Each loaded
adapter is served as the model `BASE:NAME` (`/v1/models` lists them; a request's `model`
chooses one: `Served.options`). An adapter belongs to the model it was loaded on (the body's
`model`, default the server's default model) and goes when that model unloads; the count is
bounded per model (`ServerConfig.max_adapters`), names follow `lora.adapter_name`, and the route
sits behind the API key with the rest of /v1.

A load's work (reading the files, checking them, computing each layer's update) runs on a
thread of its own, one load at a time, while the engine keeps stepping: the streams being
decoded never wait on it. Only attaching the finished updates, which computes nothing, runs
on the engine thread between steps, as does an unload, so no step sees a half-loaded adapter."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from fastapi import Request

from ..loading.adapters import attach_adapter, prepare_adapter, unload_adapter
from ..base.errors import MlxinferError
from ..models.layers import CausalLM
from ..models.lora import adapter_name, adapters_of
from .api import Api, Context, Route
from .bodies import parsed
from .errors import RequestError, server_error
from .models import Served
from .openai_schema import Strict, parse


class AdapterCommand(Strict):
    """`{"action": "load", "name": N, "path": DIR}` or `{"action": "unload", "name": N}`, on the
    model `model` names (none: the server's default)."""

    action: Literal["load", "unload"]
    name: str
    path: str | None = None
    model: str | None = None


def loaded(model: CausalLM) -> list[str]:
    found = adapters_of(model)
    return sorted(found.slots) if found is not None else []


class AdaptersApi(Api):
    """Loading and unloading LoRA adapters, under /v1: one load at a time, on a thread of its own."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="mlxinfer-adapters")

    def routes(self) -> tuple[Route, ...]:
        return Route("/adapters", self.adapters, ("GET",)), Route("/adapters", self.command)

    async def adapters(self) -> dict[str, Any]:
        return self.listing()

    async def command(self, request: Request) -> dict[str, Any]:
        asked = await parsed(request, self.ctx.config.max_body, parse, AdapterCommand)
        try:
            adapter_name(asked.name)
        except MlxinferError as e:
            raise RequestError.of(e, "name") from None
        if asked.action == "load" and not asked.path:
            raise RequestError("loading an adapter needs its folder: path", "path")
        async with self.ctx.models.use(asked.model) as served:
            if asked.action == "load":
                await self.load(asked, served)
            else:
                await served.engine.call(lambda: self.unload(asked, served))
        return self.listing()

    def listing(self) -> dict[str, Any]:
        """The adapters loaded on every loaded model."""
        return {"object": "list", "data": [{"id": f"{s.name}:{n}", "object": "adapter", "name": n, "model": s.name}
                                           for s in self.ctx.models.loaded() for n in loaded(s.model)]}

    def room(self, name: str, model: CausalLM) -> None:
        """Refuse a load the loaded adapters leave no room for (on the engine thread: final there)."""
        most, names = self.ctx.config.max_adapters, loaded(model)
        if len(names) >= most:
            raise RequestError(f"{most} adapters are loaded, the most this server keeps (--max-adapters); unload one "
                               "first", "name", status=409)
        if name in names:
            raise RequestError(f"an adapter named '{name}' is already loaded; unload it or choose another name",
                               "name", status=409)

    async def load(self, command: AdapterCommand, served: Served) -> None:
        engine, model = served.engine, served.model
        await engine.call(lambda: self.room(command.name, model))  # refused before any work (and on a sharded model)
        try:
            found = await asyncio.get_running_loop().run_in_executor(self.loader, prepare_adapter, model, command.path)
        except MlxinferError as e:  # the folder's fault: a missing file, a bad field, a damaged tensor
            raise RequestError.of(e, "path") from None
        except Exception as e:  # noqa: BLE001 - a fault of ours ends this request, not the server
            raise server_error(f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from None

        def attach() -> None:
            self.room(command.name, model)  # another load may have finished meanwhile
            attach_adapter(model, command.name, found)

        await engine.call(attach)

    @staticmethod
    def unload(command: AdapterCommand, served: Served) -> None:
        """Unload an adapter no request in flight runs (on the engine thread: `EngineThread.call`)."""
        if command.name not in loaded(served.model):
            raise RequestError(f"no adapter named '{command.name}' is loaded", "name", status=404,
                               kind="not_found_error")
        if served.engine.uses_adapter(command.name):
            raise RequestError(f"adapter '{command.name}' is in use by requests in flight; unload it "
                               "when they end", "name", status=409)
        unload_adapter(served.model, command.name)
