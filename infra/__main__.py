"""Entry point for the Pulumi CLI (`main: infra/` in Pulumi.yaml)."""

import sys
from pathlib import Path

# The CLI runs this file as a script; make `import infra` resolve to this repository.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pulumi

from infra.config.config import read_stack_config
from infra.errors import ConfigError
from infra.program import define

try:
    stack_config = read_stack_config()
except ConfigError as error:
    # RunError: the CLI shows the message without a Python traceback.
    raise pulumi.RunError(str(error)) from None
define(stack_config)
