"""The field-rule checks (test_server_fields.HONOURED) of the sampling, logprob and structured
output fields: each fails if the server ignored its field, on whichever route declares it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from server_harness import assert_error_body

EOS = {"1": 100, "3": 100}  # the tiny model's </s> and <|im_end|>: the end is most likely
SPECIAL = {"2": 100}  # <|im_start|>: a special token that ends nothing
YES_NO = {"enum": ["yes", "no"]}


def _t(send: Callable, server: Any, route: Any, **fields: Any) -> str:
    return send(server, route, **fields).texts[0]


def _greedy(send: Callable, server: Any, route: Any, **fields: Any) -> str:
    return _t(send, server, route, temperature=0, ignore_eos=True, **fields)


def make_checks(send: Callable, sampled: Callable, limit: Callable) -> dict[str, Callable]:
    """The checks, given test_server_fields' ``send``, ``sampled`` and ``_limit``."""

    def min_p(server, route) -> None:  # min_p 1 keeps only the most likely token
        greedy = sampled(server, route, temperature=0)
        assert sampled(server, route, min_p=1.0, seed=3) == greedy != sampled(server, route, seed=3)

    def penalty(name: str, value: float) -> Callable:
        def check(server, route) -> None:
            plain = _greedy(send, server, route)
            assert _greedy(send, server, route, **{name: value}) != plain

        return check

    def logit_bias(server, route) -> None:
        text = sampled(server, route, logit_bias={"77": 100})
        assert text and text == text[: len(text) // 8] * 8  # token 77, eight times
        err = assert_error_body(server.post(route.path, route.body(logit_bias={"x": 1})), 400)
        assert err["param"].endswith("logit_bias")

    def skip_special_tokens(server, route) -> None:
        assert sampled(server, route, logit_bias=SPECIAL) == ""
        shown = sampled(server, route, logit_bias=SPECIAL, skip_special_tokens=False)
        assert shown == "<|im_start|>" * 8

    def keep_stop(name: str) -> Callable:
        def check(server, route) -> None:
            text = _greedy(send, server, route)
            stop = next(text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].strip())
            kept = _greedy(send, server, route, stop=[stop], **{name: True})
            assert kept == text[: text.index(stop)] + stop

        return check

    def min_tokens(name: str) -> Callable:
        def check(server, route) -> None:
            kw = {"temperature": 0, "logit_bias": EOS, **limit(route, 20)}
            assert send(server, route, **kw).completion_tokens == 1
            held = send(server, route, **kw, **{name: 5})
            assert held.completion_tokens == 6 and held.finish == ["stop"]

        return check

    def json_schema(server, route) -> None:
        text = _greedy(send, server, route, json_schema=json.dumps(YES_NO))
        assert json.loads(text) in YES_NO["enum"]

    def regex(server, route) -> None:
        assert re.fullmatch(r"(ab|cd)[0-9]", _t(send, server, route, regex=r"(ab|cd)[0-9]"))

    def response_format(server, route) -> None:
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": YES_NO}}
        assert json.loads(_t(send, server, route, response_format=fmt)) in YES_NO["enum"]
        assert _t(send, server, route, response_format={"type": "json_object"})[0] in "{["

    def echo(server, route) -> None:
        out = _t(send, server, route, echo=True)
        assert out.startswith(route.base["prompt"]) and len(out) > len(route.base["prompt"])

    def logprobs(server, route) -> None:
        raw = send(server, route, logprobs=True if "messages" in route.base else 0).raw
        lp = raw["choices"][0]["logprobs"]
        got = lp["content"] if "content" in lp else lp["token_logprobs"]
        assert len(got) == raw["usage"]["completion_tokens"]

    def top_logprobs(server, route) -> None:
        content = send(server, route, logprobs=True, top_logprobs=2).raw["choices"][0]
        assert all(len(c["top_logprobs"]) == 2 for c in content["logprobs"]["content"])

    def return_logprob(server, route) -> None:
        meta = send(server, route, return_logprob=True).raw["meta_info"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]

    def logprob_start_len(server, route) -> None:
        meta = send(server, route, return_logprob=True, logprob_start_len=2).raw["meta_info"]
        assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] - 2

    def top_logprobs_num(server, route) -> None:
        meta = send(server, route, return_logprob=True, top_logprobs_num=2).raw["meta_info"]
        assert all(len(top) == 2 for top in meta["output_top_logprobs"])

    def return_text_in_logprobs(server, route) -> None:
        raw = send(server, route, return_logprob=True, return_text_in_logprobs=True).raw
        assert all(isinstance(t[2], str) for t in raw["meta_info"]["output_token_logprobs"])

    return {
        "min_p": min_p,
        "presence_penalty": penalty("presence_penalty", -2.0),
        "frequency_penalty": penalty("frequency_penalty", -2.0),
        "repetition_penalty": penalty("repetition_penalty", 0.2),
        "logit_bias": logit_bias,
        "skip_special_tokens": skip_special_tokens,
        "no_stop_trim": keep_stop("no_stop_trim"),
        "include_stop_str_in_output": keep_stop("include_stop_str_in_output"),
        "min_tokens": min_tokens("min_tokens"),
        "min_new_tokens": min_tokens("min_new_tokens"),
        "json_schema": json_schema,
        "regex": regex,
        "response_format": response_format,
        "echo": echo,
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
        "return_logprob": return_logprob,
        "logprob_start_len": logprob_start_len,
        "top_logprobs_num": top_logprobs_num,
        "return_text_in_logprobs": return_text_in_logprobs,
    }
