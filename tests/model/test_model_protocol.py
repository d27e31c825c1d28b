"""The Runner protocol is structural: anything with ``run(batch) -> StepResult`` is a runner
(the torch-free import of the model package is checked in test_no_torch.py)."""

from __future__ import annotations


def test_runner_protocol_is_structural() -> None:
    from radixserve.model.protocol import Runner
    from radixserve.sched.batch import Batch, StepResult

    class Echo:
        def run(self, batch: Batch) -> StepResult:
            return StepResult([None for _ in batch.entries])

    assert isinstance(Echo(), Runner)
    assert not isinstance(object(), Runner)
