"""The regions where Dataflow runs jobs, with their source (dataflow_regions.yaml)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import yaml

REGIONS_PATH = Path(__file__).with_name("dataflow_regions.yaml")


@cache
def dataflow_regions(path: Path = REGIONS_PATH) -> frozenset[str]:
    document = yaml.safe_load(path.read_text())
    return frozenset(str(region) for region in document["regions"])


def dataflow_source(path: Path = REGIONS_PATH) -> str:
    return str(yaml.safe_load(path.read_text())["source"])
