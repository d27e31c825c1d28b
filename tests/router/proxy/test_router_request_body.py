"""One rule reads a request body's prompt for every policy (proxy/request_body.py): the tree's
key (cache_aware) and the token ids (kv_aware) come from the same extraction, and a chat
message's text parts join as vLLM (and radixserve's server) join them before templating."""

from __future__ import annotations

from radixserve.modelfiles.sim_tokenizer import SimTokenizer
from radixserve.router.policies.tree_keys import ids_key, text_key
from radixserve.router.proxy.kv_setup import prompt_ids
from radixserve.router.proxy.request_body import Prompt, extract_prompt, request_view

PARTS = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "prime."}]


def test_chat_text_parts_join_with_a_newline_as_vllm_does() -> None:
    body = {"messages": [{"role": "user", "content": PARTS}]}
    want = [{"role": "user", "content": "Name a\nprime."}]
    assert extract_prompt(body) == Prompt(messages=want)
    # the same text whichever way the router reads the request
    assert request_view(body).key == text_key("<user>Name a\nprime.\n")
    tok = SimTokenizer()
    plain = {"messages": want}
    assert prompt_ids(body, tok) == prompt_ids(plain, tok)
    assert prompt_ids(body, tok) != prompt_ids({"messages": [{"role": "user", "content":
                                                "Name aprime."}]}, tok)  # fmt: skip


def test_a_batch_routes_on_its_first_prompt_for_every_policy() -> None:
    tok = SimTokenizer()
    for body, first in [
        ({"prompt": ["first prompt", "second"]}, "first prompt"),
        ({"text": ["first prompt", "second"]}, "first prompt"),
    ]:
        assert extract_prompt(body) == Prompt(text=first)
        assert request_view(body).key == text_key(first)
        assert prompt_ids(body, tok) == tok.encode(first)
    ids_batch = {"prompt": [[8, 9], [1]]}
    assert extract_prompt(ids_batch) == Prompt(ids=[8, 9])
    assert request_view(ids_batch).key == ids_key([8, 9])
    assert prompt_ids(ids_batch, tok) == [8, 9]


def test_token_ids_win_and_nothing_readable_is_no_prompt() -> None:
    assert extract_prompt({"input_ids": [1, 2], "text": "x"}) == Prompt(ids=[1, 2])
    assert extract_prompt({"prompt": [5, 6]}) == Prompt(ids=[5, 6])
    assert extract_prompt({}) == Prompt()
    assert extract_prompt({"messages": ["not an object"]}) == Prompt()
    assert prompt_ids({}, SimTokenizer()) is None
    assert request_view({"input_ids": [1, True]}).token_ids is None  # a bool is no token id
