"""Agents through the router: N coding agents x M turns, every request carrying the same tool
list (11 JSON-schema tools, about 2,100 SmolLM2 tokens once rendered) and its agent's own growing
conversation, sent through `radixserve route` in front of real `radixserve serve` engines, once
per router policy (round_robin, cache_aware, kv_aware) in one run. Reported per policy: the
engines' cached share of prompt tokens (their `usage.prompt_tokens_details.cached_tokens`), the
prompt tokens they computed, TTFT p50 / p99 (streamed), requests/s, and how the requests split
over the engines, with ratios against round_robin measured in the same run.

    python benchmarks/agent_fleet.py        # 2 engines, 5 agents x 4 turns: 11-14 min on 2 cores at load 7-10
    python benchmarks/agent_fleet.py --engines 3 --agents 7 --max-total-tokens 4096
    python benchmarks/agent_fleet.py --engines 2 --agents 2 --turns 2 --tools 2   # the smallest

The engines run the built-in SmolLM2-135M (float32, one torch thread each) with small KV pools
(--max-total-tokens, 4,608 by default: the tool list and the histories of the agents one engine
serves under a prefix-aware policy fit, every agent's do not), publishing KV events for
kv_aware. Each turn an agent's request is its chat as it stands (a system prompt, its task, and
for every earlier turn an assistant message with one tool call and the tool's result) with
`tools`, `tool_choice: "auto"`, greedy, `max_tokens` short. The calls and results are scripted
(benchmarks/_agent_tools.py: search, read, edit, test, diff), not the model's, so that every
policy sees the same prompts and the cached share compares routing alone. Turns go in waves
(all agents send turn t, then turn t+1; benchmarks/_fleet.py's loop, which vllm_fleet.py's chats
share). With --agents prime to --engines, round_robin moves each agent between engines from
turn to turn, as a fleet under mixed traffic does. Before each policy every engine's cache is
flushed and then given the system prompt and tool list (sent to each engine directly, not
measured), as in a fleet that serves this agent all day, and a fresh router starts. Timings
never fail anything: this prints.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _agent_tools import SYSTEM, TOOLS, first_message, scripted_call, tool_result
from _fleet import Chat, Router, Streamed, call, run_turns
from _machine import machine_line

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_harness import ServerProcess  # noqa: E402

POLICIES = ("round_robin", "cache_aware", "kv_aware")
EVENTS = '{"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}'


def start_engines(args: argparse.Namespace) -> list[ServerProcess]:
    argv = ["--dtype", "float32", "--num-threads", "1", "--kv-events-config", EVENTS,
            "--max-total-tokens", str(args.max_total_tokens)]  # fmt: skip
    engines: list[ServerProcess] = []
    try:
        for _ in range(args.engines):
            engines.append(ServerProcess(argv, start_timeout=300.0))
    except BaseException:
        stop_engines(engines)
        raise
    return engines


def stop_engines(engines: list[ServerProcess]) -> None:
    for e in engines:
        if e.proc.poll() is None:
            e.stop(check=False)


def agent_turns(port: int, args: argparse.Namespace, model: str) -> list[Streamed]:
    """Every agent's session, a wave per turn; each reply in the order sent."""
    tools = TOOLS[: args.tools]
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": first_message(a)}]
             for a in range(args.agents)]  # fmt: skip

    def body(messages: Chat) -> dict:
        return {"model": model, "messages": messages, "tools": tools, "tool_choice": "auto",
                "max_tokens": args.max_tokens, "temperature": 0}  # fmt: skip

    def extend(a: int, chat: Chat, reply: Streamed, turn: int) -> None:
        done = scripted_call(a, turn)
        chat += [{"role": "assistant", "content": None, "tool_calls": [done]},
                 {"role": "tool", "tool_call_id": done["id"],
                  "content": tool_result(a, turn, args.result_lines)}]  # fmt: skip

    with ThreadPoolExecutor(args.concurrency) as pool:
        return run_turns(port, pool, chats, args.turns, body, extend)


def warm(engines: list[ServerProcess], args: argparse.Namespace) -> None:
    """Every engine's cache emptied, then holding the system prompt and the tool list and
    nothing else (sent to each directly, not measured): a fleet that serves this agent all day."""
    body = {"model": engines[0].name, "messages": [{"role": "system", "content": SYSTEM}],
            "tools": TOOLS[: args.tools], "max_tokens": 1}  # fmt: skip
    for e in engines:
        reply = e.post("/flush_cache", {})
        if reply.status != 200:
            raise RuntimeError(f"{e.url}/flush_cache answered {reply.status}: {reply.body!r}")
    with ThreadPoolExecutor(len(engines)) as pool:
        for reply in pool.map(lambda e: e.request("POST", "/v1/chat/completions", body,
                                                  timeout=600), engines):  # fmt: skip
            if reply.status != 200:
                raise RuntimeError(f"warming up answered {reply.status}: {reply.body[:300]!r}")


def measure(policy: str, engines: list[ServerProcess], args: argparse.Namespace) -> dict:
    warm(engines, args)
    router = Router(policy, [e.url for e in engines], "")
    try:
        t0 = time.perf_counter()
        replies = agent_turns(router.port, args, engines[0].name)
        wall = time.perf_counter() - t0
        status, body = call(router.port, "GET", "/workers")
    finally:
        router.stop()
    return summarize(replies, wall, split(status, body, engines))


def split(status: int, body: bytes, engines: list[ServerProcess]) -> list[int]:
    """Requests the router sent to each engine, in the engines' order."""
    if status != 200:
        return []
    sent = {w["url"]: w["requests"] for w in json.loads(body)["workers"]}
    return [sent.get(e.url, 0) for e in engines]


def summarize(replies: list[Streamed], wall: float, per_engine: list[int]) -> dict:
    ttfts = sorted(r.ttft for r in replies)
    prompt = sum(r.usage.get("prompt_tokens", 0) for r in replies)
    cached = sum(r.cached_tokens for r in replies)
    return {"cached": cached / max(1, prompt), "computed": prompt - cached, "p50": statistics.median(ttfts) * 1e3,
            "p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1e3,
            "rps": len(replies) / wall, "n": len(replies), "prompt": prompt,
            "calls": sum(r.finish == "tool_calls" for r in replies), "split": per_engine}  # fmt: skip


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def report(rows: dict[str, dict]) -> None:
    print(f"\n{'policy':<13}{'cached':>8}{'computed':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'req/s':>7}  {'per engine':<11} vs round_robin: cached / computed / TTFT p50 / "
          f"TTFT p99 / req/s")  # fmt: skip
    base = rows.get("round_robin")
    for policy, r in rows.items():
        cmp = "-" if base is None or policy == "round_robin" else " / ".join(
            ratio(r[k], base[k]) for k in ("cached", "computed", "p50", "p99", "rps"))  # fmt: skip
        per = "/".join(map(str, r["split"]))
        print(f"{policy:<13}{r['cached']:>7.1%}{r['computed']:>9}{r['p50']:>8.0f}ms"
              f"{r['p99']:>8.0f}ms{r['rps']:>7.3f}  {per:<11} {cmp}")  # fmt: skip


def workload_line(args: argparse.Namespace) -> str:
    return (f"workload: {args.agents} agents x {args.turns} turns = {args.agents * args.turns} "
            f"requests per policy, each with the same {args.tools} tools and its own chat; every "
            f"turn appends one tool call and a {args.result_lines}-line tool result; "
            f"/v1/chat/completions streamed, tool_choice auto, max_tokens {args.max_tokens}, "
            f"greedy; {args.concurrency} in flight; before each policy every engine is flushed "
            f"and then holds the system prompt and tools (~{tool_tokens(args.tools)} tokens)"
            f"\nfleet: {args.engines} x `radixserve serve` "
            f"(built-in SmolLM2-135M, float32, one torch thread, --max-total-tokens "
            f"{args.max_total_tokens}, KV events on) behind `radixserve route --policy P`")  # fmt: skip


def tool_tokens(n: int) -> int:
    """About how many SmolLM2 tokens the first `n` tools render to (measured: all 11, 2,104)."""
    return int(round(2104 * len(json.dumps(TOOLS[:n])) / len(json.dumps(TOOLS)), -1))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=2, help="2 or 3 on a small machine")
    p.add_argument("--agents", type=int, default=5, help="keep it prime to --engines")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tools", type=int, default=len(TOOLS), help=f"1..{len(TOOLS)} of the list")
    p.add_argument("--result-lines", type=int, default=8, help="tool result, ~24 tokens a line")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=4608, help="KV pool per engine")
    p.add_argument("--concurrency", type=int, default=0, help="in flight (default: --engines)")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    args = p.parse_args()
    for n in ("engines", "agents", "turns", "tools", "result_lines", "max_tokens"):
        if getattr(args, n) < 1:
            p.error(f"--{n.replace('_', '-')} must be >= 1")
    if args.tools > len(TOOLS):
        p.error(f"--tools must be <= {len(TOOLS)}")
    args.concurrency = args.concurrency if args.concurrency > 0 else args.engines
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the engines on the way out
    print(machine_line())
    print(workload_line(args), flush=True)
    t0 = time.monotonic()
    engines = start_engines(args)
    try:
        print(f"engines up in {time.monotonic() - t0:.0f} s", flush=True)
        rows = {}
        for policy in args.policies:
            rows[policy] = r = measure(policy, engines, args)
            print(f"  {policy}: cached {r['cached']:.1%} of {r['prompt']} prompt tokens, "
                  f"{r['n']} requests, {r['calls']} answered with a tool call", flush=True)  # fmt: skip
        report(rows)
    finally:
        stop_engines(engines)
    print(f"\ntotal {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
