"""Enough of PromQL to say which metrics and labels an expression reads (for dashboard checks).

Not a PromQL parser: it drops string literals, durations and numbers, then takes every
identifier that is not a function, keyword or label name as a metric name. Good for the
expressions Grafana dashboards hold; tests/test_metrics.py checks it on known expressions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
    "offset", "inf", "nan", "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk",
    "bottomk", "quantile", "count_values", "group", "limitk", "limit_ratio", "atan2",
}
# Grafana variables -> what "All" selects
GRAFANA_VARS = {"$interval": "5m", "$__rate_interval": "1m", "$__interval": "30s", "$__range": "1h"}

_IDENT = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SELECTOR = re.compile(rf"({_IDENT})\s*\{{([^}}]*)\}}")
_MATCHER = re.compile(rf"({_IDENT})\s*(=~|!~|!=|=)\s*\"((?:[^\"\\]|\\.)*)\"")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


@dataclass
class Query:
    expr: str
    metrics: set[str] = field(default_factory=set)
    grouping_labels: set[str] = field(default_factory=set)  # by(...), on(...), group_left(...)
    # (metric, label) pairs whose matcher needs the label to exist (not a match-all regex)
    required_labels: set[tuple[str, str]] = field(default_factory=set)


def substitute(expr: str) -> str:
    """Replace Grafana variables by what the dashboard's "All" / default choice puts there."""
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return re.sub(r"\$\{?[a-zA-Z_][a-zA-Z0-9_]*\}?", ".*", expr)  # template variables: All


_LABEL_VALUES = re.compile(rf"^\s*label_values\(\s*(.*),\s*({_IDENT})\s*\)\s*$", re.S)


def parse(expr: str) -> Query:
    """Metrics and labels of a panel expression, or of a Grafana `label_values(m, label)` query."""
    expr = substitute(expr)
    variable = _LABEL_VALUES.match(expr)
    if variable:
        q = parse(variable.group(1))
        q.required_labels.update((name, variable.group(2)) for name in q.metrics)
        return q
    q = Query(expr)
    for metric, body in _SELECTOR.findall(expr):
        for label, op, value in _MATCHER.findall(body):
            if not (op == "=~" and value in (".*", "")) and not (op == "!~" and value == ""):
                q.required_labels.add((metric, label))
    for _, labels in _GROUPING.findall(expr):
        q.grouping_labels.update(x.strip() for x in labels.split(",") if x.strip())
    text = re.sub(r'"(?:[^"\\]|\\.)*"', " ", expr)  # strings
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = _GROUPING.sub(" ", text)  # grouping clauses name labels, not metrics
    for m in re.finditer(rf"(?<![\w.]){_IDENT}", text):
        name = m.group(0)
        rest = text[m.end():].lstrip()
        if name.lower() in KEYWORDS or rest.startswith("("):  # functions and aggregations
            continue
        q.metrics.add(name)
    return q
