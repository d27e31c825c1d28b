"""What `route --policy kv_aware` adds to the proxy: the workers' tokenizer (so prompts hash into
the same blocks the engines announce), the check that every worker tokenizes alike, and the KV
event subscribers that feed the policy's index. Owns the I/O of that setup; the proxy calls it
at a few hooks (worker added or removed, request view built, metrics)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from radixserve.chat.prompt import ChatError, template_inputs, transformers_inputs
from radixserve.chat.tool_parsers import get_tool_parser, knows_tools, parser_for_template
from radixserve.router.kvindex.subscriber import EventPlane
from radixserve.router.policies.base import RequestView, RouterPolicy
from radixserve.router.policies.kv_aware import KvAwarePolicy
from radixserve.router.proxy.request_body import Prompt, extract_prompt

if TYPE_CHECKING:
    from radixserve.router.kvindex.mooncake_reader import MooncakeStoreReader
    from radixserve.router.kvindex.redis_reader import RedisIndexReader
    from radixserve.router.proxy.config import RouterConfig

try:
    from orjson import loads
except ImportError:  # pragma: no cover
    from json import loads

log = logging.getLogger("radixserve.router")

Fetch = Callable[[str], Awaitable[dict[str, Any] | None]]
"""GET a worker path; the JSON object, or None when the worker cannot answer."""

Rendering = tuple[str, str | None]
"""How a worker renders a chat with tools: its engine kind (radixserve, vllm, sglang) and, on
ours, the tool-call format its default tools prompt is written in (None: as the template implies;
a template that renders tools itself needs none)."""


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str: ...
    def fingerprint(self) -> str: ...


def load_tokenizer(path: str, vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer a worker reports as its ``tokenizer_path``, or one given as ``--tokenizer``:
    an HF model directory, a GGUF file, ``built-in:...`` (the default model) or ``sim:...`` (the
    simulated engines' word tokenizer). Imported lazily: the router never needs torch."""
    if path.startswith("sim:"):
        from radixserve.modelfiles.sim_tokenizer import SimTokenizer

        return SimTokenizer(vocab_size) if vocab_size else SimTokenizer()
    from radixserve.config import ModelConfig
    from radixserve.modelfiles.locate import load_info

    model = None if path.startswith("built-in:") else path
    return load_info(ModelConfig(model=model))


def prompt_ids(
    payload: dict[str, Any], tok: Tokenizer, engine: str = "radixserve",
    tool_parser: str | None = None,
) -> list[int] | None:  # fmt: skip
    """The token ids a worker computes for this request body, as the engine's tokenizer
    manager does: token ids as they are, chat messages through the chat template (no special
    tokens added), text encoded with them. None when the body has no prompt the router can
    read (the worker answers with the error)."""
    prompt = extract_prompt(payload)
    if prompt.ids is not None:
        return prompt.ids
    if prompt.messages is not None:
        text = render_chat(tok, prompt, engine, tool_parser)
        return None if text is None else tok.encode(text, add_special_tokens=False)
    return tok.encode(prompt.text) if prompt.text else None


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""Appended to the last message to find where its content ends in the rendered chat."""


def render_chat(
    tok: Tokenizer, prompt: Prompt, engine: str = "radixserve", tool_parser: str | None = None
) -> str | None:
    """A chat prompt as text, as vLLM renders it (through HF transformers' apply_chat_template):
    with ``continue_final_message`` the text ends right after the last message's content (no
    end of turn, no generation prompt), found by rendering it with a marker appended and
    cutting there (trailing spaces too where the template trims the content; an empty last
    message leaves its turn's header open, as vLLM renders it). None where the worker refuses
    the request (the template drops the last message, or cannot render its tools)."""
    try:
        messages, extra = chat_inputs(tok, prompt, engine, tool_parser)
    except ChatError:
        return None
    if not prompt.continue_final_message:
        return tok.apply_chat_template(messages, prompt.add_generation_prompt, **extra)
    last = messages[-1]
    marked = [*messages[:-1], {**last, "content": last["content"] + CONTINUE_TAG}]
    text = tok.apply_chat_template(marked, False, **extra)
    at = text.rfind(CONTINUE_TAG.strip())
    if at < 0 or last["content"].strip() not in text:
        return None
    if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()


def chat_inputs(
    tok: Tokenizer, prompt: Prompt, engine: str = "radixserve", tool_parser: str | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and template variables (tools, chat_template_kwargs) the workers render
    the chat with, through the same pure code (radixserve.chat): on radixserve, tools in the
    template where it knows them, else in the default form of the workers' tool-call format
    (`tool_parser`; None: the one the template implies, as --tool-call-parser auto); on vLLM or
    SGLang (`engine`), as transformers hands them to the template."""
    if engine != "radixserve":
        return transformers_inputs(prompt.messages or [], prompt.tools, prompt.template_kwargs)
    template = getattr(tok, "chat_template", None)
    name = tool_parser or parser_for_template(template)
    parser = get_tool_parser(name) if name else None
    return template_inputs(prompt.messages or [], prompt.tools, template, parser,
                           prompt.template_kwargs)  # fmt: skip


class KvRouting:
    """Tokenizer, fingerprint check and event subscribers of a kv_aware router."""

    def __init__(
        self,
        policy: RouterPolicy,
        tokenizer_path: str | None = None,
        subscribe: bool = True,
        store: MooncakeStoreReader | None = None,
    ) -> None:
        if policy.index is None:
            raise ValueError(f"policy {policy.name} keeps no KV index")
        self.policy = policy  # kv_aware: its index, and what it expected to hit
        self.plane = EventPlane(policy.index)
        self.subscribe = subscribe  # False: another process feeds the index (kv-indexer)
        self.store = store  # --kv-index mooncake://: learns each worker's store segment
        self.tokenizer: Tokenizer | None = None
        self.fingerprint: str | None = None
        self.refused: dict[str, str] = {}  # worker url -> why
        self.tokenize_errors = 0
        self.tokenize_timeouts = 0  # prompts routed untokenized: the tokenizer took too long
        self.rendering: Rendering | None = None  # the one way the admitted workers render
        self._renderings: dict[str, Rendering] = {}  # worker id -> how it renders
        if tokenizer_path:
            self._adopt(load_tokenizer(tokenizer_path))

    def _adopt(self, tok: Tokenizer) -> None:
        self.tokenizer, self.fingerprint = tok, tok.fingerprint()
        log.info("kv_aware tokenizes with %s", self.fingerprint)

    async def admit(self, worker_id: str, url: str, fetch: Fetch, kind: str | None = None) -> bool:
        """Check a new worker's tokenizer (adopting it if the router has none yet) and start
        its event subscriber. False: the worker tokenizes or renders chats with tools
        differently and must be refused. A vLLM or SGLang worker (`kind`) renders tools as
        transformers does, ours as its tool-call format (/get_model_info) says."""
        info = await fetch("/get_model_info")
        if info is not None and not self._tokenizer_matches(url, info):
            return False
        if not self._renders_alike(worker_id, url, self._rendering_of(kind, info)):
            return False
        if self.subscribe:
            self.plane.watch(worker_id, url, lambda: fetch("/get_server_info"))
        if self.store is not None and not self.store.register(
            worker_id, await fetch("/get_server_info")
        ):
            log.info("worker %s reports no KV store keys: its store holdings are not counted", url)
        return True

    def _tokenizer_matches(self, url: str, info: dict[str, Any]) -> bool:
        theirs = info.get("tokenizer_fingerprint")
        if self.tokenizer is None and isinstance(info.get("tokenizer_path"), str):
            try:
                vocab = info.get("vocab_size")
                tok = load_tokenizer(info["tokenizer_path"], vocab if type(vocab) is int else None)
            except (OSError, ValueError) as exc:
                log.warning("cannot load %s's tokenizer (%s); give --tokenizer", url, exc)
                return True
            self._adopt(tok)
        if theirs is None or self.fingerprint is None or theirs == self.fingerprint:
            return True
        why = f"tokenizer {theirs} differs from the router's {self.fingerprint}"
        self.refused[url] = why
        log.error("refusing worker %s: %s", url, why)
        return False

    def _rendering_of(self, kind: str | None, info: dict[str, Any] | None) -> Rendering:
        if kind in ("vllm", "sglang"):
            return kind, None
        template = getattr(self.tokenizer, "chat_template", None)
        if knows_tools(template):  # the template renders the tools: no format of ours needed
            return "radixserve", None
        theirs = info.get("tool_call_parser") if info else None
        return "radixserve", theirs if isinstance(theirs, str) else parser_for_template(template)

    def _renders_alike(self, worker_id: str, url: str, theirs: Rendering) -> bool:
        """A router renders a chat one way, so every worker must render it alike: the first
        admitted sets the way, one that differs is refused (saying how)."""
        if self.rendering is None or theirs == self.rendering:
            self.rendering = theirs
            self._renderings[worker_id] = theirs
            return True
        why = (f"renders chats with tools as {_describe(theirs)}, the router's workers as "
               f"{_describe(self.rendering)}: one router renders one way (route them apart)")  # fmt: skip
        self.refused[url] = why
        log.error("refusing worker %s: %s", url, why)
        return False

    async def forget(self, worker_id: str) -> None:
        self._renderings.pop(worker_id, None)
        if not self._renderings:  # the next worker sets the way again
            self.rendering = None
        await self.plane.forget(worker_id)
        if self.store is not None:
            self.store.forget(worker_id)

    async def stop(self) -> None:
        await self.plane.stop()

    def tokenized(self, payload: dict[str, Any], view: RequestView) -> tuple[RequestView, bool]:
        """(`view` with the prompt's token ids when the router can tokenize it, whether the
        tokenizer failed). Changes no state: the proxy calls it from its tokenizing threads."""
        tok = self.tokenizer
        if tok is None or view.token_ids is not None:
            return view, False
        try:
            ids = prompt_ids(payload, tok, *(self.rendering or ("radixserve", None)))
        except Exception:  # a template error, an odd body: the worker will say what is wrong
            return view, True
        except BaseException as exc:  # a panic in the tokenizer's Rust code (pyo3's
            if type(exc).__name__ != "PanicException":  # PanicException) is no Exception
                raise
            return view, True
        return (view, False) if ids is None else (dataclasses.replace(view, token_ids=ids), False)

    def metric_families(self) -> list[tuple[str, str, dict[Any, object]]]:
        """(name, kind, {worker id or (worker id, medium): value}) for the proxy's /metrics."""
        blocks = self.plane.index.blocks()
        stats = self.plane.stat_totals()
        families: list[tuple[str, str, dict[Any, object]]] = [
            ("kv_index_blocks", "gauge", dict(blocks)),
        ]
        index = self.plane.index
        if index.counts_removals:  # blocks each worker evicted (its BlockRemoved events that hit)
            removed = {w: index.removed_blocks(w) for w in blocks}
            families.append(("kv_index_removed_blocks_total", "counter", removed))
        # blocks on a lower medium (KV events' `medium`, e.g. the host tier's "CPU"), labelled
        # by worker and medium; an index that keeps no lower media (Redis) has none
        lower = getattr(self.plane.index, "lower_blocks", dict)()
        families.append(("kv_index_lower_blocks", "gauge",
                         {(w, m): n for w, media in lower.items() for m, n in media.items()}))  # fmt: skip
        for name in (
            "events",
            "batches",
            "gaps",
            "replays",
            "resyncs",
            "restarts",
            "reconnects",
            "malformed",
        ):
            families.append((f"kv_events_{name}_total", "counter", dict(stats[name])))
        families.append(("kv_tokenize_errors_total", "counter", {"": self.tokenize_errors}))
        families.append(("kv_tokenize_timeouts_total", "counter", {"": self.tokenize_timeouts}))
        # prompt tokens dispatched, and those the chosen worker held: the router's expectation
        families.append(("kv_prompt_tokens_total", "counter", {"": self.policy.prompt_tokens}))
        families.append(
            ("kv_expected_hit_tokens_total", "counter", {"": self.policy.matched_tokens})
        )
        # of the rest, those the chosen worker was expected to load (host tier, KV store)
        loaded = getattr(self.policy, "loaded_tokens", 0)
        families.append(("kv_expected_loaded_tokens_total", "counter", {"": loaded}))
        return families


def _describe(rendering: Rendering) -> str:
    engine, parser = rendering
    if engine != "radixserve":
        return f"{engine} does (tools handed to the template)"
    return f"radixserve with --tool-call-parser {parser}" if parser else "radixserve's template"


async def fetch_json(
    request: Callable[..., Awaitable[Any]], path: str, headers: bytes = b""
) -> dict[str, Any] | None:
    """GET `path` through a worker's connection pool (`headers`: header lines to send, the
    worker's API key); None on any failure."""
    try:
        resp = await request("GET", path, timeout=5.0, headers=headers)
    except (OSError, ConnectionError):
        return None
    if resp.status != 200:
        return None
    try:
        obj = loads(resp.body)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def open_kv_index(
    config: RouterConfig, resolve: Callable[[str], Hashable | None]
) -> tuple[RedisIndexReader | MooncakeStoreReader | None, KvAwarePolicy | None]:
    """(reader, kv_aware policy on it) for `--kv-index redis://...` or `mooncake://...`; (None,
    None) for memory. On Mooncake the policy keeps its in-memory index of the workers' KV events
    (device holdings) and reads the store's holdings as a lower tier."""
    if config.kv_index == "memory":
        return None, None
    if config.kv_index.startswith("mooncake://"):
        return open_mooncake(config)
    from radixserve.router.kvindex.redis_reader import KvsConfig, RedisIndexReader

    kvs = KvsConfig(
        config.kv_index,
        config.kvs_retry_times,
        config.kvs_retry_interval_ms,
        config.kvs_metadata_service_down_duration_s,
        config.kvs_timeout_ms,
        config.redis_prefix,
    )
    reader = RedisIndexReader(kvs, resolve)
    return reader, KvAwarePolicy(config.cache_policy, index=reader)


def hash_seed() -> int:
    """The store keys' hash seed: the GO_HASH_SEED environment variable, as Llumnix reads it
    (default 0)."""
    raw = os.environ.get("GO_HASH_SEED", "").strip()
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"GO_HASH_SEED must be an integer, got {raw!r}") from None


def open_mooncake(config: RouterConfig) -> tuple[MooncakeStoreReader, KvAwarePolicy]:
    from radixserve.router.kvindex.mooncake_reader import MooncakeIndexConfig, MooncakeStoreReader
    from radixserve.router.proxy.kvs_transport import PooledMaster

    mc = MooncakeIndexConfig(
        config.mooncake_address,
        config.kvs_hash_algo,
        config.kvs_chunk_size,
        hash_seed(),
        config.kvs_enable_save_unfull_chunk,
        config.kvs_retry_times,
        config.kvs_retry_interval_ms,
        config.kvs_metadata_service_down_duration_s,
        config.kvs_timeout_ms,
        config.cache_policy.cache_aware_scheduling_min_tokens,
    )
    reader = MooncakeStoreReader(mc, PooledMaster(mc.address, mc.timeout_ms / 1000))
    return reader, KvAwarePolicy(config.cache_policy, lower=(reader,))
