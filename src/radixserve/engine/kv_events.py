"""KV-cache events of one engine: ``KVEventsConfig`` (``--kv-events-config JSON``), the ZeroMQ
publisher (vLLM's wire format) and ``KVEventPlane``, which the scheduler process runs.

Wire format (vLLM's, byte for byte; checked against vLLM's ``vllm/distributed/kv_events.py``
and against captures of vLLM >= 0.26 published in subscriber bug reports):

- PUB socket, multipart ``[topic, seq, payload]``: ``seq`` an unsigned 8-byte big-endian
  counter from 0, one per batch; ``payload`` msgpack of the array ``[ts, events, 0]`` (time in
  seconds, the events, the data-parallel rank).
- Each event is a map tagged by ``"type"`` (vLLM dropped ``array_like`` from its event structs in
  vllm-project/vllm#42892 and publishes maps since; the batch itself stays an array):
  ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
  "lora_id": null, "medium": "GPU", "lora_name", "extra_keys", "group_idx": 0,
  "kv_cache_spec_kind": "full_attention"}``, ``{"type": "BlockRemoved", "block_hashes",
  "medium": "GPU", "group_idx": 0}`` and ``{"type": "AllBlocksCleared"}``. Hashes are 64-bit
  unsigned ints; cache/block_events.py says how they and the namespaces are made.
- Replay: a ROUTER socket keeps the last ``buffer_steps`` batches. A request whose last frame is
  ``start_seq`` (8-byte big-endian) gets every buffered batch from ``start_seq`` on, then an end
  marker. vLLM's framing is kept: a request sent with an empty delimiter frame (a REQ socket,
  or a DEALER sending ``[b"", start_seq]``) is answered ``[b"", seq, payload]`` ... ``[b"",
  seq(-1, signed), b""]``; a DEALER that sends only ``[start_seq]`` gets ``[topic, seq,
  payload]`` ... ``[b"", seq(-1), b""]`` (the same bytes when the topic is empty).

Snapshot (``GET /kv_events/snapshot``, for indexers that join late): taken in the scheduler
process between two steps, after publishing every pending event, as ``{"seq": last seq sent
(-1: none yet), "block_size", "hash_algo", "hash_seed", "blocks": [{"block_hash",
"parent_block_hash", "token_ids", "lora_name", "extra_keys"}, ...]}``, parents before children:
applying the events with a larger ``seq`` to it gives the engine's blocks at any later time.

Endpoints follow vLLM's rule: an address with ``*`` or ``::`` (or ``ipc://``, ``inproc://``) is
bound, another is connected to. ``tcp://127.0.0.1:*`` binds a free port; ``/get_server_info``
shows the address bound.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from radixserve.cache.block_events import BlockTracker, KVEvent
from radixserve.cache.hashing import ALGORITHMS
from radixserve.cache.radix import RadixCache

log = logging.getLogger("radixserve.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's and SGLang's fields, plus how blocks are cut and hashed. Giving the flag turns
    events on (vLLM needs ``enable_kv_cache_events`` too; it is accepted, and ``false`` or
    ``"publisher": "null"`` turns publishing off)."""

    enable_kv_cache_events: bool = _f(True, "publish KV events")
    publisher: str = _f("zmq", '"zmq" or "null" (track blocks, send nothing)')
    endpoint: str = _f("tcp://*:5557", "PUB address (bound if it has * or ::, else connected)")
    replay_endpoint: str | None = _f(None, "ROUTER address answering replay requests")
    buffer_steps: int = _f(10_000, "batches kept for replay")
    hwm: int = _f(100_000, "ZeroMQ high-water mark of the PUB socket (0: no limit)")
    max_queue_size: int = _f(100_000, "batches queued for the publisher thread before dropping")
    topic: str = _f("", "first frame of every published message")
    block_size: int = _f(16, "tokens per announced block (a multiple of the page size)")
    hash_algo: str = _f("xxhash64", "block hash: xxhash64, sha256 or sha256_cbor")
    hash_seed: int = _f(0, "seed of the block hash")

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f'publisher must be "zmq" or "null", got {self.publisher!r}')
        if self.hash_algo not in ALGORITHMS:
            raise ValueError(f"hash_algo must be one of {sorted(ALGORITHMS)}")
        for name in ("buffer_steps", "max_queue_size", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.hash_seed < 2**64:
            raise ValueError(f"hash_seed must be in [0, 2**64), got {self.hash_seed}")
        if self.hwm < 0:
            raise ValueError(f"hwm must be >= 0 (0: no limit), got {self.hwm}")

    @property
    def publishing(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> KVEventsConfig:
        """From the flag's JSON object; unknown keys and wrong types raise ValueError."""
        try:
            data = json.loads(text) if isinstance(text, str) else dict(text)
        except ValueError as e:
            raise ValueError(f"--kv-events-config: not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config: must be a JSON object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(fields)}")  # fmt: skip
        for key, value in data.items():
            _check_type(key, value, fields[key].default)
        try:
            return cls(**data)
        except ValueError as e:
            raise ValueError(f"--kv-events-config: {e}") from None

    def check_page_size(self, page_size: int) -> None:
        if self.block_size % page_size:
            raise ValueError(f"--kv-events-config: block_size {self.block_size} must be a "
                             f"multiple of the page size {page_size}")  # fmt: skip


def _check_type(key: str, value: Any, default: Any) -> None:
    if key == "replay_endpoint":
        ok = value is None or isinstance(value, str)
    elif isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, str)
    if not ok:
        raise ValueError(f"--kv-events-config: {key} must be of type {type(default).__name__}, "
                         f"got {value!r}")  # fmt: skip


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _attach(sock: zmq.Socket, endpoint: str, bind: bool) -> str:
    """Bind or connect; the address bound (a ``*`` port resolved), or the one connected to."""
    try:
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise ValueError(f"cannot {'bind' if bind else 'connect to'} {endpoint}: {e}") from None
    return sock.last_endpoint.decode()


class ZmqPublisher:
    """PUB + replay ROUTER, served by one thread; ``publish`` never blocks the caller (a batch
    that finds the queue full is dropped, and subscribers see a gap in ``seq``)."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps
        )
        self.endpoint, self.replay_endpoint = self._open_sockets()
        self.dropped = 0
        self._thread = threading.Thread(target=self._serve, name="kv-events", daemon=True)
        self._thread.start()

    def _open_sockets(self) -> tuple[str, str | None]:
        cfg = self.config
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._pub.linger = 0
        endpoint = _attach(self._pub, cfg.endpoint, _binds(cfg.endpoint))
        self._replay = replay = None
        if cfg.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.linger = 0
            replay = _attach(self._replay, cfg.replay_endpoint, True)
        # the engine thread's end of the queue to the publisher thread
        inbox = f"inproc://kv-events-{id(self)}"
        self._in = self._ctx.socket(zmq.PAIR)
        self._in.bind(inbox)
        self._out = self._ctx.socket(zmq.PAIR)
        self._out.sndhwm = cfg.max_queue_size
        self._out.connect(inbox)
        return endpoint, replay

    def publish(self, seq: int, payload: bytes) -> None:
        try:
            self._out.send_multipart((seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            log.warning("KV events: publisher queue full; batch %d dropped", seq)

    def close(self) -> None:
        self._out.send_multipart((b"",))
        self._thread.join(5)
        self._out.close(0)
        self._ctx.term()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._replay in ready:
                    self._answer_replay()
                if self._in in ready and not self._send_queued():
                    return
        finally:
            for sock in (self._in, self._pub, self._replay):
                if sock is not None:
                    sock.close(0)

    def _send_queued(self) -> bool:
        """Send every queued batch; False once told to stop."""
        while True:
            try:
                frames = self._in.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if len(frames) == 1:
                return False
            seq_bytes, payload = frames
            self._pub.send_multipart((self.topic, seq_bytes, payload))
            self._buffer.append((int.from_bytes(seq_bytes, "big"), payload))

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) not in (2, 3) or len(frames[-1]) != 8:
            log.warning("KV events: invalid replay request of %d frame(s)", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[-1], "big")
        # vLLM's framing for a request with a delimiter frame; the topic in its place otherwise
        head = [client, b"" if len(frames) == 3 else self.topic]
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([*head, seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", END_SEQ, b""])


def encode_batch(ts: float, events: list[KVEvent]) -> bytes:
    """One message payload: msgpack of ``[ts, events, data_parallel_rank 0]``."""
    return msgpack.packb([ts, [e.wire() for e in events], 0], use_bin_type=True)


class KVEventPlane:
    """The scheduler process's side: a BlockTracker on the cache, and a publisher it feeds one
    batch per step (``flush``)."""

    def __init__(self, config: KVEventsConfig, cache: RadixCache) -> None:
        config.check_page_size(cache.page_size)
        self.config = config
        self.tracker = BlockTracker(cache, config.block_size, config.hash_algo, config.hash_seed)
        self.publisher = ZmqPublisher(config) if config.publishing else None
        self.seq = -1  # the last batch's sequence number
        self.events_sent = 0

    def info(self) -> dict[str, Any]:
        """Where and how events are published (for /get_server_info)."""
        cfg, pub = self.config, self.publisher
        return {"publisher": cfg.publisher if cfg.publishing else "null",
                "endpoint": pub.endpoint if pub else None,
                "replay_endpoint": pub.replay_endpoint if pub else None,
                "topic": cfg.topic, "block_size": cfg.block_size, "hash_algo": cfg.hash_algo,
                "hash_seed": cfg.hash_seed, "buffer_steps": cfg.buffer_steps}  # fmt: skip

    def flush(self) -> int:
        """Publish what the tree did since the last call as one batch; returns its event count."""
        if not self.tracker.pending:
            return 0
        events = self.tracker.take()
        self.seq += 1
        self.events_sent += len(events)
        if self.publisher is not None:
            self.publisher.publish(self.seq, encode_batch(time.time(), events))
        return len(events)

    def cleared(self) -> None:
        """The cache was flushed: announce AllBlocksCleared at once."""
        self.tracker.clear()
        self.flush()

    def snapshot(self) -> dict[str, Any]:
        self.flush()
        cfg = self.config
        return {"seq": self.seq, "block_size": cfg.block_size, "hash_algo": cfg.hash_algo,
                "hash_seed": cfg.hash_seed, "blocks": list(self.tracker.blocks())}  # fmt: skip

    def stats(self) -> dict[str, Any]:
        """Counters for /metrics and /get_server_info (keys prefixed, beside the scheduler's)."""
        return {"kv_events_seq": self.seq, "kv_events_sent": self.events_sent,
                "kv_events_blocks": self.tracker.num_blocks,
                "kv_events_dropped_batches": self.publisher.dropped if self.publisher else 0}  # fmt: skip

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
