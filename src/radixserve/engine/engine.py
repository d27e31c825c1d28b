"""``Engine``: the in-process Python API for offline use, over the same processes as the server.

engine = Engine(model="path/or/file.gguf")      # no model: the built-in SmolLM2-135M
outs = engine.generate(["Hello"], {"max_new_tokens": 16, "temperature": 0})
out = await engine.async_generate("Hello", sp)                       # from any event loop
async for chunk in await engine.async_generate("Hello", sp, stream=True): ...   # sglang's shape
engine.shutdown()
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from radixserve.engine.launch import EngineConfig, EngineProcesses, launch
from radixserve.engine.messages import TextOut, cached_details
from radixserve.engine.tokenizer_manager import GenerateInput, TokenizerManager, prompt_inputs
from radixserve.sched.batch import TokenLogprob
from radixserve.sched.request import SamplingParams, needs_logits

SamplingArg = Mapping[str, Any] | SamplingParams | None


def sampling_from(arg: SamplingArg) -> SamplingParams:
    """SamplingParams from a dict with SGLang's names (``stop`` may be a string)."""
    if isinstance(arg, SamplingParams):
        return arg
    kw = dict(arg or {})
    for name in ("stop", "stop_token_ids"):
        value = kw.get(name)
        if value is not None:
            kw[name] = (value,) if isinstance(value, (str, int)) else tuple(value)
    if kw.get("top_k") == 0:  # vLLM's "off", as -1 is SGLang's
        kw["top_k"] = -1
    if isinstance(kw.get("logit_bias"), Mapping):  # {token id: bias}
        kw["logit_bias"] = tuple((int(t), float(b)) for t, b in kw["logit_bias"].items())
    # SGLang's names for the one grammar: two of them is refused, not one silently dropped
    named = [(k, s) for k in ("json_schema", "regex") if (s := kw.pop(k, None)) is not None]
    if len(named) + (kw.get("grammar") is not None) > 1:
        raise ValueError("give at most one of json_schema, regex and grammar")
    if named:
        kw["grammar"] = named[0]
    return SamplingParams(**kw)


class Engine:
    """Starts the scheduler and detokenizer processes; a private event loop thread runs the
    tokenizer manager so that plain synchronous code can call ``generate``."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        if model is not None:
            kwargs["model"] = model
        self.config = EngineConfig.from_kwargs(**kwargs)
        self.procs: EngineProcesses = launch(self.config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.tm = TokenizerManager(
            self.procs.tokenizer, self.procs.endpoints.sched, self.procs.endpoints.tm,
            self.procs.why_dead,
        )  # fmt: skip
        self._call(self.tm.start())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def tokenizer(self) -> Any:
        return self.procs.tokenizer

    def generate(
        self,
        prompt: str | Sequence[str] | None = None,
        sampling_params: SamplingArg | Sequence[SamplingArg] = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        stream: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list of them (a list of dicts). With
        ``stream`` (one prompt), an iterator of chunks as sglang.Engine's: each the whole
        result so far (text, output_ids, meta_info), the last one the final result."""
        inputs, single = _inputs(prompt, input_ids, sampling_params)
        for inp in inputs:
            self._check_sim(inp.sampling)
        if stream:
            return self._sync_stream(_one(inputs, single))
        results = self._call(self._collect_all(inputs))
        return results[0] if single else results

    async def async_generate(
        self,
        prompt: str | Sequence[str] | None = None,
        sampling_params: SamplingArg | Sequence[SamplingArg] = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        stream: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """``generate`` from any event loop, as sglang.Engine's: ``await`` it for the result,
        or with ``stream=True`` for an async iterator of chunks (each the whole result so
        far). A consumer that stops iterating early aborts the request."""
        inputs, single = _inputs(prompt, input_ids, sampling_params)
        for inp in inputs:
            self._check_sim(inp.sampling)
        if stream:
            return self._async_stream(_one(inputs, single))
        future = asyncio.run_coroutine_threadsafe(self._collect_all(inputs), self._loop)
        results = await asyncio.wrap_future(future)
        return results[0] if single else results

    async def _collect_all(self, inputs: list[GenerateInput]) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self._collect(i) for i in inputs)))

    async def _collect(self, inp: GenerateInput) -> dict[str, Any]:
        got = _SoFar(inp)
        async for _ in self._outputs(inp, got):
            pass
        return got.result()

    async def _chunks(self, inp: GenerateInput) -> AsyncIterator[dict[str, Any]]:
        """The request's whole result so far after each output (on the engine's own loop)."""
        got = _SoFar(inp)
        outputs = self._outputs(inp, got)
        try:
            async for _ in outputs:
                yield got.result()
        finally:
            await outputs.aclose()

    async def _outputs(self, inp: GenerateInput, got: _SoFar) -> AsyncIterator[None]:
        outs = self.tm.generate(inp)
        try:
            async for out in outs:
                got.add(out)
                yield None
        finally:
            await outs.aclose()  # not finished: the request is aborted and its KV freed

    async def _async_stream(self, inp: GenerateInput) -> AsyncIterator[dict[str, Any]]:
        """Chunks made on the engine's loop, handed to the caller's loop one by one."""
        chunks = self._chunks(inp)
        try:
            while True:
                step = asyncio.run_coroutine_threadsafe(_next(chunks), self._loop)
                chunk = await asyncio.wrap_future(step)
                if chunk is None:
                    return
                yield chunk
        finally:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(chunks.aclose(), self._loop))

    def _sync_stream(self, inp: GenerateInput) -> Iterator[dict[str, Any]]:
        chunks = self._chunks(inp)
        try:
            while (chunk := self._call(_next(chunks))) is not None:
                yield chunk
        finally:
            self._call(chunks.aclose())

    def _check_sim(self, sampling: SamplingParams) -> None:
        """A simulated engine has no logits: refuse what needs them rather than ignore it."""
        field = needs_logits(sampling) if self.config.sim is not None else None
        if field is not None:
            raise ValueError(f"{field} needs a model's logits; a sim engine has none")

    def flush_cache(self) -> bool:
        return bool(self._call(self.tm.control("flush_cache")))

    def stats(self) -> dict[str, Any]:
        return self._call(self.tm.control("stats"))

    def update_scheduler_settings(self, **changes: Any) -> dict[str, Any]:
        """Change schedule_policy, max_wait_ms or the priority settings while requests run;
        returns the scheduler's settings. ValueError (nothing changed) if one is refused."""
        out = self._call(self.tm.control("update_scheduler_settings", args=changes))
        if "error" in out:
            raise ValueError(out["error"])
        return out["scheduler"]

    def shutdown(self) -> None:
        if self._loop.is_running():
            self._call(self.tm.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self.procs.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class _SoFar:
    """A request's outputs gathered so far, as a result in SGLang's shape."""

    def __init__(self, inp: GenerateInput) -> None:
        self.inp = inp
        self.text: list[str] = []
        self.ids: list[int] = []
        self.lps: list[TokenLogprob] = []
        self.prompt: tuple[int, list[TokenLogprob]] = (0, [])
        self.last: TextOut | None = None

    def add(self, out: TextOut) -> None:
        self.text.append(out.text)
        self.ids.extend(out.token_ids)
        self.lps.extend(out.logprobs or [])
        if out.prompt_logprobs:
            self.prompt = (out.prompt_logprob_start, out.prompt_logprobs)
        self.last = out

    def result(self) -> dict[str, Any]:
        assert self.last is not None
        result = _result("".join(self.text), list(self.ids), self.last)
        sp = self.inp.sampling
        if sp.return_logprob:
            first = self.inp.input_ids[0] if self.inp.input_ids else None
            lps = self.lps[: len(self.ids)]
            result["meta_info"] |= _logprob_meta(sp, lps, self.prompt, first)
        return result


def _inputs(prompt: Any, input_ids: Any, sampling: Any) -> tuple[list[GenerateInput], bool]:
    if (prompt is None) == (input_ids is None):
        raise ValueError("give a prompt or input_ids")
    inputs, batch = prompt_inputs(prompt if prompt is not None else input_ids)
    samplings = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(inputs)
    if len(samplings) != len(inputs):
        raise ValueError("sampling_params must be one dict or one per prompt")
    for inp, s in zip(inputs, samplings):
        inp.sampling, inp.prefill_only = _prefill_aware(s)
    return inputs, not batch


async def _next(chunks: AsyncIterator[dict[str, Any]]) -> dict[str, Any] | None:
    """The next chunk, or None at the end (a coroutine, for run_coroutine_threadsafe)."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None


def _one(inputs: list[GenerateInput], single: bool) -> GenerateInput:
    if not single:
        raise ValueError("stream=True takes one prompt, not a list")
    return inputs[0]


def _prefill_aware(arg: SamplingArg) -> tuple[SamplingParams, bool]:
    """``max_new_tokens: 0`` (prefill and cache the prompt only) runs as one hidden token."""
    asked = arg.get("max_new_tokens") if isinstance(arg, Mapping) else None
    if isinstance(asked, int) and asked < 0:
        raise ValueError(f"max_new_tokens must be >= 0 (0: prefill and cache the prompt only), "
                         f"got {asked}")  # fmt: skip
    if isinstance(arg, Mapping) and arg.get("max_new_tokens") == 0:
        return sampling_from({**arg, "max_new_tokens": 1}), True
    return sampling_from(arg), False


def _logprob_meta(
    sp: SamplingParams,
    out: list[TokenLogprob],
    prompt: tuple[int, list[TokenLogprob]],
    first_id: int | None,
) -> dict[str, Any]:
    """SGLang's logprob fields of ``meta_info``: ``[logprob, token_id, None]`` triples of the
    prompt (from ``logprob_start_len``; position 0, ``first_id``, has no logprob) and of the
    output."""

    def triples(lps: list[TokenLogprob]) -> tuple[list[list[Any]], list[Any]]:
        return ([[lp, t, None] for t, lp, _ in lps],
                [[[v, i, None] for i, v in top] for _, _, top in lps])  # fmt: skip

    start, got = prompt
    skip = max(sp.logprob_start_len - start, 0)
    first = [[None, first_id, None]] if sp.logprob_start_len == 0 else []
    in_tokens, in_top = triples(got[skip:])
    out_tokens, out_top = triples(out)
    meta = {"input_token_logprobs": first + in_tokens, "output_token_logprobs": out_tokens}
    if sp.top_logprobs_num:
        meta |= {"input_top_logprobs": [None] * len(first) + in_top, "output_top_logprobs": out_top}
    return meta


def _result(text: str, ids: list[int], out: TextOut) -> dict[str, Any]:
    return {
        "text": text,
        "output_ids": ids,
        "meta_info": {
            "id": out.rid,
            "finish_reason": out.finish_reason,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
            "cached_tokens_details": cached_details(
                out.cached_tokens, out.host_cached_tokens, out.storage_cached_tokens
            ),
            "matched_stop": out.matched_stop,
        },
    }
