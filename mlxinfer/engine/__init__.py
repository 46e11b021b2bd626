"""One engine for every front end: a request typed once (`request`, `options`), its prompt as the
engine runs it (`prompt`), the batch engine that admits, prefills and decodes many sequences
(`batch`), the text layer that turns each one's tokens into chunks (`text_stream`), the prompt-cache
pool, and what is built on them: `generate`, a chat session, embeddings, inspection, and the
replicated engine of a model sharded across ranks."""
