"""The `mlxinfer` command line: one click group; errors become one line at this edge."""

from __future__ import annotations

import sys

import click

from . import __version__
from .errors import MlxinferError


class Group(click.Group):
    """Turns any MlxinferError raised by a command into one line on stderr and exit code 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except MlxinferError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)


@click.group(cls=Group)
@click.version_option(__version__, prog_name="mlxinfer")
def main() -> None:
    """On-device LLM inference for Apple Silicon, built on MLX."""


if __name__ == "__main__":
    main()
