"""List prices of what a stack creates besides the accelerator (prices.yaml, with their units,
regions, dates and sources): loaded and checked once, so a malformed file is one line that
names the entry, the value and what is allowed."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

PRICES_PATH = Path(__file__).with_name("prices.yaml")
UNITS = ("vCPU-hour", "GiB-hour", "hour", "GiB-month", "GiB")
ASSUMPTIONS = (
    "corpus_bytes_per_token",
    "checkpoint_bytes_per_parameter",
    "export_bytes_per_parameter",
    "export_downloads",
    "vpn_gib_per_day",
)


class PriceFileError(ValueError):
    """prices.yaml is malformed; the message is one line naming the entry."""


@dataclass(frozen=True)
class Price:
    key: str
    what: str
    unit: str
    regions: Mapping[str, float]
    source: str
    seen_in: str
    read: datetime.date


@dataclass(frozen=True)
class MachineShape:
    family: str
    vcpus: float  # the vCPUs it is billed for
    memory_gib: float


@dataclass(frozen=True)
class PriceBook:
    path: Path
    currency: str
    hours_per_month: float
    fallback_region: str
    prices: Mapping[str, Price]
    machine_types: Mapping[str, MachineShape]
    unpriced: Mapping[str, str]  # thing -> the pricing page to read
    assumptions: Mapping[str, float]

    def rate(self, key: str, region: str) -> tuple[Price, float, str]:
        """(the price, its value in `region`, the region it is really from): the fallback
        region's value when `region` has none."""
        price = self.prices[key]
        if region in price.regions:
            return price, price.regions[region], region
        return price, price.regions[self.fallback_region], self.fallback_region

    @property
    def read(self) -> datetime.date:
        """The day the oldest price was read."""
        return min(price.read for price in self.prices.values())


def _where(path: Path, *keys: str) -> str:
    return f"{path.name}: " + ".".join(keys)


def _number(path: Path, value: object, *keys: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise PriceFileError(f"{_where(path, *keys)}: {value!r} is not a number >= 0")
    return float(value)


def _text(path: Path, entry: Mapping[str, Any], key: str, *keys: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value.strip():
        raise PriceFileError(f"{_where(path, *keys, key)}: {value!r}: a non-empty text is needed")
    return value.strip()


def _url(path: Path, value: object, *keys: str) -> str:
    if not isinstance(value, str) or not value.startswith("https://"):
        raise PriceFileError(f"{_where(path, *keys)}: {value!r} is not an https:// source URL")
    return value


def _mapping(path: Path, value: object, *keys: str) -> Mapping[str, Any]:
    if not isinstance(value, dict) or not value:
        raise PriceFileError(f"{_where(path, *keys)}: a non-empty mapping is needed")
    return value


def _price(path: Path, key: str, entry: object, fallback: str) -> Price:
    entry = _mapping(path, entry, "prices", key)
    unit = entry.get("unit")
    if unit not in UNITS:
        raise PriceFileError(
            f"{_where(path, 'prices', key, 'unit')}: {unit!r}; allowed: {', '.join(UNITS)}"
        )
    raw_regions = _mapping(path, entry.get("regions"), "prices", key, "regions")
    regions = {
        str(region): _number(path, value, "prices", key, "regions", str(region))
        for region, value in raw_regions.items()
    }
    if fallback not in regions:
        raise PriceFileError(
            f"{_where(path, 'prices', key, 'regions')}: no {fallback} (the fallback_region)"
        )
    read = entry.get("read")
    if not isinstance(read, datetime.date) or isinstance(read, datetime.datetime):
        raise PriceFileError(
            f"{_where(path, 'prices', key, 'read')}: {read!r} is not a date (YYYY-MM-DD)"
        )
    return Price(
        key=key,
        what=_text(path, entry, "what", "prices", key),
        unit=str(unit),
        regions=MappingProxyType(regions),
        source=_url(path, entry.get("source"), "prices", key, "source"),
        seen_in=_text(path, entry, "seen_in", "prices", key),
        read=read,
    )


def _shape(path: Path, name: str, entry: object, prices: Mapping[str, Price]) -> MachineShape:
    entry = _mapping(path, entry, "machine_types", name)
    family = entry.get("family")
    for part in ("vcpu", "memory"):
        if f"{family}-{part}" not in prices:
            raise PriceFileError(
                f"{_where(path, 'machine_types', name, 'family')}: {family!r} has no price "
                f"{family}-{part}"
            )
    return MachineShape(
        family=str(family),
        vcpus=_number(path, entry.get("vcpus"), "machine_types", name, "vcpus"),
        memory_gib=_number(path, entry.get("memory_gib"), "machine_types", name, "memory_gib"),
    )


def parse_prices(document: object, path: Path = PRICES_PATH) -> PriceBook:
    document = _mapping(path, document, "(top level)")
    fallback = _text(path, document, "fallback_region")
    raw_prices = _mapping(path, document.get("prices"), "prices")
    prices = {str(k): _price(path, str(k), v, fallback) for k, v in raw_prices.items()}
    raw_shapes = _mapping(path, document.get("machine_types"), "machine_types")
    shapes = {str(k): _shape(path, str(k), v, prices) for k, v in raw_shapes.items()}
    raw_unpriced = _mapping(path, document.get("unpriced"), "unpriced")
    unpriced = {str(k): _url(path, v, "unpriced", str(k)) for k, v in raw_unpriced.items()}
    raw_assumptions = _mapping(path, document.get("assumptions"), "assumptions")
    missing = [name for name in ASSUMPTIONS if name not in raw_assumptions]
    extra = sorted(set(map(str, raw_assumptions)) - set(ASSUMPTIONS))
    if missing or extra:
        raise PriceFileError(
            f"{_where(path, 'assumptions')}: "
            + (f"missing {', '.join(missing)}" if missing else f"unknown {', '.join(extra)}")
            + f"; the assumptions are {', '.join(ASSUMPTIONS)}"
        )
    assumptions = {
        name: _number(path, raw_assumptions[name], "assumptions", name) for name in ASSUMPTIONS
    }
    hours = _number(path, document.get("hours_per_month"), "hours_per_month")
    if hours == 0:
        raise PriceFileError(f"{_where(path, 'hours_per_month')}: must be > 0")
    return PriceBook(
        path=path,
        currency=_text(path, document, "currency"),
        hours_per_month=hours,
        fallback_region=fallback,
        prices=MappingProxyType(prices),
        machine_types=MappingProxyType(shapes),
        unpriced=MappingProxyType(unpriced),
        assumptions=MappingProxyType(assumptions),
    )


@cache
def load_prices(path: Path = PRICES_PATH) -> PriceBook:
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        detail = " ".join(str(error).split())
        raise PriceFileError(f"{path.name}: cannot be read: {detail}") from None
    return parse_prices(document, path)
