"""Read LoRA adapters (PEFT's folders and mlx-lm's) and put them on a loaded model, unfused
(`load_adapter`: the base weights stay as they are, quantized or not) or merged into its
weights (`fused_weights`, for the converter).

Both formats come down to one list of `Part`s: for one layer as the checkpoint names it (a
PEFT `target_modules` module, a `target_parameters` expert tensor, an mlx-lm layer), `a`
[r, in] and `b` [out, r] with the scale folded into b ([E, r, in] and [E, out, r] for experts),
and DoRA's magnitude. `placements` says where each such name lies in our model, whose loader
fused some layers (q/k/v into one `qkv_proj`, gate/up into one `gate_up_proj`) and stacked the
experts (`switch_mlp.*`): an update of q_proj is the rows of qkv_proj it covers, one of
transformers 5's fused `experts.gate_up_proj` is the gate and up expert stacks.

On a sharded model each rank takes its part, along the axes its weights were split on
(`shard.shard_weights`): a layer split by output rows (q/k/v, gate/up) takes those rows of B
(and of DoRA's magnitude), one split by input columns (o, down; its outputs summed over the
ranks) those columns of A, and DoRA's row norms there sum their squares over the ranks; a
pipeline rank takes the layers it holds.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from .adapter_config import MlxLora, PeftLora, mlx_lora, peft_lora
from ..base.errors import AdapterError, CorruptCheckpointError, ModelNotFoundError
from .checkpoint import PICKLE_SUFFIXES, checkpoint_json, read_weights
from ..models.layers import Attention, Linear, QuantizedLinear, SwiGLU
from ..models.lora import LoRALinear, LoRASwitchLinear, Update, adapter_name, registry
from ..models.moe import QuantizedSwitchLinear, SwitchGLU, SwitchLinear
from ..models.shard import COLUMN, KV, LAYER, ROW, Shard, Stage, _kv_part, _part

PEFT_FILE, MLX_FILE = "adapter_model.safetensors", "adapters.safetensors"
PEFT_PREFIX = "base_model.model."
MAX_PATH_CHARS = 4096  # Linux's PATH_MAX; a longer path names no folder
MAX_TENSOR_NAME = 1000
LINEARS = (Linear, QuantizedLinear, nn.Linear, nn.QuantizedLinear, LoRALinear)
SWITCHES = (SwitchLinear, QuantizedSwitchLinear, LoRASwitchLinear)


@dataclass(frozen=True)
class Part:
    """One adapter's update of one layer, as the adapter names the layer (or the layers it may
    be, its shapes telling which: see `_peft_targets`)."""

    targets: tuple[str, ...]
    a: mx.array
    b: mx.array
    magnitude: mx.array | None = None  # DoRA


@dataclass(frozen=True)
class Place:
    """Where (part of) a named layer lies in our model: the `share`-th of `shares` equal runs
    of the update's rows (all of them by default) go to rows from `offset` of the layer at `path`."""

    path: str
    offset: int = 0
    share: int = 0
    shares: int = 1

    def rows(self, b: mx.array) -> mx.array:
        n = b.shape[-2] // self.shares
        return b[..., self.share * n : (self.share + 1) * n, :]


def adapter_folder(path: str | Path) -> Path:
    """The adapter folder `path` names (a path a server's client may send: bounded, checked)."""
    text = os.fspath(path)
    if not isinstance(text, str) or not text or len(text) > MAX_PATH_CHARS or "\0" in text:
        length = f"{len(text):,} characters" if isinstance(text, str) else type(text).__name__
        raise ModelNotFoundError(f"the adapter path ({length}) is not a folder path: pass the folder that holds "
                                 f"adapter_config.json, at most {MAX_PATH_CHARS:,} characters, without NUL")
    folder = Path(text).expanduser()
    try:
        is_dir = folder.is_dir()
        has_config = is_dir and (folder / "adapter_config.json").is_file()
    except OSError as e:  # a name too long for the file system, a folder we may not read
        raise ModelNotFoundError(f"cannot read the adapter folder '{text[:200]}' ({e.strerror})") from None
    if not is_dir:
        raise ModelNotFoundError(f"no adapter folder at '{text[:200]}'; pass the folder that holds adapter_config.json")
    if not has_config:
        raise ModelNotFoundError(f"no adapter_config.json in '{str(folder)[:200]}'; "
                                 "is this a PEFT or mlx-lm adapter folder?")
    return folder


def read_adapter(path: str | Path) -> list[Part]:
    """The parts of the adapter in folder `path`, PEFT's format or mlx-lm's."""
    folder = adapter_folder(path)
    config = checkpoint_json(folder, "adapter_config.json")
    for name in (PEFT_FILE, MLX_FILE):
        if (folder / name).is_file():
            settings = peft_lora(config) if name == PEFT_FILE else mlx_lora(config)  # before reading any tensor
            weights = read_weights([folder / name])[0]
            _check_tensors(weights)
            return _peft_parts(settings, weights) if name == PEFT_FILE else _mlx_parts(settings, weights)
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (*PICKLE_SUFFIXES, ".npz"))
    if pickles:
        raise CorruptCheckpointError(
            f"'{str(folder)[:200]}' holds its adapter as {pickles[0]}, a pickle (unsafe to load) or not "
            f"safetensors; save it as {PEFT_FILE} (PEFT: save_pretrained(safe_serialization=True))"
        )
    raise ModelNotFoundError(f"no {PEFT_FILE} (PEFT) or {MLX_FILE} (mlx-lm) in '{str(folder)[:200]}'")


def _check_tensors(weights: dict[str, mx.array]) -> None:
    """Refuse a tensor named past any layer name's length (names are matched against patterns),
    or holding NaN or an infinity: every request running the adapter would end in NaN logits (a
    server's requests naming it, 500s), so it is caught here, by name."""
    long = next((key for key in weights if len(key) > MAX_TENSOR_NAME), None)
    if long is not None:
        raise AdapterError(f"adapter tensor '{long[:120]}...' has a name of {len(long):,} characters, longer than "
                           f"any layer's ({MAX_TENSOR_NAME:,} at most); the file is not an adapter for a model")
    floats = [(key, value) for key, value in weights.items() if mx.issubdtype(value.dtype, mx.floating)]
    finite = [mx.isfinite(value).all() for _, value in floats]
    mx.eval(finite)
    for (key, _), ok in zip(floats, finite):
        if not ok.item():
            raise AdapterError(f"adapter tensor '{key[:120]}' holds NaN or infinite values; the adapter is damaged "
                               "(its training diverged, or the file was corrupted): use another checkpoint of it")


def _peft_parts(config: PeftLora, weights: dict[str, mx.array]) -> list[Part]:
    groups: dict[str, dict[str, mx.array]] = defaultdict(dict)
    for key, value in weights.items():
        name = key.removeprefix(PEFT_PREFIX)
        for leaf in (".lora_A.weight", ".lora_B.weight", ".lora_magnitude_vector", ".lora_magnitude_vector.weight"):
            if name.endswith(leaf):
                groups[name.removesuffix(leaf)][leaf.split(".")[1]] = value
                break
        else:
            raise AdapterError(f"adapter tensor '{key[:120]}' is not a LoRA A, B or DoRA magnitude; "
                               "only LoRA adapters are supported")
    targets = {module: _peft_targets(module, config.target_parameters) for module in groups}
    stray = config.unselected(m for m, t in targets.items() if t[0] == m)  # expert tensors: target_parameters
    if stray is not None:
        raise AdapterError(f"adapter layer '{stray[:120]}' is not among the layers adapter_config.json's "
                           "target_modules selects; the adapter's files do not match")
    names = [t[0] for t in targets.values()]
    ranks, alphas = config.rank_pattern.resolve(names), config.alpha_pattern.resolve(names)
    parts = []
    for module, tensors in groups.items():
        target = targets[module][0]
        stacked = target != module
        rank = int(ranks.get(target, config.r))
        scale = config.scale(rank, alphas.get(target, config.alpha))
        a, b = _pair(tensors, module)
        experts = a.shape[0] // rank if stacked else 1
        if a.shape[0] != rank * experts or not experts:
            raise AdapterError(f"adapter layer '{module[:120]}' has rank {a.shape[0] // max(experts, 1)} but "
                               f"adapter_config.json says r={rank}; the adapter's files do not match")
        if experts > 1:  # PEFT's expert layout: A [E*r, in] as (E, r, in), B [out, r*E] as (out, r, E)
            a = a.reshape(experts, rank, -1)
            b = b.reshape(b.shape[0], rank, experts).transpose(2, 0, 1)
        parts.append(Part(targets[module], a, b * scale, tensors.get("lora_magnitude_vector")))
    return parts


def _peft_targets(module: str, target_parameters: Sequence[str]) -> tuple[str, ...]:
    """The layers a PEFT module name may stand for: itself, or for a module whose tensors
    `target_parameters` wraps (`mlp.experts` for `mlp.experts.gate_up_proj`, once per tensor,
    in an order the file does not keep: `experts.base_layer.lora_A`) each such expert tensor,
    the one whose shapes fit chosen in `updates`."""
    base = re.sub(r"(\.base_layer)+$", "", module)
    owned = [p.rsplit(".", 1) for p in target_parameters if "." in p]
    leaves = tuple(f"{base}.{leaf}" for owner, leaf in owned if base == owner or base.endswith(f".{owner}"))
    return leaves or (module,)


def _pair(tensors: dict[str, mx.array], module: str) -> tuple[mx.array, mx.array]:
    if "lora_A" not in tensors or "lora_B" not in tensors:
        raise AdapterError(f"adapter layer '{module[:120]}' lacks its lora_A or lora_B tensor; the file is incomplete")
    a, b = tensors["lora_A"], tensors["lora_B"]
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise AdapterError(f"adapter layer '{module[:120]}' has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                           "which do not make a low-rank pair")
    return a, b


def _mlx_parts(config: MlxLora, weights: dict[str, mx.array]) -> list[Part]:
    rank, scale = config.rank, config.scale
    groups: dict[str, dict[str, mx.array]] = defaultdict(dict)
    for key, value in weights.items():
        module, _, leaf = key.rpartition(".")
        if leaf not in ("lora_a", "lora_b", "m"):
            raise AdapterError(f"adapter tensor '{key[:120]}' is not a LoRA lora_a, lora_b or DoRA m")
        groups[module][leaf] = value
    parts = []
    for module, t in groups.items():
        if "lora_a" not in t or "lora_b" not in t:
            raise AdapterError(f"adapter layer '{module[:120]}' lacks its lora_a or lora_b tensor; the file is incomplete")
        a, b = t["lora_a"], t["lora_b"]
        if a.ndim == 2:  # mlx-lm's LoRALinear: x @ a [in, r] @ b [r, out]
            a, b = a.T, b.T
        if a.shape[-2] != rank or b.shape[-1] != rank:
            raise AdapterError(f"adapter layer '{module[:120]}' has rank {a.shape[-2]} but adapter_config.json says "
                               f"rank {rank}; the adapter's files do not match")
        parts.append(Part((module,), a, b * scale, t.get("m")))
    return parts


def _first_layer(model: nn.Module) -> int:
    """The checkpoint's number of the model's first layer (a pipeline rank's is not 0)."""
    return model.model.first_layer if isinstance(model.model, Stage) else 0


def checkpoint_name(path: str, first_layer: int = 0) -> str:
    """The checkpoint's name of the module at `path`, less a sharded model's wrappers (a pipeline
    `Stage`'s backbone, the `AllSum` around a block half) and with pipeline layers renumbered."""
    path = re.sub(r"^model\.backbone\.", "model.", path)
    path = re.sub(r"\.inner(?=\.|$)", "", path)
    return LAYER.sub(lambda m: f"model.layers.{int(m[1]) + first_layer}.", path) if first_layer else path


def placements(model: nn.Module) -> dict[str, list[Place]]:
    """Every layer name an adapter may target -> where it lies in `model` (see the module doc)."""
    places: dict[str, list[Place]] = {}
    first = _first_layer(model)
    for actual, m in model.named_modules():
        path = checkpoint_name(actual, first)
        if isinstance(m, LINEARS + SWITCHES):
            places[path] = [Place(actual)]
        if isinstance(m, Attention) and "qkv_proj" in m:
            q = m.n_heads * m.head_dim * (2 if m.output_gate else 1)
            kv = m.n_kv_heads * m.head_dim
            for name, offset in (("q_proj", 0), ("k_proj", q), ("v_proj", q + kv)):
                places[f"{path}.{name}"] = [Place(f"{actual}.qkv_proj", offset)]
        elif isinstance(m, SwiGLU) and "gate_up_proj" in m:
            half = _out_dims(m.gate_up_proj) // 2
            places[f"{path}.gate_proj"] = [Place(f"{actual}.gate_up_proj", 0)]
            places[f"{path}.up_proj"] = [Place(f"{actual}.gate_up_proj", half)]
        elif isinstance(m, SwitchGLU):  # transformers 5's fused experts, as PEFT's target_parameters name them
            block = path.rpartition(".")[0]
            places[f"{block}.experts.gate_up_proj"] = [Place(f"{actual}.gate_proj", 0, 0, 2),
                                                      Place(f"{actual}.up_proj", 0, 1, 2)]
            places[f"{block}.experts.down_proj"] = [Place(f"{actual}.down_proj")]
    return {k: v for k, v in places.items() if not k.endswith(".base")}


def _base(m: nn.Module) -> nn.Module:
    return m.base if isinstance(m, (LoRALinear, LoRASwitchLinear)) else m


def _out_dims(m: nn.Module) -> int:
    return _base(m).weight.shape[-2]


def dense_weight(m: nn.Module) -> mx.array:
    """A (quantized) linear or expert layer's weight [..., out, in] as floats."""
    m = _base(m)
    if "scales" not in m:
        return m.weight
    return mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits, m.mode)


def _float_dtype(m: nn.Module) -> mx.Dtype:
    m = _base(m)
    return m.scales.dtype if "scales" in m else m.weight.dtype


def updates(model: nn.Module, parts: list[Part], weight_of: Callable[[str], mx.array] | None = None
            ) -> dict[str, Update]:
    """Each of our layers' update from `parts`: the parts that land in one (q, k, v in a fused
    qkv_proj) side by side, each B in its rows, their ranks concatenated; on a sharded model,
    this rank's part (see the module doc). DoRA's gains need the base weights: `weight_of(path)`
    (default: the model's own, dequantized)."""
    places = placements(model)
    modules = dict(model.named_modules())
    weight_of = weight_of or (lambda path: dense_weight(modules[path]))
    split = _Split.of(model)
    pieces: dict[str, list[tuple[int, mx.array, mx.array, mx.array | None]]] = defaultdict(list)
    for part in parts:
        if split is not None and split.elsewhere(part):
            continue
        target = _target(part, places, modules, split)
        for place in places[target]:
            a, b, magnitude, columns = _local(part, target, place, split)
            layer = modules[place.path]
            _check_shape(target, a, b, place, layer)
            gain = None
            if magnitude is not None:
                if isinstance(_base(layer), SWITCHES):
                    raise AdapterError(f"the adapter uses DoRA on expert layer '{target[:120]}'; "
                                       "DoRA is supported on linear layers only")
                w = weight_of(place.path)[place.offset : place.offset + b.shape[-2]].astype(mx.float32)
                squares = mx.square(w + b.astype(mx.float32) @ a.astype(mx.float32)).sum(axis=1)
                if columns:  # each rank holds some columns of every row: the row's norm sums them all
                    squares = mx.distributed.all_sum(squares, group=split.shard.group)
                gain = magnitude.astype(mx.float32) / mx.sqrt(squares)
            pieces[place.path].append((place.offset, a, b, gain))
    return {path: _combined(path, modules[path], ps) for path, ps in pieces.items()}


@dataclass(frozen=True)
class _Split:
    """How a sharded model is split: by heads (`tensor`, with the rank's config) or by layers
    (this rank's `layers` in the checkpoint's numbering)."""

    shard: Shard
    tensor: bool
    config: dict[str, Any]
    layers: range
    total: int  # layers in the whole model

    @classmethod
    def of(cls, model: nn.Module) -> _Split | None:
        shard = model.__dict__.get("shard")
        if shard is None:
            return None
        first = _first_layer(model)
        return cls(shard, not isinstance(model.model, Stage), model.config.raw, range(first, first + len(model.layers)),
                   model.config.num_hidden_layers)

    def elsewhere(self, part: Part) -> bool:
        """A layer another pipeline rank holds (one the model does not have is refused later)."""
        found = LAYER.match(part.targets[0])
        return not self.tensor and found is not None and int(found[1]) not in self.layers and int(found[1]) < self.total


def _local(part: Part, target: str, place: Place, split: _Split | None
           ) -> tuple[mx.array, mx.array, mx.array | None, bool]:
    """The part's a, b and magnitude for `place` on this rank, and whether its layer's input
    columns are split among the ranks (its outputs then summed)."""
    a, b, magnitude = part.a, place.rows(part.b), part.magnitude
    if split is None or not split.tensor:
        return a, b, magnitude, False
    name = checkpoint_name(place.path, 0)
    if name.endswith(("qkv_proj", "gate_up_proj")) and not target.endswith(("qkv_proj", "gate_up_proj")):
        name = target  # one of the projections the loader fused: split as that projection is
    name, shard = f"{name}.weight", split.shard
    if KV.search(name):
        rows = lambda x, axis: _kv_part(x, axis, shard, split.config)  # noqa: E731
    elif COLUMN.search(name):
        rows = lambda x, axis: _part(x, axis, shard)  # noqa: E731
    elif ROW.search(name):
        return _part(a, a.ndim - 1, shard), b, magnitude, True
    else:  # a layer every rank holds whole (a router), or one split otherwise: the shape check refuses those
        return a, b, magnitude, False
    return a, rows(b, b.ndim - 2), None if magnitude is None else rows(magnitude, 0), False


def _target(part: Part, places: dict[str, list[Place]], modules: dict[str, nn.Module], split: _Split | None) -> str:
    """The one of the part's possible layers that this model has and its shapes fit."""
    known = [t for t in part.targets if t in places]
    if not known:
        raise AdapterError(f"the adapter targets layer '{part.targets[0][:120]}', which this model does not have; "
                           "was it trained for another model?")

    def fits(target: str) -> bool:
        return all(_fits(*_local(part, target, p, split)[:2], p, modules[p.path]) for p in places[target])

    fitting = [t for t in known if fits(t)]
    return fitting[0] if len(fitting) == 1 else known[0]  # none or several: the shape check names the first


def _in_dims(layer: nn.Module) -> int:
    w = _base(layer).weight
    return w.shape[-1] * 32 // _base(layer).bits if "scales" in _base(layer) else w.shape[-1]


def _fits(a: mx.array, b: mx.array, place: Place, layer: nn.Module) -> bool:
    w = _base(layer).weight
    experts = tuple(w.shape[:-2])
    return (a.shape[-1] == _in_dims(layer) and place.offset + b.shape[-2] <= w.shape[-2] and b.shape[-2] > 0
            and tuple(a.shape[:-2]) == experts and tuple(b.shape[:-2]) == experts)


def _check_shape(target: str, a: mx.array, b: mx.array, place: Place, layer: nn.Module) -> None:
    if not _fits(a, b, place, layer):
        w = _base(layer).weight
        raise AdapterError(
            f"the adapter's layer '{target[:120]}' has A {tuple(a.shape)} and B {tuple(b.shape)}, which do not "
            f"fit the model's layer of {tuple(w.shape[:-2])} x {w.shape[-2]} x {_in_dims(layer)}; was it trained "
            "for another model?"
        )


def _combined(path: str, layer: nn.Module, pieces: list[tuple[int, mx.array, mx.array, mx.array | None]]) -> Update:
    """The layer at `path`'s one update from its pieces (see `updates`), evaluated and checked finite."""
    dtype, out = _float_dtype(layer), _out_dims(layer)
    offset, a, b, gain = pieces[0]
    if len(pieces) > 1 or offset or b.shape[-2] != out:
        a = mx.concatenate([p[1] for p in pieces], axis=-2)
        full = mx.zeros((*b.shape[:-2], out, a.shape[-2]), mx.float32)
        start = 0
        for offset, _, b_i, _ in pieces:
            full[..., offset : offset + b_i.shape[-2], start : start + b_i.shape[-1]] = b_i.astype(mx.float32)
            start += b_i.shape[-1]
        b = full
        if any(p[3] is not None for p in pieces):
            g = mx.ones((out,), mx.float32)
            for offset, _, b_i, g_i in pieces:
                if g_i is not None:
                    g[offset : offset + b_i.shape[-2]] = g_i
            gain = g
    update = Update(a.astype(dtype), b.astype(dtype), None if gain is None else gain.astype(dtype))
    arrays = [update.a, update.b, *([] if update.gain is None else [update.gain])]
    finite = [mx.isfinite(x).all() for x in arrays]
    mx.eval(*arrays, *finite)
    if not all(ok.item() for ok in finite):
        raise AdapterError(f"the adapter's update of layer '{path[:120]}' is not finite in the model's {dtype}: "
                           "scaled by lora_alpha / r (DoRA: by its magnitude over the row norms) it overflows; "
                           "the adapter does not fit this model as it is")
    return update


def prepare_adapter(model: nn.Module, path: str | Path) -> dict[str, Update]:
    """All the work of loading the adapter in folder `path` on `model`: its files read and
    checked, and each layer's update computed, evaluated and checked finite (`attach_adapter`
    then puts them on the model). It changes nothing, so a server runs it on a thread of its
    own while the engine keeps stepping; the updates are evaluated arrays, usable from any
    thread (an MLX stream belongs to the thread that made it: a graph left to evaluate would
    need this one's)."""
    return updates(model, read_adapter(path))


def attach_adapter(model: nn.Module, name: str, found: dict[str, Update]) -> str:
    """Register `found` (`prepare_adapter`'s) on `model` as adapter `name`: cheap (no array is
    computed), so a server does it on its engine thread between steps."""
    adapters = registry(model)
    slot = adapters.add(name)
    modules = dict(model.named_modules())
    wrapped = []
    for where, update in found.items():
        layer = modules[where]
        if not isinstance(layer, (LoRALinear, LoRASwitchLinear)):
            layer = (LoRASwitchLinear if isinstance(layer, SWITCHES) else LoRALinear)(layer, adapters)
            wrapped.append((where, layer))
        layer.table.updates[slot] = update
    if wrapped:
        model.update_modules(tree_unflatten(wrapped))
    return name


def load_adapter(model: nn.Module, path: str | Path, name: str | None = None) -> str:
    """Register the adapter in folder `path` on `model` under `name` (default: the folder's
    name; `lora.adapter_name` says what a name may be), unfused: the base weights stay, and
    requests choose it by name."""
    folder = adapter_folder(path)
    name = adapter_name(folder.resolve().name if name is None else name)
    registry(model).check_free(name)  # before the work, which the name's refusal would waste
    return attach_adapter(model, name, prepare_adapter(model, folder))


def unload_adapter(model: nn.Module, name: str) -> None:
    """Forget adapter `name` (its layers stay wrapped; with no update they add nothing)."""
    slot = registry(model).remove(name)
    for _, m in model.named_modules():
        if isinstance(m, (LoRALinear, LoRASwitchLinear)):
            m.table.updates.pop(slot, None)


def fused_weights(model: nn.Module, path: str | Path, weight_of: Callable[[str], mx.array]
                  ) -> dict[str, Callable[[], mx.array]]:
    """The adapter in folder `path` merged into the weights of the layers it changes (as
    `weight_of(layer path)` gives them, floats), each made when called: W + B·A, and for DoRA
    gain · (W + B·A), rows scaled (a bias stays as it is). For a model built unfused (the
    converter's), whose layers are the checkpoint's."""
    found = updates(model, read_adapter(path), weight_of)

    def fused(layer: str, update: Update) -> mx.array:
        w = weight_of(layer).astype(mx.float32) + update.b.astype(mx.float32) @ update.a.astype(mx.float32)
        return w if update.gain is None else update.gain.astype(mx.float32)[:, None] * w

    return {layer: (lambda layer=layer, update=update: fused(layer, update)) for layer, update in found.items()}
