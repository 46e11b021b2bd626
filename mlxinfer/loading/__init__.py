"""Checkpoints in: a model folder (or a name `mlxinfer models` lists, or a hub id) read, checked and
built into a model and its tokenizer (`checkpoint`), LoRA adapters read, checked and applied
(`adapters`, `adapter_config`), and the public `load` that does both (`model`)."""
