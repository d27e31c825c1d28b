"""``Engine``: the in-process Python API for offline use, over the same processes as the server.

engine = Engine(model="path/or/file.gguf")      # no model: the built-in SmolLM2-135M
outs = engine.generate(["Hello"], {"max_new_tokens": 16, "temperature": 0})
engine.shutdown()
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
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
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list of them (a list of dicts)."""
        inputs, single = _inputs(prompt, input_ids, sampling_params)
        for inp in inputs:
            self._check_sim(inp.sampling)
        results = self._call(self._collect_all(inputs))
        return results[0] if single else results

    async def _collect_all(self, inputs: list[GenerateInput]) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self._collect(i) for i in inputs)))

    async def _collect(self, inp: GenerateInput) -> dict[str, Any]:
        text, ids, last = [], [], None
        lps: list[TokenLogprob] = []
        prompt: tuple[int, list[TokenLogprob]] = (0, [])
        async for out in self.tm.generate(inp):
            text.append(out.text)
            ids.extend(out.token_ids)
            lps.extend(out.logprobs or [])
            if out.prompt_logprobs:
                prompt = (out.prompt_logprob_start, out.prompt_logprobs)
            last = out
        assert last is not None
        result = _result("".join(text), ids, last)
        if inp.sampling.return_logprob:
            first = inp.input_ids[0] if inp.input_ids else None
            result["meta_info"] |= _logprob_meta(inp.sampling, lps[: len(ids)], prompt, first)
        return result

    async def async_generate(
        self, prompt: str | None = None, sampling_params: SamplingArg = None,
        input_ids: Sequence[int] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
        """Stream one request from any event loop: yields ``{"text": delta, ...}`` chunks."""
        sampling, prefill_only = _prefill_aware(sampling_params)
        self._check_sim(sampling)
        inp = GenerateInput(text=prompt, input_ids=list(input_ids) if input_ids else None,
                            sampling=sampling, prefill_only=prefill_only)  # fmt: skip
        queue: asyncio.Queue = asyncio.Queue()
        caller = asyncio.get_running_loop()

        async def pump() -> None:
            try:
                async for out in self.tm.generate(inp):
                    caller.call_soon_threadsafe(queue.put_nowait, out)
            except Exception as e:
                caller.call_soon_threadsafe(queue.put_nowait, e)

        task = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                chunk = _result(item.text, item.token_ids, item)
                if sampling.return_logprob:  # this chunk's tokens (and the prompt, once)
                    prompt = (item.prompt_logprob_start, item.prompt_logprobs or [])
                    first = inp.input_ids[0] if inp.input_ids else None
                    lps = (item.logprobs or [])[: len(item.token_ids)]
                    chunk["meta_info"] |= _logprob_meta(sampling, lps, prompt, first)
                yield chunk
                if item.finished:
                    return
        finally:
            task.cancel()  # a consumer that stops early aborts the request

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


def _prefill_aware(arg: SamplingArg) -> tuple[SamplingParams, bool]:
    """``max_new_tokens: 0`` (prefill and cache the prompt only) runs as one hidden token."""
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
            "cached_tokens_details": cached_details(out.cached_tokens, out.host_cached_tokens),
            "matched_stop": out.matched_stop,
        },
    }
