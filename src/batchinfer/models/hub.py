"""Hugging Face Hub ids (`Qwen/Qwen2.5-0.5B-Instruct`) -> a folder or `.gguf` in the hub cache.

`resolve_source` is what `load_model` calls first: `"default"` and any path that exists go to
`registry.resolve_model_source` unchanged (an existing path always wins over an id of the same
spelling); a string shaped like `org/name` is fetched through `huggingface_hub` into its own
cache (`HF_HUB_CACHE`, else `HF_HOME/hub`), only the files the loader reads: config,
generation config, safetensors (the index's shards, or `model.safetensors`), tokenizer and chat
template files; with `gguf_file`, that one file and nothing else.

The hub settings are read from the environment when a model is resolved, not when
`huggingface_hub` is imported (its `constants` are fixed at import): `HF_HUB_OFFLINE=1` then
means the cache only, passed to `huggingface_hub` as `local_files_only=True`; `HF_ENDPOINT` a
mirror.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.constants import ENV_VARS_TRUE_VALUES
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from batchinfer.models.files import read_json
from batchinfer.models.registry import (
    DEFAULT_MODEL,
    ModelSource,
    SourceKind,
    resolve_model_source,
)

# Everything the loader reads besides the weights (`load_model`, `load_tokenizer`): small files,
# fetched first so the weights can be chosen from the index.
FOLDER_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*.jinja",
)
# A sentence encoder's (models/encoder.py): the modules list, each module's config (pooling
# modes) and sentence-transformers' settings (max length, lower-casing) too.
ENCODER_FILES = (*FOLDER_FILES, "modules.json", "sentence_bert_config.json",
                 "config_sentence_transformers.json", "[0-9]_*/config.json")
SINGLE_WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# org/name as the hub spells repo ids: no leading dot or dash, no "..", one slash.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class HubSettings:
    """Where the hub cache is, whether the hub may be reached (`offline`: cache only) and at
    which address (`endpoint`; None: huggingface.co)."""

    cache_dir: Path
    offline: bool
    endpoint: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> HubSettings:
        """The settings `huggingface_hub` itself would take from these variables, read now."""
        home = environ.get("HF_HOME") or os.path.join(
            environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "huggingface")
        cache = (environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE")
                 or os.path.join(home, "hub"))
        offline = environ.get("HF_HUB_OFFLINE") or environ.get("TRANSFORMERS_OFFLINE") or ""
        return cls(Path(os.path.expandvars(cache)).expanduser(), offline.upper() in ENV_VARS_TRUE_VALUES,
                   environ.get("HF_ENDPOINT") or None)


def is_hub_id(model: str) -> bool:
    """True for strings shaped like a hub repo id, `org/name` (not checked against the hub)."""
    return bool(_REPO_ID.match(model)) and ".." not in model and not model.endswith(".")


def resolve_source(
    model: str,
    revision: str | None = None,
    gguf_file: str | None = None,
    settings: HubSettings | None = None,
) -> ModelSource:
    """`"default"`, a local folder or `.gguf`, or a hub id; `ValueError` naming `--model`.

    `gguf_file` picks one `.gguf` inside a hub repo (or inside a local folder); `revision`
    (branch, tag or commit; default `main`) applies to hub ids only. `settings` default to
    `HubSettings.from_env()`.
    """
    local = Path(model).expanduser()
    if model == DEFAULT_MODEL or local.exists() or not is_hub_id(model):
        source = resolve_model_source(os.fspath(local / gguf_file) if gguf_file else model)
        if revision is not None:
            raise ValueError(f"revision {revision!r}: applies to hub ids (org/name) only, "
                             f"not to model {model!r}")
        return source
    settings = settings or HubSettings.from_env()
    if gguf_file is not None:
        path = _download_file(model, gguf_file, revision, settings)
        return ModelSource(SourceKind.GGUF, path, model)
    folder = _download_folder(model, revision, settings, FOLDER_FILES)
    return ModelSource(SourceKind.HF_FOLDER, folder, model)


def resolve_encoder_folder(model: str, settings: HubSettings | None = None) -> Path:
    """A sentence encoder's folder for the hub id `model` (branch main), fetched as
    `resolve_source` fetches a generative model's, with `ENCODER_FILES`."""
    return _download_folder(model, None, settings or HubSettings.from_env(), ENCODER_FILES)


def _download_folder(repo_id: str, revision: str | None, settings: HubSettings,
                     small_files: tuple[str, ...]) -> Path:
    """The snapshot folder holding `small_files` and the safetensors the index names."""
    snapshot = Path(str(_call_hub(repo_id, revision, settings, lambda: snapshot_download(
        repo_id, revision=revision, cache_dir=settings.cache_dir, allow_patterns=list(small_files),
        local_files_only=settings.offline, endpoint=settings.endpoint))))
    if not (snapshot / "config.json").is_file():
        raise _no_config(repo_id, revision, snapshot, settings)
    weights = _weight_files(snapshot)
    # The commit the first call resolved (the snapshot folder's name), so both calls read one
    # state of the repo even if the branch moves in between.
    commit = snapshot.name
    _call_hub(repo_id, revision, settings, lambda: snapshot_download(
        repo_id, revision=commit, cache_dir=settings.cache_dir, allow_patterns=weights,
        local_files_only=settings.offline, endpoint=settings.endpoint))
    missing = [name for name in weights if not (snapshot / name).is_file()]
    if missing:
        where = f"the cached snapshot {snapshot}" if settings.offline else "the repo"
        raise ValueError(f"model {repo_id!r} (--model): {where} lacks {', '.join(missing)}"
                         + _offline_note(settings))
    return snapshot


def _no_config(repo_id: str, revision: str | None, snapshot: Path,
               settings: HubSettings) -> ValueError:
    """The error for a repo without config.json, naming the GGUF files it holds (a GGUF repo
    loads with --gguf-file): those listed on the hub, or offline those in the cache."""
    if settings.offline:
        where, names = f"the cached snapshot {snapshot}", [p.name for p in snapshot.glob("*.gguf")]
    else:
        api = HfApi(endpoint=settings.endpoint)
        listing = _call_hub(repo_id, revision, settings,
                            lambda: api.list_repo_files(repo_id, revision=snapshot.name))
        where, names = "the repo", [n for n in listing if n.lower().endswith(".gguf")]
    hint = f" (its GGUF files: {', '.join(sorted(names))})" if names else ""
    return ValueError(f"model {repo_id!r} (--model): {where} has no config.json at revision "
                      f"{revision or 'main'}; for a GGUF in it pass --gguf-file NAME.gguf{hint}")


def _weight_files(snapshot: Path) -> list[str]:
    """The safetensors files the loader will open: the index's shards, else the single file."""
    if not (snapshot / INDEX).is_file():
        return [SINGLE_WEIGHTS]
    weight_map = read_json(snapshot / INDEX).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{snapshot / INDEX}: field 'weight_map' is missing")
    return sorted(set(map(str, weight_map.values())))


def _download_file(repo_id: str, filename: str, revision: str | None,
                   settings: HubSettings) -> Path:
    if not filename.lower().endswith(".gguf"):
        raise ValueError(f"gguf_file {filename!r}: expected a .gguf file name")
    return Path(str(_call_hub(repo_id, revision, settings, lambda: hf_hub_download(
        repo_id, filename, revision=revision, cache_dir=settings.cache_dir,
        local_files_only=settings.offline, endpoint=settings.endpoint), filename=filename)))


def _call_hub(repo_id: str, revision: str | None, settings: HubSettings, call: Callable[[], T],
              filename: str | None = None) -> T:
    """Run a `huggingface_hub` call; its errors become one-line `ValueError`s."""
    what = f"model {repo_id!r} (--model)"
    if filename is not None:
        what += f", file {filename!r} (--gguf-file)"
    at = f" at revision {revision!r}" if revision else ""
    try:
        result = call()
    except LocalEntryNotFoundError as exc:  # IncompleteSnapshotError too
        # "No such local path" first: a mistyped relative path also reads as org/name.
        if settings.offline:
            raise ValueError(f"{what}{at}: no such local path, and not in the Hugging Face "
                             f"cache under {settings.cache_dir}, and offline mode is on "
                             "(HF_HUB_OFFLINE=1)") from exc
        raise ValueError(f"{what}{at}: no such local path; the hub cannot be reached and the "
                         f"cache under {settings.cache_dir} does not hold it ({exc})") from exc
    except RevisionNotFoundError as exc:
        raise ValueError(f"revision {revision!r}: not found in {repo_id!r}") from exc
    except GatedRepoError as exc:
        raise ValueError(f"{what}: gated; accept its terms on the hub and set HF_TOKEN") from exc
    except RepositoryNotFoundError as exc:
        raise ValueError(f"{what}: no such local path, and no such repo on the hub (or it is "
                         "private: set HF_TOKEN)") from exc
    except EntryNotFoundError as exc:
        raise ValueError(f"{what}{at}: no such file in the repo") from exc
    except HfHubHTTPError as exc:
        raise ValueError(f"{what}: the hub answered {exc}") from exc
    return result


def _offline_note(settings: HubSettings) -> str:
    return "; offline mode is on (HF_HUB_OFFLINE=1)" if settings.offline else ""
