"""The two halves meet only through the job spec, the bucket layout and the CLI.

infra/ (and the policy pack) must never import the payload, and the payload must never
import Pulumi or infra/. Checked statically on every module, so a lazy import inside a
function is caught too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent

FORBIDDEN = {
    "payload": {"pulumi", "pulumi_gcp", "pulumi_random", "pulumi_policy", "infra", "policy"},
    "infra": {"payload", "tensorflow", "tf_keras", "transformers", "tokenizers"},
    "policy": {"payload", "tensorflow", "tf_keras", "transformers", "tokenizers", "infra"},
}


def imported_roots(source: str) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            roots.add(node.args[0].value.split(".")[0])
    return roots


def test_detector_sees_every_import_form() -> None:
    source = (
        "import pulumi.runtime\n"
        "from infra import config\n"
        "def f():\n"
        "    import tensorflow as tf\n"
        "    importlib.import_module('payload.spec')\n"
    )
    assert imported_roots(source) == {"pulumi", "infra", "tensorflow", "payload"}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_import_the_other_half(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no Python modules"
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_roots(path.read_text()) & FORBIDDEN[package])
        for path in files
    }
    offenders = {path: names for path, names in offenders.items() if names}
    assert offenders == {}


def test_installing_the_payload_pulls_no_pulumi() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements.extend(extra)
    assert requirements
    assert not [r for r in requirements if r.lower().startswith("pulumi")]
    lock = (ROOT / "requirements" / "payload.lock").read_text().lower()
    assert "pulumi" not in lock
