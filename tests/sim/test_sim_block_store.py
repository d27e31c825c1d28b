"""The simulator's fleet-wide KV store: whole blocks known by their prefix, least recently used
evicted first. A hypothesis state machine drives writes, hits and lookups against a plain
per-block LRU (one entry a block, keyed by the block's whole prefix) and checks that both hold
the same blocks, count the same, and evict the same ones; plus a chain evicted from its end."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from radixserve.sim.tiers import SimStore


class ReferenceStore:
    """A per-block LRU as the store's docstring defines it: a write or a hit touches a
    chain's blocks last to first; the oldest go when it is over capacity."""

    def __init__(self, capacity_tokens: int, block: int) -> None:
        self.block, self.capacity = block, capacity_tokens // block
        self.lru: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self.written = self.evicted = self.read = 0

    def chain(self, tokens: list[int]) -> list[tuple[int, ...]]:
        b = self.block
        return [tuple(tokens[: (i + 1) * b]) for i in range(len(tokens) // b)]

    def leading(self, tokens: list[int]) -> int:
        n = 0
        for key in self.chain(tokens):
            if key not in self.lru:
                break
            n += 1
        return n

    def touch(self, keys: list[tuple[int, ...]]) -> None:
        for key in reversed(keys):
            if key in self.lru:
                self.lru.move_to_end(key)
            else:
                self.lru[key] = None
                self.written += 1

    def write(self, tokens: list[int]) -> None:
        self.touch(self.chain(tokens))
        while len(self.lru) > self.capacity:
            self.lru.popitem(last=False)
            self.evicted += 1

    def read_blocks(self, tokens: list[int], blocks: int) -> None:
        self.read += blocks
        self.touch([k for k in self.chain(tokens)[:blocks] if k in self.lru])


# few distinct tokens and shared heads, so chains share, split and diverge inside blocks
HEADS = [[1, 2, 1, 2, 3, 1], [1, 2, 3, 3], [2, 2, 2, 1, 1, 1, 2]]


@st.composite
def sequences(draw: st.DrawFn) -> list[int]:
    head = draw(st.sampled_from([[], *HEADS]))
    return head[: draw(st.integers(0, len(head)))] + draw(st.lists(st.integers(1, 3), max_size=14))


class StoreMachine(RuleBasedStateMachine):
    block = 2

    def __init__(self) -> None:
        super().__init__()
        self.store = SimStore(9 * self.block + 1, self.block)
        self.ref = ReferenceStore(9 * self.block + 1, self.block)
        self.seen: list[list[int]] = []

    @rule(tokens=sequences())
    def write(self, tokens: list[int]) -> None:
        self.store.write(tokens)
        self.ref.write(tokens)
        self.seen.append(tokens)

    @rule(tokens=sequences(), blocks=st.integers(0, 12))
    def hit(self, tokens: list[int], blocks: int) -> None:
        blocks = min(blocks, len(tokens) // self.block)
        self.store.read_blocks(tokens, blocks)
        self.ref.read_blocks(tokens, blocks)

    @rule(tokens=sequences())
    def lookup(self, tokens: list[int]) -> None:
        assert self.store.leading(tokens) == self.ref.leading(tokens)

    @invariant()
    def same_blocks_and_counts(self) -> None:
        s, r = self.store, self.ref
        s.check()
        assert (len(s), s.written, s.evicted, s.read) == (len(r.lru), r.written, r.evicted, r.read)
        for tokens in self.seen:
            assert s.leading(tokens) == r.leading(tokens)


class StoreMachineBlock1(StoreMachine):
    block = 1


class StoreMachineBlock3(StoreMachine):
    block = 3


for machine in (StoreMachine, StoreMachineBlock1, StoreMachineBlock3):
    machine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestStore = StoreMachine.TestCase
TestStoreBlock1 = StoreMachineBlock1.TestCase
TestStoreBlock3 = StoreMachineBlock3.TestCase


def test_the_store_evicts_a_chain_from_its_end() -> None:
    store = SimStore(capacity_tokens=10 * 16, block_tokens=16)
    a, b = list(range(8 * 16)), list(range(1000, 1000 + 8 * 16))
    store.write(a)
    store.write(b)  # 16 blocks into 10: a's last 6 go
    assert len(store) == 10 and store.evicted == 6
    assert store.leading(a) == 2 and store.leading(b) == 8
    store.check()
    # a hit makes a's head newer than all of b: the next write takes b's end first
    store.read_blocks(a, 2)
    store.write(list(range(2000, 2000 + 3 * 16)))
    assert store.leading(a) == 2 and store.leading(b) == 5 and store.read == 2
    # a chain that continues a held one adds only its new whole blocks (a part block is none)
    store.write(a[:3 * 16 + 5])  # fmt: skip
    assert store.leading(a) == 3 and store.written == 8 + 8 + 3 + 1
    store.check()
