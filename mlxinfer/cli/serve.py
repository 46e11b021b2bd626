"""What `mlxinfer serve` serves: the models its `--model` options name (`NAME=PATH` aliases
among them), or with none every model `mlxinfer models` lists, by the name it shows; and how
one of them is opened on the server's load thread (`Opening`).

The first `--model` is the default model (that of a request naming none) and is loaded before
the server listens, so a bad one fails `serve` at once; the others load on their first request.
With no `--model`, the default is the demo model when the store has it, or the only model
there is; a machine with no model at all gets the demo model, fetched as `serve` always did.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..base.cachedir import Notify, is_model_folder, stderr_line

if TYPE_CHECKING:
    from ..serve.models import Loaded, ModelEntry

ALIAS = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._:-]*)=(.+)$")  # NAME=PATH (a hub id or a path holds no "=" before a "/")


class Duration(click.ParamType):
    """Seconds as Ollama writes keep_alive: a number of seconds, or with a unit (`30s`, `5m`,
    `1h`); negative: forever."""

    name = "duration"
    UNITS = {"": 1, "s": 1, "m": 60, "h": 3600}

    def convert(self, value: Any, param, ctx) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        found = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([smh]?)\s*", str(value).lower())
        if found is None:
            self.fail(f"{value!r} is not a duration; write seconds or e.g. 30s, 5m, 1h (0: unload at once, "
                      "negative: keep loaded)", param, ctx)
        return float(found[1]) * self.UNITS[found[2]]


def entry(name: str, path: Path | str) -> ModelEntry:
    """A servable model's listing entry (a hub id not yet fetched: what is known before its load)."""
    from ..serve.models import ModelEntry
    from ..loading.store import describe

    if isinstance(path, Path) and is_model_folder(path):
        found = describe(name, "folder", path)
        return ModelEntry(name, path, found.size, found.family, found.parameters, found.quantization,
                          path.stat().st_mtime)
    return ModelEntry(name, path, 0, "?", 0, "?", time.time())


def named(specs: tuple[str, ...], notify: Notify = stderr_line) -> list[ModelEntry]:
    """The models `--model` names, in order: `NAME=PATH` served as NAME, anything else as
    `mlxinfer models` names it (a folder's name, the hub id)."""
    from .store import resolve_model

    out: dict[str, ModelEntry] = {}
    for spec in specs:
        alias = ALIAS.match(spec) if not Path(spec).expanduser().exists() else None
        where = resolve_model(alias[2] if alias else spec, notify)
        name = alias[1] if alias else (where.name if isinstance(where, Path) else where)
        if name in out:
            raise click.UsageError(f"two --model options serve the name '{name}'; give one of them another "
                                   "name with --model NAME=PATH")
        out[name] = entry(name, where)
    return list(out.values())


def listed() -> list[ModelEntry]:
    """Every model `mlxinfer models` lists (here: the cache, the Hugging Face cache, the current
    folder) that can be served: broken folders and unsupported families are left out."""
    from ..serve.models import ModelEntry
    from ..loading.store import local_models

    return [ModelEntry(m.name, m.path, m.size, m.family, m.parameters, m.quantization, m.path.stat().st_mtime)
            for m in local_models((Path.cwd(),)) if m.error is None and not m.family.endswith("(unsupported)")]


def demo_default(entries: list[ModelEntry]) -> str | None:
    """The default model of a server started with no --model: the demo model, or the only one."""
    from .demo import NAME

    names = [e.name for e in entries]
    return NAME if NAME in names else names[0] if len(names) == 1 else None


@dataclass
class Opening:
    """How `serve` opens a model on the load thread: loaded in `dtype`, an engine of
    `max_concurrency` sequences and `max_queue` waiting with the engine `options` and a prompt
    cache of `prompt_cache_bytes` of its own; the default model also gets the `--adapter`s and
    the `--draft-model` (a draft must be of its family)."""

    default: str | None
    dtype: str | None
    max_concurrency: int
    max_queue: int
    prompt_cache_bytes: int
    options: dict[str, Any]
    adapters: tuple[str, ...] = ()
    draft_model: str | None = None
    kv: dict[str, Any] = field(default_factory=dict)  # max_kv_size, kv_bits: what the K/V estimate reads

    def __call__(self, entry: ModelEntry, metrics) -> Loaded:
        from ..engine.batch import BatchGenerator
        from ..engine.replica import pool_for
        from ..loading.adapters import load_adapter
        from ..loading.model import load
        from ..serve.engine_thread import EngineThread
        from ..serve.models import Loaded
        from .store import resolve_model

        model, tokenizer = load(entry.path, dtype=self.dtype)
        options = dict(self.options)
        if entry.name == self.default:
            for spec in self.adapters:
                name, _, folder = spec.rpartition("=")
                load_adapter(model, folder, name or None)
            if self.draft_model:
                options["draft_model"] = load(resolve_model(self.draft_model), dtype=self.dtype)[0]
        if self.prompt_cache_bytes:
            options["pool"] = pool_for(model, self.prompt_cache_bytes)
        engine = BatchGenerator(model, tokenizer, max_batch=self.max_concurrency, **options)
        return Loaded(EngineThread(engine, max_queued=self.max_queue, metrics=metrics), model, tokenizer)

    def estimate(self, entry: ModelEntry) -> int:
        """A model's memory before it loads (`estimate_memory`); 0 for a hub id not yet fetched."""
        from ..serve.models import estimate_memory

        if not (isinstance(entry.path, Path) and is_model_folder(entry.path)):
            return 0
        return estimate_memory(entry.path, max_concurrency=self.max_concurrency,
                               prompt_cache_bytes=self.prompt_cache_bytes, **self.kv)
