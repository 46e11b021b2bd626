"""`mlxinfer convert`: the command-line face of `convert.convert`."""

from __future__ import annotations

import re
from pathlib import Path

import click

from mlxinfer.base.errors import InvalidOptionError

from .api import convert
from .calibrate import DEFAULT_TOKENS
from .quantize import BITS, DTYPES, GROUP_SIZES, METHODS, MODES, RECIPES

_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'5GB', '500MB', '1.5gb' or a byte count; units are binary, as mlx-lm's shard limit is."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise InvalidOptionError(f"--shard-size '{text}' is not a size; write e.g. 5GB, 500MB or a byte count")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.upper()])


def _choices(values) -> str:
    return "|".join(str(v) for v in values)


@click.command("convert", epilog="Recipes, GPTQ, GGUF files and what each costs: docs/converting.md")
@click.argument("source")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Folder to write.")
@click.option("-q", "--quantize", is_flag=True, help="Quantize (implied by --bits, --group-size, --recipe).")
@click.option("--bits", type=int, help=f"Bits per weight ({_choices(BITS)}; default 4).")
@click.option("--group-size", type=int, help=f"Weights per scale/bias ({_choices(GROUP_SIZES)}; default 64).")
@click.option("--recipe", help=f"Mixed precision: {_choices(RECIPES)}.")
@click.option("--q-mode", default="affine", show_default=True,
              help=f"Quantization mode ({_choices(MODES)}); the floating-point ones fix bits and group size.")
@click.option("--dtype", help=f"Float type of unquantized tensors and scales ({_choices(DTYPES)}).")
@click.option("--dequantize", is_flag=True, help="Write floats from a quantized source.")
@click.option("--force", is_flag=True, help="Replace a non-empty output folder.")
@click.option("--shard-size", default="5GB", show_default=True, help="Largest safetensors file.")
@click.option("--eval-ppl", metavar="FILE|python-reference",
              help="Compare the output with the source on this text: perplexity of both, mean KL divergence of "
                   "the next-token distribution and the share of the same top token. A UTF-8 text file, or "
                   "python-reference: the built-in evaluation half of the Python reference every install has.")
@click.option("--revision", help="Hub revision (branch, tag or commit) for a hub id.")
@click.option("--adapter", type=click.Path(path_type=Path),
              help="LoRA adapter folder (PEFT or mlx-lm) to merge into the weights before quantizing.")
@click.option("--quantize-vision", is_flag=True, help="Quantize a vision-language model's vision tower too.")
@click.option("--target-bpw", type=float,
              help="Bits per weight of the whole file: each tensor's bits chosen from its measured sensitivity.")
@click.option("--method", default="rtn", show_default=True,
              help=f"Quantization method ({_choices(METHODS)}): rtn rounds to the nearest level; gptq compensates "
                   "rounding errors, calibrated on text.")
@click.option("--calibration", type=click.Path(path_type=Path),
              help="Text file (or .jsonl chats, {\"messages\": [...]} a line) that --target-bpw and --method gptq "
                   "measure on; default: Python's own reference documentation.")
@click.option("--calibration-tokens", type=int, help=f"Calibration tokens (default {DEFAULT_TOKENS}).")
def convert_command(source, output, quantize, bits, group_size, recipe, q_mode, dtype, dequantize, force,
                    shard_size, eval_ppl, revision, adapter, quantize_vision, target_bpw, method, calibration,
                    calibration_tokens) -> None:
    """Convert SOURCE (Hugging Face/MLX folder, hub id or .gguf file) into an MLX folder."""
    report = convert(
        source,
        output,
        quantize=quantize or any(v is not None for v in (bits, group_size, recipe)),
        bits=bits,
        group_size=group_size,
        recipe=recipe,
        q_mode=q_mode,
        dtype=dtype,
        dequantize=dequantize,
        force=force,
        shard_size=parse_size(shard_size),
        eval_ppl=eval_ppl,
        revision=revision,
        adapter=adapter,
        quantize_vision=quantize_vision,
        target_bpw=target_bpw,
        method=method,
        calibration=calibration,
        calibration_tokens=calibration_tokens,
    )
    click.echo("\n".join(report.lines()))
