"""Write a converted model all or nothing.

Everything goes into a hidden sibling folder first; only when every shard has been
re-opened and checked against the plan is it renamed into place. An exception, Ctrl-C,
SIGTERM or a full disk removes the partial folder, so the output either exists complete
or not at all. The rename refuses a folder that filled in the meantime, so nothing the
conversion did not create is deleted unless --force asks for it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxinfer.base.errors import ConversionError, CorruptCheckpointError
from mlxinfer.base.files import disk_full, write_problem
from mlxinfer.base.safetensors import check_safetensors

from .plan import Job, run, shards

INDEX_FILE = "model.safetensors.index.json"
_STAGE = re.compile(r"partial-(\d+)-[0-9a-f]+")  # a stage folder's name after ".NAME."


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
    """Refuse a conversion that cannot fit. Called once the stage folder exists, so the
    folder measured is writable and on the output's file system (a pseudo file system such
    as /proc reports no space but is refused earlier as not writable)."""
    folder = next(p for p in [output, *output.parents] if p.exists())
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise ConversionError(
            f"not enough disk space for '{output}': the model needs {needed / 1e9:.2f} GB, "
            f"{free / 1e9:.2f} GB are free; free some space or choose another -o folder"
        )


@contextlib.contextmanager
def staged(output: Path, force: bool) -> Iterator[Path]:
    """A temporary sibling folder that becomes `output` when the block succeeds and is
    deleted (with any parent folders it had to create) when it does not. Stage folders left
    beside `output` by killed conversions are removed first."""
    created = _make_parents(output.parent)
    _remove_abandoned(output)
    try:
        tmp = _sibling(output, "partial")
    except OSError as e:
        _remove_created(created)
        raise ConversionError(
            f"cannot write to '{output.parent}' ({_unwritable(e)}); choose a writable -o folder"
        ) from None
    try:
        with _signals_interrupt():
            yield tmp
        with _signals_held():
            _place(tmp, output, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_created(created)
        raise


def _unwritable(e: OSError) -> str:
    """Why a folder could not be made inside one that exists: the disk is full, or else the
    place is not writable, whatever the errno says (/proc answers ENOENT)."""
    return write_problem(e) if disk_full(e) else f"not writable: {e.strerror}"


def _sibling(output: Path, tag: str) -> Path:
    """A new hidden folder beside `output` (created with the usual permissions, unlike
    mkdtemp's 0700), named after this process so a later run can tell an abandoned one."""
    folder = output.parent / f".{output.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}"
    folder.mkdir()
    return folder


def _remove_abandoned(output: Path) -> None:
    """Delete the stage folders of conversions to `output` whose process is gone (killed
    before it could clean up). One whose process still runs may be a live conversion and
    is kept."""
    prefix = f".{output.name}."
    with contextlib.suppress(OSError):
        for folder in output.parent.iterdir():
            match = _STAGE.fullmatch(folder.name[len(prefix):]) if folder.name.startswith(prefix) else None
            if match and not _running(int(match.group(1))):
                shutil.rmtree(folder, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists but belongs to someone else
        return True
    return True


def _make_parents(folder: Path) -> list[Path]:
    missing = [p for p in [folder, *folder.parents] if not p.exists()]
    for p in reversed(missing):
        try:
            p.mkdir()
        except OSError as e:
            _remove_created(missing[missing.index(p) + 1 :])
            raise ConversionError(
                f"cannot create folder '{p}' ({_unwritable(e)}); choose a writable -o folder"
            ) from None
    return missing


def _remove_created(folders: list[Path]) -> None:
    for p in folders:
        with contextlib.suppress(OSError):
            p.rmdir()


def _place(tmp: Path, output: Path, force: bool) -> None:
    """Rename `tmp` to `output` in one step. rename(2) replaces an empty folder but refuses a
    non-empty one, so the check that nothing is in the way and the placement are the same
    system call: a folder that filled while we converted (another conversion, someone's
    files) is refused, never deleted. With `force` the existing output is moved aside
    first and deleted only once the new one is in place."""
    aside = _move_aside(output) if force else None
    try:
        os.rename(tmp, output)
    except OSError as e:
        kept = f"; the folder --force replaces is kept in '{aside}'" if aside and not _put_back(aside, output) else ""
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise ConversionError(
                f"'{output}' was filled by something else (another conversion?) while converting and was left "
                f"as it is{kept}; choose another -o folder"
            ) from None
        raise ConversionError(
            f"cannot place the output at '{output}' ({write_problem(e)}){kept}; choose a writable -o folder"
        ) from None
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _move_aside(output: Path) -> Path | None:
    """The existing output folder moved into a hidden sibling; None when there is none."""
    if not output.is_dir():
        return None
    aside = _sibling(output, "old")
    try:
        os.rename(output, aside / output.name)
    except FileNotFoundError:
        aside.rmdir()
        return None
    return aside


def _put_back(aside: Path, output: Path) -> bool:
    """Return a moved-aside output to its place after a failed placement."""
    try:
        os.rename(aside / output.name, output)
    except OSError:
        return False
    aside.rmdir()
    return True


def _signals_held() -> contextlib.AbstractContextManager[None]:
    """Ignore Ctrl-C, SIGTERM and SIGHUP while the output is placed: the rename is one step,
    and once it is done the output is complete, so a stop request that arrives then must
    not turn a finished conversion into a reported failure."""
    return _signals(("SIGINT", "SIGTERM", "SIGHUP"), lambda *_: None)


def _signals_interrupt() -> contextlib.AbstractContextManager[None]:
    """Turn SIGTERM (and SIGHUP) into an exception so cleanup runs, as Ctrl-C already does."""

    def interrupt(signum, _frame):
        raise ConversionError(f"conversion stopped by {signal.Signals(signum).name}; nothing was written")

    return _signals(("SIGTERM", "SIGHUP"), interrupt)


@contextlib.contextmanager
def _signals(names: tuple[str, ...], handler: Callable) -> Iterator[None]:
    """`handler` for the named signals (those this platform has) while the block runs; only
    the main thread may set handlers, so elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {name: signal.signal(getattr(signal, name), handler) for name in names if hasattr(signal, name)}
    try:
        yield
    finally:
        for name, old in previous.items():
            signal.signal(getattr(signal, name), old)


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
    with writing(file.name):
        mx.save_safetensors(str(file), arrays, metadata={"format": "mlx"})


@contextlib.contextmanager
def writing(what: str) -> Iterator[None]:
    """Turn a failed write in the block (of `what`) into one line naming its cause: a full
    disk, an unwritable place, or the OS's words. MLX's writers raise RuntimeError, which
    carries no errno."""
    try:
        yield
    except OSError as e:
        if disk_full(e):
            raise ConversionError(f"disk full while writing {what}; free some space or choose another -o folder") \
                from None
        raise ConversionError(f"could not write {what} ({write_problem(e)}); choose a writable -o folder") from None
    except RuntimeError as e:
        raise ConversionError(
            f"could not write {what} ({str(e).splitlines()[0]}); check free space and permissions of the -o folder"
        ) from None


def write_json(file: Path, data: dict[str, Any], indent: int = 4) -> None:
    with writing(file.name):
        file.write_text(json.dumps(data, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")


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

