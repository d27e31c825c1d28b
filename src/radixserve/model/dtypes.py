"""Which precision the model and its KV cache compute in: ``--dtype auto`` picks bfloat16 where
the hardware computes it natively (a GPU, or a CPU with AVX512_BF16 or AMX) and float32
elsewhere, where bfloat16 is emulated and slower than float32."""

from __future__ import annotations

from collections.abc import Iterable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# /proc/cpuinfo flags of native bfloat16 arithmetic (AVX-512 BF16 dot products, AMX tiles)
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def auto_dtype(device_type: str, cpu_flags: Iterable[str]) -> str:
    """``bfloat16`` on a GPU or on a CPU whose flags include native bfloat16, else ``float32``."""
    if device_type != "cpu":
        return "bfloat16"
    return "bfloat16" if NATIVE_BF16_FLAGS & set(cpu_flags) else "float32"


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def resolve_dtypes(dtype: str, kv_cache_dtype: str, device: str) -> tuple[torch.dtype, torch.dtype]:
    """The model's and the KV cache's torch dtypes; ``auto`` KV follows the model's."""
    if dtype == "auto":
        dtype = auto_dtype(torch.device(device).type, cpu_flags())
    kv = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    for name in (dtype, kv):
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r} (choose from auto, {', '.join(DTYPES)})")
    return DTYPES[dtype], DTYPES[kv]
