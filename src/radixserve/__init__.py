"""radixserve: an LLM serving stack built around prefix KV-cache reuse.

The package root imports nothing heavy; torch lives under ``radixserve.model`` only.
"""

__version__ = "0.1.0"
