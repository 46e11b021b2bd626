"""The `mlxinfer` command (`main`): its commands, the chat REPL, the terminal around them, what
`--model` means and which models this machine has (`store`, `demo`), and `doctor`, `bench` and
`inspect`'s report."""
