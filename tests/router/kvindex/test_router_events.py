"""The event subscriber against a publisher written here from the wire format (issue 12), not
this project's: real ZMQ PUB and replay ROUTER sockets on loopback, vLLM's framing, both event
encodings, fields the router must read past, and hashes it cannot reproduce."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import msgpack
import zmq

from radixserve.router.kvindex.block_index import InMemoryIndex, block_keys
from radixserve.router.kvindex.subscriber import Endpoints, EventPlane, endpoints_from_info

BS = 16
PROMPT = list(range(500, 500 + 4 * BS))
TOPIC = b"kv"


class Publisher:
    """vLLM's publisher contract: PUB [topic, seq, payload]; a ROUTER answering
    [b"", start_seq] with [b"", seq, payload] per buffered batch, then [b"", seq -1, b""], and
    ignoring a request without the empty delimiter frame, as vLLM's does."""

    def __init__(self, buffer: int = 1000) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[int, bytes]] = []
        self.keep, self.seq, self.lock = buffer, 0, threading.Lock()
        self.running = True
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints(
            f"tcp://127.0.0.1:{self.port}", f"tcp://127.0.0.1:{self.replay_port}", TOPIC.decode()
        )

    def send(self, events: list, drop: bool = False) -> int:
        """Publish one batch (or only buffer it, as if the network lost it); returns its seq."""
        payload = msgpack.packb([time.time(), events, 0])
        with self.lock:
            seq, self.seq = self.seq, self.seq + 1
            self.buffer = [*self.buffer, (seq, payload)][-self.keep :]
        if not drop:
            self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        with self.lock:
            self.seq, self.buffer = 0, []

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self.replay, zmq.POLLIN)
        while self.running:
            if not poller.poll(50):
                continue
            frames = self.replay.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            with self.lock:
                batches = [(s, p) for s, p in self.buffer if s >= first]
            for seq, payload in batches:
                self.replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            self.replay.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.running = False
        self.thread.join()
        self.ctx.destroy(0)


def foreign(n: int) -> list[bytes]:
    """Hashes the subscriber cannot reproduce (random 32-byte digests)."""
    return [os.urandom(32) for _ in range(n)]


def tagged(hashes, parent, tokens):
    # block_size, lora_id, medium, lora_name, then fields a newer engine might add
    return ["BlockStored", hashes, parent, tokens, BS, 7, "GPU", None, {"new": 1}, 42]


def as_map(hashes, parent, tokens):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": None, "group_idx": 0,
            "kv_cache_spec_kind": "full_attention", "unheard_of": [1, 2]}  # fmt: skip


def held(index: InMemoryIndex, prompt=PROMPT) -> int | None:
    return index.prefix_tokens(["w"], lambda n: block_keys(prompt, n)).get("w")


async def settle(pub: Publisher, sub, seq: int, done=None) -> None:
    """Publish empty batches until the subscriber has seen `seq` and the filler (the SUB socket
    may join late; whatever it missed comes back through replay), or until `done()`."""
    done = done or (lambda: sub.live and sub.last_seq >= seq + 1)
    for _ in range(400):
        if done():
            return
        pub.send([])
        await asyncio.sleep(0.01)
    raise AssertionError(f"subscriber stuck at seq {sub.last_seq}, wanted {seq}")


def run(scenario) -> None:
    async def main() -> None:
        pub, index = Publisher(), InMemoryIndex()
        plane = EventPlane(index)
        sub = plane.subscribe("w", pub.endpoints)
        try:
            await scenario(pub, index, sub)
        finally:
            await plane.stop()
            pub.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_both_encodings_foreign_hashes_and_history_replayed_at_subscription():
    async def scenario(pub, index, sub):
        h = foreign(4)
        pub.send([tagged(h[:2], None, PROMPT[: 2 * BS])])
        seq = pub.send([as_map(h[2:], h[1], PROMPT[2 * BS :])])
        await settle(pub, sub, seq)
        assert held(index) == 4 * BS
        pub.send([["BlockRemoved", [h[3]], "GPU", "trailing"]])
        seq = pub.send([{"type": "BlockRemoved", "block_hashes": [h[2]], "medium": "GPU"}])
        await settle(pub, sub, seq)
        assert held(index) == 2 * BS and index.blocks() == {"w": 2}
        seq = pub.send([["AllBlocksCleared"]])
        await settle(pub, sub, seq)
        assert held(index) == 0

    run(scenario)


def test_a_dropped_message_is_recovered_through_replay():
    async def scenario(pub, index, sub):
        h = foreign(4)
        await settle(pub, sub, pub.send([tagged(h, None, PROMPT)]))
        pub.send([["BlockRemoved", [h[0]], "GPU"]], drop=True)  # never reaches the subscriber
        await settle(pub, sub, pub.send([]))
        assert sub.stats.gaps == 1 and sub.stats.resyncs == 0
        assert held(index) == 0  # the removal came back through replay

    run(scenario)


def test_an_unreplayable_gap_drops_the_workers_entries_until_fresh_events():
    async def scenario(pub, index, sub):
        h = foreign(4)
        await settle(pub, sub, pub.send([tagged(h, None, PROMPT)]))
        pub.keep = 1  # the buffer forgets the lost batch before anyone asks
        pub.send([["BlockRemoved", [h[3]], "GPU"]], drop=True)
        pub.send([], drop=True)
        seq = pub.send([tagged(foreign(1), None, PROMPT[:BS])])
        await settle(pub, sub, seq)
        assert sub.stats.resyncs == 1
        assert held(index) == BS  # only what was announced after the loss

    run(scenario)


def test_a_restarted_publisher_loses_its_stale_entries():
    async def scenario(pub, index, sub):
        await settle(pub, sub, pub.send([tagged(foreign(4), None, PROMPT)]))
        assert held(index) == 4 * BS
        pub.restart()  # seq starts over at 0: a new process with an empty cache
        await settle(pub, sub, pub.send([]), done=lambda: sub.stats.restarts > 0)
        assert sub.stats.restarts == 1 and held(index) is None

    run(scenario)


def test_a_dead_publisher_loses_its_entries():
    async def scenario(pub, index, sub):
        await settle(pub, sub, pub.send([tagged(foreign(4), None, PROMPT)]))
        assert held(index) == 4 * BS
        pub.pub.close(0)  # the worker died: its PUB connection drops, nothing more is said
        for _ in range(500):
            if held(index) is None:
                break
            await asyncio.sleep(0.01)
        assert held(index) is None

    run(scenario)


def test_endpoints_from_server_info_replace_the_wildcard_host():
    info = {"kv_events": {"publisher": "zmq", "endpoint": "tcp://*:5557",
                          "replay_endpoint": "tcp://*:5558", "topic": "kv"}}  # fmt: skip
    got = endpoints_from_info("http://10.0.0.7:30001", info)
    assert got == Endpoints("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558", "kv")
    assert endpoints_from_info("http://h:1", {"kv_events": {"publisher": "null"}}) is None
    assert endpoints_from_info("http://h:1", {}) is None
