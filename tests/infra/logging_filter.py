"""The part of Cloud Logging's query language the stack's alert policies use, as a matcher.

A policy's filter (infra/components/alerts.py event_filter) is field equalities joined by AND:
`logName="projects/p/logs/x" AND jsonPayload.event="hung"`. Logging's query language
(cloud.google.com/logging/docs/view/logging-query-language: "Comparisons", "Boolean
operators") compares a field path with `=` to a double-quoted string; `AND` joins terms.
Anything else (OR, NOT, `:`, `!=`, `=~`, parentheses, a bare word, a field named twice) is
refused here, so a policy that starts using more of the language fails its test instead of
being matched by rules this module does not know.

    parse(text) -> {"logName": "...", "jsonPayload.event": "hung"}    (ValueError otherwise)
    matches(text, entry) -> bool                                      (entry: a LogEntry)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_TERM = re.compile(r'([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)="((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


def parse(text: str) -> dict[str, str]:
    terms: dict[str, str] = {}
    for term in text.split(" AND "):
        match = _TERM.fullmatch(term)
        if match is None:
            raise ValueError(f'not a field equality FIELD="VALUE": {term!r}')
        field, value = match.group(1), _ESCAPE.sub(r"\1", match.group(2))
        if field in terms:
            raise ValueError(f"{field} is compared twice")
        terms[field] = value
    return terms


def _field(entry: Mapping[str, Any], path: str) -> object:
    node: object = entry
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def matches(text: str, entry: Mapping[str, Any]) -> bool:
    """Whether a LogEntry ({"logName": ..., "jsonPayload": {...}}) satisfies every equality
    of the filter (a missing field, or one that is not a string, satisfies none)."""
    return all(_field(entry, field) == value for field, value in parse(text).items())
