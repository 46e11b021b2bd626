"""`mlxinfer serve`: the HTTP server (`app`: routes, guard, errors in each API's shape, uvicorn) and
one translation module per API, from its wire shapes to the typed `Request` and back. What they
share, each in a module of its own: what an API is given (`api`), the models it serves, each
loaded on demand with an engine of its own (`models`, `engine_thread`), refusals (`errors`), request bodies read within bounds (`bodies`), replies and
streams (`replies`), and a message's content as templates take it (`content`); and the web page
(`page`, its files in `web/`)."""
