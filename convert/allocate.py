"""`--target-bpw`: how many bits (and what group size) each tensor gets, from its measured
sensitivity, so the whole file lands on a size the user chose.

Sensitivity: a float32 forward and backward pass of the source over calibration text records,
for every quantizable layer, the second moment of each input feature (d_j = mean over tokens
of x_j^2, the diagonal of X^T X / N, llama.cpp's imatrix) and the summed squared gradient of
the text's loss on each output (e_i). Rounding W to Q(W) then raises the loss by about
1/2 sum_ij e_i d_j (W - Q(W))_ij^2 (a diagonal, Kronecker-factored Fisher approximation): the
activation-weighted error sum_j d_j ||W[:, j] - Q(W)[:, j]||^2 with each output weighted by
how much the loss cares about it, which puts every layer's error in the same unit (the loss).
Without the gradient factor the LM head's logit error and a hidden layer's error are not
comparable: measured on SmolLM2-135M at 4.5 bits/weight, activation weights alone gave
perplexity 69.7 against plain 4-bit's 21.3. The LM head's input is the final hidden state;
an embedding's lookup of row i weighs it by how often the text read it, and a tied embedding
pays for both uses. Every candidate (bits x group size, affine, as the writer stores it) is
rounded with mx.quantize and scored that way; its size is the bytes the writer will write.

Choice (minimum total error with all stored bytes <= target x parameters): each tensor's
candidates are reduced to their lower convex hull in (bytes, error); starting from every
tensor's smallest candidate, the upgrade with the largest error drop per byte is taken while it
fits (a Lagrangian sweep done greedily: at each stop it is the exact optimum for its own size).
The bytes left go to the largest single improvements that still fit, and the result is never
worse than any uniform assignment that fits.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.models import CausalLM

from .gguf_file import Packed
from .perplexity import source_model
from .plan import Job
from .quantize import BITS, GROUP_SIZES, QuantSpec
from .sources import Source

@dataclass
class Use:
    """One way a tensor W is used, as a rank-one weight on its squared rounding error:
    sum_ij (W - Q(W))_ij^2 rows_i cols_j. A linear layer: rows = sum over tokens of the loss's
    squared gradient on each output, cols = mean squared input (d_j); an embedding's lookup:
    rows = how often each row was read, cols = the summed squared gradient on its output."""

    rows: mx.array
    cols: mx.array


class _Recorder:
    """Stands in for a linear layer or an embedding during the sensitivity pass: adds the pass's
    zero probe to each output (so the loss's gradient on the probe is its gradient on the output)
    and keeps the mean squared input."""

    def __init__(self, module, path: str, pass_: _Pass):
        self.module, self.path, self.pass_ = module, path, pass_

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype in (mx.int32, mx.uint32, mx.int64):  # an embedding's lookup: the rows read
            rows = self.module.weight.shape[0]
            self.pass_.inputs[f"{self.path}#lookup"] = mx.zeros(rows).at[x.reshape(-1)].add(1.0) / x.size
            return self.pass_.probe(f"{self.path}#lookup", self.module(x))
        self.pass_.inputs[self.path] = _mean_square(x)
        return self.pass_.probe(self.path, self.module(x))

    def as_linear(self, x: mx.array) -> mx.array:
        self.pass_.inputs[self.path] = _mean_square(x)
        return self.pass_.probe(self.path, self.module.as_linear(x))


def _mean_square(x: mx.array) -> mx.array:
    x = x.astype(mx.float32).reshape(-1, x.shape[-1])
    return mx.square(x).mean(axis=0)


class _Pass:
    """The probes and recorded inputs of one window's forward pass."""

    def __init__(self):
        self.probes: dict[str, mx.array] = {}
        self.inputs: dict[str, mx.array] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

    def probe(self, key: str, y: mx.array) -> mx.array:
        self.shapes[key] = y.shape
        return y + self.probes[key] if key in self.probes else y


def measure(model: CausalLM, windows: list[list[int]], paths: list[str]) -> dict[str, list[Use]]:
    """How each layer at `paths` is used on `windows` (float32, one forward and backward pass a
    window): for each use, the loss's summed squared gradient on its outputs and its mean
    squared input, the two factors of a diagonal Fisher approximation of the loss's curvature
    in the weights (F_ij ~ sum_t g_ti^2 x_tj^2 ~ (sum_t g_ti^2)(mean_t x_tj^2))."""
    modules = dict(model.named_modules())
    pass_ = _Pass()
    for path in paths:
        parent, _, name = path.rpartition(".")
        modules[parent][name] = _Recorder(modules[path], path, pass_)

    def loss(probes: dict[str, mx.array], tokens: mx.array):
        pass_.probes = probes
        logits = model(tokens[None, :-1])[0].astype(mx.float32)
        nll = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, tokens[1:, None], axis=-1)[:, 0]
        return nll.sum(), dict(pass_.inputs)

    sums: dict[str, tuple[mx.array, mx.array]] = {}
    for window in windows:
        tokens = mx.array(window)
        pass_.probes = {}
        model(tokens[None, :-1])  # learns the output shapes the probes need
        probes = {key: mx.zeros(shape) for key, shape in pass_.shapes.items()}
        (_, inputs), grads = mx.value_and_grad(loss)(probes, tokens)
        for key, g in grads.items():
            g2 = mx.square(g).reshape(-1, g.shape[-1]).sum(axis=0)
            x2 = inputs[key]
            old = sums.get(key)
            sums[key] = (g2, x2 / len(windows)) if old is None else (old[0] + g2, old[1] + x2 / len(windows))
        mx.eval(sums)
    uses: dict[str, list[Use]] = {}
    for key, (g2, x2) in sums.items():
        path, _, lookup = key.partition("#")
        uses.setdefault(path, []).append(Use(x2, g2) if lookup else Use(g2, x2))
    return uses


def candidates(shape: tuple[int, ...]) -> list[QuantSpec]:
    """Every affine setting MLX can store a tensor of `shape` in."""
    return [QuantSpec(bits, group) for bits in BITS for group in GROUP_SIZES if QuantSpec(bits, group).fits(shape)]


def weighted_error(weight: mx.array, spec: QuantSpec, dtype: mx.Dtype, uses: list[Use]) -> mx.array:
    """sum over `uses` of sum_ij (W - Q(W))_ij^2 rows_i cols_j: the loss's expected increase
    (up to a factor 1/2) from rounding to `spec` as the writer rounds (in `dtype`, with scales
    and biases in `dtype`)."""
    packed = mx.quantize(weight.astype(dtype), spec.group_size, spec.bits)
    diff = mx.square(mx.dequantize(*packed, spec.group_size, spec.bits).astype(mx.float32) - weight)
    return sum((use.rows @ (diff @ use.cols) for use in uses), mx.zeros(()))


Option = tuple[int, float]  # (bytes, error)


def choose(options: list[list[Option]], budget: int) -> list[int]:
    """For each tensor the index of one of its `options` such that the bytes add up to at most
    `budget` and the errors to as little as the module docstring's method finds."""
    hulls = [_hull(opts) for opts in options]
    pick = [hull[0] for hull in hulls]  # every tensor at its smallest option
    heap: list[tuple[float, int, int]] = []
    for t in range(len(hulls)):
        _push(heap, options, hulls, t, 0)
    left = budget - sum(opts[k][0] for opts, k in zip(options, pick))
    while heap:
        _, t, step = heapq.heappop(heap)
        extra = options[t][hulls[t][step + 1]][0] - options[t][hulls[t][step]][0]
        if extra <= left:
            left -= extra
            pick[t] = hulls[t][step + 1]
            _push(heap, options, hulls, t, step + 1)
    _fill(options, pick, left)
    return _best_uniform(options, pick, budget)


def _hull(opts: list[Option]) -> list[int]:
    """Indices of the lower convex hull of (bytes, error), by size: the options a Lagrangian
    price on bytes can choose."""
    order = sorted(range(len(opts)), key=lambda k: (opts[k][0], opts[k][1]))
    hull: list[int] = []
    for k in order:
        if hull and opts[k][1] >= opts[hull[-1]][1]:
            continue  # no better than something no bigger
        while len(hull) >= 2:
            (x0, y0), (x1, y1), (x2, y2) = opts[hull[-2]], opts[hull[-1]], opts[k]
            if (y1 - y0) * (x2 - x1) >= (y2 - y1) * (x1 - x0):  # hull[-1] lies on or above the chord
                hull.pop()
            else:
                break
        hull.append(k)
    return hull


def _push(heap: list, options: list[list[Option]], hulls: list[list[int]], t: int, step: int) -> None:
    """Queue tensor `t`'s upgrade from hull point `step` to the next, keyed by error saved per byte."""
    if step + 1 < len(hulls[t]):
        (b0, e0), (b1, e1) = options[t][hulls[t][step]], options[t][hulls[t][step + 1]]
        heapq.heappush(heap, (-(e0 - e1) / max(b1 - b0, 1), t, step))


def _fill(options: list[list[Option]], pick: list[int], left: int) -> None:
    """Spend the bytes the hull walk left on the largest single improvements that fit."""
    while True:
        best = None
        for t, opts in enumerate(options):
            here_bytes, here_error = opts[pick[t]]
            for k, (b, e) in enumerate(opts):
                if e < here_error and b - here_bytes <= left and (best is None or here_error - e > best[0]):
                    best = (here_error - e, t, k, b - here_bytes)
        if best is None:
            return
        _, t, k, extra = best
        pick[t] = k
        left -= extra


def _best_uniform(options: list[list[Option]], pick: list[int], budget: int) -> list[int]:
    """`pick`, or the uniform assignment (every tensor its k-th option) that fits with less error.
    Only when every tensor has the same number of options: the group sizes that fit a width are
    nested (128 | n implies 64 | n implies 32 | n), so then the k-th options are the same setting."""
    if len({len(opts) for opts in options}) > 1:
        return pick

    def total(ks):
        return sum(opts[k][0] for opts, k in zip(options, ks)), sum(opts[k][1] for opts, k in zip(options, ks))

    best, (_, best_error) = pick, total(pick)
    for k in range(min(len(opts) for opts in options)):
        uniform = [k] * len(options)
        size, error = total(uniform)
        if size <= budget and error < best_error:
            best, best_error = uniform, error
    return best


def _floats(job: Job) -> mx.array:
    tensor = job.source.read()
    return tensor.dequantize(mx.float32) if isinstance(tensor, Packed) else tensor.astype(mx.float32)


def allocate(jobs: list[Job], model: CausalLM, windows: list[list[int]], target_bpw: float) -> list[Job]:
    """`jobs` with each quantizable tensor's precision chosen so that every written byte adds up
    to at most `target_bpw` bits per parameter, from `model` (the float source) run on `windows`."""
    layers = dict(model.named_modules())
    free = [i for i, job in enumerate(jobs) if (job.target is not None or job.kept_float) and candidates(job.source.shape)]
    if not free:
        raise InvalidOptionError("--target-bpw: this model has no layer that can be quantized; drop --target-bpw")
    unmeasurable = [jobs[i].path for i in free if not _measurable(layers.get(jobs[i].path))]
    if unmeasurable:
        raise InvalidOptionError(f"--target-bpw cannot measure '{unmeasurable[0]}' "
                                 f"({type(layers.get(unmeasurable[0])).__name__}) yet; use --bits or --recipe")
    uses = measure(model, windows, [jobs[i].path for i in free])
    parameters = sum(int(np.prod(job.source.shape)) for job in jobs)
    budget = int(target_bpw * parameters // 8)
    fixed = sum(job.nbytes for i, job in enumerate(jobs) if i not in set(free))  # norms, biases: as stored
    specs, options = [], []
    for i in free:
        job = jobs[i]
        weight = _floats(job)
        specs.append(candidates(job.source.shape))
        errors = [weighted_error(weight, s, job.dtype, uses[job.path]) for s in specs[-1]]
        mx.eval(errors)
        options.append([(replace(job, target=s, kept_float=None).nbytes, e.item()) for s, e in zip(specs[-1], errors)])
        del weight
    smallest = fixed + sum(min(b for b, _ in opts) for opts in options)
    if smallest > budget:
        raise InvalidOptionError(f"--target-bpw {target_bpw:g} is below the smallest this model can be stored in "
                                 f"({smallest * 8 / parameters:.3f} bits/weight); pass at least that")
    pick = choose(options, budget - fixed)
    out = list(jobs)
    for i, spec_list, k in zip(free, specs, pick):
        out[i] = replace(jobs[i], target=spec_list[k], kept_float=None)
    return out


def _measurable(module) -> bool:
    """Layers whose input the sensitivity pass sees: plain linear layers and embeddings
    (a mixture of experts' stacked layers route each token to a few and are not measured yet)."""
    return isinstance(module, (nn.Linear, nn.Embedding, nn.QuantizedLinear, nn.QuantizedEmbedding))


def allocate_source(jobs: list[Job], source: Source, windows: list[list[int]], target_bpw: float) -> list[Job]:
    """`allocate` for a conversion: the source in float32 run over the calibration `windows`."""
    model = source_model(source)
    allocated = allocate(jobs, model, windows, target_bpw)
    del model
    mx.clear_cache()
    return allocated
