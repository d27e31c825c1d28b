"""How long one forward step of a batch takes on a given GPU and model, by a roofline model.

Owns the model and GPU specs, the named presets (``llama3-8b-h100``, ...) and the KV budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

# A step is costed as three phases that run one after the other on every GPU:
#   linear layers  one pass over the weights for all tokens of the batch: a roofline
#                  max(FLOPs / achievable FLOP/s, weight bytes / achievable bandwidth), so a
#                  small decode batch is bound by reading the weights and a big prefill by math;
#   attention      prefill and decode kernels, each a roofline over its own FLOPs and KV bytes
#                  (prefill is compute-bound, decode reads the KV of every running context);
#   all-reduce     two per layer under tensor parallelism (after attention and after the MLP);
# plus a fixed per-step overhead (scheduling, sampling, kernel launches). The phases are summed
# rather than overlapped: a mixed prefill+decode step is one forward pass, and a GPU runs its
# layers' kernels in sequence.


class StepEntry(NamedTuple):
    """One request's share of a step; a plain ``(new, context, is_prefill)`` tuple also works."""

    num_new_tokens: int
    context_len: int  # tokens already in the KV cache before this step
    is_prefill: bool


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    num_params: float
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bf16 weights and KV

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, on the whole model (all GPUs together)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bandwidth: float  # HBM bytes/s
    memory_bytes: float
    link_bandwidth: float  # NVLink bytes/s per direction


@dataclass(frozen=True, slots=True)
class TierSpec:
    """The KV tiers below one GPU's pool: its share of the host's memory for KV and the copy
    bandwidth to it (PCIe), and the network path to a fleet-wide KV store (Mooncake Store):
    bandwidth and the latency of one batched get; and the network between engines that a
    prefill engine sends a prompt's KV over to a decode engine (prefill and decode apart). Per
    GPU, as each GPU moves its own share of the KV over its own links."""

    host_memory_bytes: float
    host_bandwidth: float  # bytes/s, effective host <-> device copy
    store_bandwidth: float  # bytes/s, effective store -> host over the NIC
    store_latency_s: float  # one batched get: lookup, RDMA set-up, completion
    transfer_bandwidth: float = 40e9  # bytes/s, prefill engine -> decode engine (RDMA)


@dataclass(frozen=True, slots=True)
class StepCost:
    """A step's time in seconds, by phase (their sum is ``total``)."""

    linear: float
    attention: float
    allreduce: float
    overhead: float

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.allreduce + self.overhead


@dataclass(frozen=True, slots=True)
class CostModel:
    """A model served on ``tp`` GPUs of one kind, with the efficiencies it reaches on them.

    The efficiencies and overheads are assumptions of the order that tuned engines reach;
    calibrate them against a measured engine before trusting absolute times.
    """

    name: str
    model: ModelSpec
    gpu: GpuSpec
    tp: int = 1
    compute_efficiency: float = 0.5  # assumption: end-to-end MFU of a tuned bf16 prefill
    bandwidth_efficiency: float = 0.8  # assumption: share of HBM peak that a decode GEMV reaches
    link_efficiency: float = 0.7  # assumption: NCCL ring bus bandwidth / NVLink peak
    allreduce_latency_s: float = 8e-6  # assumption: small-message all-reduce latency on NVLink
    step_overhead_s: float = 1e-3  # assumption: scheduling, sampling and launch time per step
    # share of GPU memory kept for activations, CUDA graphs and allocator slack: what SGLang
    # leaves with --mem-fraction-static 0.88
    activation_reserve: float = 0.12
    tiers: TierSpec | None = None  # the lower KV tiers (sim's host tier and KV store)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        for name in ("compute_efficiency", "bandwidth_efficiency", "link_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.kv_capacity_tokens <= 0:
            raise ValueError(f"{self.name}: the weights leave no GPU memory for the KV cache")

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        # tensor parallelism splits the KV heads; with more GPUs than KV heads they are copied
        heads = max(self.model.num_kv_heads / self.tp, 1)
        return self.model.kv_bytes_per_token * heads / self.model.num_kv_heads

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV that fit beside the weights and the activation reserve on each GPU."""
        free = self.gpu.memory_bytes * (1 - self.activation_reserve)
        free -= self.model.weight_bytes / self.tp
        return int(free // self.kv_bytes_per_token_per_gpu)

    def tier_spec(self) -> TierSpec:
        """The preset's lower tiers (a preset without them: the H100 node's)."""
        return self.tiers or H100_NODE_TIERS

    def host_load_time(self, tokens: int, tiers: TierSpec | None = None) -> float:
        """Seconds to copy ``tokens`` of KV from the host tier to the device pool."""
        spec = tiers or self.tier_spec()
        return tokens * self.kv_bytes_per_token_per_gpu / spec.host_bandwidth

    def store_load_time(self, tokens: int, tiers: TierSpec | None = None) -> float:
        """Seconds for one batched get of ``tokens`` of KV from the store into host memory."""
        spec = tiers or self.tier_spec()
        return (
            spec.store_latency_s + tokens * self.kv_bytes_per_token_per_gpu / spec.store_bandwidth
        )

    def transfer_time(self, tokens: int, bandwidth: float | None = None) -> float:
        """Seconds to send ``tokens`` of KV from a prefill engine to a decode engine, each GPU
        its own share over its own NIC (``bandwidth``: bytes/s, default the preset's)."""
        bw = self.tier_spec().transfer_bandwidth if bandwidth is None else bandwidth
        return tokens * self.kv_bytes_per_token_per_gpu / bw

    def prefill_time_per_token(self, tokens: int = 2048) -> float:
        """Seconds per token of one cold prefill of ``tokens`` (what a load saves)."""
        return self.step_time([(tokens, 0, True)]) / tokens

    def load_to_prefill_ratio(self, tiers: TierSpec | None = None, tokens: int = 2048) -> float:
        """Seconds to load a token from the store (host copy included, as it lands there first)
        over seconds to prefill one, for a prefix of ``tokens``: the store's ratio an engine
        reports to kv_aware (WorkerView.kv_store_load_ratio)."""
        spec = tiers or self.tier_spec()
        load = self.store_load_time(tokens, spec) + self.host_load_time(tokens, spec)
        return load / (tokens * self.prefill_time_per_token(tokens))

    def host_load_to_prefill_ratio(
        self, tiers: TierSpec | None = None, tokens: int = 2048
    ) -> float:
        """Seconds to copy a token from the host tier over seconds to prefill one, for a prefix
        of ``tokens``: the host tier's ratio an engine reports (WorkerView.kv_load_ratio)."""
        load = self.host_load_time(tokens, tiers or self.tier_spec())
        return load / (tokens * self.prefill_time_per_token(tokens))

    def step_time(self, entries: Iterable[StepEntry | tuple[int, int, bool]]) -> float:
        """Seconds one forward step over ``entries`` takes (0 for an empty step)."""
        return self.timer()(entries)

    def step_cost(self, entries: Iterable[StepEntry | tuple[int, int, bool]]) -> StepCost:
        return StepCost(*self.timer().phases(entries))

    def timer(self) -> StepTimer:
        """``step_time`` with this model's constants worked out once (the simulator's hot path)."""
        return StepTimer(self)

    def _allreduce_time(self, tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        nbytes = tokens * self.model.hidden_size * self.model.dtype_bytes
        # a ring all-reduce sends 2 (n - 1) / n of the buffer over each GPU's link
        wire = 2 * (self.tp - 1) / self.tp * nbytes
        one = wire / (self.gpu.link_bandwidth * self.link_efficiency) + self.allreduce_latency_s
        return 2 * self.model.num_layers * one


class StepTimer:
    """A cost model's ``step_time`` with its constants folded, in one pass over the entries.

    Each phase is a roofline, max(FLOPs / effective peak, bytes / effective bandwidth), on one
    GPU of the tensor-parallel group: the linear layers (2 FLOPs, a multiply and an add, per
    parameter per token, reading the GPU's share of the weights once per step) and attention
    (prefills and decodes apart), plus the all-reduces and a fixed per-step overhead."""

    __slots__ = (
        "_lin_flops", "_tp", "_compute", "_memory", "_lin_memory", "_attn", "_kv_bytes",
        "_allreduce", "_overhead",
    )  # fmt: skip

    def __init__(self, cm: CostModel) -> None:
        m = cm.model
        self._tp = cm.tp
        self._compute = cm.gpu.peak_flops * cm.compute_efficiency
        self._memory = cm.gpu.mem_bandwidth * cm.bandwidth_efficiency
        self._lin_flops = 2 * m.num_params
        self._lin_memory = m.weight_bytes / cm.tp / self._memory
        self._attn = 4 * m.num_layers * m.hidden_size
        self._kv_bytes = cm.kv_bytes_per_token_per_gpu
        self._allreduce = cm._allreduce_time
        self._overhead = cm.step_overhead_s

    def __call__(self, entries: Iterable[StepEntry | tuple[int, int, bool]]) -> float:
        linear, attention, allreduce, overhead = self.phases(entries)
        return linear + attention + allreduce + overhead

    def phases(
        self, entries: Iterable[StepEntry | tuple[int, int, bool]]
    ) -> tuple[float, float, float, float]:
        """(linear, attention, allreduce, overhead) seconds, as ``StepCost`` holds them."""
        attn, kvb = self._attn, self._kv_bytes
        tokens = n_pre = n_dec = 0
        pre_flops = pre_bytes = dec_flops = dec_bytes = 0.0
        for new, ctx, is_prefill in entries:
            tokens += new
            # QK^T and AV: 2 matmuls x 2 FLOPs over hidden_size per (query, key) pair, a causal
            # query seeing the cached context plus on average half of the new tokens; bytes:
            # read the context's KV, write the new tokens
            if is_prefill:
                n_pre += 1
                pre_flops += attn * new * (ctx + new / 2)
                pre_bytes += kvb * (ctx + new)
            else:
                n_dec += 1
                dec_flops += attn * new * (ctx + new / 2)
                dec_bytes += kvb * (ctx + new)
        if tokens == 0:
            return 0.0, 0.0, 0.0, 0.0
        attention = self._roofline(pre_flops, pre_bytes) if n_pre else 0.0
        attention += self._roofline(dec_flops, dec_bytes) if n_dec else 0.0
        linear = max(self._lin_flops * tokens / self._tp / self._compute, self._lin_memory)
        return linear, attention, self._allreduce(tokens), self._overhead

    def _roofline(self, flops: float, nbytes: float) -> float:
        return max(flops / self._tp / self._compute, nbytes / self._memory)

    def decode_steps(self, contexts: Sequence[int], steps: int) -> list[float]:
        """The times of ``steps`` pure decode steps of requests whose cached contexts start at
        ``contexts`` and grow by one token a step: each equals this timer on that step's
        entries, float for float."""
        n, total = len(contexts), sum(contexts)
        linear = max(self._lin_flops * n / self._tp / self._compute, self._lin_memory)
        fixed = (linear, self._allreduce(n), self._overhead)
        half, odd = divmod(self._attn, 2)
        kvb = self._kv_bytes
        last = total + n * steps  # the largest context sum, after the last step
        if odd or not float(kvb).is_integer() or max(half * (2 * last + n), kvb * last) >= 2**53:
            return self._decode_steps_entrywise(contexts, steps, fixed)
        # every term and partial sum of the per-entry float sums is then an integer below 2**53,
        # so each float addition is exact and the sums equal these integers: O(1) a step
        tp, compute, memory, kvb = self._tp, self._compute, self._memory, int(kvb)
        _, allreduce, overhead = fixed
        sums = range(total, total + n * steps, n)  # the context sum at each step
        # decode attention reads more bytes than the GPU computes FLOPs for whenever
        # kvb * tp * compute > 2 * memory * half (then b / f = kvb * (s + n) * tp * compute /
        # (memory * half * (2s + n)) > 1 for every s, as (s + n) / (2s + n) >= 1/2); with half
        # a percent to spare the rounded b beats the rounded f too, and max() needs no f
        if kvb * tp * compute > 2.01 * memory * half:  # (then kvb > 0)
            reads = range(kvb * (total + n), kvb * (last + n), kvb * n)  # kvb * (s + n) a step
            if not allreduce:  # one GPU: adding 0.0 leaves a positive float as it is
                return [linear + b / memory + overhead for b in reads]
            return [linear + b / memory + allreduce + overhead for b in reads]
        out = []
        append = out.append
        for s in sums:
            f = float(half * (2 * s + n)) / tp / compute
            b = float(kvb * (s + n)) / memory
            append(linear + (b if b > f else f) + allreduce + overhead)  # max(f, b): roofline
        return out

    def _decode_steps_entrywise(
        self, contexts: Sequence[int], steps: int, fixed: tuple[float, float, float]
    ) -> list[float]:
        attn, kvb = self._attn, self._kv_bytes
        linear, allreduce, overhead = fixed
        out = []
        for j in range(steps):
            flops = nbytes = 0.0
            for ctx in contexts:  # as ``phases`` does, with new = 1
                ctx += j
                flops += attn * (ctx + 0.5)
                nbytes += kvb * (ctx + 1)
            out.append(linear + self._roofline(flops, nbytes) + allreduce + overhead)
        return out


# Model shapes from the Llama 3 model cards and config.json (meta-llama/Meta-Llama-3-8B and
# -70B: num_hidden_layers, hidden_size, num_key_value_heads, head_dim = hidden / 32 or 64 heads);
# parameter counts as Hugging Face lists them (8.03B, 70.6B).
LLAMA3_8B = ModelSpec("llama3-8b", 8.03e9, 32, 4096, num_kv_heads=8, head_dim=128)
LLAMA3_70B = ModelSpec("llama3-70b", 70.6e9, 80, 8192, num_kv_heads=8, head_dim=128)
# GPU peaks from NVIDIA's datasheets: H100 SXM 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB,
# NVLink 900 GB/s total (450 per direction); A100 SXM 80GB 312 TFLOP/s dense bf16,
# 2.039 TB/s HBM2e, NVLink 600 GB/s total (300 per direction).
H100_SXM = GpuSpec("h100-sxm", 989e12, 3.35e12, 80e9, link_bandwidth=450e9)
A100_SXM_80GB = GpuSpec("a100-sxm-80gb", 312e12, 2.039e12, 80e9, link_bandwidth=300e9)
# A toy model on a toy device: steps of tens of microseconds, about 25k tokens of KV.
TINY_MODEL = ModelSpec("tiny", 1e6, 2, 64, num_kv_heads=2, head_dim=32)
TINY_DEVICE = GpuSpec("cpu-toy", 1e12, 1e11, 16 * 2**20, link_bandwidth=1e10)
# Lower tiers (assumptions of the order such nodes have): an 8-GPU node with 2 TB of DRAM gives
# each GPU 128 GB for host KV; PCIe Gen5 x16 peaks at 64 GB/s a direction and pinned copies
# reach 25-50 GB/s (40 taken), Gen4 half that; a 200 Gb/s NIC per GPU to the store is 25 GB/s,
# of which RDMA gets reach ~80%; a batched get costs ~0.5 ms before its first byte.
# Between engines (PD transfer): NVIDIA's DGX H100 datasheet gives each GPU its own ConnectX-7
# at 400 Gb/s (50 GB/s a direction), the DGX A100's a ConnectX-6 at 200 Gb/s (25 GB/s); RDMA
# writes of large pages (Mooncake's transfer engine) reach ~80% of that: 40 and 20 GB/s.
H100_NODE_TIERS = TierSpec(128e9, 40e9, 20e9, 5e-4, transfer_bandwidth=40e9)
A100_NODE_TIERS = TierSpec(128e9, 20e9, 20e9, 5e-4, transfer_bandwidth=20e9)
TINY_TIERS = TierSpec(64 * 2**20, 1e10, 5e9, 1e-5, transfer_bandwidth=5e9)

COST_MODELS: dict[str, CostModel] = {}


def register_cost_model(cost_model: CostModel) -> CostModel:
    """Add a preset to the registry under its name (names are unique)."""
    if cost_model.name in COST_MODELS:
        raise ValueError(f"cost model {cost_model.name!r} is already registered")
    COST_MODELS[cost_model.name] = cost_model
    return cost_model


def get_cost_model(name: str) -> CostModel:
    """The preset called ``name``; a ValueError lists the known ones."""
    try:
        return COST_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(COST_MODELS))
        raise ValueError(f"unknown cost model {name!r}; known: {known}") from None


H100, A100 = {"tiers": H100_NODE_TIERS}, {"tiers": A100_NODE_TIERS}
register_cost_model(CostModel("llama3-8b-h100", LLAMA3_8B, H100_SXM, **H100))
register_cost_model(CostModel("llama3-8b-a100", LLAMA3_8B, A100_SXM_80GB, **A100))
register_cost_model(CostModel("llama3-70b-tp4-h100", LLAMA3_70B, H100_SXM, tp=4, **H100))
register_cost_model(CostModel("llama3-70b-tp4-a100", LLAMA3_70B, A100_SXM_80GB, tp=4, **A100))
register_cost_model(
    CostModel(
        "tiny-cpu",
        TINY_MODEL,
        TINY_DEVICE,
        allreduce_latency_s=0.0,
        step_overhead_s=1e-5,
        tiers=TINY_TIERS,
    )
)
