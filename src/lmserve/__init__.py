"""lmserve: an LLM inference server with a paged KV cache and continuous batching."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lmserve.frontend.llm import LLM
    from lmserve.outputs import CompletionOutput, RequestOutput

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `import lmserve` must not pull in torch for the load generator or the planners.
    if name == "LLM":
        from lmserve.frontend.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from lmserve import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'lmserve' has no attribute {name!r}")
