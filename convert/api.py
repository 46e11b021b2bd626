"""`convert.convert`: any supported checkpoint in, an MLX (optionally quantized) folder out."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

from mlxinfer.loading.adapters import fused_weights
from mlxinfer.base.errors import ConversionError, InvalidOptionError, MlxinferError, ModelNotFoundError
from mlxinfer.loading.checkpoint import check_weights, resolve
from mlxinfer.loading.quant_summary import quantization_summary
from mlxinfer.models import build_model
from mlxinfer.text.tokenizer import Tokenizer, load_tokenizer_from_dir

from . import allocate, perplexity, texts
from .calibrate import DEFAULT_TOKENS, CalibrationText, calibrate, check_calibratable, read_calibration, windows
from .gguf_file import Packed
from .gguf_source import open_gguf
from .plan import Job, parameter_count, plan, quantization_config
from .quantize import Options, dtype_name
from .blockwise import BlockProgress
from .report import Progress, Report
from .sources import Source, is_gguf, open_folder
from .writer import (
    INDEX_FILE,
    check_not_source,
    check_output,
    check_space,
    folder_size,
    index,
    staged,
    verify,
    write_json,
    write_weights,
    writing,
)

_DROP_KEYS = ("quantization", "quantization_config", "_name_or_path")
BUILTIN_TEXT = "python-reference"  # --eval-ppl's name for `texts.evaluation_text()`


def open_source(source: str | os.PathLike, revision: str | None = None) -> Source:
    """The checkpoint `source` names: a GGUF file, or a folder or hub id. Here, above both
    readers, so neither needs the other."""
    path = Path(source).expanduser()
    if path.is_file():
        if not is_gguf(path):
            raise ModelNotFoundError(
                f"'{source}' is a file but not a GGUF file; pass a model folder, a hub id or a .gguf file"
            )
        return open_gguf(path)
    if path.suffix == ".gguf":
        raise ModelNotFoundError(f"no GGUF file at '{source}'; check the path")
    return open_folder(resolve(source, revision))


def convert(
    source: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    quantize: bool = False,
    bits: int | None = None,
    group_size: int | None = None,
    recipe: str | None = None,
    q_mode: str = "affine",
    dtype: str | None = None,
    dequantize: bool = False,
    force: bool = False,
    shard_size: int = 5 << 30,
    eval_ppl: str | os.PathLike | None = None,
    revision: str | None = None,
    progress: bool | None = None,
    adapter: str | os.PathLike | None = None,
    quantize_vision: bool = False,
    target_bpw: float | None = None,
    method: str = "rtn",
    calibration: str | os.PathLike | None = None,
    calibration_tokens: int | None = None,
) -> Report:
    """Convert a Hugging Face folder or hub id, an MLX folder or a GGUF file into an MLX folder
    that mlxinfer and mlx-lm both load.

    Without `quantize`/`recipe`/`q_mode` every tensor keeps its source precision (GGUF K-quants
    become the nearest MLX width, MXFP4 experts stay MXFP4); with them, layers are quantized at
    `bits`/`group_size` (default 4 and 64) or by the recipe, in affine mode or the floating-point
    `q_mode` (mxfp4, mxfp8, nvfp4: each fixes bits and group size). `dequantize` writes floats.
    `eval_ppl`: a text file, or "python-reference" for the built-in evaluation text, on which the
    report compares the output with the source (perplexity, KL divergence, same top token).
    Nothing is written unless the whole conversion succeeds; `progress` (default: stderr is a
    TTY) shows a bar. `adapter`: a LoRA adapter folder (PEFT or mlx-lm, DoRA included) merged
    into the weights before anything is quantized, so the output runs without it. A vision-language
    model's vision tower stays float unless `quantize_vision`. A calibrated conversion measures the
    source on `calibration_tokens` tokens of `calibration` (a text file, or .jsonl chats; default:
    `texts.calibration_text()`): `target_bpw` chooses each tensor's bits and group size from its
    sensitivity, so every written byte comes to at most that many bits per parameter (`allocate`);
    `method` "gptq" rounds the layers inside the model's blocks by GPTQ (`calibrate`), at the
    precisions chosen either way.
    """
    options = Options(quantize, bits, group_size, recipe, dtype, dequantize, shard_size, q_mode, quantize_vision,
                      target_bpw, method, calibration_tokens)
    if calibration is not None and not options.calibrated:
        raise InvalidOptionError("--calibration is the text a calibrated conversion measures; pass --method gptq or "
                                 "--target-bpw, or drop --calibration")
    calibration_text = read_calibration(calibration) if options.calibrated else None
    output = Path(output_dir).expanduser()
    started = time.perf_counter()
    mx.reset_peak_memory()
    check_output(output, force)
    text = evaluation_text(eval_ppl)
    src = open_source(source, revision)
    try:
        check_not_source(output, src.location)
        model = build_model(src.config)
        check_weights(model, src.tensors, src.origin, src.location)
        if adapter is not None:
            fuse_adapter(model, src, adapter)
        jobs = plan(model, src, options)
        if options.method != "rtn":
            check_calibratable(model, jobs)
        total = sum(job.nbytes for job in jobs)
        if target_bpw is not None:
            total = max(total, int(target_bpw * parameter_count(jobs) / 8))
        with staged(output, force) as tmp:
            check_space(output, total)
            with writing("the tokenizer files"):
                src.write_extras(tmp)
            check_tokenizer(tmp, str(source))
            method = None
            if calibration_text is not None:
                jobs, method = _calibrated(src, jobs, options, calibration_text, load_tokenizer_from_dir(tmp), progress)
            write_json(tmp / "config.json", output_config(src, jobs, options, method))
            bar = Progress(len(jobs), total, progress)
            try:
                weight_map = write_weights(tmp, jobs, options.shard_size, bar.advance)
            finally:
                bar.close()
            write_json(tmp / INDEX_FILE, index(jobs, weight_map, parameter_count(jobs)))
            verify(tmp, jobs, weight_map)
        report = _report(str(source), src, output, jobs, len(set(weight_map.values())), started)
        written = json.loads((output / "config.json").read_text(encoding="utf-8"))
        report.quantized = quantization_summary(written.get("quantization"), weight_map)
        report.method = written.get("quantization_method")
        if text is not None:
            try:
                report.comparison = perplexity.compare(src, output, text)
            except KeyboardInterrupt:  # the output is complete: Ctrl-C only skips the comparison
                report.perplexity_skipped = True
        return report
    finally:
        src.close()


def evaluation_text(eval_ppl: str | os.PathLike | None) -> str | None:
    """The text `--eval-ppl` names, read before any work: a UTF-8 file, or BUILTIN_TEXT for the
    evaluation half of the Python reference every install has (`texts.evaluation_text`)."""
    if eval_ppl is None:
        return None
    if str(eval_ppl) == BUILTIN_TEXT:
        return texts.evaluation_text()
    return texts.read_text(eval_ppl, "--eval-ppl")


def fuse_adapter(model, src: Source, adapter: str | os.PathLike) -> None:
    """Make the source's tensors of the layers the adapter changes read as their merged floats."""

    originals = dict(src.tensors)  # the merged tensors read these, not themselves

    def floats(layer: str) -> mx.array:
        t = originals[f"{layer}.weight"].read()
        return t.dequantize(mx.float32) if isinstance(t, Packed) else t.astype(mx.float32)

    for layer, merged in fused_weights(model, adapter, floats).items():
        t = src.tensors[f"{layer}.weight"]
        src.tensors[t.name] = replace(t, stored=f"{t.stored} + adapter", precision=None, read=merged)


def check_tokenizer(stage: Path, source: str) -> None:
    """Load the tokenizer the output will have, from the stage folder before any weights are
    written: a malformed tokenizer.json fails the conversion, not the first load of its output."""
    try:
        load_tokenizer_from_dir(stage)
    except MlxinferError as e:
        reason = str(e).replace(f"{stage}{os.sep}", "")  # the stage folder's name would mean nothing to the user
        raise ConversionError(f"the tokenizer of '{source}' does not load ({reason}); nothing was written") from None


def _calibrated(src: Source, jobs: list[Job], options: Options, text: CalibrationText, tokenizer: Tokenizer,
                progress: bool | None) -> tuple[list[Job], dict]:
    """The jobs as a calibrated conversion makes them, and what was done, for the config: with
    --target-bpw each tensor's precision chosen from its measured sensitivity; with --method gptq
    the block linears' GPTQ results at those precisions in place of their plain rounding (the
    writer stores a source already in its target precision as it is)."""
    ids = windows(text.ids(tokenizer), options.calibration_tokens or DEFAULT_TOKENS)
    measured = {"calibration": text.name, "calibration_tokens": int(ids.size)}
    record = {"method": options.method, **measured}
    if options.target_bpw is not None:
        jobs = allocate.allocate(jobs, src, ids.tolist(), options.target_bpw,
                                  BlockProgress("measuring sensitivity", progress))
        chosen_by = "allocate" if options.method == "rtn" else f"allocate+{options.method}"
        record = {"method": chosen_by, "target_bpw": options.target_bpw, **measured}
    if options.method != "rtn":
        done = calibrate(src, jobs, ids, options.float_dtype(src.dtype), BlockProgress("calibrating (GPTQ)", progress))
        jobs = [replace(job, source=replace(job.source, read=lambda p=done[job.path]: p)) if job.path in done else job
                for job in jobs]
    return jobs, record


def output_config(source: Source, jobs: list[Job], options: Options, method: dict | None = None) -> dict:
    """The source's config.json with its quantization replaced, keys sorted as mlx-lm saves them;
    a calibrated conversion says how under "quantization_method"."""
    config = {k: v for k, v in source.config.items() if k not in _DROP_KEYS}
    floats = dtype_name(options.float_dtype(source.dtype))
    for key in ("torch_dtype", "dtype"):
        if key in config:
            config[key] = floats
    quant = quantization_config(jobs, options)
    if quant:
        config["quantization"] = config["quantization_config"] = quant
    if method is not None:
        config["quantization_method"] = method
    return dict(sorted(config.items()))


def _report(name: str, src: Source, output: Path, jobs: list[Job], n_shards: int, started: float) -> Report:
    kept = {job.path: job.kept_float for job in jobs if job.kept_float}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return Report(
        source=name,
        source_kind=src.kind,
        output=output,
        source_bytes=src.nbytes,
        output_bytes=folder_size(output),
        weight_bytes=sum(job.nbytes for job in jobs),
        parameters=parameter_count(jobs),
        precisions=Counter(job.precision for job in jobs),
        kept_float=kept,
        shards=n_shards,
        seconds=time.perf_counter() - started,
        peak_memory=mx.get_peak_memory(),
        peak_rss=rss,
        source_precisions=Counter(job.source.stored for job in jobs),
    )
