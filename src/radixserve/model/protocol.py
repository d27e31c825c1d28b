"""The Runner protocol the scheduler process drives: a Batch in, a StepResult out.

Torch-free, so the simulated runner and tests can name the interface without installing torch.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from radixserve.sched.batch import Batch, StepResult


@runtime_checkable
class Runner(Protocol):
    """Computes one forward step. Every entry's ``slots`` must be allocated by the caller, and
    the slots of its cached context must hold K/V this runner wrote in an earlier step."""

    def run(self, batch: Batch) -> StepResult: ...
