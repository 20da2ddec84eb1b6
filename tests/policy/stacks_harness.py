"""The real stacks' resources as the policy pack sees them (test_stacks.py, test_allowlist.py,
test_dataflow_policy.py): every stack run once under the infra tests' Pulumi mocks harness
(tests/infra/harness.py), handed out as (type, name, props, urn) copies."""

from __future__ import annotations

import copy
import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "infra"))
from harness import Captured, gpu_stack_names, run_stack, stack_names

STACKS = stack_names()
GPU_STACKS = gpu_stack_names()
Resource = tuple[str, str, dict[str, Any], str]


@cache
def _captured(stack: str, overrides_json: str) -> tuple[Captured, ...]:
    return tuple(run_stack(stack, json.loads(overrides_json) or None))


def resources(stack: str, overrides: dict[str, Any] | None = None) -> list[Resource]:
    captured = _captured(stack, json.dumps(overrides or {}, sort_keys=True))
    return [(r.type_, r.name, copy.deepcopy(r.inputs), r.urn) for r in captured]
