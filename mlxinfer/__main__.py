"""`python -m mlxinfer ...`: the `mlxinfer` command."""

from .cli.main import main

main()
