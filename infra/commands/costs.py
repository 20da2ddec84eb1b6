"""What the grant does not pay: the daily cost of what a stack creates besides the accelerator.

    python -m infra.commands.costs --stack v6e-euw4 [--set KEY=VALUE ...] [--markdown]

Priced from the resources the real program registers under Pulumi's mocks (the controller's
and the hop's machine types and zones, the hop's address, the bucket's location), the
payload's plan of the stack's job (parameters and tokens, which size the bucket), and the list
prices of infra/catalogs/prices.yaml. A TPU's time is paid by the grant (the TPU Research
Cloud pays for Cloud TPU, not for the VMs, storage and traffic around it); a GPU VM is not
covered by a TPU grant. What has no price in the file is printed as unknown, never guessed.
`make plan` prints the same table after the resources; the pull request's preview comment
carries the --markdown one (.github/workflows/preview.yml)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infra import jobfit, jobspec
from infra.catalogs.prices import PriceBook, PriceFileError, load_prices
from infra.commands import offline
from infra.config.config import StackConfig, parse_config
from infra.config.job import plan_job
from infra.errors import ConfigError

GIB = 2**30
# The payload's default train.keep_checkpoints (payload/schema/job.py TrainConfig): infra never
# imports the payload, so the job template's own value wins and this is the fallback.
DEFAULT_KEEP_CHECKPOINTS = 3
# Raw packed token ids are uint16 below this vocabulary size, uint32 from it.
UINT16_VOCABULARY = 65_536
ROLES = {"controller-vm": "controller VM", "vpn-hop-vm": "VPN hop VM"}
GRANT = "paid by the grant (TRC)"
NOT_GRANT = "not covered by a TPU grant"


@dataclass(frozen=True)
class CostLine:
    item: str
    detail: str
    usd: float | None  # None: no price in the file (unknown)
    note: str = ""
    once: bool = False  # a one-time cost, not a daily one
    grant: bool = False  # paid by the grant: never in a total


@dataclass(frozen=True)
class CostEstimate:
    stack: str
    lines: tuple[CostLine, ...]
    book: PriceBook

    @property
    def daily(self) -> tuple[CostLine, ...]:
        return tuple(line for line in self.lines if not line.once)

    @property
    def once(self) -> tuple[CostLine, ...]:
        return tuple(line for line in self.lines if line.once)

    @property
    def daily_total(self) -> float:
        return sum(line.usd for line in self.daily if line.usd is not None and not line.grant)

    @property
    def once_total(self) -> float:
        return sum(line.usd for line in self.once if line.usd is not None and not line.grant)

    @property
    def unknown(self) -> tuple[CostLine, ...]:
        return tuple(line for line in self.lines if line.usd is None and not line.grant)

    @property
    def sources(self) -> list[str]:
        return sorted({price.source for price in self.book.prices.values()})


def _region_of_zone(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def _fallback_note(asked: str, used: str) -> str:
    return "" if asked == used else f"no {asked} price read: {used}'s shown"


def _vm_line(book: PriceBook, item: str, inputs: Mapping[str, Any]) -> list[CostLine]:
    machine = str(inputs.get("machineType", ""))
    zone = str(inputs.get("zone", ""))
    region = _region_of_zone(zone)
    lines: list[CostLine] = []
    spot = (inputs.get("scheduling") or {}).get("provisioningModel") == "SPOT"
    shape = book.machine_types.get(machine)
    if shape is None:
        lines.append(
            CostLine(
                item,
                f"{machine}, {zone}",
                None,
                f"unknown: {machine} has no price in infra/catalogs/prices.yaml "
                f"(machine_types: {', '.join(sorted(book.machine_types))})",
            )
        )
    elif spot:
        lines.append(
            CostLine(
                item,
                f"{machine} (spot), {zone}",
                None,
                f"unknown: spot prices are not in the file ({book.unpriced['spot-vm']})",
            )
        )
    else:
        _, vcpu, used = book.rate(f"{shape.family}-vcpu", region)
        _, memory, _ = book.rate(f"{shape.family}-memory", region)
        hourly = shape.vcpus * vcpu + shape.memory_gib * memory
        note = f"{shape.vcpus:g} vCPU x ${vcpu}/h + {shape.memory_gib:g} GiB x ${memory}/h"
        fallback = _fallback_note(region, used)
        lines.append(CostLine(item, f"{machine}, {zone}", hourly * 24, _join(note, fallback)))
    disk = (inputs.get("bootDisk") or {}).get("initializeParams") or {}
    if disk:
        lines.append(
            CostLine(
                f"{item} boot disk",
                f"{disk.get('size', 0):g} GiB {disk.get('type', '')}",
                None,
                f"unknown: no disk price read ({book.unpriced['boot-disk']})",
            )
        )
    return lines


def _join(*parts: str) -> str:
    return "; ".join(part for part in parts if part)


@dataclass(frozen=True)
class BucketSizes:
    corpus_gib: float
    shards_gib: float
    checkpoints_gib: float
    export_gib: float

    @property
    def total_gib(self) -> float:
        return self.corpus_gib + self.shards_gib + self.checkpoints_gib + self.export_gib


def bucket_sizes(book: PriceBook, template: Mapping[str, Any], fit: jobfit.JobFit) -> BucketSizes:
    """What the run leaves in the bucket, from the plan's tokens and parameters and the file's
    assumptions (each printed beside its line)."""
    assume = book.assumptions
    vocabulary = (template.get("tokenizer") or {}).get("vocab_size") or UINT16_VOCABULARY
    id_bytes = 2 if int(vocabulary) < UINT16_VOCABULARY else 4
    keep = (template.get("train") or {}).get("keep_checkpoints") or DEFAULT_KEEP_CHECKPOINTS
    return BucketSizes(
        corpus_gib=fit.tokens * assume["corpus_bytes_per_token"] / GIB,
        shards_gib=fit.tokens * id_bytes / GIB,
        checkpoints_gib=fit.parameters * assume["checkpoint_bytes_per_parameter"] * keep / GIB,
        export_gib=fit.parameters * assume["export_bytes_per_parameter"] / GIB,
    )


def estimate(
    run: offline.OfflineRun,
    cfg: StackConfig,
    template: Mapping[str, Any],
    fit: jobfit.JobFit,
    book: PriceBook,
) -> CostEstimate:
    lines: list[CostLine] = []
    by_type: dict[str, list[offline.Registered]] = {}
    for resource in run.resources:
        by_type.setdefault(resource.type_, []).append(resource)
    for tpu in by_type.get("gcp:tpu/v2Vm:V2Vm", []):
        scheduling = tpu.inputs.get("schedulingConfig") or {}
        kind = "spot" if scheduling.get("spot") else "on-demand"
        lines.append(
            CostLine(
                f"TPU {tpu.inputs.get('acceleratorType')} ({kind})",
                str(tpu.inputs.get("zone", "")),
                None,
                "TPU time: the TPU Research Cloud grant pays it",
                grant=True,
            )
        )
    for vm in sorted(by_type.get("gcp:compute/instance:Instance", []), key=lambda r: r.name):
        role = ROLES.get(vm.name)
        if role is not None:
            lines += _vm_line(book, role, vm.inputs)
            continue
        gpus = ", ".join(
            f"{int(g.get('count', 0))} x {g.get('type')}"
            for g in vm.inputs.get("guestAccelerators") or []
        )
        for host in _vm_line(book, "GPU VM", vm.inputs):
            if host.item != "GPU VM":
                lines.append(host)  # its boot disk
                continue
            lines.append(
                CostLine(
                    host.item,
                    f"{host.detail} + {gpus}" if gpus else host.detail,
                    None,
                    f"{NOT_GRANT}; unknown: GPU prices are not in the file "
                    f"({book.unpriced['gpu']})"
                    + (f"; the host alone: ${host.usd:,.2f}/day" if host.usd else ""),
                )
            )
    for address in by_type.get("gcp:compute/address:Address", []):
        if address.inputs.get("addressType") != "EXTERNAL":
            continue
        region = str(address.inputs.get("region", ""))
        price, hourly, used = book.rate("static-external-ip", region)
        lines.append(
            CostLine(
                "VPN hop static external IP",
                region,
                hourly * 24,
                _join(f"${hourly}/{price.unit}, {price.what}", _fallback_note(region, used)),
            )
        )
    sizes = bucket_sizes(book, template, fit)
    for bucket in by_type.get("gcp:storage/bucket:Bucket", []):
        region = str(bucket.inputs.get("location", "")).lower()
        price, monthly, used = book.rate("storage-standard", region)
        lines.append(
            CostLine(
                "bucket storage",
                f"{sizes.total_gib:,.1f} GiB Standard, {region}",
                sizes.total_gib * monthly * 24 / book.hours_per_month,
                _join(
                    f"${monthly}/{price.unit}; corpus {sizes.corpus_gib:,.1f} GiB "
                    f"({book.assumptions['corpus_bytes_per_token']:g} B/token assumed), shards "
                    f"{sizes.shards_gib:,.1f}, checkpoints {sizes.checkpoints_gib:,.1f}, export "
                    f"{sizes.export_gib:,.1f} (a full run's, from the plan's "
                    f"{fit.tokens:,} tokens and {fit.parameters:,} parameters)",
                    _fallback_note(region, used),
                ),
            )
        )
    price, per_gib, used = book.rate("internet-egress-premium", cfg.vpn.region)
    vpn_gib = book.assumptions["vpn_gib_per_day"]
    lines.append(
        CostLine(
            "egress: VPN sessions",
            f"{vpn_gib:g} GiB/day out of {cfg.vpn.region} (assumed)",
            vpn_gib * per_gib,
            _join(f"${per_gib}/GiB, {price.what}", _fallback_note(cfg.vpn.region, used)),
        )
    )
    price, per_gib, used = book.rate("internet-egress-premium", cfg.bucket.location.lower())
    downloads = book.assumptions["export_downloads"]
    lines.append(
        CostLine(
            "egress: export download",
            f"{downloads:g} x {sizes.export_gib:,.2f} GiB (assumed)",
            downloads * sizes.export_gib * per_gib,
            _join(
                f"${per_gib}/GiB, {price.what}",
                _fallback_note(cfg.bucket.location.lower(), used),
            ),
            once=True,
        )
    )
    if cfg.dataflow and jobspec.uses_dataflow(template):
        lines.append(
            CostLine(
                "Dataflow encoding job",
                f"the job's encode stage, {cfg.accelerator.region}",
                None,
                f"unknown: workers' vCPU, memory, disk and shuffle ({book.unpriced['dataflow']})",
                once=True,
            )
        )
    return CostEstimate(run.stack, tuple(lines), book)


def _usd(value: float | None, line: CostLine | None = None) -> str:
    if line is not None and line.grant:
        return GRANT
    if value is None:
        return "unknown"
    return f"${value:,.2f}" if value >= 0.01 or value == 0 else f"${value:.4f}"


def _heading(estimate: CostEstimate) -> str:
    book = estimate.book
    return (
        f"What the grant does not pay (stack {estimate.stack}): list prices in "
        f"{book.currency} read {book.read.isoformat()} (infra/catalogs/prices.yaml)"
    )


def _unknown_line(estimate: CostEstimate) -> str:
    if not estimate.unknown:
        return ""
    return "Not in the totals (unknown): " + ", ".join(line.item for line in estimate.unknown)


def format_text(estimate: CostEstimate) -> str:
    rows = [(line.item, line.detail, _usd(line.usd, line), line.note) for line in estimate.lines]
    item_w = max(len("ITEM"), *(len(r[0]) for r in rows))
    detail_w = max(len("DETAIL"), *(len(r[1]) for r in rows))
    usd_w = max(len("USD"), *(len(r[2]) for r in rows))

    def row(item: str, detail: str, usd: str, note: str) -> str:
        return f"  {item:<{item_w}}  {detail:<{detail_w}}  {usd:>{usd_w}}  {note}".rstrip()

    out = [_heading(estimate), "", row("ITEM", "DETAIL", "USD", "NOTE")]
    out += [row(*r) for r, line in zip(rows, estimate.lines, strict=True) if not line.once]
    out.append(row("per day", "", _usd(estimate.daily_total), "the daily lines' sum"))
    out.append(
        row("per month", "", _usd(estimate.daily_total * estimate.book.hours_per_month / 24), "")
    )
    out += [row(*r) for r, line in zip(rows, estimate.lines, strict=True) if line.once]
    if estimate.once:
        out.append(row("once", "", _usd(estimate.once_total), "the one-time lines' sum"))
    unknown = _unknown_line(estimate)
    out += ["", *([unknown] if unknown else []), "Sources: " + ", ".join(estimate.sources)]
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_markdown(estimate: CostEstimate) -> str:
    out = [
        f"**{_heading(estimate)}**",
        "",
        "| item | detail | USD | note |",
        "|---|---|---:|---|",
    ]
    for line in (*estimate.daily, *estimate.once):
        when = " (once)" if line.once else " / day"
        usd = _usd(line.usd, line) + ("" if line.grant or line.usd is None else when)
        out.append(f"| {_cell(line.item)} | {_cell(line.detail)} | {usd} | {_cell(line.note)} |")
    out.append(f"| **per day** | | **{_usd(estimate.daily_total)}** | the daily lines' sum |")
    if estimate.once:
        out.append(f"| **once** | | **{_usd(estimate.once_total)}** | the one-time lines' sum |")
    unknown = _unknown_line(estimate)
    out += ["", *([unknown, ""] if unknown else []), "Sources: " + ", ".join(estimate.sources)]
    return "\n".join(out) + "\n"


def stack_estimate(
    stack: str, overrides: Mapping[str, object], run: offline.OfflineRun | None = None
) -> CostEstimate:
    """The estimate of `stack` with `overrides` (`run`: its offline run, when made already)."""
    run = run or offline.run_offline(stack, overrides)
    config = offline.stack_config(stack, overrides)
    values = {k.split(":", 1)[1]: v for k, v in config.items() if k.startswith("tpu-pretrain:")}
    cfg = parse_config(project=str(config.get("gcp:project")), stack=stack, values=values)
    template = jobspec.load_template(cfg.job_file)
    # The same arguments as parse_config's check: the payload's plan ran once (jobfit caches it).
    job = str(values.get("job", cfg.job_file))
    fit = plan_job(job, template, cfg.accelerator, cfg.bucket.name, cfg.backend)
    try:
        book = load_prices()
    except PriceFileError as error:
        raise ConfigError(str(error)) from None
    return estimate(run, cfg, template, fit, book)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infra.commands.costs", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--stack", required=True, help="one of: " + ", ".join(offline.stack_names())
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--markdown", action="store_true", help="a Markdown table (the PR comment)")
    args = parser.parse_args(argv)
    try:
        if args.stack not in offline.stack_names():
            raise ConfigError(
                f"--stack {args.stack!r}: no stacks/Pulumi.{args.stack}.yaml; stacks: "
                + ", ".join(offline.stack_names())
            )
        result = stack_estimate(args.stack, offline.parse_overrides(args.set))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(format_markdown(result) if args.markdown else format_text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
