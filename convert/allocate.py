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
from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxinfer.base.errors import InvalidOptionError

from .blockwise import Blockwise, run_block, set_module
from .gguf_file import Packed
from .plan import Job
from .quantize import BITS, GROUP_SIZES, QuantSpec
from .sources import Source

ERROR_ROWS = 4096  # rows of a tensor whose rounding error is measured at once


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
        self.pass_.inputs[self.path] = _mean_square(x)
        return self.pass_.probe(self.path, self.module(x))

    def as_linear(self, x: mx.array) -> mx.array:
        self.pass_.inputs[self.path] = _mean_square(x)
        return self.pass_.probe(self.path, self.module.as_linear(x))


def _mean_square(x: mx.array) -> mx.array:
    x = x.astype(mx.float32).reshape(-1, x.shape[-1])
    return mx.square(x).mean(axis=0)


class _Pass:
    """The probes and recorded inputs of one window's pass through one part of the model."""

    def __init__(self):
        self.probes: dict[str, mx.array] = {}
        self.inputs: dict[str, mx.array] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

    def probe(self, key: str, y: mx.array) -> mx.array:
        self.shapes[key] = y.shape
        return y + self.probes[key] if key in self.probes else y

    def zeros(self) -> dict[str, mx.array]:
        return {key: mx.zeros(shape) for key, shape in self.shapes.items()}


class _Sums:
    """Per key: the squared gradient on the outputs summed over every window's tokens, and the mean
    squared input averaged over the windows."""

    def __init__(self, windows: int):
        self.windows = windows
        self.sums: dict[str, tuple[mx.array, mx.array]] = {}

    def add(self, grads: dict[str, mx.array], inputs: dict[str, mx.array]) -> None:
        for key, g in grads.items():
            g2 = mx.square(g).reshape(-1, g.shape[-1]).sum(axis=0)
            x2 = inputs[key] / self.windows
            old = self.sums.get(key)
            self.sums[key] = (g2, x2) if old is None else (old[0] + g2, old[1] + x2)
        mx.eval(self.sums)


def _probed(part: nn.Module, paths: dict[str, str], pass_: _Pass) -> Callable[[], None]:
    """Put recorders at `paths` (path under `part` -> key) and return what puts the layers back."""
    modules = dict(part.named_modules())
    for path, key in paths.items():
        set_module(part, path, _Recorder(modules[path], key, pass_))
    return lambda: [set_module(part, path, modules[path]) for path in paths]


def measure(source: Source, windows: list[list[int]], paths: list[str],
            progress: Callable[[int, int], None] = lambda done, total: None) -> dict[str, list[Use]]:
    """How each layer at `paths` is used on `windows`: for each use, the loss's summed squared
    gradient on its outputs and its mean squared input, the two factors of a diagonal Fisher
    approximation of the loss's curvature in the weights (F_ij ~ sum_t g_ti^2 x_tj^2 ~
    (sum_t g_ti^2)(mean_t x_tj^2)).

    The float32 source runs one block at a time (`Blockwise`): forward over every window, keeping
    each block's input; then the loss's gradient on the last hidden state; then backward, block by
    block from the last, each block's forward recomputed from its kept input and its gradient on
    that input (the chain rule, so the same gradients as one backward pass through the whole
    model) handed to the block before. Memory: one block's weights, the embedding and LM head,
    and every block's input over the calibration tokens (tokens x hidden x 4 bytes a block)."""
    model = Blockwise(source, "--target-bpw")
    _check_measurable(model, paths)
    embed = model.path(model.backbone.embed_tokens)
    steps, done = 2 * len(model.prefixes) + 1, 0
    model.load_outer()
    tokens = [mx.array(w) for w in windows]
    reads = sum(mx.zeros(model.backbone.embed_tokens.weight.shape[0]).at[t[:-1]].add(1.0) / (len(t) - 1)
                for t in tokens) / len(tokens)  # how often the text reads each row of the embedding
    inputs = [[model.backbone.embed(t[None, :-1]) for t in tokens]]
    mx.eval(inputs)
    if not model.model.config.tie_word_embeddings:
        model.drop_embedding()  # the LM head is its own layer: the table is not needed again
    for i, block, _ in model.blocks():
        inputs.append([run_block(block, x) for x in inputs[-1]])
        mx.eval(inputs[-1])
        done += 1
        progress(done, steps)
    sums = _Sums(len(windows))
    grads = _head(model, paths, embed, tokens, inputs.pop(), sums)
    done += 1
    progress(done, steps)
    for i, block, prefix in model.blocks(range(len(model.prefixes) - 1, -1, -1)):
        grads = _block(block, {p[len(prefix) + 1:]: p for p in paths if p.startswith(f"{prefix}.")},
                       inputs.pop(), grads, sums)
        done += 1
        progress(done, steps)
    uses: dict[str, list[Use]] = {}
    for key, (g2, x2) in sums.sums.items():
        uses.setdefault(key, []).append(Use(g2, x2))
    if embed in paths:
        scale = model.backbone.embed_scale  # the lookup's output is scaled before the first block
        g2 = sum(mx.square(g * scale).reshape(-1, g.shape[-1]).sum(axis=0) for g in grads)
        uses.setdefault(embed, []).append(Use(reads, g2))
    return uses


def _head(model: Blockwise, paths: list[str], embed: str, tokens: list[mx.array], hidden: list[mx.array],
          sums: _Sums) -> list[mx.array]:
    """The text's loss from the last block's outputs: records the LM head's use and returns the
    loss's gradient on each window's last hidden state."""
    pass_ = _Pass()
    head = embed if model.model.config.tie_word_embeddings else "lm_head"
    restore = _probed(model.model, {head: head} if head in paths else {}, pass_)

    def loss(h: mx.array, probes: dict[str, mx.array], t: mx.array):
        pass_.probes = probes
        logits = model.model.logits(model.backbone.norm(h))[0].astype(mx.float32)
        nll = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, t[1:, None], axis=-1)[:, 0]
        return nll.sum(), dict(pass_.inputs)

    try:
        return _gradients(loss, pass_, hidden, tokens, sums)
    finally:
        restore()


def _block(block: nn.Module, paths: dict[str, str], inputs: list[mx.array], grads: list[mx.array],
           sums: _Sums) -> list[mx.array]:
    """One block recomputed over each window from its input: records its layers' uses and returns
    the loss's gradient on its inputs (the vector-Jacobian product with `grads`, its outputs')."""
    pass_ = _Pass()
    restore = _probed(block, paths, pass_)

    def through(x: mx.array, probes: dict[str, mx.array], g: mx.array):
        pass_.probes = probes
        return (run_block(block, x) * g).sum(), dict(pass_.inputs)

    try:
        return _gradients(through, pass_, inputs, grads, sums)
    finally:
        restore()


def _gradients(f: Callable, pass_: _Pass, xs: list[mx.array], extras: list[mx.array], sums: _Sums) -> list[mx.array]:
    """For each window, f(x, probes, extra) -> (scalar, recorded inputs) differentiated in x and
    in the probes: the probes' gradients and the inputs go to `sums`, x's gradient is returned."""
    pass_.probes = {}
    f(xs[0], {}, extras[0])  # learns the probes' shapes once: every window has the same length
    out = []
    for x, extra in zip(xs, extras):
        (_, recorded), (gx, probe_grads) = mx.value_and_grad(f, argnums=(0, 1))(x, pass_.zeros(), extra)
        sums.add(probe_grads, recorded)
        out.append(gx)
        mx.eval(gx)
    return out


def _check_measurable(model: Blockwise, paths: list[str]) -> None:
    """Refuse, before any work, a layer the pass cannot see: it measures plain linear layers in
    the blocks and the embedding and LM head (a mixture of experts' stacked layers route each
    token to a few and are not measured yet)."""
    outer = {model.path(model.backbone.embed_tokens), "lm_head"}
    for path in paths:
        module = model.modules.get(path)
        if not (isinstance(module, (nn.Linear, nn.Embedding)) and (path in outer or model.in_block(path))):
            raise InvalidOptionError(f"--target-bpw cannot measure '{path}' ({type(module).__name__}) yet; "
                                     "use --bits or --recipe")


def candidates(shape: tuple[int, ...]) -> list[QuantSpec]:
    """Every affine setting MLX can store a tensor of `shape` in."""
    return [QuantSpec(bits, group) for bits in BITS for group in GROUP_SIZES if QuantSpec(bits, group).fits(shape)]


def weighted_error(weight: mx.array, spec: QuantSpec, dtype: mx.Dtype, uses: list[Use]) -> float:
    """sum over `uses` of sum_ij (W - Q(W))_ij^2 rows_i cols_j: the loss's expected increase
    (up to a factor 1/2) from rounding to `spec` as the writer rounds (in `dtype`, with scales
    and biases in `dtype`)."""
    total = 0.0
    for start in range(0, weight.shape[0], ERROR_ROWS):  # a slice at a time: a 7B head's copies are GBs
        rows = weight[start : start + ERROR_ROWS]
        packed = mx.quantize(rows.astype(dtype), spec.group_size, spec.bits)
        diff = mx.square(mx.dequantize(*packed, spec.group_size, spec.bits).astype(mx.float32) - rows)
        part = sum((use.rows[start : start + ERROR_ROWS] @ (diff @ use.cols) for use in uses), mx.zeros(()))
        total += part.item()
    return total


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


def allocate(jobs: list[Job], source: Source, windows: list[list[int]], target_bpw: float,
             progress: Callable[[int, int], None] = lambda done, total: None) -> list[Job]:
    """`jobs` with each quantizable tensor's precision chosen so that every written byte adds up
    to at most `target_bpw` bits per parameter, from the float `source` run on `windows`."""
    free = [i for i, job in enumerate(jobs) if (job.target is not None or job.kept_float) and candidates(job.source.shape)]
    if not free:
        raise InvalidOptionError("--target-bpw: this model has no layer that can be quantized; drop --target-bpw")
    uses = measure(source, windows, [jobs[i].path for i in free], progress)
    parameters = sum(int(np.prod(job.source.shape)) for job in jobs)
    budget = int(target_bpw * parameters // 8)
    fixed = sum(job.nbytes for i, job in enumerate(jobs) if i not in set(free))  # norms, biases: as stored
    specs, options = [], []
    for i in free:
        job = jobs[i]
        weight = _floats(job)
        specs.append(candidates(job.source.shape))
        errors = [weighted_error(weight, s, job.dtype, uses[job.path]) for s in specs[-1]]  # one at a time
        options.append([(replace(job, target=s, kept_float=None).nbytes, e) for s, e in zip(specs[-1], errors)])
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
