"""Entry point the Pulumi CLI runs for the bootstrap project (infra/bootstrap/Pulumi.yaml)."""

import sys
from pathlib import Path

# The CLI runs this directory as a script; its modules are siblings of this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pulumi
from gitops_bootstrap import BootstrapConfigError, define, read_config

try:
    bootstrap_config = read_config()
except BootstrapConfigError as error:
    # RunError: the CLI shows the one-line message without a Python traceback.
    raise pulumi.RunError(str(error)) from None
define(bootstrap_config)
