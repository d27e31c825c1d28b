"""The grammars that enforce tool_choice "required" / a named function admit exactly the calls,
in each format, whose arguments follow the tool's schema (compiled by xgrammar for SmolLM2)."""

import json

import pytest

from radixserve.chat.constrain import strict_auto_grammar, tool_grammar
from radixserve.chat.tool_parsers import get_tool_parser
from radixserve.config import ModelConfig
from radixserve.modelfiles.locate import resolve_model_dir
from radixserve.modelfiles.tokenizer import load_model_info

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}  # fmt: skip
GOOD, BAD = {"a": 1, "b": 2}, {"a": "one", "b": 2}


@pytest.fixture(scope="module")
def compiler():
    xgrammar = pytest.importorskip("xgrammar")
    from transformers import PreTrainedTokenizerFast

    info = load_model_info(resolve_model_dir(ModelConfig()))
    hf = PreTrainedTokenizerFast(tokenizer_object=info.tokenizer)
    tok = xgrammar.TokenizerInfo.from_huggingface(
        hf, vocab_size=info.vocab_size, stop_token_ids=list(info.eos_token_ids)
    )
    return xgrammar, xgrammar.GrammarCompiler(tok)


def admits(compiler, name: str, text: str, parallel: bool = True) -> bool:
    xgrammar, c = compiler
    kind, spec = tool_grammar(get_tool_parser(name), [TOOL], parallel)
    assert kind == "structural_tag"
    matcher = xgrammar.GrammarMatcher(c.compile_structural_tag(spec))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("name", ["hermes", "smollm2", "mistral", "llama3"])
def test_a_call_in_the_format_is_admitted_and_bad_arguments_are_not(compiler, name):
    parser = get_tool_parser(name)
    good = parser.render([{"name": "add", "arguments": GOOD}]).replace(", ", ",").replace(": ", ":")
    assert admits(compiler, name, good), good
    assert not admits(compiler, name, good.replace('"a":1', '"a":"one"'))
    assert not admits(compiler, name, "Sure, " + good)  # a call and nothing else
    assert json.loads(parser.parse(good).calls[0].arguments) == GOOD


def test_one_call_only_unless_parallel(compiler):
    two = '<tool_call>[{"name":"add","arguments":{"a":1,"b":2}},{"name":"add","arguments":{"a":1,"b":2}}]</tool_call>'
    assert admits(compiler, "smollm2", two, parallel=True)
    assert not admits(compiler, "smollm2", two, parallel=False)


def test_pythonic_cannot_be_enforced():
    with pytest.raises(ValueError, match="pythonic"):
        tool_grammar(get_tool_parser("pythonic"), [TOOL], True)


def admits_auto(compiler, name: str, text: str, strict: bool = True) -> bool:
    xgrammar, c = compiler
    tool = {**TOOL, "function": {**TOOL["function"], "strict": strict}}
    _, spec = strict_auto_grammar(get_tool_parser(name), [tool], True)
    matcher = xgrammar.GrammarMatcher(c.compile_structural_tag(spec))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("name", ["hermes", "smollm2"])
def test_strict_auto_admits_text_and_holds_opened_calls_to_the_schema(compiler, name):
    good = get_tool_parser(name).render([{"name": "add", "arguments": GOOD}])
    good = good.replace(", ", ",").replace(": ", ":")
    assert admits_auto(compiler, name, "No call needed.")
    assert admits_auto(compiler, name, "Let me add. " + good)
    bad = good.replace('"a":1', '"a":"one"')
    assert not admits_auto(compiler, name, bad)
    assert admits_auto(compiler, name, bad, strict=False)  # not strict: only the name is held


def test_strict_auto_needs_a_format_with_an_opening_tag():
    with pytest.raises(ValueError, match="llama3"):
        strict_auto_grammar(get_tool_parser("llama3"), [TOOL], True)
