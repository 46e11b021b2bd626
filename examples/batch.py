"""Several prompts decoded together, each in its own stream; one JSON line per finished prompt.

    python examples/batch.py [MODEL] ["Name a planet." "Name a river." ...]

MODEL is a name `mlxinfer models` lists or a folder (default: the demo model, SmolLM2-135M-Instruct).
"""

import json
import sys

import mlxinfer

DEMO_MODEL = "SmolLM2-135M-Instruct"  # what `mlxinfer chat` fetches; works offline once cached


def main() -> None:
    model, tokenizer = mlxinfer.load(sys.argv[1] if len(sys.argv) > 1 else DEMO_MODEL)
    prompts = sys.argv[2:] or ["Name a planet.", "Name a river."]
    engine = mlxinfer.BatchGenerator(model, tokenizer, max_tokens=32)
    index = {engine.submit(prompt): i for i, prompt in enumerate(prompts)}
    texts = [""] * len(prompts)
    for uid, chunk in engine.stream():  # chunks of all prompts, interleaved as they are decoded
        i = index[uid]
        texts[i] += chunk.text
        if chunk.finish_reason:
            print(json.dumps({"prompt": i, "text": texts[i], "finish_reason": chunk.finish_reason,
                              "tokens": chunk.stats.generated_tokens}))


if __name__ == "__main__":
    main()
