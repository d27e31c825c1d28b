"""Structured output: each request with a grammar (a JSON schema, any JSON, a regex, or a forced
tool call's structural tag) has an xgrammar matcher that masks the tokens its grammar forbids
before every draw.

A matcher is a function of the request's output so far, so it is rebuilt from ``output_ids``
whenever it is missing or out of step: after a retraction, or once dropped for being idle.
Chunked prefill and prefix-cache hits touch only prompt tokens, which a grammar never sees.
xgrammar is imported only when the first grammar is compiled.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.sched.batch import BatchEntry

logger = logging.getLogger(__name__)
# matchers of requests that did not run for this many steps are dropped (rebuilt on return)
IDLE_STEPS = 256
MAX_COMPILED = 64  # compiled grammars kept, most recently used first


@dataclass(slots=True)
class _Matcher:
    grammar: tuple[str, str]
    matcher: Any
    accepted: int  # output tokens it has consumed
    last_step: int
    failed: bool = False  # xgrammar raised: the output ends here rather than the process

    def ended(self) -> bool:
        return self.failed or self.matcher.is_terminated()


class Grammars:
    """The grammar matchers of one runner, keyed by request id."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._tokenizer, self._vocab, self._eos = tokenizer, vocab_size, list(eos_ids)
        self._compiler: Any = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._live: dict[str, _Matcher] = {}
        self._step = 0

    def compile(self, grammar: tuple[str, str]) -> Any:
        """The compiled grammar (cached); ValueError naming what is wrong with it."""
        if grammar in self._compiled:
            self._compiled.move_to_end(grammar)
            return self._compiled[grammar]
        compiler = self._get_compiler()
        kind, spec = grammar
        try:
            if kind == "json_schema":
                out = compiler.compile_json_schema(spec, any_whitespace=False)
            elif kind == "regex":
                out = compiler.compile_regex(spec)
            elif kind == "json":
                out = compiler.compile_builtin_json_grammar()
            elif kind == "structural_tag":  # the server's own: a forced tool call
                out = compiler.compile_structural_tag(spec)
            else:
                raise ValueError(f"unknown grammar kind {kind!r}")
        except Exception as e:  # xgrammar's parse errors: "[time] file.cc:line: message"
            message = re.sub(r"^\[[^\]]*\] \S+: ", "", str(e).strip().splitlines()[0])
            raise ValueError(f"invalid {kind}: {message}") from None
        self._compiled[grammar] = out
        if len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)
        return out

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar
            from transformers import PreTrainedTokenizerFast

            hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer)
            info = xgrammar.TokenizerInfo.from_huggingface(
                hf, vocab_size=self._vocab, stop_token_ids=self._eos
            )
            self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler

    def mask(self, logits: torch.Tensor, entries: Sequence[BatchEntry]) -> None:
        """Forbid, in each grammar entry's row of ``logits``, what its grammar forbids next."""
        self._step += 1
        rows = [i for i, e in enumerate(entries) if e.sampling.grammar is not None]
        live = [i for i in rows if not self._matcher(entries[i]).ended()]
        if live:
            import xgrammar

            bitmask = xgrammar.allocate_token_bitmask(len(entries), logits.shape[-1])
            for i in live:
                m = self._matcher(entries[i])
                try:
                    m.matcher.fill_next_token_bitmask(bitmask, i)
                except Exception:
                    logger.exception("grammar of request %s failed; ending it", entries[i].rid)
                    m.failed = True
            live = [i for i in live if not self._live[entries[i].rid].failed]
            if live:
                mask = bitmask.to(logits.device)
                xgrammar.apply_token_bitmask_inplace(logits, mask, indices=live)
        # a finished grammar allows only the end (it goes on only under ignore_eos): the text
        # stays what the grammar accepted, as EOS is a special token
        for i in set(rows) - set(live):
            ended = torch.full_like(logits[i], float("-inf"))
            ended[self._eos] = logits[i, self._eos]
            logits[i] = ended
        if self._step % IDLE_STEPS == 0:
            self._drop_idle()

    def accept(self, entries: Sequence[BatchEntry], tokens: Sequence[int]) -> None:
        """Advance each grammar entry's matcher by the token drawn for it."""
        for e, token in zip(entries, tokens, strict=True):
            if e.sampling.grammar is None:
                continue
            m = self._live[e.rid]
            if not m.ended() and not m.matcher.accept_token(token):
                m.failed = True  # cannot happen for a token drawn under its mask
            m.accepted += 1

    def _matcher(self, e: BatchEntry) -> _Matcher:
        m = self._live.get(e.rid)
        if m is None or m.grammar != e.sampling.grammar or m.accepted != e.num_generated:
            m = self._rebuild(e)
        m.last_step = self._step
        return m

    def _rebuild(self, e: BatchEntry) -> _Matcher:
        import xgrammar

        grammar = e.sampling.grammar
        assert grammar is not None
        matcher = xgrammar.GrammarMatcher(self.compile(grammar))
        for token in list(e.output_ids)[: e.num_generated]:
            if not matcher.is_terminated():
                matcher.accept_token(token)
        m = self._live[e.rid] = _Matcher(grammar, matcher, e.num_generated, self._step)
        return m

    def _drop_idle(self) -> None:
        old = [rid for rid, m in self._live.items() if self._step - m.last_step > IDLE_STEPS]
        for rid in old:
            del self._live[rid]
