"""The WireGuard hop's default zone per accelerator region, with its source (vpn_hop.yaml)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from pathlib import Path
from types import MappingProxyType

import yaml

HOP_ZONES_PATH = Path(__file__).with_name("vpn_hop.yaml")


@cache
def default_hop_zones(path: Path = HOP_ZONES_PATH) -> Mapping[str, str]:
    """Accelerator region -> the hop's zone when tpu-pretrain:vpnZone is not set."""
    document = yaml.safe_load(path.read_text())
    return MappingProxyType({str(k): str(v) for k, v in document["zones"].items()})
