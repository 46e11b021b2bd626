"""Files written whole or not at all, and why a write failed in words that point at the fix;
and the one way a checkpoint's own files are read.

A reader (or a later run) sees the old file or the new one, never half of one: data goes to
a temporary name beside the target and is renamed over it only once complete, and a write
that fails removes its temporary file.

A checkpoint folder is untrusted: a link in it may point anywhere (`chat_template.jinja ->
~/.ssh/id_rsa` would put the key into every prompt, and `convert` into the output). Every file
read from one goes through `checkpoint_file`, which refuses a file that, links followed, leaves
the folder; a Hugging Face cache snapshot's links into its repo's `blobs` are the one exception.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from .errors import CorruptCheckpointError

_FULL = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


def disk_full(e: OSError) -> bool:
    return e.errno in _FULL


def write_problem(e: OSError) -> str:
    """Why a write failed. A full disk and a place one may not write need different fixes,
    so neither is reported as the other; anything else keeps the OS's own words."""
    if disk_full(e):
        return "the disk is full"
    if e.errno in _DENIED:
        return f"not writable: {e.strerror}"
    return e.strerror or str(e)


@contextlib.contextmanager
def replacing(path: Path, suffix: str = "") -> Iterator[Path]:
    """A temporary path beside `path` for the block to write: it replaces `path` when the
    block succeeds and is deleted when it fails. `suffix` ends the temporary name, for
    writers that add their extension to a name without it (`mx.save_safetensors`)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp{suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def checkpoint_file(folder: Path, name: str) -> Path | None:
    """`folder / name` if it is a file (None if there is none), after checking that it, links
    followed, stays inside `folder` or, for a Hugging Face cache snapshot
    (`snapshots/<rev>/name -> ../../blobs/<hash>`), inside that repo's blobs. A link leading
    anywhere else is refused even when its target is missing: where it points is the problem."""
    path = folder / name
    if not os.path.lexists(path):
        return None
    if not _inside(folder, path):
        raise CorruptCheckpointError(
            f"'{name}' in '{folder}' links outside the model folder; refusing to read it "
            "(put a copy of the file itself in the folder)"
        )
    return path if path.is_file() else None


def read_checkpoint_file(folder: Path, name: str) -> bytes | None:
    """The bytes of the checkpoint file `name` (checked by `checkpoint_file`), None if absent."""
    path = checkpoint_file(folder, name)
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as e:
        raise CorruptCheckpointError(f"cannot read {path} ({e.strerror or e}); check its permissions") from None


def _inside(folder: Path, file: Path) -> bool:
    target = file.resolve()
    home = folder.resolve()
    homes = [home]
    if home.parent.name == "snapshots":
        homes.append((home.parent.parent / "blobs").resolve())
    return any(target.is_relative_to(h) for h in homes)
