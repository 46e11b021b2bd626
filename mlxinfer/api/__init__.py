"""The HTTP APIs of `mlxinfer serve`: one translation module per API, from its wire shapes
to the typed `Request` and back (`common` holds what they share, `engine_thread` the engine
they all drive)."""
