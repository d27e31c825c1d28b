"""Messages and tools as chat templates get them: as transformers passes them to a template that
renders tools, and in the default form for one that does not (the built-in SmolLM2's)."""

import json

import pytest

from radixserve.chat.prompt import ChatError, template_inputs, transformers_inputs
from radixserve.chat.tool_parsers import get_tool_parser, parser_for_template
from radixserve.config import ModelConfig
from radixserve.modelfiles.locate import resolve_model_dir
from radixserve.modelfiles.tokenizer import ModelInfo, load_model_info

# a template in the way Qwen2.5's renders tools and past calls (written for this test)
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}:"
    "{{ c.function.arguments.city }}</tool_call>{% endfor %}</{{ m.role }}>\n{% endfor %}"
)
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },  # fmt: skip
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]


@pytest.fixture(scope="module")
def smollm2() -> ModelInfo:
    return load_model_info(resolve_model_dir(ModelConfig()))


def test_a_template_that_renders_tools_gets_them_and_past_arguments_as_objects():
    info = ModelInfo(
        None, vocab_size=1, context_length=1, eos_token_ids=[], chat_template=TOOLS_TEMPLATE
    )  # type: ignore[arg-type]
    parser = get_tool_parser(parser_for_template(TOOLS_TEMPLATE) or "")
    assert parser.name == "hermes"
    messages, extra = template_inputs(HISTORY, [TOOL], TOOLS_TEMPLATE, parser)
    text = info.apply_chat_template(messages, **extra)
    assert json.dumps(TOOL) in text and "<tool_call>get_weather:Paris</tool_call>" in text
    assert "<tool>sunny</tool>" in text


def test_the_default_form_lists_the_tools_and_writes_past_calls_in_the_parsers_format(smollm2):
    assert parser_for_template(smollm2.chat_template) == "smollm2"
    parser = get_tool_parser("smollm2")
    messages, extra = template_inputs(HISTORY, [TOOL], smollm2.chat_template, parser)
    text = smollm2.apply_chat_template(messages, **extra)
    assert text.startswith("<|im_start|>system\nYou may call functions")
    assert json.dumps(TOOL["function"]) in text
    assert (
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>' in text
    )
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_no_tools_leaves_a_chat_as_it_was(smollm2):
    chat = [{"role": "user", "content": "hi"}]
    assert template_inputs(chat, None, smollm2.chat_template, None) == (chat, {})


def test_bad_arguments_and_unused_template_kwargs_name_the_field(smollm2):
    bad = [HISTORY[0], HISTORY[1] | {"tool_calls": [HISTORY[1]["tool_calls"][0] | {"function": {
        "name": "f", "arguments": "[1]"}}]}]  # fmt: skip
    with pytest.raises(ChatError) as e:
        template_inputs(bad, [TOOL], smollm2.chat_template, get_tool_parser("smollm2"))
    assert e.value.param == "messages.1.tool_calls.0.function.arguments"
    with pytest.raises(ChatError, match="enable_thinking") as e:
        template_inputs(HISTORY[:1], None, smollm2.chat_template, None, {"enable_thinking": False})
    assert e.value.param == "chat_template_kwargs"


def test_past_reasoning_reaches_the_template_under_both_names():
    """Qwen3's and DeepSeek's templates read reasoning_content, newer ones reasoning (vLLM hands
    both); a message without reasoning is left as it was."""
    said = {"role": "assistant", "content": "Sunny.", "reasoning_content": "look it up"}
    for render in (lambda m: template_inputs(m, None, "{{ messages }}", None)[0],
                   lambda m: transformers_inputs(m, None)[0]):  # fmt: skip
        got = render([HISTORY[0], said, {"role": "user", "content": "And tomorrow?"}])
        assert got[1] == said | {"reasoning": "look it up"} and got[0] == HISTORY[0]
        newer = render([HISTORY[0], {"role": "assistant", "content": "x", "reasoning": "r"}])
        assert newer[1]["reasoning_content"] == "r"
