"""Load a model and show its most likely next tokens for a prompt.

    python examples/next_token.py [MODEL] [PROMPT]

MODEL is a name `mlxinfer models` lists or a folder (default: the demo model, SmolLM2-135M-Instruct).
"""

import sys

import mlxinfer  # first: it binds a fast BLAS before mlx.core loads (see mlxinfer.base.blas)
import mlx.core as mx  # noqa: I001

DEMO_MODEL = "SmolLM2-135M-Instruct"  # what `mlxinfer chat` fetches; works offline once cached


def main(model_path: str = DEMO_MODEL, prompt: str = "The capital of France is", top: int = 5) -> None:
    model, tokenizer = mlxinfer.load(model_path)
    ids = tokenizer.encode(prompt)
    logits = model(mx.array([ids]))[0, -1]
    probs = mx.softmax(logits.astype(mx.float32))
    best = mx.argsort(-probs)[:top].tolist()
    print(f"{len(ids)} prompt tokens; top {top} next tokens:")
    for token in best:
        print(f"  {probs[token].item():6.3f}  {tokenizer.decode([token])!r}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
