"""The engine behind `mlxinfer serve`, on a thread of its own.

The engine (`batch.BatchGenerator`) runs on one dedicated thread, so MLX work never
blocks the event loop: requests reach it through a queue of commands (submit, cancel,
a call to run between steps), and each request's chunks come back through its own
asyncio queue. Concurrent requests share decode steps; a client that disconnects cancels
its sequences at once. Requests beyond the engine's slots wait in its queue, which is
bounded: past it, a 503 with Retry-After. A request for n choices is n sequences and takes
n places. One request's failure ends that request (500 or an error event), never the server.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, TypeVar

import mlx.core as mx

from ..engine.batch import BatchGenerator
from ..engine.prepared import Prepared
from ..base.errors import MlxinferError
from ..engine.text_stream import Chunk
from ..engine.replica import Replica
from ..engine.options import Prompt, RequestOptions
from ..engine.request import Request
from ..base.slices import Slices
from ..text.images import downloads, has_images
from .errors import RequestError, server_error
from .metrics import Metrics

RETRY_AFTER_SECONDS = 1
# Threads that prepare requests (render, tokenize, compile grammars) beside the engine thread.
PREPARE_THREADS = 2
# Threads that make the requests that download image URLs (`serve --allow-image-urls`), each for
# up to --image-url-timeout: their own, so a slow sender never holds a thread another request
# needs, and this many at once (past that a 503: the clients retry).
DOWNLOAD_THREADS = 4
T = TypeVar("T")


@dataclass(eq=False)
class _Job:
    """One request inside the engine thread: what to run and where its chunks go."""

    request: Request
    loop: asyncio.AbstractEventLoop
    group: int | None = None  # the client request it is part of (`BatchGenerator.new_group`); None: its own
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    prepared: Prepared | None = None
    running: set[int] = field(default_factory=set)  # engine uids of its choices that have not ended
    failed: bool = False  # one choice failed: the request is over, the rest are being cancelled
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    @property
    def places(self) -> int:
        """The places it takes: one per choice."""
        return self.request.options.n


@dataclass(eq=False)
class _Work:
    """Model work other than a generation, run on the engine thread a slice at a time between
    engine steps; `done` gets its result (a cancelled `done`: its caller left, the work stops)."""

    slices: Slices
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop


class EngineThread:
    """Runs a BatchGenerator on its own thread; `reserve`, `prepare`, `submit` and `cancel`
    are safe from any thread.

    A request first takes a place (`reserve`: at most `max_batch + max_queued` requests are
    in flight, past that a 503), is prepared on a small pool of other threads (`prepare`:
    rendering, tokenizing and compiling its grammar grow with the request, and must not
    stall the streams being decoded), then joins the engine (`submit`). It gets its chunks,
    then `None`; a refused request gets a RequestError instead. Its place is given back when
    the engine ends it, so a request whose client vanished still frees its place when it
    stops. `health` is a snapshot the engine thread refreshes before and after every step,
    so the event loop never touches the engine. For a model sharded across ranks the engine is
    a `Replica`, whose rounds the other ranks follow. A request whose images are downloaded is
    made on threads of its own (`download`): slow image senders never hold the shared workers."""

    def __init__(self, engine: BatchGenerator, max_queued: int = 32, metrics: Metrics | None = None):
        self._engine, self.max_queued = engine, max_queued
        self.served = 0
        # fed here as sequences end, and by the server as responses end (one for every model's engine)
        self.metrics = metrics or Metrics()
        self.health: dict[str, Any] = {}
        self._in_flight = 0
        self.preparing = 0
        self._preparer = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="mlxinfer-prepare")
        self._downloader = ThreadPoolExecutor(DOWNLOAD_THREADS, thread_name_prefix="mlxinfer-download")
        self.downloading = 0  # requests on the download threads
        self._lock = threading.Lock()
        self._commands: queue.Queue = queue.Queue()
        self._requests: dict[int, _Job] = {}  # engine uid -> request
        self._works: deque[_Work] = deque()  # model work other than generations, a slice at a time
        self._stop = threading.Event()
        self._snapshot()
        self._thread = threading.Thread(target=self._run, name="mlxinfer-engine", daemon=True)
        self._thread.start()

    @property
    def max_batch(self) -> int:
        """Sequences the engine runs at once (`serve --max-concurrency`)."""
        return self._engine.max_batch

    @property
    def places(self) -> int:
        """Places in all: sequences running and queued (`reserve`)."""
        return self._engine.max_batch + self.max_queued

    @property
    def prefill_step(self) -> int:
        """Tokens of a prompt the engine runs at a time: the slice other model work takes (`run_slices`)."""
        return self._engine.prefill_step

    def uses_adapter(self, name: str) -> bool:
        """Whether a request in the engine runs adapter `name` (on the engine thread: `call`)."""
        return self._engine.uses_adapter(name)

    async def request(self, prompt: Prompt, options: RequestOptions) -> Request:
        """The typed `Request` for `prompt`. Making one reads its images (base64, headers), so a
        prompt with images is made on a worker thread: the event loop keeps answering every other
        request. One that downloads them (`serve --allow-image-urls`, for up to --image-url-timeout)
        is made on the download threads (`download`), never on the workers that other requests'
        images, /tokenize and token counts run on."""
        keywords = options.keywords(self._engine.tokenizer)
        if not has_images(prompt):
            return self._engine.request(prompt, **keywords)
        make = functools.partial(self._engine.request, prompt, **keywords)
        if downloads(prompt, self._engine.image_sources):
            return await self.download(make)
        return await asyncio.to_thread(make)

    async def count(self, request: Request) -> int:
        """How many tokens `request`'s prompt is as the engine renders it (`BatchGenerator.count`),
        counted on a worker thread: it grows with the prompt."""
        return await asyncio.to_thread(self._engine.count, request)

    async def chunks(self, request: Request, group: int | None = None) -> AsyncIterator[Chunk]:
        """A request's chunks as they come: its places taken, the request prepared, then its engine
        chunks (those of n choices interleaved, each with its `index`). Leaving early (a client
        gone) gives the places back or cancels every choice. The engine requests of one client
        request (its prompts) share a `group` (`new_group`): slots are shared fairly between groups."""
        job = _Job(request, asyncio.get_running_loop(), group)
        self.reserve(job.places)
        try:
            await self.prepare(job)
        except BaseException:
            self.release(job.places)
            raise
        self.submit(job)
        finished = False
        try:
            while True:
                item = await job.chunks.get()
                if item is None:
                    finished = True
                    return
                if isinstance(item, RequestError):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:
                self.cancel(job)

    def reserve(self, places: int = 1) -> None:
        """Take `places` places (one per choice of a request), or refuse: 400 when there are
        never that many, 503 when they are taken now."""
        limit = self.places
        if places > limit:
            raise RequestError(f"n={places} choices need {places} places, but this server runs "
                               f"{self._engine.max_batch} sequences and queues {self.max_queued} (--max-concurrency, "
                               f"--max-queue); ask for at most n={limit}", "n")
        with self._lock:
            if self._stop.is_set():
                raise RequestError("the server is shutting down", status=503, kind="server_busy")
            if self._in_flight + places > limit:
                raise RequestError(f"the server is busy ({limit} requests running or queued); retry shortly",
                                   status=503, kind="server_busy", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
            self._in_flight += places

    def release(self, places: int = 1) -> None:
        """Give back places: a request's that never reached the engine, or a choice's that ended."""
        with self._lock:
            self._in_flight -= places

    async def prepare(self, request: _Job) -> None:
        """Prepare a reserved request off the engine thread; a bad one is a 400."""
        with self._lock:
            self.preparing += 1
        try:
            request.prepared = await asyncio.get_running_loop().run_in_executor(self._preparer, self._engine.prepare,
                                                                                request.request)
        except MlxinferError as e:  # the request's own fault (options, prompt, context, grammar)
            raise RequestError.of(e) from None
        except Exception as e:  # noqa: BLE001 - a fault of ours ends this request, not the server
            raise server_error(f"{type(e).__name__}: {' '.join(str(e).split())}") from None
        finally:
            with self._lock:
                self.preparing -= 1

    def new_group(self) -> int:
        """A name for the engine requests of one client request (`BatchGenerator.new_group`)."""
        return self._engine.new_group()

    async def download(self, make: Callable[[], T]) -> T:
        """`make()` (a typed request whose images download) on a download thread, or a 503 when
        all DOWNLOAD_THREADS are taken: a download ends by its own deadline, so waiting for one
        would only hold the client's connection as long."""
        with self._lock:
            if self.downloading >= DOWNLOAD_THREADS:
                raise RequestError(f"the server is downloading images for {DOWNLOAD_THREADS} requests; retry shortly, "
                                   "or send the images inline as data: URLs", status=503, kind="server_busy",
                                   headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
            self.downloading += 1
        done = self._downloader.submit(make)
        done.add_done_callback(self._downloaded)  # when the thread is free, even if the client left before
        return await asyncio.wrap_future(done)

    def _downloaded(self, _: object) -> None:
        with self._lock:
            self.downloading -= 1

    def submit(self, request: _Job) -> None:
        """Hand a prepared request to the engine."""
        self._commands.put(("submit", request))

    async def call(self, fn: Callable[[], T]) -> T:
        """`fn()` run on the engine thread between steps: one short piece of MLX work that is not
        a generation (it must not run beside a step on another thread)."""

        def once() -> Slices:
            return fn()
            yield  # a generator of one slice

        return await self.run_slices(once())

    async def run_slices(self, slices: Slices[T]) -> T:
        """Run model work that is not a generation (inspection, embeddings) on the engine thread,
        one slice (at most one prefill chunk of work) at a time, taking turns with the prefill of
        the engine's own requests, so no stream being decoded waits longer than one chunk for it.
        Its result, or the RequestError it ended with; leaving (a cancelled await) stops it."""
        if isinstance(self._engine, Replica):  # the other ranks run engine rounds only: they would not join this
            slices.close()
            raise RequestError("this endpoint is not available while the model is sharded across ranks")
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._commands.put(("work", _Work(slices, done, loop)))
        return await done

    def cancel(self, request: _Job) -> None:
        self._commands.put(("cancel", request))

    def shutdown(self) -> None:
        """Refuse new requests and end those in flight now, each with its last chunk (the
        text it has); returns at once (safe in a signal handler)."""
        self._commands.put(("shutdown", None))

    def stop(self, timeout: float = 10.0) -> None:
        self.shutdown()
        self._thread.join(timeout)
        self._preparer.shutdown(wait=False, cancel_futures=True)
        self._downloader.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _deliver(request: _Job, item: Chunk | RequestError | None) -> None:
        try:
            request.loop.call_soon_threadsafe(request.chunks.put_nowait, item)
        except RuntimeError:  # the event loop has closed (the server stopped): nobody is listening
            pass

    def _refuse(self, request: _Job, error: RequestError) -> None:
        """End a request that never reached the engine with `error`, giving back its places."""
        self._deliver(request, error)
        self._deliver(request, None)
        self.release(request.places)

    def _fail(self, request: _Job, error: RequestError) -> None:
        """One of the request's choices failed: it gets `error`, and its other choices are cancelled."""
        if not request.failed:
            request.failed = True
            self._deliver(request, error)
        for uid in request.running:
            self._cancel(uid)

    def _ended(self, uid: int) -> None:
        """A choice's sequence ended: its place is free; the request ends with its last choice."""
        request = self._requests.pop(uid)
        request.running.discard(uid)
        self.release()
        if not request.running:
            self._deliver(request, None)
            self.served += 1

    def _handle(self, command: str, request: _Job | None) -> None:
        if command == "submit":
            if self._stop.is_set():  # prepared while the server began to stop
                self._refuse(request, RequestError("the server is shutting down", status=503, kind="server_busy"))
                return
            try:
                uids = self._engine.enqueue_choices(request.prepared, request.group)
            except Exception as e:  # noqa: BLE001 - a fault of ours ends this request, not the server
                self._refuse(request, server_error(f"{type(e).__name__}: {e}"))
                return
            request.running.update(uids)
            self._requests.update(dict.fromkeys(uids, request))
        elif command == "work":
            self._works.append(request)
        elif command == "cancel":
            for uid in request.running:
                self._cancel(uid)
        elif command == "shutdown":
            with self._lock:
                self._stop.set()
            for uid in self._requests:
                self._cancel(uid)

    def _slice(self) -> None:
        """Run one slice of the oldest work, which then goes to the back of the line."""
        work = self._works.popleft()
        if work.done.cancelled():  # its caller left
            work.slices.close()
            return
        try:
            next(work.slices)
            self._works.append(work)
            return
        except StopIteration as end:
            self._settle(work, end.value)
        except RequestError as e:  # refused as the caller says
            self._settle(work, error=e)
        except MlxinferError as e:  # the request's own fault
            self._settle(work, error=RequestError.of(e))
        except Exception as e:  # noqa: BLE001 - a fault of ours ends this request, not the server
            self._settle(work, error=server_error(f"{type(e).__name__}: {' '.join(str(e).split())}"))

    @staticmethod
    def _settle(work: _Work, result: object = None, error: RequestError | None = None) -> None:
        def settle() -> None:
            if not work.done.cancelled():
                work.done.set_exception(error) if error is not None else work.done.set_result(result)

        try:
            work.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the event loop has closed: nobody is waiting
            pass

    def _cancel(self, uid: int) -> None:
        self._engine.cancel(uid)

    def _run(self) -> None:
        engine_had_turn = True  # with work waiting, the engine's prefill and the work's slices take turns
        while not self._stop.is_set():
            block = not self._engine.active and not self._works
            try:
                while True:
                    self._handle(*self._commands.get(block=block))
                    block = False
            except queue.Empty:
                pass
            self._snapshot()  # a request that just arrived shows as active while its prefill runs
            work_turn = bool(self._works) and (engine_had_turn or not self._engine.active)
            if self._engine.active:  # on the work's turn the step only decodes: the slice is its chunk of work
                self._step(prefill=not work_turn)
            if work_turn:
                self._slice()
            engine_had_turn = not work_turn
            self._snapshot()
        self._engine.close()
        for work in self._works:  # stopping: work that is left is refused
            work.slices.close()
            self._settle(work, error=RequestError("the server is shutting down", status=503, kind="server_busy"))
        self._works.clear()
        for request in set(self._requests.values()):  # stopping: end the streams that are left
            self._deliver(request, None)
        self._requests.clear()

    def _step(self, prefill: bool = True) -> None:
        try:
            produced = self._engine.step() if prefill else self._engine.step(prefill=False)
        except Exception as e:  # noqa: BLE001 - the engine ends a failed sequence itself; this is the last guard
            for uid in list(self._requests):
                request = self._requests[uid]
                self._fail(request, server_error(f"{type(e).__name__}: {e}"))
                self._ended(uid)
                self.metrics.sequence_ended("error", None, request.arrived, request.first_token_at,
                                            time.perf_counter())
            return
        now = time.perf_counter()
        for uid, chunk in produced:
            request = self._requests.get(uid)
            if request is None:
                continue
            if request.first_token_at is None and chunk.token is not None:
                request.first_token_at = now
            if chunk.finish_reason == "error":
                self._fail(request, server_error(chunk.error or "generation failed"))
            elif not request.failed:
                self._deliver(request, chunk)
            if chunk.finish_reason:
                self._ended(uid)
                self.metrics.sequence_ended(chunk.finish_reason, chunk.stats, request.arrived, request.first_token_at,
                                            now, chunk.index)

    def _snapshot(self) -> None:
        e = self._engine
        running = min(e.active, e.max_batch)  # a step admits every waiting sequence that has a slot first
        self.health = {
            "active": running, "queued": e.active - running + self._commands.qsize(),
            "served": self.served,
            "cache_bytes": e.cache_bytes,
            "prompt_cache": dict(e.pool.stats.__dict__) if e.pool is not None else None,
            "memory": {"mlx_active_bytes": mx.get_active_memory(), "mlx_peak_bytes": mx.get_peak_memory()},
        }
