"""The torch model computes what Hugging Face transformers computes on the same weights."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from radixserve.config import ModelConfig  # noqa: E402
from radixserve.model.runner import TorchRunner  # noqa: E402
from radixserve.sched.batch import Batch  # noqa: E402
from tiny_models import TINY_KINDS, SlotAllocator, build_tiny_model, entry  # noqa: E402

PROMPT = [0, 17, 93, 140, 201, 33, 250, 7, 64, 99, 180, 12]


@pytest.fixture(scope="module", params=sorted(TINY_KINDS))
def tiny(request, tmp_path_factory):
    path = build_tiny_model(request.param, tmp_path_factory.mktemp("tiny"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return path, hf


def hf_last_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float()


def test_logits_match_transformers_at_prefill_and_every_decode_step(tiny):
    path, hf = tiny
    runner = TorchRunner(ModelConfig(model=str(path)), num_slots=128)
    alloc = SlotAllocator(128)
    tokens = list(PROMPT)
    slots = alloc.take(len(tokens))
    ours = runner.logits(Batch([entry("a", tokens, 0, slots)]))[0]
    ref = hf_last_logits(hf, tokens)
    assert ref.std() > 0.1, "logits too flat for the comparison to mean anything"
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    for step in range(1, 9):
        tokens.append(int(ref.argmax()))
        slots += alloc.take(1)
        batch = Batch([entry("a", tokens[-1:], len(tokens) - 1, slots, num_generated=step)])
        ours = runner.logits(batch)[0]
        ref = hf_last_logits(hf, tokens)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4, msg=f"decode step {step}")


def test_runner_reads_model_facts(tiny):
    path, _ = tiny
    runner = TorchRunner(ModelConfig(model=str(path), context_length=100), num_slots=8)
    assert runner.info.vocab_size == 320
    assert runner.info.context_length == 100
    assert 1 in runner.info.eos_token_ids
    assert runner.info.bos_token_id == 0
