"""The metric names a PromQL expression reads: a small tokenizer, enough for dashboards (string
literals, label matchers, range selectors and grouping clauses are skipped; identifiers followed
by "(" or by a grouping clause are functions or aggregations; keywords are not names)."""

from __future__ import annotations

import re

_TOKEN = re.compile(
    r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|\{[^}]*\}|\[[^\]]*\]'
    r"|[A-Za-z_:][A-Za-z0-9_:]*|\(|\)|[0-9][0-9.]*(?:e[+-]?[0-9]+|(?:ms|[smhdwy])+)?|\S"
)
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = _GROUPING | {"and", "or", "unless", "bool", "offset"}


def metric_names(expr: str) -> set[str]:
    """Every metric name `expr` selects."""
    tokens = _TOKEN.findall(expr)
    names, i = set(), 0
    while i < len(tokens):
        tok = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok in _GROUPING and nxt == "(":
            i = tokens.index(")", i) + 1  # the label list of by (...), on (...)
            continue
        if (
            re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", tok)
            and tok not in _KEYWORDS
            and nxt != "("
            and nxt not in _GROUPING
        ):
            names.add(tok)
        i += 1
    return names
