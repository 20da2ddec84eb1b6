#!/usr/bin/env python3
"""Prints the stacks of stacks/Pulumi.<stack>.yaml as a GitHub Actions output line,
`stacks=["a","b"]`, so workflow matrices come from the folder and cannot drift from it.

With --only NAME, prints just that stack, after checking that its file exists (a manual
deploy of a stack that is not in the folder fails here, with the list of known stacks).
Standard library only: runs on the runner's system Python before any setup.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STACKS_DIR = Path(__file__).resolve().parents[2] / "stacks"


def stack_names(stacks_dir: Path = STACKS_DIR) -> list[str]:
    return sorted(
        path.name[len("Pulumi.") : -len(".yaml")] for path in stacks_dir.glob("Pulumi.*.yaml")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="a single stack name (empty: all stacks)")
    args = parser.parse_args(argv)
    names = stack_names()
    if not names:
        print(f"error: no stacks/Pulumi.<stack>.yaml files in {STACKS_DIR}", file=sys.stderr)
        return 2
    if args.only:
        if args.only not in names:
            print(
                f"error: stack {args.only!r} has no stacks/Pulumi.{args.only}.yaml; "
                f"known stacks: {', '.join(names)}",
                file=sys.stderr,
            )
            return 2
        names = [args.only]
    print(f"stacks={json.dumps(names, separators=(',', ':'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
