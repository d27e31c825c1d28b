"""One rule reads a request body's prompt for every policy (proxy/request_body.py): the tree's
key (cache_aware) and the token ids (kv_aware) come from the same extraction, and a chat
message's text parts join as vLLM (and radixserve's server) join them before templating."""

from __future__ import annotations

import pytest

from radixserve.config import ModelConfig
from radixserve.modelfiles.locate import resolve_model_dir
from radixserve.modelfiles.sim_tokenizer import SimTokenizer
from radixserve.router.policies.tree_keys import ids_key, text_key
from radixserve.router.proxy.kv_setup import load_tokenizer, prompt_ids
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


# Chat parity (issue 26, item 2): the ids the router hashes for a chat body are the ones vLLM
# prefills. vLLM renders chats with HF transformers' apply_chat_template (its content parts
# already joined with "\n"), so transformers itself, on the built-in SmolLM2's own tokenizer
# and template, is the reference here; test_router_vllm.py checks the same corpus against a
# running vLLM's POST /tokenize.
SYSTEM = {"role": "system", "content": "You are terse."}
CHAT_CORPUS = [
    ({"messages": [{"role": "user", "content": "Hi there"}]}, None),
    ({"messages": [SYSTEM, {"role": "user", "content": "2+2?"}]}, None),
    (
        {
            "messages": [
                SYSTEM,
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "and 3+3?\n  spaced  "},
            ]
        },
        None,
    ),  # fmt: skip
    (
        {"messages": [{"role": "user", "content": PARTS}]},
        [{"role": "user", "content": "Name a\nprime."}],
    ),  # fmt: skip
    (
        {"messages": [{"role": "user", "content": "Héllo ✓ 日本"}], "add_generation_prompt": False},
        None,
    ),  # fmt: skip
    (
        {
            "messages": [
                {"role": "user", "content": "Write a haiku"},
                {"role": "assistant", "content": "Autumn moon"},
            ],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        None,
    ),  # fmt: skip
    (
        {
            "messages": [
                {"role": "user", "content": "Go on"},
                {"role": "assistant", "content": "The answer is "},
            ],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        None,
    ),  # fmt: skip
    (
        {
            "messages": [
                SYSTEM,
                {"role": "user", "content": "List"},
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "1."}, {"type": "text", "text": "2."}],
                },
            ],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        [SYSTEM, {"role": "user", "content": "List"}, {"role": "assistant", "content": "1.\n2."}],
    ),  # fmt: skip
    # continued messages whose text also occurs in the template's own markup ("end" in
    # "<|im_end|>"), and an empty one: vLLM leaves the assistant's header open (no content,
    # or "", is "" once vLLM parses it; transformers' marker rule then cuts right after it)
    *(
        (
            {
                "messages": [{"role": "user", "content": "Say end"}, last],
                "add_generation_prompt": False,
                "continue_final_message": True,
            },
            [{"role": "user", "content": "Say end"}, {"role": "assistant", "content": text}],
        )
        for last, text in [
            ({"role": "assistant", "content": "end"}, "end"),
            ({"role": "assistant", "content": ">"}, ">"),
            ({"role": "assistant", "content": ""}, ""),
            ({"role": "assistant"}, ""),
        ]
    ),
]


@pytest.fixture(scope="module")
def smollm2():
    """The router's tokenizer for the built-in model and transformers' own for the same dir."""
    transformers = pytest.importorskip("transformers")
    tok = load_tokenizer("built-in:SmolLM2-135M")
    root = resolve_model_dir(ModelConfig(model=None))
    return tok, transformers.AutoTokenizer.from_pretrained(str(root))


@pytest.mark.parametrize("case", range(len(CHAT_CORPUS)))
def test_chat_ids_are_the_ones_vllm_renders(smollm2, case) -> None:
    tok, hf = smollm2
    body, normalised = CHAT_CORPUS[case]
    text = hf.apply_chat_template(
        normalised or body["messages"],
        tokenize=False,
        add_generation_prompt=body.get("add_generation_prompt", True),
        continue_final_message=body.get("continue_final_message", False),
    )
    assert prompt_ids(body, tok) == hf.encode(text, add_special_tokens=False)


def test_generation_prompt_and_continued_message_change_the_ids(smollm2) -> None:
    tok = smollm2[0]
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    opened = tok.decode(prompt_ids({"messages": msgs}, tok), skip_special_tokens=False)
    closed = {"messages": msgs, "add_generation_prompt": False}
    plain = tok.decode(prompt_ids(closed, tok), skip_special_tokens=False)
    cont = {**closed, "continue_final_message": True}
    open_end = tok.decode(prompt_ids(cont, tok), skip_special_tokens=False)
    assert opened.endswith("Hello<|im_end|>\n<|im_start|>assistant\n")
    assert plain.endswith("Hello<|im_end|>\n")
    assert open_end.endswith("assistant\nHello")
    # what vLLM refuses, the router does not tokenize (the worker answers with the error)
    both = {"messages": msgs, "continue_final_message": True}
    assert prompt_ids(both, tok) is None
    assert prompt_ids({"messages": msgs, "add_generation_prompt": "no"}, tok) is None
