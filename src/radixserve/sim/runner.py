"""SimRunner: the Runner protocol without a model, for simulated engines and tests.

Next tokens are a hash of the context and each step's duration comes from a cost model.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.modelfiles.sim_tokenizer import SIM_VOCAB_SIZE
from radixserve.sched.batch import Batch, StepResult
from radixserve.sim.costmodel import CostModel, StepEntry, get_cost_model

_MASK64 = (1 << 64) - 1


class SimRunner:
    """Returns a next token per sampled entry and the step's duration; never sleeps.

    The next token depends only on (last token, sequence length, seed), so a request produces
    the same output whether its prefix came from the cache, was recomputed after a retraction,
    or was prefilled in chunks. ``eos_token_id`` is never produced unless ``eos_prob`` > 0, in
    which case it is produced at that rate, still as a function of the context.
    """

    def __init__(
        self,
        cost_model: str | CostModel = "tiny-cpu",
        vocab_size: int = SIM_VOCAB_SIZE,
        seed: int = 0,
        eos_token_id: int | None = None,
        eos_prob: float = 0.0,
        host_load_s_per_token: float = 0.0,
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if not 0 <= eos_prob <= 1:
            raise ValueError(f"eos_prob must be in [0, 1], got {eos_prob}")
        if eos_prob > 0 and eos_token_id is None:
            raise ValueError("eos_prob > 0 needs an eos_token_id")
        if isinstance(cost_model, str):
            cost_model = get_cost_model(cost_model)
        self.cost_model = cost_model
        self._step_time = cost_model.timer()
        self.vocab_size = vocab_size
        self.seed = seed
        # a batch's loads from the host tier (Batch.kv_copies) run before its forward
        self.host_load_s_per_token = host_load_s_per_token
        self.host_loaded = 0  # tokens copied up from the host tier, ever
        self.eos_token_id = eos_token_id
        # compare the hash's top 32 bits with a threshold instead of drawing a float
        self._eos_threshold = int(eos_prob * (1 << 32))

    def run(self, batch: Batch) -> StepResult:
        next_token = self.next_token
        tokens: list[int | None] = []
        steps = []  # step_entries(batch), without a StepEntry per entry
        for e in batch.entries:
            ids, start = e.token_ids, e.start_pos
            tokens.append(next_token(ids[-1], start + len(ids)) if e.sample else None)
            steps.append((len(ids), start, e.is_prefill))
        duration = self._step_time(steps)
        if batch.kv_copies:
            loaded = sum(len(c.host) for c in batch.kv_copies if c.kind == "load")
            self.host_loaded += loaded
            duration += loaded * self.host_load_s_per_token
        return StepResult(next_token_ids=tokens, duration=duration)

    def next_token(self, last_token: int, seq_len: int) -> int:
        """The token that follows a context of ``seq_len`` tokens ending in ``last_token``."""
        # CPython's tuple hash (xxHash's mixing; ints are not salted by PYTHONHASHSEED, so it
        # is the same in every process): a few times cheaper than mixing 64-bit ints in Python,
        # and this runs once per generated token
        h = hash((self.seed, last_token, seq_len)) & _MASK64
        if self.eos_token_id is not None and (h >> 32) < self._eos_threshold:
            return self.eos_token_id
        token = h % self.vocab_size
        if token == self.eos_token_id:
            token = (token + 1) % self.vocab_size
        return token

    # -- runs of pure decode steps: equal to ``run`` on each step's batch, one call for all --
    def decode_durations(self, contexts: Sequence[int], steps: int) -> list[float]:
        """Each step's duration, the requests having ``contexts[i]`` tokens computed at first."""
        return self._step_time.decode_steps(contexts, steps)

    def decode_tokens(
        self, lasts: Sequence[int], contexts: Sequence[int], steps: int
    ) -> list[list[int]]:
        """Each request's next ``steps`` tokens (its last token ``lasts[i]``, ``contexts[i]``
        tokens computed). EOS is not checked: callers run only steps that cannot stop."""
        if self.eos_token_id is not None:  # the EOS rules: token by token
            return [self._tokens(last, ctx, steps) for last, ctx in zip(lasts, contexts)]
        vocab, seed, mask, h = self.vocab_size, self.seed, _MASK64, hash
        tokens = []
        for first, ctx in zip(lasts, contexts, strict=True):
            last = first
            tokens.append(
                [  # next_token without EOS, each token from the one before
                    last := (h((seed, last, seq_len)) & mask) % vocab
                    for seq_len in range(ctx + 1, ctx + 1 + steps)
                ]
            )
        return tokens

    def _tokens(self, last: int, ctx: int, steps: int) -> list[int]:
        out = []
        for seq_len in range(ctx + 1, ctx + 1 + steps):
            last = self.next_token(last, seq_len)
            out.append(last)
        return out

    def generate(self, input_ids: list[int], max_new_tokens: int) -> list[int]:
        """What this runner outputs for a prompt, without a scheduler (stops after an EOS)."""
        if not input_ids:
            raise ValueError("generate needs a non-empty prompt")
        out: list[int] = []
        last, seq_len = input_ids[-1], len(input_ids)
        while len(out) < max_new_tokens:
            last = self.next_token(last, seq_len)
            out.append(last)
            seq_len += 1
            if last == self.eos_token_id:
                break
        return out


def step_entries(batch: Batch) -> list[StepEntry]:
    """The cost model's view of a batch: new tokens, cached context, prefill or decode."""
    return [StepEntry(len(e.token_ids), e.start_pos, e.is_prefill) for e in batch.entries]
