"""The config the Pulumi CLI hands the program: a stack's own settings merged with the
project's declarations in Pulumi.yaml, the way pulumi/pulumi's `sdk/go/common/workspace`
does it. Nothing here runs the CLI; it follows its source, which says:

- `LoadProjectBytes` -> `Project.Validate`: a typed project key whose `default` is not of its
  type makes the whole project fail to load ("The default value specified for configuration
  key '<k>' is not of the expected type '<t>'"); so does an array without `items`.
- `mergeConfig`: every project key the stack does not set gets the key's `default` ("not
  found on the stack we are currently validating / merging values with then we assign the
  value to that stack whatever that value is"), a primitive as its text (`createConfigValue`:
  fmt "%v", so false -> "false", 7 -> "7"), a list or map as JSON; a project key without a
  default that the stack does not set stops the run ("Stack '<s>' is missing configuration
  value '<k>'"); a value not of its key's type stops it too ("Stack '<s>' with configuration
  key '<k>' must be of type '<t>'", `ValidateConfigValue`: a primitive is checked as the
  text the stack holds).
- the language host passes every value to the program as a string (PULUMI_CONFIG),
  structured ones as JSON.

infra/commands/offline.py (the offline plan, the tests, the policy pack's captures) and
infra/commands/smoke.py build a stack's config through `cli_config`, so they see what `pulumi up`
gives the program."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from infra.errors import ConfigError

PROJECT_FILE = Path(__file__).resolve().parents[2] / "Pulumi.yaml"
_NO_DEFAULT = object()
_ATOI = re.compile(r"^[+-]?\d+$")  # what Go's strconv.Atoi accepts


@dataclass(frozen=True)
class Declared:
    """One key of Pulumi.yaml's `config:` block."""

    name: str  # as written in Pulumi.yaml: tpuZone, or gcp:region for another namespace
    key: str  # namespaced: tpu-pretrain:tpuZone
    type: str | None  # None: untyped (not validated)
    items: Mapping[str, object] | None
    default: object  # _NO_DEFAULT when the key has neither `default` nor `value`

    @property
    def has_default(self) -> bool:
        return self.default is not _NO_DEFAULT


def cli_text(value: object) -> str:
    """A config value as the program receives it: createConfigValue's fmt "%v" for a
    primitive (Go prints booleans as true/false), JSON for a list or map."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int)):
        return str(value)
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _full_type(type_name: str, items: Mapping[str, object] | None) -> str:
    """InferFullTypeName: array<string> for an array of strings."""
    if items is not None:
        inner = items.get("items")
        return f"array<{_full_type(str(items.get('type')), inner)}>"  # type: ignore[arg-type]
    return type_name


def _valid_integer(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, float):
        return value == int(value)
    return isinstance(value, int) or (isinstance(value, str) and bool(_ATOI.match(value)))


def valid_for_type(type_name: str, items: Mapping[str, object] | None, value: object) -> bool:
    """workspace.ValidateConfigValue, the check both of a default and of a stack's value."""
    if type_name == "string":
        return isinstance(value, str)
    if type_name == "integer":
        return _valid_integer(value)
    if type_name == "boolean":
        return isinstance(value, bool) or value in ("true", "false")
    if not isinstance(value, list) or items is None:
        return False
    inner = items.get("items")
    return all(
        valid_for_type(str(items.get("type")), inner, item)  # type: ignore[arg-type]
        for item in value
    )


def load_project(path: Path = PROJECT_FILE) -> tuple[str, dict[str, Declared]]:
    """The project's name and its declared config keys; a project the CLI would refuse to
    load raises ConfigError with the CLI's words."""
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    project = str(raw["name"])
    declared: dict[str, Declared] = {}
    for name, written in (raw.get("config") or {}).items():
        own = ":" not in name or name.startswith(f"{project}:")
        spec = written if isinstance(written, dict) else {"default" if own else "value": written}
        type_name = spec.get("type")
        items = spec.get("items")
        default = spec.get("default", spec.get("value"))
        if own and type_name == "array" and items is None:
            raise ConfigError(
                f"could not unmarshal '{path}': The configuration key '{name}' declares an "
                "array but does not specify the underlying type via the 'items' attribute"
            )
        if (
            own
            and type_name
            and default is not None
            and not valid_for_type(type_name, items, default)
        ):
            raise ConfigError(
                f"could not unmarshal '{path}': The default value specified for "
                f"configuration key '{name}' is not of the expected type "
                f"'{_full_type(type_name, items)}'"
            )
        key = name if ":" in name else f"{project}:{name}"
        declared[name] = Declared(
            name=name,
            key=key,
            type=type_name,
            items=items,
            default=_NO_DEFAULT if default is None else default,
        )
    return project, declared


def _missing(stack: str, names: list[str]) -> str:
    """missingStackConfigurationKeysError."""
    quoted = [f"'{name}'" for name in sorted(names)]
    listed = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"
    plural = "value" if len(quoted) == 1 else "values"
    return f"Stack '{stack}' is missing configuration {plural} {listed}"


def _content(value: object) -> object:
    """What ValidateConfigValue sees of a stack value: the text of a primitive, the parsed
    structure of a list or map."""
    return value if isinstance(value, (list, dict)) else cli_text(value)


def cli_config(
    stack: str, config: Mapping[str, object], project_file: Path = PROJECT_FILE
) -> dict[str, str]:
    """The stack's settings (namespaced keys -> the stack file's values) as the CLI hands
    them to the program: project defaults filled in, checked against the declared types,
    every value a string."""
    project, declared = load_project(project_file)
    merged = dict(config)
    missing: list[str] = []
    for name in sorted(declared):
        entry = declared[name]
        if entry.key in merged:
            continue
        if entry.has_default:
            merged[entry.key] = entry.default
        elif entry.key.split(":", 1)[0] == project:
            missing.append(name)
    if missing:
        raise ConfigError(_missing(stack, missing))
    for name in sorted(declared):
        entry = declared[name]
        if entry.key not in merged:
            continue
        if entry.type and not valid_for_type(entry.type, entry.items, _content(merged[entry.key])):
            raise ConfigError(
                f"Stack '{stack}' with configuration key '{name}' must be of type "
                f"'{_full_type(entry.type, entry.items)}'"
            )
    return {key: cli_text(value) for key, value in merged.items()}
