"""The grammar compiler's own process: compiles grammars where a crash cannot reach the server.

Run by path (`python grammar_worker.py LIMITS_JSON`), never imported: it loads only
llguidance and the standard library (not mlxinfer, whose import loads MLX), so it starts
in a fraction of a second. It reads one JSON request per line on stdin and answers one
JSON line on stdout:

    {"tokenizer": KEY, "json": TOKENIZER_JSON, "n_vocab": N, "eos": [IDS]}  -> {"ok": true}
    {"grammar": GRAMMAR, "tokenizer": KEY or null}  -> {"error": MESSAGE or null, "empty": BOOL}
                                                       or {"unknown_tokenizer": true}

A grammar is validated, and with a tokenizer, matched from its start with the first
token mask computed (where llguidance's parser limits trip); "empty" says the matcher
stopped there without accepting: the grammar admits no output at all.

The work runs on a thread with a 1 MiB stack, several times smaller than the threads
mlxinfer compiles on (a main thread's 8 MiB, Python's threads: 8 MiB on Linux, 16 MiB on
macOS), so a grammar that compiles here compiles there. Stack overflow, or any other
fatal signal, ends this process alone; the parent sees the pipe close and says so.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # mlxinfer's modules must not shadow stdlib

import json  # noqa: E402
import threading  # noqa: E402

STACK_BYTES = 1024 * 1024
TOKENIZERS_KEPT = 2  # ~100 MB each for a 150K vocabulary; one dropped is sent again


def serve(limits: dict, stdin, stdout) -> None:
    import llguidance

    tokenizers: dict[str, object] = {}
    parser_limits = llguidance.LLParserLimits(**limits)
    matcher = llguidance.LLMatcher
    stdout.write(json.dumps({"ready": True}) + "\n")
    stdout.flush()
    for line in stdin:
        request = json.loads(line)
        if "json" in request:
            while len(tokenizers) >= TOKENIZERS_KEPT:
                tokenizers.pop(next(iter(tokenizers)))
            tokenizers[request["tokenizer"]] = llguidance.LLTokenizer(
                request["json"], n_vocab=request["n_vocab"], eos_token=request["eos"] or None)
            reply = {"ok": True}
        elif request["tokenizer"] is not None and request["tokenizer"] not in tokenizers:
            reply = {"unknown_tokenizer": True}  # dropped to make room: the parent sends it again
        else:
            tokenizer = tokenizers.pop(request["tokenizer"], None)
            if tokenizer is not None:
                tokenizers[request["tokenizer"]] = tokenizer  # the most recently used is dropped last
            try:
                reply = check(matcher, request["grammar"], tokenizer, parser_limits)
            except Exception as e:  # noqa: BLE001 - llguidance refusing its input is an answer, not a crash
                reply = {"error": f"{type(e).__name__}: {e}", "empty": False}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()


def check(matcher, grammar: str, tokenizer, limits) -> dict:
    if tokenizer is None:
        is_error, messages = matcher.validate_grammar_with_warnings(grammar, limits=limits)
        return {"error": messages[0] if is_error else None, "empty": False}
    m = matcher(tokenizer, grammar, log_level=0, limits=limits)
    if not m.is_error():
        m.compute_bitmask()
    # stopped at the start without accepting: no extension of the empty output is legal
    if m.is_stopped() and not m.is_accepting() and m.get_error().split("\n")[0] in ("", "NoExtension",
                                                                                   "NoExtensionBias"):
        return {"error": None, "empty": True}
    return {"error": m.get_error() or None, "empty": False}


def main() -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash here is expected: no core file
    except (ImportError, ValueError, OSError):
        pass
    limits = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    threading.stack_size(STACK_BYTES)
    worker = threading.Thread(target=serve, args=(limits, sys.stdin, sys.stdout), daemon=True)
    worker.start()
    worker.join()


if __name__ == "__main__":
    main()
