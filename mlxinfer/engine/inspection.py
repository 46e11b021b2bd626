"""`mlxinfer inspect`: the pipeline made visible, stage by stage, for one prompt.

(images → patches → tokens and positions) → tokens → embedding → transformer layers → KV cache → prefill and decode → next-token
distribution, and how temperature and top-p reshape it. `inspect_pipeline` returns
plain data (what `--json` prints; `inspect_report.render` turns it into text for a terminal).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..models.cache import StateCache
from ..models.prompt_cache import PromptCache
from ..base.errors import InvalidOptionError
from .prompt import ImagePrompt
from ..models.config import SLIDING
from ..models.layers import Attention
from ..models.moe import SwitchGLU
from ..decode.sample import SamplingConfig, filtered_probs
from ..models.shard import layout
from ..models.vision import image_spans
from ..base.slices import Slices, run_whole
from ..text.tokenizer import Tokenizer


def inspect_pipeline(
    model, tokenizer: Tokenizer, prompt: list[int], steps: int = 5, top: int = 5,
    temperature: float = 0.7, top_p: float = 0.9, images: ImagePrompt | None = None,
) -> dict[str, Any]:
    """Run `prompt` (with `images`, its pictures as the engine prepared them) through the model,
    recording each stage; decode `steps` tokens greedily, showing the `top` most likely next
    tokens and their probability after `temperature` and after `top_p` on top of it."""
    return run_whole(inspect_slices(model, tokenizer, prompt, steps, top, temperature, top_p, images))


def inspect_slices(
    model, tokenizer: Tokenizer, prompt: list[int], steps: int = 5, top: int = 5,
    temperature: float = 0.7, top_p: float = 0.9, images: ImagePrompt | None = None, chunk: int = 512,
) -> Slices[dict[str, Any]]:
    """`inspect_pipeline` in slices (`slices`): the prompt is prefilled `chunk` tokens at a time,
    then each decode step is one slice; the timings count the work, not the time between slices."""
    cache = PromptCache.for_model(model)
    start = time.perf_counter()
    embedded = seen = None
    if images is not None:
        embedded = model.embedded(prompt, images.pixels)
        seen = image_view(model, prompt, images, embedded)
    keys = images.keys if images is not None else prompt
    prefill_s = 0.0
    for _ in cache.prefill_slices(model, prompt[:-1], chunk, embedded, keys[:-1]):
        prefill_s += time.perf_counter() - start
        yield
        start = time.perf_counter()
    last = None if embedded is None else embedded.slice(len(prompt) - 1, len(prompt))
    logits = cache.run(model, prompt[-1:], last, keys[-1:])[-1]
    mx.eval(logits)
    prefill_s += time.perf_counter() - start
    prompt_bytes = cache.nbytes
    per_token = sum(c.bytes_per_token for c in cache.caches)
    eos = set(tokenizer.eos_token_ids)
    decoded: list[dict[str, Any]] = []
    decode_s = 0.0
    for _ in range(steps):
        step = next_token_view(tokenizer, logits, top, temperature, top_p)
        decoded.append(step)
        token = step["chosen"]["id"]
        if token in eos or len(decoded) == steps:
            break
        yield
        start = time.perf_counter()
        logits = cache.run(model, [token])[-1]
        mx.eval(logits)
        decode_s += time.perf_counter() - start
    decode_tokens = len(decoded) - 1  # the first token came out of the prefill
    return {
        "sharding": layout(model),
        **({"images": seen} if seen is not None else {}),
        "tokens": [{"id": t, "text": p} for t, p in zip(prompt, tokenizer.pieces(prompt))],
        "embedding": embedding_view(model, len(prompt)),
        "layers": layers_view(model),
        "kv_cache": {"bytes_per_token": per_token, "prompt_bytes": prompt_bytes, "prompt_tokens": len(prompt),
                     "dtype": str(next(c.keys[0] for c in cache.caches if c.arrays() and not isinstance(c, StateCache)
                                       ).dtype).removeprefix("mlx.core."),
                     "state_bytes": sum(c.nbytes for c in cache.caches if isinstance(c, StateCache)),
                     "state_layers": sum(isinstance(c, StateCache) for c in cache.caches)},
        "timing": {
            "prefill_tokens": len(prompt), "prefill_s": prefill_s, "prefill_tps": len(prompt) / prefill_s,
            "decode_tokens": decode_tokens, "decode_s": decode_s,
            "decode_tps": decode_tokens / decode_s if decode_s else 0.0,
        },
        "sampling": {"temperature": temperature, "top_p": top_p, "choice": "greedy (the most likely token)"},
        "steps": decoded,
        "generated": tokenizer.decode([step["chosen"]["id"] for step in decoded]),
    }


def image_view(model, prompt: list[int], images: ImagePrompt, embedded) -> dict[str, Any]:
    """The image stage: each image's pixel tensor, patch grid, tokens, where they sit in the prompt
    and the positions they take (Qwen-VL's M-RoPE: (t, h, w) ranges; else one position per token)."""
    out = []
    for px, (start, end) in zip(images.pixels, image_spans(prompt, model.image_token_id, images.pixels)):
        entry: dict[str, Any] = {"pixel_values": list(px.values.shape), "tokens": px.tokens, "span": [start, end],
                                 "digest": px.digest[:16]}
        if px.grid is not None:
            entry.update(grid_thw=list(px.grid), patches=int(np.prod(px.grid)))
        if embedded.positions is not None:
            pos = np.array(embedded.positions[:, start:end])
            entry["positions"] = {axis: [int(pos[i].min()), int(pos[i].max())] for i, axis in enumerate("thw")}
        out.append(entry)
    processor = model.image_processor
    return {"processor": processor.kind, "settings": {"size": list(processor.size), "patch": processor.patch_size,
                                                      "merge": processor.merge_size} if processor.kind == "qwen2_vl"
            else {"size": list(processor.size)}, "images": out, "position_delta": embedded.position_delta,
            "bidirectional": [list(s) for s in embedded.bidirectional]}


def next_token_view(tokenizer: Tokenizer, logits: mx.array, top: int, temperature: float, top_p: float) -> dict:
    """The model's next-token distribution, reshaped by temperature and by temperature plus top-p."""
    row = logits.astype(mx.float32)[None]
    raw = mx.softmax(row, axis=-1, precise=True)[0]
    warmed = filtered_probs(row, SamplingConfig(temperature=temperature))[0]
    nucleus = filtered_probs(row, SamplingConfig(temperature=temperature, top_p=top_p))[0]
    best = mx.argsort(-raw)[:top].tolist()
    chosen = best[0]

    def entry(t: int) -> dict[str, Any]:
        return {"id": t, "text": tokenizer.decode([t]), "p": raw[t].item(), "p_temperature": warmed[t].item(),
                "p_top_p": nucleus[t].item()}

    return {"chosen": entry(chosen), "top": [entry(t) for t in best], "top_p_keeps": int((nucleus > 0).sum().item())}


class _Tap(nn.Module):
    """Stands in for the chosen layer's attention and keeps its input: a module that is not an
    `Attention`, so the block takes its per-op path (the fused one never calls its mixer). The
    rest of the forward pass is built on its zeros but never evaluated."""

    def __call__(self, x: mx.array, mask, cache=None, positions=None) -> mx.array:
        self.x = x
        return mx.zeros_like(x)


def attention_weights(model, prompt: list[int], layer: int, head: int) -> list[float]:
    """How the last token of `prompt` attends over all of it in `layer`'s `head`: the softmax
    weights, one per token."""
    return run_whole(attention_slices(model, prompt, layer, head))


def attention_slices(model, prompt: list[int], layer: int, head: int, chunk: int = 512) -> Slices[list[float]]:
    """`attention_weights` in slices (`slices`): the prompt but its last token is prefilled
    `chunk` tokens at a time through the layers up to the chosen one (those above it are never
    run); the last token then runs up to that layer's attention, whose input is taken there, and
    the weights the fused kernel never forms are spelled out by the layer itself over what its
    cache keeps (`Attention.last_weights`)."""
    layers = model.layers
    if not 0 <= layer < len(layers):
        raise InvalidOptionError(f"layer {layer} does not exist; this model has layers 0 to {len(layers) - 1}")
    block = layers[layer]
    mixer = block[block.mixer_name] if block.attends else None
    if not isinstance(mixer, Attention):
        raise InvalidOptionError(f"layer {layer} mixes tokens by {type(mixer).__name__}, not by attention weights "
                                 "over the context; choose a grouped-query attention layer")
    if not 0 <= head < mixer.n_heads:
        raise InvalidOptionError(f"head {head} does not exist; layer {layer} has heads 0 to {mixer.n_heads - 1}")
    cache = PromptCache.for_model(model)
    below = cache.caches[: layer + 1]  # what the chosen layer's input comes through: the layers above never run
    for i in range(0, len(prompt) - 1, chunk):
        cache.run(model, prompt[i : min(i + chunk, len(prompt) - 1)])  # built through every layer, run up to it
        mx.eval([c.arrays() for c in below])
        yield
    block[block.mixer_name] = tap = _Tap()
    try:
        cache.run(model, prompt[-1:])
    finally:
        block[block.mixer_name] = mixer
    return mixer.last_weights(tap.x, cache.caches[layer], block.window)[head].tolist()


def embedding_view(model, tokens: int) -> dict[str, Any]:
    cfg = model.config
    embed = model.model.embed_tokens
    embed = getattr(embed, "inner", embed)  # a vocabulary-sharded embedding: this rank's rows
    if isinstance(embed, nn.QuantizedEmbedding):
        stored = f"{embed.bits}-bit g{embed.group_size}, {str(embed.scales.dtype).removeprefix('mlx.core.')} scales"
    else:
        stored = str(embed.weight.dtype).removeprefix("mlx.core.")
    return {"shape": [cfg.vocab_size, cfg.hidden_size], "stored": stored, "output_shape": [1, tokens, cfg.hidden_size]}


def attention_view(model) -> tuple[str, str]:
    """How attention shares keys and values, and what the cache keeps per token and layer."""
    cfg = model.config
    mla = getattr(next(layer for layer in model.layers if layer.attends).self_attn, "mla", None)
    if mla is not None:
        return (f"multi-head latent ({mla.heads} heads rebuild keys and values from one shared latent)",
                f"a {mla.kv_lora_rank}-dim latent + a {mla.rope_dim}-dim rotary key")
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if kv == heads:
        kind = "multi-head (one KV head per query head)"
    elif kv == 1:
        kind = "multi-query (all query heads share one KV head)"
    else:
        kind = f"grouped-query ({heads // kv} query heads share each KV head)"
    return kind, f"keys and values, {kv} KV heads x {cfg.head_dim} dims"


def mlp_view(model) -> str:
    """The feed-forward: gated MLP, or a mixture of gated experts in some layers."""
    cfg = model.config
    gate = "GeGLU" if cfg.hidden_act.startswith("gelu") else "SwiGLU"
    moe = [m for _, m in model.named_modules() if isinstance(m, SwitchGLU)]
    if not moe:
        return f"{cfg.hidden_act} gated ({gate})"
    experts = moe[0].gate_proj.weight.shape[0]
    per_token = cfg.raw.get("num_experts_per_tok", "?")
    return (f"mixture of experts ({per_token} of {experts} {gate} experts per token) in {len(moe)} of "
            f"{cfg.num_hidden_layers} layers")


def layers_view(model) -> dict[str, Any]:
    cfg = model.config
    kind, cached = attention_view(model)
    sliding = sum(1 for t in cfg.layer_types if t == SLIDING)
    return {
        "count": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "attention": kind, "cached": cached,
        "sliding_window_layers": sliding, "sliding_window": cfg.sliding_window if sliding else None,
        "mlp": mlp_view(model), "intermediate_size": cfg.intermediate_size,
        "norm": f"RMSNorm (eps {cfg.rms_norm_eps:g})", "rope": {"theta": cfg.rope.theta, "scaling": cfg.rope.kind},
        "qk_norm": cfg.qk_norm, "lm_head": "tied to the embedding" if cfg.tie_word_embeddings else "own matrix",
        "recurrent": {kind: cfg.layer_types.count(kind) for kind in cfg.recurrent_kinds},
    }


