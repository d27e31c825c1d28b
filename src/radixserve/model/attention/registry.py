"""The ``--attention-backend`` registry: each backend's name, the devices it runs on and the
function that builds it (importing its module only then); ``get_backend`` picks and builds one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from radixserve.model.attention.base import AttentionBackend
from radixserve.model.kernels import CpuKernels


class Builder(Protocol):
    """Builds a backend for weights in ``dtype`` and a KV cache in ``kv_dtype``; ``kernels``:
    radixserve's loaded CPU kernels, or why they are not there. ValueError where it cannot."""

    def __call__(
        self, dtype: torch.dtype, kv_dtype: torch.dtype, kernels: CpuKernels | str | None
    ) -> AttentionBackend: ...


@dataclass(frozen=True, slots=True)
class Registered:
    devices: tuple[str, ...]  # the device types it runs on
    build: Builder


BACKENDS: dict[str, Registered] = {}


def register(name: str, *devices: str) -> Callable[[Builder], Builder]:
    """Make the decorated builder ``get_backend``'s choice ``name`` on ``devices``."""

    def wrap(build: Builder) -> Builder:
        if name in BACKENDS:
            raise ValueError(f"attention backend {name!r} is registered twice")
        BACKENDS[name] = Registered(devices, build)
        return build

    return wrap


@register("cpu-paged", "cpu")
def _cpu_paged(
    dtype: torch.dtype, kv_dtype: torch.dtype, kernels: CpuKernels | str | None
) -> AttentionBackend:
    if not dtype == kv_dtype == torch.float32:
        raise ValueError(
            f"attention backend 'cpu-paged' computes in float32, not {dtype} weights with a "
            f"{kv_dtype} KV cache (use cpu-contig)"
        )
    if not isinstance(kernels, CpuKernels):
        why = kernels or "needs radixserve's CPU kernels, which are not loaded"
        raise ValueError(f"attention backend 'cpu-paged': {why}")
    from radixserve.model.attention.cpu_paged import CpuPaged

    return CpuPaged(kernels)


@register("cpu-contig", "cpu")
def _cpu_contig(
    dtype: torch.dtype, kv_dtype: torch.dtype, kernels: CpuKernels | str | None
) -> AttentionBackend:
    from radixserve.model.attention.cpu_contig import CpuContig

    return CpuContig()


@register("cpu-prefix", "cpu")
def _cpu_prefix(
    dtype: torch.dtype, kv_dtype: torch.dtype, kernels: CpuKernels | str | None
) -> AttentionBackend:
    from radixserve.model.attention.cpu_prefix import CpuPrefix

    return CpuPrefix()


@register("cuda-sdpa", "cuda")
def _cuda_sdpa(
    dtype: torch.dtype, kv_dtype: torch.dtype, kernels: CpuKernels | str | None
) -> AttentionBackend:
    from radixserve.model.attention.cuda_sdpa import CudaSdpa

    return CudaSdpa()


@register("torch-gather", "cpu", "cuda")
def _torch_gather(
    dtype: torch.dtype, kv_dtype: torch.dtype, kernels: CpuKernels | str | None
) -> AttentionBackend:
    from radixserve.model.attention.torch_gather import TorchGather

    return TorchGather()


BACKEND_CHOICES = ("auto", *BACKENDS)


def get_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
    kernels: CpuKernels | str | None = None,
) -> AttentionBackend:
    """The backend called ``name`` for a model computing in ``dtype`` with its KV cache in
    ``kv_dtype`` (default: ``dtype``). ``kernels``: radixserve's loaded CPU kernels, or why
    they are not there (a reason, or None: turned off). ``auto``: ``cuda-sdpa`` on a GPU; on a
    CPU ``cpu-paged`` in float32 with the kernels, else ``cpu-contig``. ValueError when the
    backend does not run on ``device``, at these dtypes, or (``cpu-paged``) without the
    kernels."""
    kv_dtype = kv_dtype or dtype
    if name == "auto":
        name = _auto(device, dtype, kv_dtype, kernels)
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r} (choose from {', '.join(BACKEND_CHOICES)})"
        )
    registered = BACKENDS[name]
    if device.type not in registered.devices:
        raise ValueError(
            f"attention backend {name!r} runs on {' or '.join(registered.devices)}, "
            f"not on {device.type}"
        )
    return registered.build(dtype, kv_dtype, kernels)


def _auto(
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    kernels: CpuKernels | str | None,
) -> str:
    if device.type == "cuda":
        return "cuda-sdpa"
    f32 = dtype == kv_dtype == torch.float32
    return "cpu-paged" if f32 and isinstance(kernels, CpuKernels) else "cpu-contig"
