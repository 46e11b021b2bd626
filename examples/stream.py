"""Stream a chat reply token by token, then print the generation stats.

    python examples/stream.py [MODEL] [QUESTION]

MODEL is a name `mlxinfer models` lists or a folder (default: the demo model, SmolLM2-135M-Instruct).
"""

import sys

import mlxinfer

DEMO_MODEL = "SmolLM2-135M-Instruct"  # what `mlxinfer chat` fetches; works offline once cached


def main(model_path: str = DEMO_MODEL, question: str = "Name three planets.", max_tokens: int = 64) -> None:
    model, tokenizer = mlxinfer.load(model_path)
    messages = [{"role": "user", "content": question}]
    stats = None
    for chunk in mlxinfer.stream_generate(model, tokenizer, messages, max_tokens=max_tokens, temperature=0.7, seed=0):
        print(chunk.text, end="", flush=True)
        stats = chunk.stats
    print()
    print(
        f"[{stats.prompt_tokens} prompt tokens, {stats.generated_tokens} generated, "
        f"TTFT {stats.ttft * 1000:.0f} ms, prefill {stats.prefill_tps:.0f} tok/s, "
        f"decode {stats.decode_tps:.1f} tok/s, finish: {stats.finish_reason}]"
    )


if __name__ == "__main__":
    main(*sys.argv[1:3])
