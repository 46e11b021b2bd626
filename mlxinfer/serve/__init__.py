"""`mlxinfer serve`: the HTTP server (`app`: routes, guard, errors in each API's shape, uvicorn) and
one translation module per API, from its wire shapes to the typed `Request` and back (`common`
holds what they share, `engine_thread` the engine they all drive), and the web page (`page`, its
files in `web/`)."""
