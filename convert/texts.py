"""Real text every install has, to calibrate a quantization and to measure one, with no network:
the Python language reference as CPython ships it for `help()` (`pydoc_data.topics`, ~465 KB of
documentation in English with code). Text we wrote ourselves would measure what we expect; this
was written by others, for people.

The topics are split in two disjoint halves, alternately in sorted order, so a method calibrated
on one half is never scored on text it saw: `calibration_text` for `--calibration`'s default,
`evaluation_text` for measuring the result.
"""

from __future__ import annotations

from pathlib import Path

from pydoc_data.topics import topics

from mlxinfer.base.errors import InvalidOptionError


def _half(which: int) -> str:
    names = sorted(topics)[which::2]
    return "\n\n".join(topics[name] for name in names)


def calibration_text() -> str:
    """Half the reference's topics (the even ones in sorted order): the default calibration set."""
    return _half(0)


def evaluation_text() -> str:
    """The other half (the odd ones): text no calibration by default has seen."""
    return _half(1)


def read_text(file, option: str) -> str:
    """A UTF-8 text file given to `option`, read before converting so a bad path fails before any work."""
    try:
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidOptionError(f"cannot read {option} file '{file}' ({e}); pass a UTF-8 text file") from None
    if not text.strip():
        raise InvalidOptionError(f"{option} file '{file}' is empty; pass a text file with some text in it")
    return text
