"""`pull`: a model the user names — a Hugging Face hub id, a local Hugging Face or MLX folder, a
GGUF file or a GGUF URL — converted (and quantized) into mlxinfer's cache under a readable name
(`loading.store.cache_name`), for `mlxinfer pull` and Ollama's `/api/pull`.

Nothing is fetched unless the caller passes a hub id or a URL: that is the user asking. A hub
download goes to the Hugging Face cache through huggingface_hub, which resumes its own partial
files; a GGUF URL downloads to `$MLXINFER_HOME/downloads/NAME.gguf.part`, resumed with an HTTP
Range request (checked with If-Range against the file's validator, so a file changed on the
server starts over rather than splicing two versions), and renamed once whole. The conversion
writes the model atomically (`convert`'s stage folder), so an interrupted pull leaves a
resumable download at most, never a half-written model.

A float source is quantized to 4 bits unless `bits` or `recipe` says otherwise (as Ollama's
library defaults to 4-bit models); a source that is already quantized (an MLX folder, a GGUF
file) keeps its precision unless told.
"""

from __future__ import annotations

import hashlib
import http.client
import inspect
import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlxinfer
from mlxinfer.base.cachedir import home, is_model_folder
from mlxinfer.base.errors import DownloadError, InvalidOptionError, MlxinferError, ModelNotFoundError
from mlxinfer.base.files import replacing, write_problem
from mlxinfer.loading.checkpoint import MODEL_FILES, read_config
from mlxinfer.loading.store import LocalModel, cache_name, check_new_name, describe

from .api import convert
from .quantize import BITS, RECIPES
from .sources import is_gguf

DEFAULT_BITS = 4
CHUNK = 1 << 20
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# a GGUF file's own precision at the end of its name: `SmolLM2-135M-Instruct.Q4_1`, `qwen-q4_k_m`
_GGUF_TAG = re.compile(r"^(.*?)[._-]((?:I?Q\d[A-Z0-9_]*)|BF16|F16|F32|MXFP4)$", re.IGNORECASE)


@dataclass(frozen=True)
class PullProgress:
    """One step of a pull, as Ollama's `/api/pull` streams them: what is happening, and for a
    download the bytes expected (`total`, None when the server does not say) and received."""

    status: str
    total: int | None = None
    completed: int | None = None


Progress = Callable[[PullProgress], None]


def _quiet(_: PullProgress) -> None:
    pass


SOURCES = frozenset({"hub", "folder", "gguf", "url"})
_WORDS = {"hub": "a hub id", "folder": "a model folder", "gguf": "a .gguf file", "url": "a GGUF URL"}


def pull(source: str, *, bits: int | None = None, recipe: str | None = None, name: str | None = None,
         progress: Progress = _quiet, kinds: frozenset[str] = SOURCES) -> LocalModel:
    """Convert `source` into our cache and return the model as `mlxinfer models` lists it.
    `source`: a hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`), a model folder, a `.gguf` file
    or an http(s) URL of one. `bits` or `recipe` quantize as `mlxinfer convert` does; `name`
    replaces the readable name chosen from the source. A name already in the cache is refused
    before anything is downloaded, saying how to replace it. `kinds`: the sources this caller
    may name (a server's clients: hub ids only, so none can make it read its files or fetch
    from its network)."""
    if bits is not None and recipe is not None:
        raise InvalidOptionError("--bits and --recipe both choose the precision; pass one of them")
    if bits is not None and bits not in BITS:
        raise InvalidOptionError(f"--bits {bits} is not one of {', '.join(map(str, BITS))}")
    if recipe is not None and recipe not in RECIPES:
        raise InvalidOptionError(f"unknown recipe '{recipe}'; choose one of {', '.join(RECIPES)}")
    kind = source_kind(source, local=bool(kinds & {"folder", "gguf"}))
    if kind not in kinds:
        allowed = " or ".join(_WORDS[k] for k in sorted(kinds))
        raise InvalidOptionError(f"'{source}' is {_WORDS[kind]}; only {allowed} can be pulled here")
    path = Path(source).expanduser()
    if kind == "url":
        return _pull_gguf_url(source, bits, recipe, name, progress)
    if kind == "gguf":
        return _convert(path, _gguf_name(path.name, bits, recipe, name), bits, recipe, progress)
    if kind == "folder":
        target = name or cache_name(path.resolve().name, _precision(read_config(path), bits, recipe))
        return _convert(path, target, *_quantization(read_config(path), bits, recipe), progress)
    return _pull_hub(source, bits, recipe, name, progress)


def source_kind(source: str, local: bool = True) -> str:
    """Which of `SOURCES` `source` is: an http(s) URL, a GGUF file or a model folder (looked for
    only when `local`), else a hub id (`org/name`); anything else is refused."""
    if urllib.parse.urlsplit(source).scheme in ("http", "https"):
        return "url"
    path = Path(source).expanduser()
    if local and path.is_file():
        if not is_gguf(path):
            raise ModelNotFoundError(f"'{source}' is a file but not a GGUF file; pull a .gguf file, a model folder "
                                     "or a hub id like 'org/model'")
        return "gguf"
    if local and path.is_dir():
        if not is_model_folder(path):
            raise ModelNotFoundError(f"'{source}' is a folder without config.json and .safetensors weights; "
                                     "pull a model folder, a .gguf file or a hub id")
        return "folder"
    if path.suffix == ".gguf" or _REPO_ID.fullmatch(source) is None:
        if local:
            raise ModelNotFoundError(f"no file or folder at '{source}', and it is not a hub id like 'org/model'; "
                                     "check the path or the id")
        raise ModelNotFoundError(f"'{source}' is not a hub id like 'org/model'; check the id")
    return "hub"


def _convert(source: Path, name: str, bits: int | None, recipe: str | None, progress: Progress) -> LocalModel:
    """`source` converted into the cache folder `name` (refused if taken), written whole or not at all."""
    target = check_new_name(name)
    progress(PullProgress(f"converting {source.name} into {name}"))
    as_stored = bits is None and recipe is None
    convert(source, target, quantize=not as_stored, bits=bits, recipe=recipe, progress=False)
    if as_stored and source.is_file():
        record_gguf(target, source)
    progress(PullProgress("success"))
    return describe(name, "mlxinfer", target)


# which GGUF file a cache folder was converted from, so `--model FILE.gguf` reuses a pulled one

SOURCE_RECORD = "mlxinfer_source.json"


def gguf_key(path: Path) -> str:
    """Identifies a GGUF file by its size and first and last MiB (its header holds the
    metadata), so a copy elsewhere reuses the conversion without hashing gigabytes."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(path.stat().st_size - (1 << 20), 0))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:8]


def record_gguf(folder: Path, gguf: Path) -> None:
    """Note in `folder` that it is `gguf` converted as stored."""
    with replacing(folder / SOURCE_RECORD) as tmp:
        tmp.write_text(json.dumps({"gguf": gguf.name, "gguf_key": gguf_key(gguf)}) + "\n")


def recorded_gguf(folder: Path) -> str | None:
    """The `gguf_key` of the GGUF file `folder` was converted from as stored, if it says."""
    try:
        return json.loads((folder / SOURCE_RECORD).read_text())["gguf_key"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def gguf_cache_name(filename: str) -> str:
    """The name a GGUF file converted as stored has in the cache: `smollm2-135m-instruct-q4_1`."""
    return _gguf_name(filename, None, None, None)


def _quantization(config: dict, bits: int | None, recipe: str | None) -> tuple[int | None, str | None]:
    """The bits and recipe a folder is converted with: as asked; else a float model at 4 bits,
    an already quantized one as it is stored."""
    if bits is None and recipe is None and not config.get("quantization"):
        return DEFAULT_BITS, None
    return bits, recipe


def _precision(config: dict, bits: int | None, recipe: str | None) -> str:
    """How the pulled model will be stored, for its name: `4bit`, `mixed-4-6`, or a quantized
    source's own (`8bit`, `mxfp4`)."""
    bits, recipe = _quantization(config, bits, recipe)
    if recipe is not None:
        return recipe
    if bits is not None:
        return f"{bits}bit"
    quant = config.get("quantization") or {}
    mode = quant.get("mode", "affine")
    return f"{quant.get('bits', '')}bit" if mode == "affine" else str(mode)


def _gguf_name(filename: str, bits: int | None, recipe: str | None, name: str | None) -> str:
    """The cache name of a GGUF file: its name in lowercase with its own precision
    (`smollm2-135m-instruct-q4_1`), or the one asked for in its place."""
    if name:
        return name
    stem = filename.removesuffix(".gguf")
    match = _GGUF_TAG.match(stem)
    base, tag = (match.group(1), match.group(2)) if match else (stem, "")
    asked = recipe or (f"{bits}bit" if bits is not None else None)
    return cache_name(base, asked or tag)


# Hugging Face hub


def _pull_hub(repo: str, bits: int | None, recipe: str | None, name: str | None, progress: Progress) -> LocalModel:
    """Download the files loading needs (`MODEL_FILES`) into the Hugging Face cache, config.json
    first so a taken name is refused before the weights come, then convert."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.utils import filter_repo_objects

    progress(PullProgress(f"pulling manifest of {repo}"))
    with _hub_errors(repo):
        info = HfApi().model_info(repo, files_metadata=True)
    files = list(filter_repo_objects(info.siblings or [], allow_patterns=MODEL_FILES, key=lambda s: s.rfilename))
    if not any(f.rfilename.endswith(".safetensors") for f in files):
        raise ModelNotFoundError(f"hub repo '{repo}' has no .safetensors weights (mlxinfer never loads pickled ones); "
                                 "pull a repo that has them, or a GGUF of the model")
    with _hub_errors(repo):
        snapshot = Path(hf_hub_download(repo, "config.json", revision=info.sha)).parent
    target = name or cache_name(repo.split("/")[-1], _precision(read_config(snapshot), bits, recipe))
    check_new_name(target)
    total = sum(f.size or 0 for f in files) or None
    done = 0
    status = f"downloading {repo}"
    for f in files:
        counted = _ByteCounter.counting(lambda n, base=done: progress(PullProgress(status, total, base + n)))
        # older huggingface_hub releases take no tqdm_class here: with them, progress comes a file at a time
        bar = {"tqdm_class": counted} if "tqdm_class" in inspect.signature(hf_hub_download).parameters else {}
        with _hub_errors(repo):
            hf_hub_download(repo, f.rfilename, revision=info.sha, **bar)
        done += f.size or 0
        progress(PullProgress(status, total, done))
    return _convert(snapshot, target, *_quantization(read_config(snapshot), bits, recipe), progress)


class _ByteCounter:
    """Stands in for the tqdm bar huggingface_hub drives while downloading one file (its
    documented `tqdm_class`): counts the bytes on disk (a resumed file starts at what it has)
    and passes the running count on; everything else a bar does is a no-op."""

    report: Callable[[int], None]

    @classmethod
    def counting(cls, report: Callable[[int], None]) -> type[_ByteCounter]:
        return type("ByteCounter", (cls,), {"report": staticmethod(report)})

    def __init__(self, *args, initial: int = 0, **kwargs) -> None:
        self.n = initial or 0
        self.report(self.n)

    def update(self, n: int | float | None = 1) -> None:
        self.n += int(n or 0)
        self.report(self.n)

    def __enter__(self) -> _ByteCounter:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class _hub_errors:
    """huggingface_hub's failures as one-line errors that say what to do."""

    def __init__(self, repo: str) -> None:
        self.repo = repo

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or not isinstance(error, Exception) or isinstance(error, MlxinferError):
            return False
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

        if isinstance(error, GatedRepoError):
            raise ModelNotFoundError(f"hub repo '{self.repo}' is gated: accept its terms on huggingface.co and log in "
                                     "(`hf auth login`), then pull again") from None
        if isinstance(error, RepositoryNotFoundError):
            raise ModelNotFoundError(f"hub repo '{self.repo}' does not exist (or is private); check the id") from None
        if isinstance(error, OSError) and not _network(error):
            raise DownloadError(f"cannot download '{self.repo}' ({write_problem(error)}); free some space or "
                                "set HF_HOME to a disk with room, then pull again (it resumes)") from None
        if os.environ.get("HF_HUB_OFFLINE"):
            raise DownloadError(f"cannot download '{self.repo}': HF_HUB_OFFLINE is set; unset it to pull from "
                                "the Hugging Face hub") from None
        raise DownloadError(f"cannot download '{self.repo}' from the Hugging Face hub ({type(error).__name__}: "
                            f"{error}); check the network and pull again (it resumes)") from None


def _network(error: OSError) -> bool:
    return error.errno is None  # connection and HTTP failures carry no errno; a full disk does


# a GGUF file at a URL


def _pull_gguf_url(url: str, bits: int | None, recipe: str | None, name: str | None, progress: Progress) -> LocalModel:
    """Download the GGUF (resuming a partial download), convert it, and delete the download."""
    filename = urllib.parse.unquote(Path(urllib.parse.urlsplit(url).path).name)
    if not filename.endswith(".gguf") or filename.startswith("."):
        raise ModelNotFoundError(f"'{url}' does not name a .gguf file; mlxinfer pulls GGUF files by URL, "
                                 "other models by hub id")
    target = _gguf_name(filename, bits, recipe, name)
    check_new_name(target)
    file = download(url, home() / "downloads" / filename, progress)
    if not is_gguf(file):
        file.unlink()
        raise ModelNotFoundError(f"'{url}' is not a GGUF file (it does not start with GGUF's magic bytes)")
    model = _convert(file, target, bits, recipe, progress)
    file.unlink()
    return model


def download(url: str, dest: Path, progress: Progress = _quiet) -> Path:
    """`url` saved as `dest`, through `dest.part`: a partial file left by an earlier attempt is
    continued with a Range request, but only if the server still has the same file (If-Range with
    the validator saved beside it); a server that ignores ranges or whose file changed sends it
    all, and the part starts over. `dest` appears only once the whole file is there."""
    part, validator_file = dest.with_name(dest.name + ".part"), dest.with_name(dest.name + ".part.json")
    dest.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    validator = _read_validator(validator_file) if have else None
    headers = {"User-Agent": f"mlxinfer/{mlxinfer.__version__}", "Accept-Encoding": "identity"}
    if have and validator:
        headers |= {"Range": f"bytes={have}-", "If-Range": validator}
    status = f"downloading {dest.name}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as response:
            resumed = response.status == 206
            total = _total(response, have if resumed else 0)
            if not resumed:
                have = 0
                _save_validator(validator_file, response)
            with open(part, "ab" if resumed else "wb") as out:
                progress(PullProgress(status, total, have))
                while block := response.read(CHUNK):
                    out.write(block)
                    have += len(block)
                    progress(PullProgress(status, total, have))
    except urllib.error.HTTPError as e:
        if e.code == 416 and have and _total(e, 0) == have:  # the part was already whole
            total = have
        else:
            raise DownloadError(f"cannot download '{url}' (HTTP {e.code} {e.reason}); check the URL") from None
    except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError) as e:
        why = getattr(e, "reason", None) or type(e).__name__
        if not have:
            raise DownloadError(f"cannot download '{url}' ({why}); check the URL and the network") from None
        raise DownloadError(f"the download of '{url}' stopped at {have} bytes ({why}); run the same pull again "
                            "to resume it") from None
    except OSError as e:
        raise DownloadError(f"cannot write '{part}' ({write_problem(e)}); free some space, then pull again "
                            "(it resumes)") from None
    if total is not None and have != total:
        raise DownloadError(f"the download of '{url}' stopped at {have} of {total} bytes; run the same pull again "
                            "to resume it")
    os.replace(part, dest)
    validator_file.unlink(missing_ok=True)
    return dest


def _total(response, offset: int) -> int | None:
    """The whole file's size: from Content-Range (`bytes 100-199/200`, or `bytes */200` on a 416),
    else Content-Length plus where the body starts."""
    content_range = response.headers.get("Content-Range") or ""
    if "/" in content_range and content_range.rsplit("/", 1)[1].strip().isdigit():
        return int(content_range.rsplit("/", 1)[1])
    length = response.headers.get("Content-Length")
    return offset + int(length) if length and length.isdigit() else None


def _save_validator(file: Path, response) -> None:
    """The ETag (a strong one) or Last-Modified of the file being downloaded, so a resume asks
    for the rest of that file and no other."""
    etag = response.headers.get("ETag")
    validator = etag if etag and not etag.startswith("W/") else response.headers.get("Last-Modified")
    if validator:
        file.write_text(json.dumps({"validator": validator}))
    else:
        file.unlink(missing_ok=True)


def _read_validator(file: Path) -> str | None:
    try:
        return json.loads(file.read_text())["validator"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
