"""One exception hierarchy for everything mlxinfer reports to a user.

Every error carries a single-line message that names the problem and, where
there is one, the fix; the CLI catches `MlxinferError` once and prints it.
"""


class MlxinferError(Exception):
    """Base class: a user-facing error whose message is one line."""


class ModelNotFoundError(MlxinferError):
    """A path or hub id that does not resolve to a model."""


class UnsupportedArchitectureError(MlxinferError):
    """A `model_type` (or GGUF architecture) we have no family for."""


class CorruptCheckpointError(MlxinferError):
    """Weights that are missing, truncated, mis-shaped or unsafe to load."""


class ConfigError(MlxinferError):
    """A config.json or tokenizer config that cannot be understood."""


class TokenizerError(MlxinferError):
    """A tokenizer that cannot be loaded or a chat template that fails to render."""


class NoLMHeadError(MlxinferError):
    """Generation asked of a model saved without its LM head (an embedding checkpoint)."""


class InvalidOptionError(MlxinferError, ValueError):
    """An option value out of its allowed range. `option` names it where a rule every front end
    shares found it at fault, so a server's error names the field (`param`) as its own refusals do."""

    def __init__(self, message: str, option: str | None = None):
        super().__init__(message)
        self.option = option


class AdapterError(MlxinferError):
    """A LoRA adapter that does not fit the model or uses what we do not run."""


class ConversionError(MlxinferError):
    """A conversion that cannot go ahead: output in the way, disk full, tensor type we cannot read."""


class SessionFileError(MlxinferError):
    """A saved chat session that cannot be written or read back."""


class SamplingError(MlxinferError):
    """A step with nothing to draw from: every logit -inf or NaN (it ends that sequence)."""


class ImageError(InvalidOptionError):
    """An image that cannot be used: not an image, too large, a decompression bomb, or given to a
    model that takes none (a request's own fault: a 400 from the server)."""


class StoreError(MlxinferError):
    """A change to mlxinfer's model cache that cannot go ahead: a name already taken or not
    allowed, or a model the cache does not hold (in the Hugging Face cache, a folder of yours)."""


class DownloadError(MlxinferError):
    """A download the user asked for (`mlxinfer pull`) that failed or stopped; what arrived is kept
    so the same command resumes it."""


class ModelExistsError(StoreError):
    """A new model's name already taken in the cache; `name` says which, so a caller for whom
    "already there" is success (Ollama's `/api/pull`) can take the model that has it."""

    def __init__(self, message: str, name: str):
        super().__init__(message)
        self.name = name
