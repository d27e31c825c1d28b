"""What reading tool calls costs the API process per streamed delta: a chat answer whose one
call writes a file (the arguments grow to N characters) streamed 4 characters a delta through
the server's reader (server/chat_output.py) with `--tool-call-parser hermes`, against the same
text read with no parser (every delta is content), in the same run.

    python benchmarks/tool_parse_stream.py

Every parser rescans the text so far at each delta (which is what keeps streamed and whole
parses equal), so the cost per delta grows with the length of the call being written.
Medians of 5 rounds; timings never fail anything.
"""

from __future__ import annotations

import json
import statistics
import time

from _machine import machine_line
from radixserve.chat.tool_parsers import get_tool_parser
from radixserve.server.chat_output import ChatOutput

STEP = 4  # characters per delta: about one token


def call_text(chars: int) -> str:
    args = json.dumps({"path": "a.py", "content": "x = 1\n" * (chars // 7)})
    return f'<tool_call>\n{{"name": "write_file", "arguments": {args}}}\n</tool_call>'


def per_delta_ms(output: ChatOutput, text: str) -> float:
    deltas = output.stream()
    start = time.perf_counter()
    for i in range(0, len(text), STEP):
        deltas.feed(text[i : i + STEP])
    deltas.finish("stop")
    return (time.perf_counter() - start) * 1e3 / (len(text) / STEP)


def main() -> None:
    print(machine_line())
    print(f"workload: one call, arguments of N chars, streamed {STEP} chars a delta; 5 rounds")
    print(f"{'N':>7} {'no parser ms/delta':>19} {'hermes ms/delta':>16} {'ratio':>7}")
    for chars in (1_000, 4_000, 16_000):
        text = call_text(chars)
        plain, hermes = [], []
        for _ in range(5):
            plain.append(per_delta_ms(ChatOutput(), text))
            hermes.append(per_delta_ms(ChatOutput(get_tool_parser("hermes")), text))
        p, h = statistics.median(plain), statistics.median(hermes)
        print(f"{len(text):>7} {p:>19.4f} {h:>16.3f} {h / p:>6.0f}x")


if __name__ == "__main__":
    main()
