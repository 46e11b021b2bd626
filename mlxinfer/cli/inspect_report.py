"""`mlxinfer inspect`'s report as text for a terminal: each stage of `inspection.inspect_pipeline`'s
plain data (what `--json` prints) as lines that fit the width."""

from __future__ import annotations

from typing import Any

from ..loading.quant_summary import method_text
from .terminal import size


def _images_text(v: dict[str, Any]) -> str:
    lines = [f"0. images    {v['processor']} processor {v['settings']}; positions after the prompt shift by "
             f"{v['position_delta']}" + (f"; image tokens attend both ways within {v['bidirectional']}"
                                         if v["bidirectional"] else "")]
    for i, im in enumerate(v["images"]):
        grid = f", grid t*h*w {im['grid_thw']} = {im['patches']} patches" if "grid_thw" in im else ""
        pos = f", positions t/h/w {im['positions']}" if "positions" in im else ""
        lines.append(f"   image {i + 1}: pixel_values {im['pixel_values']}{grid} -> {im['tokens']} tokens at "
                     f"[{im['span'][0]}, {im['span'][1]}){pos}  (sha256 {im['digest']}...)")
    return "\n".join(lines)


def render(report: dict[str, Any], title: str, width: int = 100) -> str:
    """The report as text that reads well in a terminal."""
    split = [_sharding_text(report["sharding"])] if report.get("sharding") else []
    split += [_images_text(report["images"])] if report.get("images") else []
    head = f"{title}\n{_weights_text(report['weights'])}" if report.get("weights") else title
    sections = [head, *split, _tokens_text(report["tokens"], width), _embedding_text(report["embedding"]),
                _layers_text(report["layers"], report["embedding"]["shape"]),
                _cache_text(report["kv_cache"], report["layers"]), _timing_text(report["timing"]),
                _steps_text(report["steps"], report["sampling"]), f"   generated: {report['generated']!r}"]
    return "\n\n".join(sections)


def _weights_text(w: dict[str, Any]) -> str:
    """How the weights were quantized: bits per weight over every stored tensor, the bits per layer, the method."""
    how = f"; method {method_text(w['method'])}" if w.get("method") else ""
    return (f"   weights: {w['bits_per_weight']:.3f} bits/weight (every stored tensor, embedding and LM head "
            f"included); {w['precision']}{how}")


def _sharding_text(s: dict[str, Any]) -> str:
    ranks = ", ".join(f"rank {r}: {size(b)}" + (f" ({n} layers)" if s["mode"] == "pipeline" else "")
                      for r, (b, n) in enumerate(zip(s["weight_bytes"], s["layers"])))
    how = ("pipeline (each rank runs a run of layers and hands the hidden state on)" if s["mode"] == "pipeline" else
           f"tensor-parallel ({s['heads_here']} query heads per rank and their share of every matrix"
           f"{_kv_split_text(s['kv_heads'])})")
    return (f"0. Sharding: {s['ranks']} ranks, {how}; weights {ranks}; {size(s['sent_per_token'])} sent per token "
            f"by each rank. What follows is rank {s['rank']}'s part.")


def _kv_split_text(kv: dict[str, int] | None) -> str:
    """How the KV heads (and their cache) sit on the ranks: split, or copied when fewer than the ranks."""
    if kv is None:
        return ""
    if kv["replicas"] > 1:
        each = "each " if kv["total"] > 1 else ""
        return f"; KV heads: {kv['total']}, {each}replicated on {kv['replicas']} ranks"
    return f"; KV heads: {kv['total']}, {kv['here']} per rank"


def _tokens_text(tokens: list[dict[str, Any]], width: int) -> str:
    lines, line = [f"1. Tokens: {len(tokens)} (id:text)"], "  "
    for tok in tokens:
        cell = f" {tok['id']}:{tok['text']!r}"
        if len(line) + len(cell) > width:
            lines.append(line)
            line = "  "
        line += cell
    return "\n".join([*lines, line])


def _embedding_text(emb: dict[str, Any]) -> str:
    v, h = emb["shape"]
    shape = " x ".join(map(str, emb["output_shape"]))
    return f"2. Embedding: a {v} x {h} matrix ({emb['stored']}) turns the ids into a {shape} array"


def _layers_text(lay: dict[str, Any], shape: list[int]) -> str:
    v, h = shape
    window = ""
    if lay["sliding_window_layers"]:
        window = f"; {lay['sliding_window_layers']} layers see a sliding window of {lay['sliding_window']}"
    qk = "q/k RMSNorm; " if lay["qk_norm"] else ""
    others = lay.get("recurrent") or {}
    mixer = " or ".join([f"attention ({lay['count'] - sum(others.values())})",
                         *(f"{kind} ({n})" for kind, n in others.items())]) if others else "attention"
    stack = (f"3. Transformer: {lay['count']} layers, each RMSNorm -> {mixer} -> RMSNorm -> {lay['mlp']} "
             f"({h} -> {lay['intermediate_size']} -> {h})")
    attention = (f"   attention: {lay['heads']} query heads, {lay['kv_heads']} KV heads, head dim {lay['head_dim']}: "
                 f"{lay['attention']}{window}")
    positions = (f"   positions: RoPE theta {lay['rope']['theta']:g} ({lay['rope']['scaling']}); {qk}"
                 f"final {lay['norm']}, LM head {lay['lm_head']} -> {v} logits")
    return f"{stack}\n{attention}\n{positions}"


def _cache_text(kv: dict[str, Any], lay: dict[str, Any]) -> str:
    layers = lay["count"] - kv.get("state_layers", 0)
    state = ""
    if kv.get("state_layers"):  # recurrent layers: a fixed-size state, whatever the length
        state = (f"; the other {kv['state_layers']} layers keep a recurrent state of {size(kv['state_bytes'])} "
                 "per sequence, whatever its length")
    return (f"4. KV cache: {kv['bytes_per_token']:,} bytes per token ({kv['dtype']}, {layers} layers x "
            f"{lay['cached']}); "
            f"{size(kv['prompt_bytes'])} for the {kv['prompt_tokens']}-token prompt{state}")


def _timing_text(t: dict[str, Any]) -> str:
    decode = "no decode step"
    if t["decode_tokens"]:
        decode = (f"decode {t['decode_tokens']} tokens in {t['decode_s'] * 1000:.0f} ms "
                  f"({t['decode_tps']:.1f} tok/s, one token per step)")
    return (f"5. Time: prefill {t['prefill_tokens']} tokens in {t['prefill_s'] * 1000:.0f} ms "
            f"({t['prefill_tps']:.0f} tok/s, all at once); {decode}")


def _steps_text(steps: list[dict[str, Any]], sampling: dict[str, Any]) -> str:
    header = (f"6. Next token, step by step: {sampling['choice']} is marked ->; columns: probability, "
              f"after temperature {sampling['temperature']:g}, after top-p {sampling['top_p']:g} on top of it")
    lines = [header]
    for i, step in enumerate(steps, 1):
        lines.append(f"   step {i}: top-p keeps {step['top_p_keeps']} token(s)")
        for e in step["top"]:
            mark = "->" if e["id"] == step["chosen"]["id"] else "  "
            lines.append(f"   {mark} {e['text']!r:<18} {e['id']:>7}  {e['p']:7.1%}  {e['p_temperature']:7.1%}  "
                         f"{e['p_top_p']:7.1%}")
    return "\n".join(lines)
