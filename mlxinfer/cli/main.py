"""The `mlxinfer` command line: one click group; errors become one line at this edge."""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import click

from .. import __version__
from ..base.errors import InvalidOptionError, MlxinferError
from ..engine.options import PREFILL_STEP
from .serve import Duration


class Group(click.Group):
    """Turns any MlxinferError raised by a command into one line on stderr and exit code 1
    (with the traceback first under --verbose)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except MlxinferError as e:
            if ctx.obj:
                traceback.print_exc()
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except RuntimeError as e:
            from ..models.shard import lost_peer

            if not lost_peer(e):
                raise
            click.echo(f"error: another rank of the distributed group is gone ({e}); every rank stops", err=True)
            sys.exit(1)


@click.group(cls=Group)
@click.version_option(__version__, prog_name="mlxinfer")
@click.option("--verbose", is_flag=True, help="Show the traceback of an error, not just its one-line message.")
@click.pass_context
def main(ctx: click.Context, verbose: bool) -> None:
    """On-device LLM inference for Apple Silicon, built on MLX."""
    ctx.obj = verbose
    as_one_rank_of_several()
    hints_once()


def no_drafting_across_ranks(drafting: bool) -> None:
    """Ranks must take the same steps, and a speculative decoder picks its steps from its own
    machine's timings."""
    from ..models.shard import launched

    if drafting and launched():
        raise InvalidOptionError("speculative decoding (--draft-model, --prompt-lookup) does not run across ranks "
                                 "yet: each machine would choose its drafts by its own timings; drop it under "
                                 "mlx.launch")


def as_one_rank_of_several() -> None:
    """Under `mlx.launch` every rank runs the command: rank 0 owns the terminal and the
    others print nothing."""
    import os

    from ..models.shard import rank_zero

    if not rank_zero():
        sys.stdout = sys.stderr = open(os.devnull, "w")


def hints_once() -> None:
    """On a machine where MLX runs a slow path (the reference BLAS; OpenBLAS's narrow kernels on a
    wider CPU; MLX's CPU quantized matmul for want of the extension), say once each (a marker in
    MLXINFER_HOME) how to get the fast one; `mlxinfer doctor` says it every time."""
    from ..base.blas import core_hint as blas_core_hint
    from ..base.blas import hint as blas_hint
    from ..base.cachedir import home
    from ..kernels.quantized_matmul import hint as extension_hint

    for name, hint in (("blas-hint-shown", blas_hint), ("blas-core-hint-shown", blas_core_hint),
                       ("cpu-extension-hint-shown", extension_hint)):
        marker = home() / name
        if marker.exists() or (message := hint()) is None:
            continue
        click.echo(f"mlxinfer: {message}", err=True)
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:
            pass


MODEL_HELP = "Local folder, hub id, .gguf file or a name from `mlxinfer models` (default: the demo model)."
ADAPTER_HELP = "A LoRA adapter folder (PEFT or mlx-lm) to run with, unfused."
MODEL_OPTIONS = [
    click.option("--model", "-m", help=MODEL_HELP),
    click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]),
                 help="Compute dtype (default: as stored; half precision becomes float32 off Apple GPUs)."),
]
PIPELINE_OPTION = click.option(
    "--pipeline", is_flag=True,
    help="Under mlx.launch: split the model by layers across the ranks (default: by heads, tensor-parallel).")
GENERATION_OPTIONS = [
    *MODEL_OPTIONS,
    click.option("--adapter", metavar="DIR", help=ADAPTER_HELP),
    click.option("--draft-model", help="A small model of the same family that drafts tokens (speculative decoding)."),
    click.option("--prompt-lookup", is_flag=True, help="Draft tokens by copying from the context (no draft model)."),
    click.option("--num-draft-tokens", type=int,
                 help="Most tokens drafted per step [default: 8 with --prompt-lookup, 4 with --draft-model]."),
    click.option("--system", help="System prompt."),
    click.option("--temp", type=float, default=0.3, show_default=True, help="Temperature (0: greedy)."),
    click.option("--top-p", type=float, default=0.9, show_default=True, help="Nucleus sampling mass."),
    click.option("--top-k", type=int, default=0, show_default=True, help="Keep the K most likely tokens (0: off)."),
    click.option("--min-p", type=float, default=0.0, show_default=True, help="Drop tokens below MIN_P x the top one."),
    click.option("--seed", type=int, help="Random seed, for repeatable sampling."),
    click.option("--max-kv-size", type=int, help="Rotating KV cache of this many tokens: memory stays flat."),
    click.option("--kv-bits", type=click.Choice(["4", "8"]), help="Quantize the KV cache."),
    click.option("--max-tokens", type=int, default=512, show_default=True, help="Longest reply, in tokens."),
    click.option("--stop", multiple=True, help="End the reply before this text (repeatable; not printed)."),
    click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence, up to --max-tokens."),
    click.option("--json-schema", metavar="FILE|JSON",
                 help="Hold the reply to this JSON Schema (a file or inline JSON; {} for any JSON object)."),
    click.option("--regex", metavar="PATTERN", help="Hold the reply to this regular expression."),
    click.option("--tools", "tools_file", metavar="FILE",
                 help="Functions the model may call: a JSON file holding OpenAI's tools list."),
    click.option("--tool-choice", metavar="auto|none|required|NAME",
                 help="auto (default): the model decides; required: it must call one; NAME: it must call that one."),
    click.option("--repetition-penalty", type=float,
                 help="Shrink the logits of the last 64 tokens by this factor (> 1 discourages repeats; 1: off)."),
    click.option("--presence-penalty", type=float,
                 help="Subtract this from the logits of tokens among the last 64 (0: off)."),
    click.option("--frequency-penalty", type=float,
                 help="Subtract this times each token's count among the last 64 (0: off)."),
    click.option("--think/--no-think", default=None,
                 help="Let a thinking model (Qwen3, SmolLM3) think before it answers, or not [default: as its "
                      "template does]."),
]
# CLI parameter -> stream_generate option
OPTION_NAMES = {
    "temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
    "max_kv_size": "max_kv_size", "max_tokens": "max_tokens", "num_draft_tokens": "num_draft_tokens",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "logprobs": "logprobs",
}


class ByteSize(click.ParamType):
    """A size in bytes: a number with an optional unit (KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024)."""

    name = "size"
    UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

    def convert(self, value: Any, param, ctx) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().lower()
        number = text.rstrip("kmgtib")
        try:
            size = float(number) * self.UNITS[text[len(number):].strip()]
        except (ValueError, KeyError):
            self.fail(f"{value!r} is not a size; write e.g. 1073741824, 512MiB or 2GB", param, ctx)
        if size < 0:
            self.fail(f"{value!r} is negative", param, ctx)
        return int(size)


def with_options(options: list[Callable]) -> Callable:
    def decorate(f: Callable) -> Callable:
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


@dataclass(frozen=True)
class Run:
    """What the generation options of `chat` and `generate` ask for."""

    model: str | None
    dtype: str | None
    draft_model: str | None
    system: str | None
    options: dict[str, Any]
    think: bool | None = None  # --think / --no-think: checked against the model's template once it is loaded
    adapter: str | None = None  # --adapter: a LoRA adapter folder, the model's default

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> Run:
        from ..text.constrain import typed_format
        from ..text.tools import read_tools
        from ..engine.request import Request
        from .terminal import typed_text

        options = {name: params[key] for key, name in OPTION_NAMES.items() if params.get(key) is not None}
        if params.get("kv_bits"):
            options["kv_bits"] = int(params["kv_bits"])
        if params.get("prompt_lookup"):
            options["prompt_lookup"] = True
        if params.get("ignore_eos"):
            options["ignore_eos"] = True
        if params.get("stop"):
            options["stop"] = list(params["stop"])
        if params.get("json_schema") is not None and params.get("regex") is not None:
            raise InvalidOptionError("--json-schema and --regex are alternatives: pass one of them")
        if params.get("json_schema") is not None:
            schema = params["json_schema"].strip()
            options["response_format"] = typed_format("json", "" if schema == "{}" else schema)
        elif params.get("regex") is not None:
            options["response_format"] = typed_format("regex", params["regex"])
        if params.get("tools_file") is not None:
            options["tools"] = read_tools(params["tools_file"])
        if params.get("tool_choice") is not None:
            choice = params["tool_choice"]
            options["tool_choice"] = choice if choice in ("auto", "none", "required") else {
                "type": "function", "function": {"name": choice}}
        Request.of("", **options)  # a bad value fails now, before a model is fetched and loaded
        system = typed_text(params["system"]) if params["system"] is not None else None
        return cls(params["model"], params["dtype"], params["draft_model"], system, options, params.get("think"),
                   params.get("adapter"))

    def load(self, pipeline: bool = False):
        """(model, tokenizer, where it came from, draft model or None)."""
        from .store import open_model

        no_drafting_across_ranks(bool(self.draft_model or self.options.get("prompt_lookup")))
        model, tokenizer, where = open_model(self.model, self.dtype, pipeline=pipeline, adapter=self.adapter)
        draft = open_model(self.draft_model, self.dtype)[0] if self.draft_model else None
        return model, tokenizer, where, draft

    def options_for(self, tokenizer) -> dict[str, Any]:
        """The options, with --think / --no-think as the template's switch (refused by a model without one)."""
        from ..text.reasoning import thinking_switch

        if self.think is None:
            return self.options
        return {**self.options, "chat_template_kwargs": thinking_switch(tokenizer, self.think)}


IMAGE_OPTION = click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False),
                            help="Show this image with the (first) message (repeatable; a vision-language model).")


@main.command(epilog="The commands, options and thinking models: docs/chat.md")
@with_options(GENERATION_OPTIONS)
@IMAGE_OPTION
@PIPELINE_OPTION
@click.pass_obj
def chat(verbose: bool, pipeline: bool, images: tuple[str, ...], **params) -> None:
    """Chat with a model in the terminal (multi-turn, streaming, /help for commands)."""
    from ..base.cachedir import home
    from ..engine.chat import ChatSession
    from ..engine.replica import Replica, run_front_end
    from .repl import run_repl
    from ..models.shard import summary as shard_summary
    from .terminal import use_color

    run = Run.from_params(params)
    model, tokenizer, where, draft = run.load(pipeline=pipeline)

    def talk(engine: Replica | None) -> None:
        session = ChatSession(model, tokenizer, system=run.system, draft_model=draft, engine=engine,
                              **run.options_for(tokenizer))
        split = shard_summary(model)
        click.echo(f"mlxinfer chat: {model_name(where)}" + (f" [{split}]" if split else ""), err=True)
        run_repl(session, home() / "chat_history", color=use_color(sys.stdout), verbose=verbose, images=images)

    run_front_end(talk, model, tokenizer, max_batch=1)


def model_name(where: Path | str) -> str:
    """A folder's name, or the hub id."""
    return where.name if isinstance(where, Path) else where


def chat_prompt(tokenizer, text: str, system: str | None, raw: bool, images: tuple[str, ...] = ()) -> str | list[dict]:
    """Chat messages for the template (the images shown before the text), or the text as it is
    with --raw (or no template)."""
    if raw or tokenizer.chat_template is None:
        if system:
            raise InvalidOptionError("--system needs the model's chat template; drop --raw or --system")
        if images:
            raise InvalidOptionError("--image needs the model's chat template, which places the image; drop --raw")
        return text
    content = [*({"type": "image", "image": Path(i)} for i in images), {"type": "text", "text": text}]
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content if images else text}]


@main.command()
@with_options(GENERATION_OPTIONS)
@click.option("--prompt", "-p", required=True, help="The prompt; - reads it from stdin.")
@click.option("--raw", is_flag=True, help="Send the prompt as it is, without the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print the text and stats as one JSON object.")
@click.option("--logprobs", type=int, metavar="N",
              help="With --json: each generated token with its log-probability and the N likeliest alternatives.")
@click.option("--no-stream", is_flag=True, help="Print the text once it is complete.")
@IMAGE_OPTION
@PIPELINE_OPTION
def generate(prompt: str, raw: bool, as_json: bool, no_stream: bool, pipeline: bool, images: tuple[str, ...],
             **params) -> None:
    """Complete one prompt: text on stdout (streamed), stats on stderr."""
    from ..engine.generate import stream_generate
    from ..engine.replica import Replica, run_front_end
    from .terminal import stats_line, typed_text, use_color
    from ..models.shard import summary as shard_summary
    from ..text.tools import describe_call

    if params["logprobs"] is not None and not as_json:
        raise InvalidOptionError("--logprobs needs --json, which prints each token with its log-probabilities")
    run = Run.from_params(params)
    text = typed_text(sys.stdin.buffer.read()).rstrip("\n") if prompt == "-" else typed_text(prompt)
    if not text.strip():
        raise InvalidOptionError("the prompt is empty; pass --prompt TEXT, or --prompt - and text on stdin")
    model, tokenizer, where, draft = run.load(pipeline=pipeline)

    def reply(engine: Replica | None) -> None:
        options = run.options_for(tokenizer)
        prompt_or_messages = chat_prompt(tokenizer, text, run.system, raw, images)
        if run.think is not None and raw:
            raise InvalidOptionError("--think and --no-think switch the chat template, which --raw skips; drop one")
        options = {**options, "draft_model": draft} if draft else options
        stream = not (no_stream or as_json)
        pieces, thoughts, tokens, stats = [], [], [], None
        last = None
        shown = use_color(sys.stderr)
        thinking = False  # thoughts shown on stderr whose line is not ended yet
        for chunk in stream_generate(model, tokenizer, prompt_or_messages, engine=engine, **options):
            pieces.append(chunk.text)
            thoughts.append(chunk.reasoning)
            stats, last = chunk.stats, chunk
            if params["logprobs"] is not None and chunk.token is not None:
                tokens.append(token_logprobs(tokenizer, chunk))
            if stream:
                thinking = show_thinking(chunk.reasoning, shown) or thinking
                if chunk.text and thinking:
                    click.echo(err=True)
                    thinking = False
                click.echo(chunk.text, nl=False)
                sys.stdout.flush()
        if as_json:
            logprobs = {"tokens": tokens} if params["logprobs"] is not None else {}
            calls = {"tool_calls": [c.openai() for c in last.tool_calls]} if last and last.tool_calls else {}
            click.echo(json.dumps({"model": str(where), "prompt": text, "reasoning": "".join(thoughts),
                                   "text": "".join(pieces), "finish_reason": stats.finish_reason,
                                   "stats": asdict(stats), **logprobs, **calls}))
            return
        if thinking or (not stream and show_thinking("".join(thoughts), shown)):
            click.echo(err=True)
        click.echo("" if stream else "".join(pieces))
        for call in last.tool_calls or []:
            click.echo(f"tool call: {describe_call(call)}", err=True)
        click.echo(stats_line(stats), err=True)
        if (split := shard_summary(model)) is not None:
            click.echo(f"[{split}]", err=True)

    run_front_end(reply, model, tokenizer, max_batch=1)


def show_thinking(text: str, color: bool) -> bool:
    """A thinking model's thoughts on stderr (dimmed on a terminal): stdout keeps the answer
    alone. Whether there were any."""
    from .terminal import DIM, paint

    if text:
        click.echo(paint(text, DIM, color), nl=False, err=True)
        sys.stderr.flush()
    return bool(text)


@main.command("embed")
@click.argument("texts", nargs=-1, required=True, metavar="TEXT...")
@with_options(MODEL_OPTIONS)
@click.option("--dimensions", type=click.IntRange(1), help="Keep the first N numbers of each vector, renormalised.")
@click.option("--json", "as_json", is_flag=True, help="Print the vectors and token counts as one JSON object.")
def embed_command(texts: tuple[str, ...], model, dtype, dimensions, as_json) -> None:
    """Embed each TEXT (- reads one from stdin): one unit-length vector per text, a line of
    numbers each, pooled as the checkpoint's sentence-transformers config says (mean otherwise)."""
    from ..engine.embed import embed_tokens, encode_texts
    from .store import open_model
    from .terminal import typed_text

    texts = tuple(typed_text(sys.stdin.buffer.read()).rstrip("\n") if t == "-" else typed_text(t) for t in texts)
    m, tokenizer, where = open_model(model, dtype)
    ids = encode_texts(m, tokenizer, list(texts))
    vectors = embed_tokens(m, ids, dimensions=dimensions)
    if as_json:
        click.echo(json.dumps({"model": str(where), "dimensions": vectors.shape[1], "embeddings": vectors.tolist(),
                               "tokens": [len(i) for i in ids]}))
        return
    for vector in vectors:
        click.echo(" ".join(f"{x:.9g}" for x in vector.tolist()))


def token_logprobs(tokenizer, chunk) -> dict[str, Any]:
    """One generated token for --json --logprobs: its id, its text alone, its log-probability
    under the model (before sampling filters) and the likeliest alternatives."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"id": token, "token": tokenizer.decode([token]), "logprob": logprob}

    top = [entry(t, lp) for t, lp in chunk.top_logprobs or []]
    return {**entry(chunk.token, chunk.logprob), "top_logprobs": top}


@main.command("models")
@click.argument("folders", nargs=-1, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--supported", is_flag=True, help="List the supported model families (config.json model_type).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def models_command(folders: tuple[Path, ...], supported: bool, as_json: bool) -> None:
    """Models on this machine: mlxinfer's cache, the Hugging Face cache, and model folders
    in FOLDERS (default: the current directory). The NAME column is what --model accepts.
    With --supported, the model families mlxinfer runs instead."""
    from ..loading.store import local_models
    from .terminal import size

    if supported:
        from ..models import supported as families

        table = families()
        if as_json:
            click.echo(json.dumps(table))
            return
        width = max(map(len, table))
        click.echo(f"{'MODEL_TYPE':<{width}}  COVERS")
        for model_type, covers in table.items():
            click.echo(f"{model_type:<{width}}  {covers}")
        return

    found = local_models(folders or (Path.cwd(),))
    if as_json:
        click.echo(json.dumps([m.as_dict() for m in found]))
        return
    if not found:
        click.echo("no local models yet: `mlxinfer pull` fetches one, `mlxinfer chat` fetches the demo model")
        return
    rows = [("NAME", "FAMILY", "PARAMS", "QUANTIZATION", "SIZE", "WHERE", "NOTE")]
    rows += [(m.name, m.family, _count(m.parameters), m.quantization, size(m.size), m.where, m.error or "")
             for m in found]
    if not any(m.error for m in found):  # the NOTE column only says why a folder is broken
        rows = [r[:-1] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


@main.command("pull")
@click.argument("source")
@click.option("--bits", type=int, help="Quantize to this many bits (2, 3, 4, 5, 6, 8) [default: 4 for a float "
                                       "model; a quantized one keeps its precision].")
@click.option("--recipe", help="Mixed precision instead of --bits: mixed-3-6, mixed-4-6 or mixed-4-8.")
@click.option("--name", help="The name to give it [default: the source's name and precision, "
                             "e.g. smollm2-135m-instruct-4bit].")
def pull_command(source: str, bits: int | None, recipe: str | None, name: str | None) -> None:
    """Convert SOURCE into mlxinfer's cache, under the name `mlxinfer models` then lists: a hub id
    (downloaded into the Hugging Face cache, resumably), a model folder, a .gguf file, or the
    http(s) URL of one (resumed if interrupted)."""
    from ..convert.pull import pull
    from .terminal import PullBar, size

    bar = PullBar()
    try:
        model = pull(source, bits=bits, recipe=recipe, name=name, progress=bar)
    finally:
        bar.close()
    click.echo(f"pulled {model.name}: {model.family}, {_count(model.parameters)} parameters, {model.quantization}, "
               f"{size(model.size)}; run it with `mlxinfer chat -m {model.name}`")


@main.command("rm")
@click.argument("name")
@click.option("--yes", "-y", is_flag=True, help="Delete without asking.")
def rm_command(name: str, yes: bool) -> None:
    """Delete the model NAME from mlxinfer's cache (only there: a Hugging Face cache model or a
    folder of yours is left alone, with how to delete it)."""
    from ..loading.store import removable, remove
    from .terminal import size

    model = removable(name)
    if not yes:
        click.confirm(f"delete {model.name} ({size(model.size)}, {model.path})?", abort=True, err=True)
    remove(name)
    click.echo(f"deleted {model.name} ({size(model.size)})")


@main.command("cp")
@click.argument("source")
@click.argument("new_name")
def cp_command(source: str, new_name: str) -> None:
    """Copy the model SOURCE (any name `mlxinfer models` lists) into mlxinfer's cache as NEW_NAME
    (files hard-linked where possible, so it costs no space)."""
    from ..loading.store import copy

    click.echo(f"copied {source} to {copy(source, new_name).name}")


TEMPLATE_LINES = 8


@main.command("show")
@click.argument("name")
@click.option("--template", "whole_template", is_flag=True, help="Print the whole chat template.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (the whole template included).")
def show_command(name: str, whole_template: bool, as_json: bool) -> None:
    """What the model NAME is: family, parameters, quantization and how it was chosen, context
    length, chat template, size on disk and where it is."""
    from ..loading.quant_summary import method_text
    from ..loading.store import details
    from .terminal import size

    d = details(name)
    if as_json:
        click.echo(json.dumps(d.as_dict()))
        return
    m = d.model
    rows = [("name", m.name), ("family", m.family), ("parameters", f"{_count(m.parameters)} ({m.parameters:,})"),
            ("quantization", m.quantization), ("layers", d.precision), ("bits/weight", f"{d.bits_per_weight:.2f}")]
    if d.method:
        rows.append(("chosen by", method_text(d.method)))
    rows += [("context", f"{d.context_length:,} tokens" if d.context_length else "unknown"),
             ("size", size(m.size)), ("path", str(m.path)), ("where", m.where)]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")
    if d.template is None:
        click.echo(f"{'template':<{width}}  none (the model takes raw text)")
        return
    lines = d.template.splitlines()
    shown = lines if whole_template else lines[:TEMPLATE_LINES]
    click.echo(f"{'template':<{width}}  " + (f"\n{'':<{width}}  ".join(shown)))
    if len(shown) < len(lines):
        click.echo(f"{'':<{width}}  ... {len(lines) - len(shown)} more lines (--template shows them all)")


@main.command("inspect")
@click.argument("prompt")
@with_options(MODEL_OPTIONS)
@click.option("--steps", type=click.IntRange(1), default=5, show_default=True, help="Tokens to generate.")
@click.option("--top", type=click.IntRange(1), default=5, show_default=True, help="Candidates shown per step.")
@click.option("--temp", type=click.FloatRange(0), default=0.7, show_default=True,
              help="Temperature whose effect is shown.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=0.9, show_default=True,
              help="Top-p whose effect is shown.")
@click.option("--system", help="System prompt.")
@click.option("--raw", is_flag=True, help="Use the prompt as it is, without the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@IMAGE_OPTION
@PIPELINE_OPTION
def inspect_command(prompt, model, dtype, steps, top, temp, top_p, system, raw, as_json, images, pipeline) -> None:
    """Show the pipeline for PROMPT stage by stage: the images' patches, tokens and positions (with
    --image), tokens, embedding, layers, KV cache, prefill and decode time, and each step's
    next-token distribution."""
    from ..engine.batch import BatchGenerator
    from ..engine.inspection import inspect_pipeline
    from .inspect_report import render
    from ..loading.store import stored_weights
    from .store import open_model
    from .terminal import typed_text

    prompt, system = typed_text(prompt), typed_text(system) if system is not None else None
    m, tokenizer, where = open_model(model, dtype, pipeline=pipeline)
    engine = BatchGenerator(m, tokenizer, max_batch=1)
    prepared = engine.prepare(engine.request(chat_prompt(tokenizer, prompt, system, raw, images)))
    report = inspect_pipeline(m, tokenizer, prepared.ids, steps=steps, top=top, temperature=temp, top_p=top_p,
                              images=prepared.images)
    report["weights"] = stored_weights(where)
    if as_json:
        click.echo(json.dumps({"model": str(where), "prompt": prompt, **report}))
    else:
        click.echo(render(report, f"mlxinfer inspect: {model_name(where)}, prompt {prompt!r}"))


@main.command()
@click.argument("model_argument", metavar="[MODEL]", required=False)
@with_options(MODEL_OPTIONS)
@click.option("--prompt-tokens", default=512, show_default=True, help="Random prompt length.")
@click.option("--gen-tokens", default=128, show_default=True, help="Tokens to generate (EOS ignored).")
@click.option("--repeat", default=5, show_default=True, help="Measured runs (after one warm-up).")
@click.option("--max-kv-size", type=int, default=None, help="Rotating cache size.")
@click.option("--kv-bits", type=click.Choice(["4", "8"]), default=None, help="Quantize the KV cache.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def bench(model_argument, model, dtype, prompt_tokens, gen_tokens, repeat, max_kv_size, kv_bits, as_json):
    """Prefill and decode speed, time to first token and peak memory for MODEL (or --model:
    anything --model accepts; default: the demo model)."""
    from .bench import bench as run_bench
    from .store import open_model

    if model_argument is not None and model is not None:
        raise click.UsageError("give the model once: as MODEL or as --model")
    m, tok, where = open_model(model if model is not None else model_argument, dtype)
    s = run_bench(m, tok, prompt_tokens, gen_tokens, repeat, max_kv_size=max_kv_size,
                  kv_bits=int(kv_bits) if kv_bits else None)
    if as_json:
        click.echo(json.dumps({"model": str(where), "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens,
                               **s.as_dict()}))
        return
    click.echo(f"model {model_name(where)}: {prompt_tokens} prompt tokens, {gen_tokens} generated, "
               f"{s.runs} runs (median [min-max])")
    rows = [("prefill tok/s", s.prefill_tps, 1, ".1f"), ("decode tok/s", s.decode_tps, 1, ".1f"),
            ("TTFT ms", s.ttft, 1000, ".1f"), ("peak memory MiB", s.peak_memory, 1 / 2**20, ".1f")]
    for name, (med, lo, hi), scale, fmt in rows:
        click.echo(f"  {name:<16} {med * scale:{fmt}} [{lo * scale:{fmt}}-{hi * scale:{fmt}}]")

SERVE_MODEL_HELP = ("A model to serve: a local folder, hub id, .gguf file or a name from `mlxinfer models`, as NAME=PATH "
                    "to serve it as NAME (repeatable; the first is the default for requests that name none). "
                    "Default: every model `mlxinfer models` lists, by its name.")


@main.command(epilog="Every API, its clients and the limits: docs/serving.md")
@click.option("--model", "-m", "models", multiple=True, metavar="[NAME=]MODEL", help=SERVE_MODEL_HELP)
@with_options(MODEL_OPTIONS[1:])
@click.option("--keep-alive", type=Duration(), default="5m", show_default=True,
              help="How long a model stays loaded after its last request (e.g. 30s, 10m, 1h; 0: unload once idle; "
                   "negative: keep loaded). A request's keep_alive overrides it for its model.")
@click.option("--max-loaded-models", type=click.IntRange(1), default=3, show_default=True,
              help="Models loaded at once (3, as Ollama); loading another unloads the least recently used idle one.")
@click.option("--memory-budget", type=ByteSize(), default=None,
              help="Memory the loaded models may hold together, each counted as its weights, its prompt-cache limit "
                   "and its K/V (--max-concurrency x --max-kv-size tokens; without it, 4096) (e.g. 24GiB; default: "
                   "the wired limit on Metal, else 3/4 of memory).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback by default).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--max-concurrency", type=click.IntRange(1), default=8, show_default=True,
              help="Requests decoded together, per model; more wait in the queue.")
@click.option("--max-queue", type=click.IntRange(0), default=32, show_default=True,
              help="Requests that may wait for a slot, per model; past that the server answers 503 with Retry-After.")
@click.option("--max-kv-size", type=click.IntRange(2), help="Rotating KV cache of this many tokens per request.")
@click.option("--kv-bits", type=click.Choice(["4", "8"]), help="Quantize the KV cache.")
@click.option("--prompt-cache-bytes", type=ByteSize(), default="1GiB", show_default=True,
              help="K/V of finished requests kept for reuse by later ones, per model (e.g. 512MiB, 2GB, 0: off).")
@click.option("--draft-model", help="A small model of the default model's family that drafts tokens while one request "
              "runs on it.")
@click.option("--prompt-lookup", is_flag=True, help="Draft tokens by copying from the context while one request runs.")
@click.option("--api-key", help="Require 'Authorization: Bearer KEY' on /v1 requests.")
@click.option("--cors", "cors", help="Allow browser requests from this origin.")
@click.option("--allowed-host", "allowed_host", multiple=True, metavar="NAME",
              help="Also answer requests whose Host header names NAME (repeatable; '*': any). Loopback names and "
                   "the --host address are always allowed.")
@click.option("--max-connections", type=click.IntRange(8), default=128, show_default=True,
              help="Open connections at most (fewer when the descriptor limit is lower); past it the longest-idle "
                   "one is closed.")
@click.option("--responses-store", type=click.IntRange(0), default=256, show_default=True,
              help="Responses API responses kept in memory for GET /v1/responses/{id} and previous_response_id "
                   "(the least recently used go first; 0: none).")
@click.option("--responses-store-bytes", type=ByteSize(), default="256MiB", show_default=True,
              help="Bytes the kept responses may hold in all, their inputs included, as JSON (e.g. 64MiB, 1GB); the "
                   "least recently used go first, and one larger than this alone is not kept.")
@click.option("--adapter", "adapters", multiple=True, metavar="NAME=DIR",
              help="A LoRA adapter on the default model, served as BASE:NAME (repeatable; DIR alone: named after its "
                   "folder).")
@click.option("--max-adapters", type=click.IntRange(0), default=8, show_default=True,
              help="Most adapters loaded at once on one model (--adapter and POST /v1/adapters together).")
@click.option("--no-web", "no_web", is_flag=True, help="Serve no chat page at / (the APIs only).")
@click.option("--allow-image-urls", is_flag=True,
              help="Fetch http(s) image URLs in requests (a vision-language model; each bounded in bytes and "
                   "seconds), from public addresses only. Without it images come inline, as data: URLs.")
@click.option("--allow-image-hosts", "image_hosts", multiple=True, metavar="HOST[,HOST]",
              help="With --allow-image-urls, also fetch from these hosts (names or addresses, as URLs write "
                   "them) whatever address they are at: loopback, private, link-local (repeatable).")
@click.option("--image-url-timeout", type=click.FloatRange(0, min_open=True), default=None,
              help="Seconds a request's image URLs may take to download, all of them, with --allow-image-urls "
                   "(default: 10).")
@click.option("--images-per-request", type=click.IntRange(1), default=None,
              help="Images one request may hold (default: 16).")
@click.option("--pixels-per-request", type=click.IntRange(1), default=None,
              help="Pixels one request's images may hold together, width x height summed (default: 128000000; "
                   "each image: at most 64000000).")
@click.option("--prefill-step", type=click.IntRange(1), default=PREFILL_STEP, show_default=True,
              help="Prompt tokens per prefill chunk (one chunk's activations are held at once).")
@PIPELINE_OPTION
def serve(models, dtype, keep_alive, max_loaded_models, memory_budget, host, port, max_concurrency, max_queue,
          max_kv_size, kv_bits, prompt_cache_bytes, draft_model, prompt_lookup, api_key, cors, allowed_host,
          max_connections, responses_store, responses_store_bytes, adapters, max_adapters, no_web, allow_image_urls,
          image_hosts, image_url_timeout, images_per_request, pixels_per_request, prefill_step, pipeline) -> None:
    """Serve models over OpenAI's HTTP API (chat and text completions, streaming) and Anthropic's,
    with a chat page at / (unless --no-web). Each request's `model` picks one; a model loads on
    its first request and unloads after --keep-alive idle, or when another needs its room.
    Each loaded model has its own engine: requests to different models run at once, and one
    model's concurrent requests are decoded together. Ctrl-C stops after the requests in flight."""
    from ..engine.replica import Replica, pool_for, run_front_end
    from ..loading.adapters import load_adapter
    from ..serve.guard import allowed_hosts
    from ..serve.inspect import attention_offered
    from ..serve.app import ServerConfig, create_app, run
    from ..serve.models import Models, Policy, Served
    from ..models.shard import launched, rank_zero
    from ..models.shard import summary as shard_summary
    from ..text.images import DATA, HTTP, LIMITS
    from .serve import Opening, demo_default, entry, listed, named
    from .store import open_model
    from .terminal import spinner

    if image_hosts and not allow_image_urls:
        raise click.UsageError("--allow-image-hosts names hosts image URLs may also be fetched from: pass "
                               "--allow-image-urls too")
    if draft_model and prompt_lookup:
        raise click.UsageError("--draft-model and --prompt-lookup are alternatives: pass one of them")
    no_drafting_across_ranks(bool(draft_model or prompt_lookup))
    if launched() and len(models) > 1:
        raise click.UsageError("under mlx.launch the ranks serve one model together: pass one --model")
    if rank_zero():
        check_free(host, port)
    guarded = attention_offered(host, api_key)  # on a loopback address, or behind a key
    if not guarded:
        click.echo(f"warning: listening on {host} without --api-key: anyone who can reach it can use it", err=True)
    if len(adapters) > max_adapters:
        raise click.UsageError(f"{len(adapters)} --adapter options but --max-adapters is {max_adapters}")
    options: dict[str, Any] = {"prefill_step": prefill_step, "max_kv_size": max_kv_size,
                               "kv_bits": int(kv_bits) if kv_bits else None,
                               "prompt_lookup": prompt_lookup or None,
                               "image_sources": frozenset({DATA, HTTP} if allow_image_urls else {DATA}),
                               "image_limits": replace(
                                   LIMITS, url_seconds=image_url_timeout or LIMITS.url_seconds,
                                   max_images=images_per_request or LIMITS.max_images,
                                   max_request_pixels=pixels_per_request or LIMITS.max_request_pixels,
                                   allowed_hosts=frozenset(",".join(image_hosts).split(",")))}
    options = {k: v for k, v in options.items() if v is not None}
    limits = {"max_concurrency": max_concurrency, "max_queued": max_queue}

    def listen(served: Models) -> None:
        loaded = served.loaded()
        one = loaded[0] if len(served.listing()) == 1 and loaded else None
        # a vision-language model's requests carry images inline: room for one of the largest, base64-encoded
        images = one is None or one.model.image_token_id is not None
        max_body = (4 << 20) + (LIMITS.max_bytes * 4 // 3 if images else 0)
        config = ServerConfig(api_key=api_key, cors=cors, hosts=allowed_hosts(host, allowed_host),
                              responses_store=responses_store, responses_store_bytes=responses_store_bytes,
                              max_adapters=max_adapters, max_body=max_body, web=not no_web, attention=guarded)
        split = shard_summary(one.model) if one is not None else None
        page = "" if no_web else f"; chat at http://{host}:{port}/"
        names = ", ".join(e.name for e in served.listing())
        click.echo(f"serving {names} at http://{host}:{port}/v1{page} (Ctrl-C stops)" + (f" [{split}]" if split else ""),
                   err=True)
        run(create_app(served, config), served, host, port, max_connections)

    if launched():  # every rank loads its part of the one model
        m, tokenizer, where = open_model(models[0] if models else None, dtype, pipeline=pipeline)
        for spec in adapters:
            adapter, _, folder = spec.rpartition("=")
            load_adapter(m, folder, adapter or None)
        if prompt_cache_bytes:
            options["pool"] = pool_for(m, prompt_cache_bytes)
        name = named(models)[0].name if models else model_name(where)

        def sharded(replica: Replica | None) -> None:
            from ..serve.engine_thread import EngineThread

            engine = EngineThread(replica, max_queued=max_queue)
            listen(Models.of(Served(name, engine, m, tokenizer, m.config.max_position_embeddings, where, 0,
                                    time.time())))

        run_front_end(sharded, m, tokenizer, max_batch=max_concurrency, **options)
        return
    entries = named(models) if models else listed()
    default = entries[0].name if models else demo_default(entries)
    if not entries:  # nothing on this machine yet: the demo model, as `serve` always offered
        entries = [entry(*_demo())]
        default = entries[0].name
    opening = Opening(default, dtype, max_concurrency, max_queue, prompt_cache_bytes, options, adapters, draft_model,
                      {k: options[k] for k in ("max_kv_size", "kv_bits") if k in options})
    policy = Policy(keep_alive, max_loaded_models, memory_budget or 0)
    # with --model, those models; without, the store as it is now (`Models.refresh` after a pull or delete)
    registry = Models(lambda: entries if models else listed() or entries, opening, opening.estimate, policy, default,
                      limits=limits)
    if default is not None and (models or len(entries) == 1):
        with spinner(f"loading {default}"):
            registry.preload(default)
    listen(registry)


def _demo() -> tuple[str, Path]:
    from .demo import NAME
    from .store import resolve_model

    return NAME, resolve_model(None)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Where the server listens.")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def ps(host: str, port: int, as_json: bool) -> None:
    """The models a running server (`mlxinfer serve`, or Ollama) has loaded: the memory each
    takes and when it unloads unless used."""
    from .ps import running, until
    from .terminal import size

    found = running(host, port)
    if as_json:
        click.echo(json.dumps([{**m.__dict__, "expires_at": m.expires_at.isoformat() if m.expires_at else None}
                               for m in found]))
        return
    if not found:
        click.echo(f"no model is loaded on the server at {host}:{port}; its first request to a model loads it")
        return
    rows = [("NAME", "SIZE", "FAMILY", "PARAMETERS", "QUANTIZATION", "UNTIL")]
    rows += [(m.name, size(m.size), m.family, m.parameters, m.quantization, until(m.expires_at)) for m in found]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def check_free(host: str, port: int) -> None:
    """Fail before loading a model when the address cannot be listened on."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(infos[0][4])
    except OSError as e:
        raise click.UsageError(f"cannot listen on {host}:{port} ({e.strerror or e}); pass another --port or --host")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def doctor(as_json: bool) -> None:
    """The environment (MLX, device, memory) and, on Metal, every custom kernel checked against its reference;
    a kernel that disagrees is disabled for the session and the reference runs instead."""
    from . import doctor as checks
    from .. import kernels

    if not as_json:
        for line in checks.report():
            click.echo(line)
        return
    ran = kernels.mode() == "auto" and kernels.metal_available()
    click.echo(json.dumps({"environment": dict(checks.environment()),
                           "checks": [{**asdict(c), "ok": c.ok} for c in checks.run_checks()] if ran else [],
                           "disabled": kernels.disabled(), "in_use": kernels.selection()}))


from ..convert.cli import convert_command  # noqa: E402

main.add_command(convert_command, "convert")

