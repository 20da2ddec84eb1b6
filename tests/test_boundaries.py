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


# The framework-free core every backend builds on (ARCHITECTURE.md, payload layout): the
# modules of payload/ outside payload/backends/. Only the TF backend's tf.data input (data,
# masking, records' parse_batch) and quiet.py (which imports the backend's framework early
# to absorb its import-time log lines) may import TensorFlow, only quiet.py JAX, and no
# other module of the core imports a framework: a backend's framework is loaded only by
# that backend (the TensorBoard writer and the JAX backend's input need none).
FRAMEWORKS = {"tensorflow", "tf_keras", "jax", "jaxlib", "keras", "orbax", "flax", "torch"}
TF_INPUT_MODULES = {"records.py"}


def test_the_shared_core_imports_no_framework() -> None:
    """Everything outside payload/backends/ is framework-free (the TF backend's input and the
    frameworks' log lines, quiet.py, live in backends/)."""
    core = sorted(p for p in (ROOT / "payload").rglob("*.py") if "backends" not in p.parts)
    assert len(core) > 40
    offenders = {}
    for path in core:
        allowed = {"tensorflow"} if path.name in TF_INPUT_MODULES else set()
        names = imported_roots(path.read_text()) & (FRAMEWORKS - allowed)
        if names:
            offenders[path.name] = sorted(names)
    assert offenders == {}


@pytest.mark.parametrize(
    ("backend", "foreign"),
    # The JAX backend imports no TensorFlow (its input is Grain's: input.py); at run time
    # tests/payload/test_resume.py trains with TensorFlow unimportable (no_tensorflow/).
    [
        ("tf", {"jax", "keras", "orbax", "grain"}),
        ("jax", {"tf_keras", "transformers", "tensorflow"}),
    ],
)
def test_a_backend_imports_not_the_other(backend: str, foreign: set[str]) -> None:
    files = sorted((ROOT / "payload" / "backends" / backend).rglob("*.py"))
    assert files
    offenders = {path.name: sorted(imported_roots(path.read_text()) & foreign) for path in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def gcp_services(source: str) -> set[str]:
    """The pulumi_gcp services (`gcp.compute`, `pulumi_gcp.storage`...) a module names."""
    tree = ast.parse(source)
    aliases = {"pulumi_gcp"}
    services: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "pulumi_gcp":
                    aliases.add(alias.asname or "pulumi_gcp")
                    services.update(parts[1:2])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "pulumi_gcp":
                services.update(parts[1:2] or [a.name for a in node.names if a.name.islower()])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.islower()
            and not node.attr.startswith("_")
        ):
            services.add(node.attr)
    return services


def _mypy_checked_gcp_services() -> set[str]:
    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    followed = [o for o in overrides if o.get("follow_imports") == "normal"]
    assert len(followed) == 1
    return {
        name.split(".")[1]
        for name in followed[0]["module"]
        if name.startswith("pulumi_gcp.") and not name.split(".")[1].startswith("_")
    }


def test_gcp_service_detector_sees_every_form() -> None:
    source = (
        "import pulumi_gcp as gcp\nimport pulumi_gcp.dns\nfrom pulumi_gcp import kms\n"
        "from pulumi_gcp.tpu import V2Vm\nx = gcp.compute.Instance\ny = gcp.Provider\n"
    )
    assert gcp_services(source) == {"dns", "kms", "tpu", "compute"}


def test_mypy_reads_every_gcp_service_infra_uses() -> None:
    """pyproject.toml's mypy overrides skip the pulumi_gcp services infra/ does not use (its
    __init__ imports all 157: minutes of `make lint`); one that infra/ or policy/ starts to
    use must be added there, or mypy would check its resources' arguments as Any."""
    used: dict[str, set[str]] = {}
    for package in ("infra", "policy"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for service in gcp_services(path.read_text()):
                used.setdefault(service, set()).add(str(path.relative_to(ROOT)))
    assert {"compute", "storage", "tpu"} <= set(used)
    missing = {s: sorted(p) for s, p in used.items() if s not in _mypy_checked_gcp_services()}
    assert missing == {}
