"""Log-probabilities in the shapes clients expect: OpenAI chat (``logprobs.content``), OpenAI
completions (``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``) and SGLang's
``meta_info`` (``input_token_logprobs`` and friends, ``[logprob, token_id, text]`` triples).

The engine sends (token id, logprob, top alternatives) per token; token texts are decoded here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from radixserve.sched.batch import TokenLogprob
from radixserve.sched.request import SamplingParams

TokenText = Callable[[int], str]


def chat_content(lps: Sequence[TokenLogprob], text: TokenText) -> dict[str, Any]:
    """OpenAI chat ``logprobs``: one entry per generated token, with its top alternatives."""

    def item(token: int, logprob: float) -> dict[str, Any]:
        s = text(token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8", "replace"))}

    content = []
    for token, logprob, top in lps:
        entry = item(token, logprob)
        entry["top_logprobs"] = [item(t, v) for t, v in top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    lps: Sequence[TokenLogprob | None],
    text: TokenText,
    ids: Sequence[int],
    offset: int = 0,
    visible: TokenText | None = None,
) -> dict[str, Any]:
    """OpenAI completions ``logprobs`` for tokens ``ids`` (None where a token has none, as
    the first prompt token of an echo); ``offset`` is where the first token's text starts,
    and each token moves it by its ``visible`` text (special tokens are not in the text)."""
    visible = visible or text
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}  # fmt: skip
    for token, lp in zip(ids, lps):  # noqa: B905 (a hidden prefill-only token)
        s = text(token)
        out["tokens"].append(s)
        out["token_logprobs"].append(lp[1] if lp else None)
        out["top_logprobs"].append({text(t): v for t, v in lp[2]} if lp else None)
        out["text_offset"].append(offset)
        offset += len(visible(token))
    return out


def sglang_triples(
    lps: Sequence[TokenLogprob | None], ids: Sequence[int], text: TokenText | None
) -> tuple[list[list[Any]], list[Any]]:
    """SGLang's ``*_token_logprobs`` and ``*_top_logprobs`` lists for tokens ``ids``; texts
    only when ``text`` is given (``return_text_in_logprobs``)."""

    def triple(token: int, logprob: float | None) -> list[Any]:
        return [logprob, token, text(token) if text else None]

    tokens, tops = [], []
    for token, lp in zip(ids, lps):  # noqa: B905 (a hidden prefill-only token)
        tokens.append(triple(token, lp[1] if lp else None))
        tops.append([triple(t, v) for t, v in lp[2]] if lp else None)
    return tokens, tops


def prompt_entries(
    prompt_ids: Sequence[int], start: int, got: Sequence[TokenLogprob], got_start: int
) -> tuple[list[int], list[TokenLogprob | None]]:
    """The prompt tokens from position ``start`` on and their logprobs (``got`` holds those of
    positions ``got_start..``; position 0 has none)."""
    ids = list(prompt_ids[start:])
    lps: list[TokenLogprob | None] = [None] * len(ids)
    for j, lp in enumerate(got):
        at = got_start + j - start
        if 0 <= at < len(lps):
            lps[at] = lp
    return ids, lps


def generate_meta(c: Any, sp: SamplingParams, text: TokenText | None) -> dict[str, Any]:
    """SGLang's logprob fields of ``meta_info`` for choice ``c`` (a responses.Choice)."""
    if not sp.return_logprob:
        return {}
    ids_in: list[int] = []
    lps_in: list[TokenLogprob | None] = []
    if sp.logprob_start_len >= 0:
        ids_in, lps_in = prompt_entries(c.prompt_ids, sp.logprob_start_len, c.prompt_logprobs,
                                        c.prompt_logprob_start)  # fmt: skip
    in_tokens, in_top = sglang_triples(lps_in, ids_in, text)
    out_tokens, out_top = sglang_triples(c.logprobs, c.ids, text)
    meta = {"input_token_logprobs": in_tokens, "output_token_logprobs": out_tokens}
    if sp.top_logprobs_num:
        meta |= {"input_top_logprobs": in_top, "output_top_logprobs": out_top}
    return meta
