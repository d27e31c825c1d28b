"""radixserve: an LLM serving stack built around prefix KV-cache reuse.

The package root imports nothing heavy; torch lives under ``radixserve.model`` only.
``from radixserve import Engine`` (the offline Python API, as ``sglang.Engine``) loads the
engine's modules on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "__version__"]

if TYPE_CHECKING:
    from radixserve.engine.engine import Engine


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixserve.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
