"""The models one server serves (`Models`): every model the store lists, by name, each loaded on
its first request and unloaded when idle or when another needs the room.

A loaded model (`Served`) is its weights, its tokenizer and its own `EngineThread`: requests to
different models run at once on their own threads, and one model's requests still batch
together. Its engine's limits are therefore per model: `--max-concurrency` and `--max-queue`
(a model's batch and its waiting line: a busy model does not turn away another's clients),
`--prompt-cache-bytes` (a pool holds one model's K/V layout, so it cannot be shared; it counts
in that model's memory, see `estimate_memory`) and `--max-adapters` (adapters belong to a
model's weights). What the machine has in all is guarded across models by `Policy`: how many
are loaded at once and the memory they may hold.

API modules take their model per request: `async with models.use(body.model) as served:`
waits for a load if need be and holds the model while the block runs, so nothing unloads a
model a request is using; leaving the block starts its keep-alive countdown (Ollama's
semantics: seconds; 0 unloads it once idle, negative keeps it). A streamed reply holds its
model until the stream ends (`held_for`).

Loading runs on a thread of its own (`LOAD_THREADS`), never on the event loop or another
model's engine thread, so loaded models keep streaming meanwhile. When a load would pass
`max_loaded` models or the memory budget, the least recently used idle models are unloaded
first; a model in use is never unloaded: the load waits until enough models are idle (so a
client is served late rather than refused, as Ollama's scheduler queues), and a model too big
for the budget even alone is refused at once (400, naming the sizes and `--memory-budget`).
The wait is bounded: a client that hangs up stops waiting (`WatchesClients` tells `use` when),
and one still waiting after `Policy.load_wait` seconds is answered 503 with Retry-After,
naming the models in use.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from fastapi.responses import Response, StreamingResponse

from ..base.errors import MlxinferError
from ..engine.options import RequestOptions
from ..models.layers import CausalLM
from ..text.tokenizer import Tokenizer
from .engine_thread import EngineThread
from .errors import RequestError, server_error
from .metrics import Metrics

LOAD_THREADS = 1  # one load at a time: two at once would peak at both models' loading memory
KEEP_ALIVE_SECONDS = 300.0  # `serve --keep-alive`'s default, as Ollama's
MAX_LOADED = 3  # `serve --max-loaded-models`'s default, as Ollama's (3 per GPU)
BUDGET_FRACTION = 0.75  # of physical memory, where no wired limit says otherwise
KV_TOKENS = 4096  # K/V tokens a model is counted at without --max-kv-size (Ollama's default num_ctx)
LOAD_WAIT_SECONDS = 300.0  # a request waits this long for room to load its model (Ollama's load timeout)
RETRY_AFTER_SECONDS = 5  # what a request refused for want of room is told to wait before asking again


@dataclass(frozen=True)
class Served:
    """One loaded model: its engine (a thread of its own), weights and tokenizer, the default
    `max_tokens` of its requests (its context), where it came from, the memory it is counted at
    (`estimate_memory`), when it loaded and when it unloads if unused (None: never)."""

    name: str
    engine: EngineThread
    model: CausalLM
    tokenizer: Tokenizer
    max_tokens: int
    path: Path | str
    memory: int
    loaded_at: float
    expires_at: float | None = None

    def options(self, options: RequestOptions, model: str | None) -> RequestOptions:
        """A request's `options` with this model's defaults: `max_tokens` when it gives none, and
        the LoRA adapter its `model` names as `NAME:ADAPTER` (none for the model itself)."""
        prefix = f"{self.name}:"
        adapter = model[len(prefix):] if model is not None and model.startswith(prefix) else None
        return replace(options, max_tokens=self.max_tokens if options.max_tokens is None else options.max_tokens,
                       adapter=adapter)


@dataclass(frozen=True)
class ModelEntry:
    """One servable model, loaded or not, as listings show it (`size`: bytes on disk;
    `modified_at`: epoch seconds; `served`: the loaded model, None while it is not)."""

    name: str
    path: Path | str
    size: int
    family: str
    parameters: int
    quantization: str
    modified_at: float
    served: Served | None = None


@dataclass(frozen=True)
class Policy:
    """What the models may hold together: at most `max_loaded` loaded at once and
    `memory_budget` bytes (their `estimate_memory` summed); an idle model stays loaded for
    `keep_alive` seconds after its last request (0: unloaded once idle; negative: kept); a
    request waits at most `load_wait` seconds for room to load its model."""

    keep_alive: float = KEEP_ALIVE_SECONDS
    max_loaded: int = MAX_LOADED
    memory_budget: int = 0  # 0: `default_budget()`
    load_wait: float = LOAD_WAIT_SECONDS

    def budget(self) -> int:
        return self.memory_budget or default_budget()


def default_budget() -> int:
    """What loaded models may hold by default: on Metal the wired limit MLX recommends (what the
    GPU may keep resident); elsewhere BUDGET_FRACTION of physical memory, leaving the rest to
    the system and the server's own work."""
    if mx.metal.is_available():
        return int(mx.metal.device_info()["max_recommended_working_set_size"])
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * BUDGET_FRACTION)


def estimate_memory(path: Path, *, max_concurrency: int, max_kv_size: int | None = None, kv_bits: int | None = None,
                    prompt_cache_bytes: int = 0) -> int:
    """The bytes a model is counted at before it loads: its weight files as stored (what loading
    maps), plus the prompt cache's limit (a bound the pool keeps), plus K/V at 2 x layers x K/V
    heads x head size values a token, 16 bits each (or `kv_bits`): with `max_kv_size` (each
    sequence's rotating cache) the bound, `max_concurrency` sequences of it; without, K/V grows
    only as tokens come, so KV_TOKENS in all (one conversation of Ollama's default context,
    capped by the model's): a working estimate, not a bound, that lets a model whose every
    sequence could fill its context still be served, as a one-model server is. Sliding-window
    and recurrent layers hold less: this overcounts them."""
    from ..loading.checkpoint import read_config, weight_files

    config = read_config(path)
    text = config.get("text_config") or config
    weights = sum(f.stat().st_size for f in weight_files(path))
    layers = int(text.get("num_hidden_layers") or 0)
    heads = int(text.get("num_attention_heads") or 1)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or (int(text.get("hidden_size") or 0) // heads))
    context = int(text.get("max_position_embeddings") or KV_TOKENS)
    tokens = max_concurrency * min(max_kv_size, context) if max_kv_size else min(KV_TOKENS, context)
    per_token = 2 * layers * kv_heads * head_dim * (kv_bits or 16) // 8
    return weights + tokens * per_token + prompt_cache_bytes


@dataclass(frozen=True)
class Loaded:
    """What opening a model gives (`Opener`): its engine, weights and tokenizer."""

    engine: EngineThread
    model: CausalLM
    tokenizer: Tokenizer


# Returns once the client of the request being served hangs up (`WatchesClients`); None outside a request.
_hung_up: contextvars.ContextVar[Callable[[], Awaitable[Any]] | None] = contextvars.ContextVar(
    "mlxinfer_hung_up", default=None)


class WatchesClients:
    """ASGI middleware (innermost, next to the routes): lets `Models.use` learn that the client
    of the request it is loading a model for has hung up, so that it stops waiting. The routes
    read their whole body before they name a model, so the next message the connection gives is
    the disconnect; it is read only while the request waits for its model, never beside a reply."""

    def __init__(self, app: Callable[..., Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def hung_up() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        token = _hung_up.set(hung_up)
        try:
            await self.app(scope, receive, send)
        finally:
            _hung_up.reset(token)


Opener = Callable[[ModelEntry, Metrics], Loaded]  # runs on the load thread; feeds the server's Metrics
Scan = Callable[[], Sequence[ModelEntry]]  # every servable model, unloaded (the store's listing)
Estimate = Callable[[ModelEntry], int]


@dataclass(eq=False)
class _Slot:
    """A servable model's state in the registry (on the event loop only)."""

    entry: ModelEntry
    served: Served | None = None
    users: int = 0  # requests holding it or waiting for its load
    loading: asyncio.Future | None = None
    unloading: asyncio.Future | None = None
    doomed: bool = False  # asked to unload while in use: unloaded once idle, whatever keep-alive its requests ask
    gone: bool = False  # no longer in the store (`refresh`): forgotten once unloaded
    pinned: bool = False  # loaded before the server started and never unloaded (a model sharded across ranks)
    last_used: float = 0.0
    timer: asyncio.TimerHandle | None = None

    @property
    def resident(self) -> bool:
        """Holds (or is about to hold) memory: loaded, loading or unloading."""
        return self.served is not None or self.loading is not None or self.unloading is not None

    @property
    def idle(self) -> bool:
        """Loaded, and may be unloaded now."""
        return self.served is not None and self.unloading is None and self.users == 0 and not self.pinned


def _timestamp(path: Path | str) -> float:
    try:
        return Path(path).stat().st_mtime
    except OSError:
        return 0.0


class Models:
    """The registry of servable models; every method runs on the server's event loop but
    `preload` and `shutdown`/`stop`, which run before and after it. One model is the default
    (`default`): the one a request naming none gets. When only one model is served, every name
    means it (clients send their own defaults, "gpt-4o" and the like); with several, a name
    not served is a 404 naming those that are. `NAME:ADAPTER` names a LoRA adapter loaded on
    model NAME (`Served.options`)."""

    def __init__(self, scan: Scan, opener: Opener, estimate: Estimate, policy: Policy = Policy(),
                 default: str | None = None, metrics: Metrics | None = None, limits: dict[str, int] | None = None):
        self._scan, self._opener, self._estimate, self.policy = scan, opener, estimate, policy
        self.limits = limits or {}  # each model's engine limits, as /health reports them
        self.metrics = metrics or Metrics()  # every model's engine feeds this one: /metrics sums them
        self._slots: dict[str, _Slot] = {}
        self._loader = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="mlxinfer-load")
        self._changed: asyncio.Condition | None = None  # made on the event loop, at first use
        self._wanted_default = default
        self.default: str | None = None
        self.refresh()

    @classmethod
    def of(cls, served: Served, metrics: Metrics | None = None) -> Models:
        """A registry of one model already loaded, never unloaded: a model sharded across ranks
        (whose ranks all loaded it), or one a program built itself around its own engine."""
        entry = ModelEntry(served.name, served.path, 0, type(served.model).__name__, 0, "?",
                           _timestamp(served.path))
        limits = {"max_concurrency": served.engine.max_batch, "max_queued": served.engine.max_queued}
        models = cls(lambda: [entry], _unopenable, lambda _: served.memory, Policy(keep_alive=-1), served.name,
                     metrics or served.engine.metrics, limits)
        slot = models._slots[served.name]
        slot.served, slot.pinned = served, True
        return models

    # --- what is served ---

    def refresh(self) -> None:
        """Rescan the store (after a pull, delete or copy): new models become servable, and
        models no longer listed stop being servable once they are unloaded (a loaded one keeps
        its requests until it is)."""
        found = {e.name: e for e in self._scan()}
        for name, entry in found.items():
            if name in self._slots:
                self._slots[name].entry, self._slots[name].gone = entry, False
            else:
                self._slots[name] = _Slot(entry)
        for name, slot in list(self._slots.items()):
            slot.gone = name not in found and not slot.pinned
            if slot.gone and not slot.resident:
                del self._slots[name]
        wanted = self._wanted_default
        self.default = wanted if wanted in self._slots else next(iter(self._slots)) if len(self._slots) == 1 else None

    def listing(self) -> list[ModelEntry]:
        """Every servable model, loaded or not (`served`), in the order the store lists them."""
        return [replace(s.entry, served=s.served) for s in self._slots.values()]

    def loaded(self) -> list[Served]:
        return [s.served for s in self._slots.values() if s.served is not None]

    def resolve(self, name: str | None) -> str:
        """The served model a request's `model` names (`NAME` or `NAME:ADAPTER`)."""
        if name is not None and name in self._slots:
            return name
        if name is not None and name.partition(":")[0] in self._slots and ":" in name:
            return name.partition(":")[0]
        if self.default is not None and (name is None or len(self._slots) == 1):
            return self.default
        names = ", ".join(self._slots) or "none"
        if name is None:
            raise RequestError(f"name a model: this server serves {names[:1000]} (GET /v1/models lists them)",
                               "model")
        raise RequestError(f"the model '{name[:200]}' does not exist; this server serves {names[:1000]} (see GET "
                           "/v1/models, or `mlxinfer models` on the server's machine)", "model", status=404,
                           kind="not_found_error", code="model_not_found")

    # --- holding a model ---

    @asynccontextmanager
    async def use(self, name: str | None, keep_alive: float | None = None) -> AsyncIterator[Served]:
        """The model `name` names, loaded (the caller waits for its load), held until the block
        ends: it is never unloaded meanwhile. On leaving, its keep-alive countdown starts over
        at `keep_alive` seconds (None: the server's --keep-alive; 0: unload once idle; negative:
        never)."""
        slot = self._slots[self.resolve(name)]
        slot.users += 1
        try:
            served = await self._watched(slot)
        except BaseException:
            self._release(slot, keep_alive)
            raise
        try:
            yield served
        finally:
            self._release(slot, keep_alive)

    async def held_for(self, name: str | None, answer: Callable[[Served], Awaitable[Response]],
                       keep_alive: float | None = None) -> Response:
        """`answer(served)` with the model held (`use`); a streamed response holds it until its
        stream ends or its client leaves, not just until the route returns."""
        stack = AsyncExitStack()
        served = await stack.enter_async_context(self.use(name, keep_alive))
        try:
            response = await answer(served)
        except BaseException:
            await stack.aclose()
            raise
        if isinstance(response, StreamingResponse):
            response.body_iterator = _released(response.body_iterator, stack)
        else:
            await stack.aclose()
        return response

    async def unload(self, name: str) -> None:
        """Unload model `name` now if it is idle; one in use unloads as its requests end."""
        slot = self._slots[self.resolve(name)]
        if slot.pinned:
            return
        if slot.users:
            slot.doomed = True
            return
        if slot.loading is not None:
            await asyncio.shield(slot.loading)
        if slot.idle:  # marked as unloading first: a request arriving meanwhile waits and loads it again
            slot.unloading = asyncio.ensure_future(self._unload(slot))
        if slot.unloading is not None:
            await asyncio.shield(slot.unloading)

    # --- inside ---

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        async with self._condition():
            self._condition().notify_all()

    async def _watched(self, slot: _Slot) -> Served:
        """`_loaded`, given up (499) when the request's client hangs up first (`WatchesClients`):
        a load already started goes on, for the next request."""
        hung_up = _hung_up.get()
        if hung_up is None or (slot.served is not None and slot.unloading is None):
            return await self._loaded(slot)
        loading, gone = asyncio.ensure_future(self._loaded(slot)), asyncio.ensure_future(hung_up())
        try:
            await asyncio.wait({loading, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not loading.done():
                loading.cancel()
        if loading.cancelled():
            raise RequestError(f"the client hung up while '{slot.entry.name}' waited to load", "model", status=499)
        return loading.result()

    async def _loaded(self, slot: _Slot) -> Served:
        """`slot`'s model once loaded (its load started here, or by another request); 503 when
        no room is made for it within `Policy.load_wait` seconds."""
        deadline: float | None = None
        while True:
            if slot.served is not None and slot.unloading is None:
                return slot.served
            if slot.loading is not None or slot.unloading is not None:
                await asyncio.shield(slot.loading or slot.unloading)
                continue
            if self._make_room(slot):
                slot.loading = asyncio.ensure_future(self._load(slot))
                continue
            clock = asyncio.get_running_loop().time
            deadline = deadline if deadline is not None else clock() + self.policy.load_wait
            async with self._condition():  # no room until a model in use goes idle, or an unload ends
                if not self._fits(slot):
                    try:
                        await asyncio.wait_for(self._condition().wait(), max(deadline - clock(), 0))
                    except asyncio.TimeoutError:
                        raise self._no_room(slot) from None

    def _no_room(self, slot: _Slot) -> RequestError:
        """The refusal of a request that waited `Policy.load_wait` seconds for room to load its model."""
        busy = ", ".join(f"'{n}'" for n, s in self._slots.items() if s is not slot and s.resident and s.users) or "none"
        return RequestError(f"the model '{slot.entry.name}' could not be loaded within {self.policy.load_wait:g} s: "
                            f"the models in use ({busy[:1000]}) leave no room (at most {self.policy.max_loaded} "
                            f"loaded, {_size(self.policy.budget())} in all); retry later, or restart the server with "
                            "a larger --max-loaded-models or --memory-budget", "model", status=503, kind="server_busy",
                            headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    def _fits(self, slot: _Slot, leaving: Sequence[_Slot] = ()) -> bool:
        """Whether `slot`'s model fits beside the resident ones (but `leaving`)."""
        resident = [s for s in self._slots.values() if s.resident and s is not slot and s not in leaving]
        used = sum(self._memory(s) for s in resident)
        return len(resident) < self.policy.max_loaded and used + self._estimate(slot.entry) <= self.policy.budget()

    def _memory(self, slot: _Slot) -> int:
        return slot.served.memory if slot.served is not None else self._estimate(slot.entry)

    def _make_room(self, slot: _Slot) -> bool:
        """Start unloading the least recently used idle models until `slot`'s fits; True when it
        fits now (unloads in progress still count: the caller waits for them). A model too big
        for the budget alone is refused."""
        need, budget = self._estimate(slot.entry), self.policy.budget()
        if need > budget:
            raise RequestError(f"the model '{slot.entry.name}' needs about {_size(need)} (weights, K/V and prompt "
                               f"cache) but the server's memory budget is {_size(budget)}; restart it with a larger "
                               "--memory-budget, or a smaller --max-concurrency, --max-kv-size or --prompt-cache-bytes",
                               "model", status=400)
        leaving = [s for s in self._slots.values() if s.unloading is not None]
        for idle in sorted((s for s in self._slots.values() if s.idle and s is not slot), key=lambda s: s.last_used):
            if self._fits(slot, leaving):
                break
            idle.unloading = asyncio.ensure_future(self._unload(idle))
            leaving.append(idle)
        return self._fits(slot)

    async def _load(self, slot: _Slot) -> None:
        """Load `slot`'s model on the load thread; a failure is every waiter's error."""
        entry = slot.entry
        memory = self._estimate(entry)
        try:
            loaded = await asyncio.get_running_loop().run_in_executor(self._loader, self._opener, entry, self.metrics)
            slot.served = Served(entry.name, loaded.engine, loaded.model, loaded.tokenizer,
                                 loaded.model.config.max_position_embeddings, entry.path, memory, time.time())
            slot.last_used = time.time()
            self._set_expiry(slot, self.policy.keep_alive)  # its requests' release restarts it (all may have left)
        except MlxinferError as e:  # the model's folder: a damaged file, an unsupported family
            raise RequestError(f"the model '{entry.name}' cannot be loaded: {e}", "model", status=400) from None
        except Exception as e:  # noqa: BLE001 - a fault of ours ends this request, not the server
            raise server_error(f"loading '{entry.name}': {type(e).__name__}: {' '.join(str(e).split())}") from None
        finally:
            slot.loading = None
            await self._notify()

    async def _unload(self, slot: _Slot) -> None:
        """Stop `slot`'s engine (off the event loop: it joins its thread) and free its memory."""
        served = slot.served
        if slot.timer is not None:
            slot.timer.cancel()
            slot.timer = None
        try:
            if served is not None:
                await asyncio.to_thread(served.engine.stop)
        finally:
            slot.served, slot.doomed = None, False
            del served
            await asyncio.to_thread(_free)
            slot.unloading = None  # only now: until its memory is given back, it still counts
            if slot.gone and not slot.users:  # deleted from the store meanwhile
                self._slots.pop(slot.entry.name, None)
            await self._notify()

    def _release(self, slot: _Slot, keep_alive: float | None) -> None:
        slot.users -= 1
        slot.last_used = time.time()
        if slot.served is None or slot.pinned:
            asyncio.ensure_future(self._notify())
            return
        keep = self.policy.keep_alive if keep_alive is None else keep_alive  # the last request's counts, as Ollama's
        self._set_expiry(slot, 0 if slot.doomed else keep)  # a model busy when it expires is left to its next
        asyncio.ensure_future(self._notify())  # a load waiting for room may take it now

    def _set_expiry(self, slot: _Slot, keep_alive: float) -> None:
        """Start `slot`'s countdown over: unloaded `keep_alive` seconds after it was last used."""
        if slot.timer is not None:
            slot.timer.cancel()
            slot.timer = None
        expires = None if keep_alive < 0 else slot.last_used + keep_alive
        if slot.served is not None:
            slot.served = replace(slot.served, expires_at=expires)
        if expires is not None:
            slot.timer = asyncio.get_running_loop().call_later(max(keep_alive, 0), self._expire, slot)

    def _expire(self, slot: _Slot) -> None:
        slot.timer = None
        if slot.idle:
            slot.unloading = asyncio.ensure_future(self._unload(slot))

    # --- before and after serving ---

    def preload(self, name: str) -> Served:
        """Load model `name` before the server starts (so a bad model fails `serve` at once); its
        keep-alive countdown starts when the server does (`start`)."""
        slot = self._slots[self.resolve(name)]
        entry = slot.entry
        loaded = self._opener(entry, self.metrics)
        slot.served = Served(entry.name, loaded.engine, loaded.model, loaded.tokenizer,
                             loaded.model.config.max_position_embeddings, entry.path, self._estimate(entry), time.time())
        slot.last_used = time.time()
        return slot.served

    def start(self) -> None:
        """As the server starts, on its event loop: the keep-alive countdown of each model loaded
        before (`preload`) starts now, as if it had just been used, so a default model nobody asks
        for unloads after --keep-alive as any other (a model loaded for good, `of`, stays)."""
        for slot in self._slots.values():
            if slot.served is not None and not slot.pinned and slot.timer is None:
                slot.last_used = time.time()
                self._set_expiry(slot, self.policy.keep_alive)

    def shutdown(self) -> None:
        """Refuse new requests on every loaded model and end those in flight (safe in a signal handler)."""
        for served in self.loaded():
            served.engine.shutdown()

    def stop(self) -> None:
        """Stop every engine and the load thread."""
        for served in self.loaded():
            served.engine.stop()
        self._loader.shutdown(wait=False, cancel_futures=True)

    def health(self) -> dict[str, Any]:
        """The loaded models' engine snapshots summed (what /health and /metrics report), each on its
        own (`models`), the requests waiting for a model to load (`waiting`, by model), and the
        models being unloaded (`unloading`: their memory is not given back yet)."""
        each = {s.name: {**s.engine.health, "preparing": s.engine.preparing, "memory_estimate": s.memory,
                         "expires_at": s.expires_at} for s in self.loaded()}
        total: dict[str, Any] = {"active": 0, "queued": 0, "served": 0, "cache_bytes": 0, "preparing": 0}
        pools = [h["prompt_cache"] for h in each.values() if h.get("prompt_cache")]
        for h in each.values():
            for key in total:
                total[key] += h.get(key, 0)
        total["prompt_cache"] = {k: sum(p.get(k, 0) for p in pools) for k in pools[0]} if pools else None
        total["memory"] = {"mlx_active_bytes": mx.get_active_memory(), "mlx_peak_bytes": mx.get_peak_memory()}
        waiting = {n: s.users for n, s in self._slots.items() if s.users and (s.served is None or s.unloading)}
        unloading = [n for n, s in self._slots.items() if s.unloading is not None]
        return {**total, "models": each, "waiting": waiting, "unloading": unloading}


def _unopenable(entry: ModelEntry, metrics: Metrics) -> Loaded:
    raise MlxinferError(f"the model '{entry.name}' was loaded before the server started and cannot be reloaded")


def _free() -> None:
    """Once an unloaded model's last reference is gone: collect it, and let MLX return its buffers."""
    gc.collect()
    mx.clear_cache()


async def _released(body: AsyncIterator[Any], stack: AsyncExitStack) -> AsyncIterator[Any]:
    """A streamed body that lets go of its model (`stack`) when it ends or its client leaves."""
    try:
        async for part in body:
            yield part
    finally:
        await stack.aclose()


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
