"""TorchRunner: the real model behind the Runner protocol. It owns the weights, the KV tensor
pool indexed by the scheduler's slot ids, and the sampler.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from radixserve.config import ModelConfig
from radixserve.model.arch import ModelArch
from radixserve.model.attention.plan import StepPlan
from radixserve.model.attention.registry import get_backend
from radixserve.model.cuda_graphs import GRAPH_BACKENDS, DecodeGraphs
from radixserve.model.dtypes import resolve_dtypes
from radixserve.model.grammar import Grammars
from radixserve.model.kernels import CpuKernels, load_cpu_kernels
from radixserve.model.kv_pool import KVPool
from radixserve.model.llama import LlamaModel
from radixserve.model.loader import load_weights
from radixserve.model.logits_process import process_logits
from radixserve.model.logprobs import prompt_logprobs, sampled_logprobs
from radixserve.model.sampler import Sampler
from radixserve.model.tp import TPShard, tp_problem
from radixserve.modelfiles.locate import model_name, resolve_model_dir
from radixserve.modelfiles.tokenizer import ModelInfo, load_model_info
from radixserve.sched.batch import Batch, BatchEntry, EntryLogprobs, StepResult
from radixserve.sched.request import SamplingParams

logger = logging.getLogger(__name__)


class TorchRunner:
    """Runs Batches on a Llama-family model; ``num_slots`` is the scheduler's KV pool size."""

    def __init__(
        self, model_config: ModelConfig, num_slots: int, tp: TPShard | None = None
    ) -> None:
        """``tp``: the shard of the model this process computes (one rank of ``--tp-size``;
        the whole model by default)."""
        self.config = model_config
        self.tp = tp or TPShard()
        self.device = torch.device(model_config.device)
        if self.device.type == "cpu":  # the ranks of one machine share its cores
            threads = model_config.num_threads or max(1, default_num_threads() // self.tp.size)
            torch.set_num_threads(threads)
        self.dtype, self.kv_dtype = resolve_dtypes(
            model_config.dtype, model_config.kv_cache_dtype, model_config.device
        )
        loaded = self._load_kernels(model_config)
        self.kernels = loaded if isinstance(loaded, CpuKernels) else None
        self.backend = get_backend(
            model_config.attention_backend, self.device, self.dtype, self.kv_dtype, loaded
        )
        model_dir = resolve_model_dir(model_config)
        self.info: ModelInfo = load_model_info(
            model_dir, model_config.context_length, model_name(model_config)
        )
        arch = read_arch(model_dir)
        if problem := tp_problem(arch, self.tp.size):
            raise ValueError(problem)
        self.model = LlamaModel(
            arch, load_weights(model_dir), self.dtype, self.device, self.backend, self.kv_dtype,
            self.kernels, self.tp,
        )  # fmt: skip
        graphs = self._use_graphs(model_config)
        self.kv = self.model.new_kv_pool(num_slots, scratch=graphs)
        self.backend.bind(self.kv)
        self.graphs: DecodeGraphs | None = None
        if graphs:
            self.graphs = DecodeGraphs(self.model, self.kv, model_config.cuda_graph_max_bs,
                                       self.info.context_length)  # fmt: skip
        argmax = self.kernels.argmax if self.kernels is not None else None
        self.sampler = Sampler(model_config.sampling_seed, argmax)
        self.grammars = Grammars(self.info.tokenizer, arch.vocab_size, self.info.eos_token_ids)

    def _load_kernels(self, config: ModelConfig) -> CpuKernels | str | None:
        """radixserve's CPU kernels for a float32 model on a CPU (``--cpu-kernels auto``); the
        reason when they cannot be built (said once, in the log); None where they do not apply
        or are turned off."""
        if config.cpu_kernels == "off" or self.device.type != "cpu":
            return None
        if self.dtype != torch.float32:
            return None
        loaded = load_cpu_kernels(config.weights_cache_dir)
        if isinstance(loaded, str):
            logger.warning("CPU kernels not available (%s): using PyTorch's (oneDNN linears, "
                           "cpu-contig attention)", loaded)  # fmt: skip
        return loaded

    def _use_graphs(self, config: ModelConfig) -> bool:
        """CUDA graphs for decode steps: on a CUDA device, unless turned off, with a backend
        that reads the padded decode layout (every GPU backend this engine has)."""
        if self.device.type != "cuda" or config.disable_cuda_graph or self.tp.size > 1:
            return False  # (a graph would capture the ranks' all-reduces: not done yet)
        if self.model.arch.moe is not None:
            return False  # the experts' row counts are read back each step: not capturable
        return self.backend.name in GRAPH_BACKENDS

    @property
    def arch(self) -> ModelArch:
        return self.model.arch

    def check_request(self, sampling: SamplingParams) -> None:
        """Raise ValueError for what this runner cannot honour (a grammar that does not
        compile), before the request is queued."""
        if sampling.grammar is not None:
            self.grammars.compile(sampling.grammar)

    @torch.inference_mode()
    def run(self, batch: Batch) -> StepResult:
        """Compute the batch, write its K/V, and sample the entries that ask for a token."""
        sampled = [i for i, e in enumerate(batch.entries) if e.sample]
        logits, logprobs = self._forward(batch, sampled)
        tokens: list[int | None] = [None] * len(batch.entries)
        if sampled:
            entries = [batch.entries[i] for i in sampled]
            ids = self._sample(logits, entries)
            for k, lp in sampled_logprobs(logits, entries, ids).items():
                logprobs.setdefault(sampled[k], EntryLogprobs()).sampled = lp.sampled
            for i, token in zip(sampled, ids, strict=True):
                tokens[i] = token
        return StepResult(next_token_ids=tokens, logprobs=logprobs)

    def _sample(self, logits: torch.Tensor, entries: list[BatchEntry]) -> list[int]:
        """Tokens drawn from processed copies of the raw ``logits`` (kept for logprobs)."""
        keep = any(e.sampling.return_logprob for e in entries)
        processed = process_logits(logits.clone() if keep else logits, entries,
                                   self.info.eos_token_ids)  # fmt: skip
        self.grammars.mask(processed, entries)
        params = [e.sampling for e in entries]
        ids = self.sampler.sample(processed, params, [e.num_generated for e in entries])
        self.grammars.accept(entries, ids)
        return ids

    @torch.inference_mode()
    def logits(self, batch: Batch) -> torch.Tensor:
        """Float32 next-token logits ``[S, vocab]`` of the entries with ``sample`` set, in batch
        order (a step like ``run``, K/V writes included, without sampling)."""
        logits = self._forward(batch, [i for i, e in enumerate(batch.entries) if e.sample])[0]
        return logits.clone() if self.graphs is not None else logits  # a graph's output is reused

    def _forward(
        self, batch: Batch, sampled: list[int]
    ) -> tuple[torch.Tensor, dict[int, EntryLogprobs]]:
        """Logits of the sampled entries' last tokens, and the prompt logprobs asked for."""
        if not batch.entries:
            return torch.empty(0, self.arch.vocab_size, device=self.device), {}
        self._check_bounds(batch)
        if self.graphs is not None and self.graphs.accepts(batch.entries):
            return self.graphs.logits(batch.entries), {}
        plan: StepPlan = self.backend.plan(batch.entries, self.device, self.dtype)
        hidden = self.model.forward(plan, self.kv)
        # only the last token of an entry that samples needs the (large) vocab projection
        rows = [plan.last_rows[i] for i in sampled]
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        firsts = [r - len(e.token_ids) + 1 for r, e in zip(plan.last_rows, batch.entries)]
        prompt = prompt_logprobs(hidden, firsts, batch.entries, self.model.logits)
        return self.model.logits(hidden.index_select(0, index)), prompt

    @torch.inference_mode()
    def forward_shard(self, batch: Batch) -> None:
        """A rank other than 0's part of a step: its heads' K/V written, its share of every
        layer all-reduced with the other ranks; no logits (rank 0 samples)."""
        if batch.entries:
            self._check_bounds(batch)
            self.model.forward(self.backend.plan(batch.entries, self.device, self.dtype), self.kv)

    def _check_bounds(self, batch: Batch) -> None:
        for e in batch.entries:
            if e.seq_len > self.info.context_length:
                raise ValueError(
                    f"request {e.rid}: {e.seq_len} tokens exceed the context length "
                    f"{self.info.context_length}"
                )
            new = e.slots[e.start_pos :]  # older slots were checked in the step that wrote them
            if new and (min(new) < 0 or max(new) >= self.kv.num_slots):
                raise ValueError(f"request {e.rid}: slot id outside 0..{self.kv.num_slots - 1}")


def default_num_threads() -> int:
    """``OMP_NUM_THREADS`` when it is set (the usual way to pin a process's threads), else one
    torch thread per core this process may use. All cores, not one fewer: the API process and
    the detokenizer take ~1% of a core here (1.3 CPU-s beside the model's 108 over a 64-request
    run), and on a quiet 2-core machine two threads finished that run in 0.71x the wall time of
    one (benchmarks/engine_bench.py); where neighbours keep the cores busy, two threads that
    must share them can lose (the same run took 1.06x), and ``--num-threads`` sets fewer."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores)


def read_arch(model_dir: Path) -> ModelArch:
    return ModelArch.from_hf_config(json.loads((model_dir / "config.json").read_text()))


def kv_bytes_per_token(model_config: ModelConfig) -> int:
    """KV cache bytes one token slot costs for this model and dtype (to size ``num_slots``)."""
    arch = read_arch(resolve_model_dir(model_config))
    _, kv_dtype = resolve_dtypes(
        model_config.dtype, model_config.kv_cache_dtype, model_config.device
    )
    return KVPool.bytes_per_slot(arch.num_layers, arch.num_kv_heads, arch.head_dim, kv_dtype)
