"""adapter_config.json read once into typed settings (PEFT's LoRA options, mlx-lm's), every field
we use checked for its type and range: an adapter folder is untrusted input (a server loads one
a client names), and a bad field must be a one-line refusal naming it, never a crash later.

PEFT picks layers with regular expressions (peft.tuners.tuners_utils, peft.utils.other):
`target_modules` given as one string selects a layer whose name it `re.fullmatch`es (a list
selects a name equal to an entry or ending in "." + one), and `rank_pattern` / `alpha_pattern`
give a layer the value of their first key, in the file's order, for which
`re.match(rf"(.*\\.)?({key})$", name)` holds. Python's `re` backtracks: a crafted pattern runs
for hours on a 30-character name, holding the GIL, so a server stops answering anyone, SIGTERM
included. We match with RE2 instead, the engine built for patterns from strangers: linear time
in the name and bounded memory (`RE2_MAX_MEM` per pattern), with Python's results for every
pattern both engines take. A pattern must compile in both: in Python's `re` (an adapter PEFT
itself could not load is refused) and in RE2 (which lacks backreferences, lookaround, atomic
groups and possessive repeats, and bounds repeat counts).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import re2

from ..base.errors import AdapterError

FILE = "adapter_config.json"
# PEFT options that change what the adapter computes in ways we do not run: refused when set.
PEFT_REFUSED = ("modules_to_save", "fan_in_fan_out", "lora_bias", "layer_replication", "trainable_token_indices",
                "alora_invocation_tokens", "use_qalora")
MAX_PATTERN_CHARS = 1000  # one pattern; PEFT's real ones are names or alternations of them, a few hundred at most
MAX_ENTRIES = 1024  # keys of rank_pattern / alpha_pattern, entries of target_modules / target_parameters
RE2_MAX_MEM = 256 << 10  # bytes one compiled pattern may take; a 1,000-character alternation needs a tenth


def _options() -> re2.Options:
    options = re2.Options()
    options.max_mem = RE2_MAX_MEM
    options.log_errors = False  # the refusal says it, once, to whoever asked
    return options


def _shown(text: str, limit: int = 60) -> str:
    """`text` quoted for a one-line message: escaped (no newline gets through) and cut."""
    return repr(text[:limit]) + (f"... ({len(text):,} characters)" if len(text) > limit else "")


def _value(value: Any) -> str:
    """A JSON value as a one-line message shows it (a string quoted and cut)."""
    return _shown(value, 40) if isinstance(value, str) else repr(value)[:40]


def _pattern(field: str, pattern: Any, peft_form: Callable[[str], str]) -> str:
    """`pattern` if it is a string both engines compile (`peft_form(pattern)` is what PEFT
    compiles), short enough to be one."""
    if not isinstance(pattern, str):
        raise AdapterError(f"{FILE} has {field} {_value(pattern)}; expected a string (a regular expression)")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise AdapterError(f"{FILE}'s {field} {_shown(pattern)} is longer than a pattern may be "
                           f"({MAX_PATTERN_CHARS:,} characters); shorten it")
    try:
        re.compile(pattern)  # first alone, so an error's position is the pattern's own
        re.compile(peft_form(pattern))
    except (re.error, OverflowError, RecursionError) as e:
        raise AdapterError(f"{FILE}'s {field} {_shown(pattern)} is not a valid regular expression ({e}); "
                           "fix or remove it") from None
    return pattern


def _re2(field: str, pattern: str, peft_form: Callable[[str], str]) -> re2._Regexp:
    try:
        return re2.compile(peft_form(pattern), _options())
    except re2.error as e:
        why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise AdapterError(f"{FILE}'s {field} {_shown(pattern)} is refused by RE2, which mlxinfer matches "
                           f"patterns with ({why}): backreferences, lookaround, atomic groups, possessive "
                           "repeats and repeat counts over 1000 are not run; rewrite it without them") from None


def _suffix_form(key: str) -> str:
    return rf"(.*\.)?({key})$"


def _whole_form(pattern: str) -> str:
    return pattern


@dataclass(frozen=True)
class Patterns:
    """`rank_pattern` or `alpha_pattern`: (regular expression, value) in the file's order."""

    field: str
    items: tuple[tuple[str, float], ...] = ()

    def resolve(self, names: Iterable[str]) -> dict[str, float]:
        """The value PEFT gives each of `names` (the first key matching its end), for those a key
        matches. Key by key: one compiled pattern is held at a time."""
        left, found = list(dict.fromkeys(names)), {}
        for key, value in self.items:
            if not left:
                break
            matcher = _re2(f"{self.field} key", key, _suffix_form)
            hits = [name for name in left if matcher.match(name)]
            found.update(dict.fromkeys(hits, value))
            left = [name for name in left if name not in found]
        return found


@dataclass(frozen=True)
class PeftLora:
    """A PEFT LoRA adapter's settings, checked."""

    r: int
    alpha: float
    rslora: bool
    rank_pattern: Patterns
    alpha_pattern: Patterns
    target_modules: str | tuple[str, ...] | None  # a string: one regular expression
    target_parameters: tuple[str, ...]

    def scale(self, rank: int, alpha: float) -> float:
        """What B·A is multiplied by (rsLoRA: alpha / √r)."""
        return alpha / math.sqrt(rank) if self.rslora else alpha / rank

    def unselected(self, names: Iterable[str]) -> str | None:
        """The first of `names` that `target_modules` does not select (None: all are); a file
        holding such a layer does not match its config (PEFT would not load that layer)."""
        selector = self.target_modules
        if selector is None or isinstance(selector, str) and selector.lower() == "all-linear":  # PEFT's shorthand
            return None
        if isinstance(selector, str):
            matcher = _re2("target_modules", selector, _whole_form)
            return next((n for n in names if not matcher.fullmatch(n)), None)
        ends = tuple(f".{t}" for t in selector)
        return next((n for n in names if n not in selector and not n.endswith(ends)), None)


@dataclass(frozen=True)
class MlxLora:
    """An mlx-lm adapter's settings, checked (`fine_tune_type` lora or dora)."""

    rank: int
    scale: float


def _rank(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AdapterError(f"{FILE} has {field} {_value(value)}; expected a positive whole number (a rank)")
    return value


def _positive(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise AdapterError(f"{FILE} has {field} {_value(value)}; expected a positive number")
    return value


def _finite(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AdapterError(f"{FILE} has {field} {_value(value)}; expected a finite number")
    return value


def _flag(config: dict[str, Any], field: str) -> bool:
    value = config.get(field)
    if value is not None and not isinstance(value, bool):
        raise AdapterError(f"{FILE} has {field} {_value(value)}; expected true or false")
    return bool(value)


def _entries(config: dict[str, Any], field: str) -> list[Any]:
    value = config.get(field)
    if value is None:
        return []
    if not isinstance(value, list):
        raise AdapterError(f"{FILE} has {field} {_value(value)}; expected a list of names")
    if len(value) > MAX_ENTRIES:
        raise AdapterError(f"{FILE}'s {field} has {len(value):,} entries, over the {MAX_ENTRIES:,} "
                           "mlxinfer reads; name the layers with fewer entries (one pattern matches many)")
    for entry in value:
        if not isinstance(entry, str) or not entry or len(entry) > MAX_PATTERN_CHARS:
            raise AdapterError(f"{FILE}'s {field} holds {_value(entry)}; expected layer names "
                               f"(strings of 1 to {MAX_PATTERN_CHARS:,} characters)")
    return value


def _patterns(config: dict[str, Any], field: str, check: Callable[[str, Any], float]) -> Patterns:
    value = config.get(field)
    if value is None:
        return Patterns(field)
    if not isinstance(value, dict):
        raise AdapterError(f"{FILE} has {field} {_value(value)}; expected an object of "
                           "pattern: value pairs")
    if len(value) > MAX_ENTRIES:
        raise AdapterError(f"{FILE}'s {field} has {len(value):,} keys, over the {MAX_ENTRIES:,} mlxinfer "
                           "reads; merge them (one pattern matches many layers)")
    items = tuple((_pattern(f"{field} key", key, _suffix_form), check(f"{field}[{_shown(key, 40)}]", v))
                  for key, v in value.items())
    return Patterns(field, items)


def peft_lora(config: Any) -> PeftLora:
    """PEFT's adapter_config.json (parsed JSON) as settings, or the one-line refusal."""
    if not isinstance(config, dict):
        raise AdapterError(f"{FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{FILE} is a {_value(config.get('peft_type'))} adapter; "
                           "only LoRA is supported")
    for key in PEFT_REFUSED:
        if config.get(key):
            raise AdapterError(f"{FILE} sets {key}, which mlxinfer does not run; merge the adapter with PEFT "
                               "(merge_and_unload) and load the merged model")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{FILE} has bias {_value(config['bias'])}; only 'none' is supported")
    r = _rank("r", config.get("r"))
    target = config.get("target_modules")
    if isinstance(target, str):
        target = _pattern("target_modules", target, _whole_form)
    elif target is not None:
        target = tuple(_entries(config, "target_modules"))
    return PeftLora(r, _positive("lora_alpha", config.get("lora_alpha", r)), _flag(config, "use_rslora"),
                    _patterns(config, "rank_pattern", _rank), _patterns(config, "alpha_pattern", _positive),
                    target, tuple(_entries(config, "target_parameters")))


def mlx_lora(config: Any) -> MlxLora:
    """mlx-lm's adapter_config.json (parsed JSON) as settings, or the one-line refusal."""
    if not isinstance(config, dict):
        raise AdapterError(f"{FILE} is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise AdapterError(f"{FILE} has fine_tune_type {_value(kind)}; only 'lora' and 'dora' are adapters")
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise AdapterError(f"{FILE} has no lora_parameters object (rank, scale)")
    return MlxLora(_rank("lora_parameters.rank", params.get("rank")),
                   _finite("lora_parameters.scale", params.get("scale")))
