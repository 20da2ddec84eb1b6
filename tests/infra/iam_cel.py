"""Evaluates IAM condition expressions with a real CEL evaluator (cel-python, pinned in
requirements/infra-dev.txt), the way IAM evaluates them for one request's resource, and a
Workload Identity provider's attribute mapping and condition over a token's claims.

cel-python implements the CEL language and its standard functions (startsWith, endsWith,
==, &&, ||, ...). `extract()` is IAM's own, not CEL's: it is implemented here exactly as
Google's "Attribute reference for IAM Conditions" (iam/docs/conditions-attribute-reference,
"Extract values from attributes") describes it, and checked against that page's table of
examples (tests/infra/test_iam_conditions.py):

- a template has an identifier in curly braces (letters, digits, underscores), with an
  optional prefix before it and an optional suffix after it;
- no prefix, no suffix: the entire attribute; prefix only: the characters after its first
  occurrence; suffix only: the characters before its first occurrence; both: the characters
  between the first occurrence of the prefix and the first subsequent occurrence of the
  suffix;
- a prefix or suffix that does not appear (or a suffix only before the prefix): "".
"""

from __future__ import annotations

import re
from typing import Any

import celpy
from celpy import celtypes
from lark import Token

_TEMPLATE = re.compile(r"(?P<prefix>[^{}]*)\{[A-Za-z0-9_]+\}(?P<suffix>[^{}]*)")


def iam_extract(value: str, template: str) -> str:
    """IAM's extract(), as Google's attribute reference documents it."""
    match = _TEMPLATE.fullmatch(template)
    if match is None:
        raise ValueError(f"not an extraction template: {template!r}")
    prefix, suffix = match.group("prefix"), match.group("suffix")
    start = 0
    if prefix:
        found = value.find(prefix)
        if found < 0:
            return ""
        start = found + len(prefix)
    if not suffix:
        return value[start:]
    end = value.find(suffix, start)
    return "" if end < 0 else value[start:end]


def _extract(value: Any, template: Any) -> celtypes.StringType:
    return celtypes.StringType(iam_extract(str(value), str(template)))


_ENV = celpy.Environment()


def functions_called(expression: str) -> set[str]:
    """Every function or method an expression calls (from the CEL parse tree)."""
    called: set[str] = set()
    tree = _ENV.compile(expression)
    for node in tree.iter_subtrees():
        if node.data in ("member_dot_arg", "ident_arg"):
            name = next(c for c in node.children if isinstance(c, Token))
            called.add(str(name))
    return called


def logic_operators(expression: str) -> int:
    """How many of CEL's logic operators (`&&`, `||`, `!`) an expression uses, from the parse
    tree: IAM allows 12 in a binding's condition (Google's IAM "Quotas and limits")."""
    count = 0
    for node in _ENV.compile(expression).iter_subtrees():
        if node.data in ("conditionalor", "conditionaland") and len(node.children) == 2:
            count += 1  # one binary node per `||` / `&&` (a lone operand is one child)
        elif node.data == "unary_not":
            count += 1
    return count


def _cel(value: Any) -> Any:
    if isinstance(value, dict):
        return celtypes.MapType({celtypes.StringType(k): _cel(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return celtypes.ListType([_cel(v) for v in value])
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    return celtypes.StringType(str(value))


def evaluate_value(expression: str, activation: dict[str, Any]) -> Any:
    """An expression's value over plain data (names -> str, list, dict): a Workload Identity
    provider's attribute mapping (a string) or its attribute condition (a bool), with
    `assertion` the token's claims and `attribute` the mapped custom attributes."""
    program = _ENV.program(_ENV.compile(expression), functions={"extract": _extract})
    result = program.evaluate({name: _cel(value) for name, value in activation.items()})
    if isinstance(result, Exception):
        raise result
    if isinstance(result, celtypes.BoolType):
        return bool(result)
    return str(result)


def evaluate(
    expression: str,
    resource_type: str,
    resource_name: str,
) -> bool:
    """The expression's value for a request on one resource."""
    program = _ENV.program(_ENV.compile(expression), functions={"extract": _extract})
    attributes: dict[str, Any] = {
        "resource": celtypes.MapType(
            {
                celtypes.StringType("type"): celtypes.StringType(resource_type),
                celtypes.StringType("name"): celtypes.StringType(resource_name),
            }
        )
    }
    result = program.evaluate(attributes)
    if isinstance(result, Exception):  # cel-python returns evaluation errors as values
        raise result
    return bool(result)
