"""Files written whole or not at all, and why a write failed in words that point at the fix.

A reader (or a later run) sees the old file or the new one, never half of one: data goes to
a temporary name beside the target and is renamed over it only once complete, and a write
that fails removes its temporary file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

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
