"""Write a converted model all or nothing.

Everything goes into a hidden sibling folder first; only when every shard has been
re-opened and checked against the plan is it renamed into place. An exception, Ctrl-C,
SIGTERM or a full disk removes the partial folder, so the output either exists complete
or not at all.
"""

from __future__ import annotations

import contextlib
import errno
import json
import secrets
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxinfer.errors import ConversionError, CorruptCheckpointError
from mlxinfer.loading import check_safetensors

from .plan import Job, run, shards

INDEX_FILE = "model.safetensors.index.json"


def check_output(output: Path, force: bool) -> None:
    """Refuse, before anything is read or written, an output that would clobber data."""
    if output.exists() and not output.is_dir():
        raise ConversionError(f"output '{output}' exists and is not a folder; choose another -o path")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise ConversionError(f"output folder '{output}' already exists and is not empty; pass --force to replace it")


def check_not_source(output: Path, source: Path) -> None:
    """--force must never delete the checkpoint being converted."""
    out, src = output.resolve(), source.resolve()
    if out == src or out in src.parents:
        raise ConversionError(f"output '{output}' would replace the source '{source}'; choose another -o folder")


def check_space(output: Path, needed: int) -> None:
    folder = next(p for p in [output, *output.parents] if p.exists())
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise ConversionError(
            f"not enough disk space for '{output}': the model needs {needed / 1e9:.2f} GB, "
            f"{free / 1e9:.2f} GB are free; free some space or choose another -o folder"
        )


@contextlib.contextmanager
def staged(output: Path) -> Iterator[Path]:
    """A temporary sibling folder that becomes `output` when the block succeeds and is
    deleted (with any parent folders it had to create) when it does not."""
    created = _make_parents(output.parent)
    try:
        tmp = _sibling(output, "partial")
    except OSError as e:
        _remove_created(created)
        raise ConversionError(
            f"cannot write to '{output.parent}' ({e.strerror}); choose a writable -o folder"
        ) from None
    try:
        with _signals_interrupt():
            yield tmp
            _swap_in(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_created(created)
        raise


def _sibling(output: Path, tag: str) -> Path:
    """A new hidden folder beside `output` (created with the usual permissions, unlike mkdtemp's 0700)."""
    folder = output.parent / f".{output.name}.{tag}-{secrets.token_hex(4)}"
    folder.mkdir()
    return folder


def _make_parents(folder: Path) -> list[Path]:
    missing = [p for p in [folder, *folder.parents] if not p.exists()]
    for p in reversed(missing):
        try:
            p.mkdir()
        except OSError as e:
            _remove_created(missing[missing.index(p) + 1 :])
            raise ConversionError(f"cannot create folder '{p}' ({e.strerror}); choose a writable -o folder") from None
    return missing


def _remove_created(folders: list[Path]) -> None:
    for p in folders:
        with contextlib.suppress(OSError):
            p.rmdir()


def _swap_in(tmp: Path, output: Path) -> None:
    """Rename `tmp` to `output`; an existing output (--force) is moved aside first and
    deleted only after the new one is in place."""
    old = None
    if output.exists():
        old = _sibling(output, "old")
        output.rename(old / output.name)
    try:
        tmp.rename(output)
    except BaseException:
        if old is not None:
            (old / output.name).rename(output)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """Turn SIGTERM (and SIGHUP) into an exception so cleanup runs, as Ctrl-C already does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, _frame):
        raise ConversionError(f"conversion stopped by {signal.Signals(signum).name}; nothing was written")

    names = [s for s in ("SIGTERM", "SIGHUP") if hasattr(signal, s)]
    previous = {name: signal.signal(getattr(signal, name), interrupt) for name in names}
    try:
        yield
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)


def write_weights(folder: Path, jobs: list[Job], shard_size: int, advance: Callable[[int], None]) -> dict[str, str]:
    """Stream the jobs into safetensors shards named as mlx-lm names them; returns the weight map.

    Only the shard being filled is held in memory: each job is evaluated on its own, and
    its source tensor is freed before the next one is read.
    """
    groups = shards(jobs, shard_size)
    names = (
        [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        if len(groups) > 1
        else ["model.safetensors"]
    )
    weight_map: dict[str, str] = {}
    for file, group in zip(names, groups, strict=True):
        arrays: dict[str, mx.array] = {}
        for job in group:
            out = run(job)
            mx.eval(out)
            arrays.update(out)
            advance(job.nbytes)
        _save(folder / file, arrays)
        weight_map.update(dict.fromkeys(arrays, file))
        del arrays, out
        mx.clear_cache()
    return weight_map


def _save(file: Path, arrays: dict[str, mx.array]) -> None:
    try:
        mx.save_safetensors(str(file), arrays, metadata={"format": "mlx"})
    except (OSError, RuntimeError) as e:
        raise _write_error(file, e) from None


def _write_error(file: Path, e: Exception) -> ConversionError:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return ConversionError(f"disk full while writing {file.name}; free some space or choose another -o folder")
    return ConversionError(f"could not write {file.name} ({e}); check free space and permissions of the -o folder")


def write_json(file: Path, data: dict[str, Any], indent: int = 4) -> None:
    try:
        file.write_text(json.dumps(data, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as e:
        raise _write_error(file, e) from None


def index(jobs: list[Job], weight_map: dict[str, str], parameters: int) -> dict[str, Any]:
    """model.safetensors.index.json as mlx-lm writes it."""
    return {
        "metadata": {"total_size": sum(job.nbytes for job in jobs), "total_parameters": parameters},
        "weight_map": dict(sorted(weight_map.items())),
    }


def verify(folder: Path, jobs: list[Job], weight_map: dict[str, str]) -> None:
    """Re-open every shard and check that it holds exactly the planned tensors, shapes and dtypes."""
    planned = {t.name: t for job in jobs for t in job.outputs}
    found: dict[str, mx.array] = {}
    for file in sorted(set(weight_map.values())):
        check_safetensors(folder / file)
        arrays, meta = mx.load(str(folder / file), return_metadata=True)
        if meta.get("format") != "mlx":
            raise CorruptCheckpointError(f"{file} was written without the mlx format tag; re-run the conversion")
        found.update(arrays)
    if set(found) != set(planned):
        odd = sorted(set(found) ^ set(planned))
        raise CorruptCheckpointError(
            f"written shards disagree with the plan on tensor '{odd[0]}'; re-run the conversion"
        )
    for name, t in planned.items():
        if tuple(found[name].shape) != t.shape or found[name].dtype != t.dtype:
            raise CorruptCheckpointError(
                f"tensor '{name}' was written as {found[name].dtype}{tuple(found[name].shape)} but planned as "
                f"{t.dtype}{t.shape}; re-run the conversion"
            )


def folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())

