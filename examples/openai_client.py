"""Talk to `mlxinfer serve` with the official `openai` package (pip install openai).

    mlxinfer serve                               # in another terminal: the demo model, or -m MODEL
    python examples/openai_client.py [BASE_URL] [API_KEY]

A whole reply, a streamed one, and a second turn that reuses the first turn's prompt cache.
"""

import sys

from openai import OpenAI


def main() -> None:
    base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080/v1"
    client = OpenAI(base_url=base_url, api_key=sys.argv[2] if len(sys.argv) > 2 else "none")
    model = client.models.list().data[0].id  # the server serves one model

    messages = [{"role": "user", "content": "Name three colours."}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
    print("reply:", reply.choices[0].message.content)
    print("finish:", reply.choices[0].finish_reason, "| usage:", reply.usage.prompt_tokens, "prompt tokens,",
          reply.usage.completion_tokens, "completion tokens")

    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "And three animals?"}]
    print("streamed: ", end="")
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for event in stream:
        if event.choices:
            print(event.choices[0].delta.content or "", end="", flush=True)
        elif event.usage:  # the last event: usage, with the prompt tokens the first turn left cached
            print(f"\ncached prompt tokens: {event.usage.prompt_tokens_details.cached_tokens}"
                  f" of {event.usage.prompt_tokens}")


if __name__ == "__main__":
    main()
