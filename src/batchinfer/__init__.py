"""batchinfer: one copy of the weights serving many requests at once."""

from typing import TYPE_CHECKING, Any

from batchinfer.core.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from batchinfer.engine.llm import LLM


def __getattr__(name: str) -> Any:
    # Lazy so that `import batchinfer` (and the CLI's --help) does not pay for importing torch.
    if name == "LLM":
        from batchinfer.engine.llm import LLM

        return LLM
    raise AttributeError(name)
