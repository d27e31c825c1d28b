"""Rotary position embeddings: inverse frequencies for each supported scaling type, and applying
them to queries and keys at arbitrary (per-token) positions.
"""

from __future__ import annotations

import math

import torch

from radixserve.model.arch import ModelArch


def inv_freq(arch: ModelArch, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 ``[head_dim // 2]`` inverse frequencies, scaled as the config says.

    ``freq_factors`` are llama.cpp's per-frequency divisors (a GGUF ``rope_freqs`` tensor).
    """
    dim = arch.head_dim
    base = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    params = arch.rope_scaling
    if arch.rope_type == "linear":
        base = base / float(params["factor"])
    elif arch.rope_type == "llama3":
        base = _llama3(base, params)
    if freq_factors is not None:
        base = base / freq_factors.float().cpu()
    return base


def _llama3(freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, short ones kept, and a
    smooth blend in between."""
    factor = float(params["factor"])
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    old_len = float(params.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > old_len / low, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled)


def cos_sin(
    positions: torch.Tensor, freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and signed ``sin`` of shape ``[T, 1, head_dim]`` for ``positions`` ``[T]``, made
    once per step for every layer. Computed in float32 (as transformers does), then cast; the
    first half of ``sin`` is negated so that ``apply_rope`` needs no negation per layer."""
    angles = positions.float()[:, None] * freq[None, :]
    cos = torch.cat((angles, angles), dim=-1).cos()
    sin = angles.sin()
    signed_sin = torch.cat((-sin, sin), dim=-1)
    return cos[:, None, :].to(dtype), signed_sin[:, None, :].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` in the half-split layout of HF checkpoints:
    ``x * cos + (x2, x1) * (-sin, sin)``, which is transformers' ``rotate_half`` form."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin
