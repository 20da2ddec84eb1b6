"""What the grant does not pay (infra/commands/costs.py, infra/catalogs/prices.yaml): every line
priced from the price file and the resources the real program registers, the daily total the
sum of its lines, TPU time marked as the grant's, what has no price printed as unknown, and a
malformed price file refused in one line naming the entry."""

from __future__ import annotations

import copy
import datetime
from pathlib import Path

import pytest
import yaml
from harness import gpu_stack_names, run_offline, stack_names

from infra.catalogs import prices
from infra.catalogs.prices import PriceFileError, load_prices, parse_prices
from infra.commands import costs, plan

ROOT = Path(__file__).resolve().parents[2]
K = "tpu-pretrain:"


def _estimate(stack: str, overrides: dict[str, object] | None = None) -> costs.CostEstimate:
    overrides = overrides or {}
    return costs.stack_estimate(stack, overrides, run_offline(stack, overrides))


@pytest.fixture(scope="module")
def tpu_estimate() -> costs.CostEstimate:
    return _estimate("v6e-euw4")


@pytest.fixture(scope="module")
def gpu_estimate() -> costs.CostEstimate:
    return _estimate("t4-usc1")


def _line(estimate: costs.CostEstimate, item: str) -> costs.CostLine:
    (line,) = [line for line in estimate.lines if line.item == item]
    return line


def _hourly(machine: str) -> float:
    """A machine type's on-demand price an hour, from the price file (us-central1)."""
    book = load_prices()
    shape = book.machine_types[machine]
    vcpu = book.prices[f"{shape.family}-vcpu"].regions["us-central1"]
    memory = book.prices[f"{shape.family}-memory"].regions["us-central1"]
    return shape.vcpus * vcpu + shape.memory_gib * memory


def test_the_daily_total_is_the_sum_of_the_stacks_lines(tpu_estimate):
    book = load_prices()
    expected = {
        "controller VM": _hourly("e2-standard-4") * 24,
        "VPN hop VM": _hourly("e2-small") * 24,
        "VPN hop static external IP": book.prices["static-external-ip"].regions["us-central1"] * 24,
        "egress: VPN sessions": book.assumptions["vpn_gib_per_day"]
        * book.prices["internet-egress-premium"].regions["us-central1"],
    }
    for item, usd in expected.items():
        assert _line(tpu_estimate, item).usd == pytest.approx(usd)
    storage = _line(tpu_estimate, "bucket storage").usd
    assert storage is not None and storage > 0
    assert tpu_estimate.daily_total == pytest.approx(sum(expected.values()) + storage)
    text = costs.format_text(tpu_estimate)
    (total,) = [line for line in text.splitlines() if line.strip().startswith("per day")]
    assert f"${tpu_estimate.daily_total:,.2f}" in total


@pytest.mark.parametrize("stack", stack_names())
def test_every_stack_is_priced_and_only_a_tpu_is_the_grants(stack):
    estimate = _estimate(stack)
    known = [line.usd for line in estimate.daily if line.usd is not None and not line.grant]
    assert estimate.daily_total == pytest.approx(sum(known)) and estimate.daily_total > 0
    for item in ("controller VM", "VPN hop VM", "VPN hop static external IP", "bucket storage"):
        assert _line(estimate, item).usd is not None  # every stack's are in the price file
    granted = [line for line in estimate.lines if line.grant]
    if stack in gpu_stack_names():
        assert granted == [] and _line(estimate, "GPU VM").note.startswith(costs.NOT_GRANT)
    else:
        (tpu,) = granted
        assert tpu.item.startswith("TPU ") and tpu.usd is None


def test_the_bucket_is_sized_from_the_plans_tokens_and_parameters(tpu_estimate):
    template = yaml.safe_load((ROOT / "stacks/jobs/gpt2-small-clm.yaml").read_text())
    tokens = (
        template["train"]["steps"]
        * template["train"]["global_batch_size"]
        * template["data"]["seq_length"]
    )
    book = load_prices()
    line = _line(tpu_estimate, "bucket storage")
    assert f"{tokens:,} tokens" in line.note
    # A 32,000-entry vocabulary packs its ids in 2 bytes; the corpus is the assumed 4 a token.
    shards_and_corpus = tokens * (2 + book.assumptions["corpus_bytes_per_token"]) / 2**30
    assert float(line.detail.split(" GiB")[0].replace(",", "")) > shards_and_corpus
    monthly = book.prices["storage-standard"].regions["us-central1"]
    gib = line.usd * book.hours_per_month / 24 / monthly
    assert gib == pytest.approx(float(line.detail.split(" GiB")[0].replace(",", "")), rel=0.01)


def test_the_e2_rates_give_the_quoted_hourly_price_of_e2_standard_4():
    # $0.134012 an hour in us-central1, as quoted beside the rates (prices.yaml, e2-vcpu).
    assert _hourly("e2-standard-4") == pytest.approx(0.134012, abs=5e-7)


def test_tpu_time_is_marked_paid_by_the_grant(tpu_estimate):
    (tpu,) = [line for line in tpu_estimate.lines if line.item.startswith("TPU v6e-8")]
    assert tpu.grant and tpu.usd is None
    assert tpu not in tpu_estimate.unknown  # the grant's, not an unknown
    text = costs.format_text(tpu_estimate)
    assert "TPU v6e-8 (spot)" in text and costs.GRANT in text
    assert costs.GRANT in costs.format_markdown(tpu_estimate)


def test_a_gpu_stack_is_not_covered_by_a_tpu_grant(gpu_estimate):
    gpu = _line(gpu_estimate, "GPU VM")
    assert not gpu.grant
    assert gpu.note.startswith(costs.NOT_GRANT)
    assert "nvidia-tesla-t4" in gpu.detail
    assert gpu in gpu_estimate.unknown  # no GPU or spot price read: never guessed
    assert costs.GRANT not in costs.format_text(gpu_estimate)


def test_an_unknown_machine_type_says_so():
    estimate = _estimate("v2-usc1", {f"{K}controllerMachineType": "n2-standard-2"})
    line = _line(estimate, "controller VM")
    assert line.usd is None
    assert "n2-standard-2 has no price in infra/catalogs/prices.yaml" in line.note
    text = costs.format_text(estimate)
    assert "Not in the totals (unknown): controller VM," in text
    assert estimate.daily_total == pytest.approx(
        sum(x.usd for x in estimate.daily if x.usd is not None)
    )


def test_a_region_without_a_price_falls_back_with_a_note(tpu_estimate, gpu_estimate):
    assert (
        "no europe-west4 price read: us-central1's shown"
        in _line(tpu_estimate, "controller VM").note
    )
    assert "price read" not in _line(gpu_estimate, "controller VM").note  # us-central1's own


def test_a_job_on_dataflow_adds_its_line(tmp_path):
    template = yaml.safe_load((ROOT / "stacks/jobs/bert-small-mlm.yaml").read_text())
    template["data"] = {
        **template["data"],
        "runner": "beam",
        "beam": {"runner": "DataflowRunner", "options": {"max_num_workers": 8}},
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(template))
    without = _estimate("v3-euw4")
    assert not [line for line in without.lines if line.item.startswith("Dataflow")]
    estimate = _estimate("v3-euw4", {f"{K}dataflow": True, f"{K}job": str(job)})
    line = _line(estimate, "Dataflow encoding job")
    assert line.once and line.usd is None
    assert "https://cloud.google.com/dataflow/pricing" in line.note


def test_make_plan_prints_the_costs_after_the_resources(capsys):
    assert plan.main(["--stack", "v6e-euw4"]) == 0
    out = capsys.readouterr().out
    heading = out.index("What the grant does not pay (stack v6e-euw4)")
    assert heading > out.index("gcp:compute/instance:Instance")
    assert "Sources: https://cloud.google.com/compute/vm-instance-pricing" in out[heading:]


def test_the_markdown_table_lists_every_line(tpu_estimate):
    text = costs.format_markdown(tpu_estimate)
    assert "| item | detail | USD | note |" in text
    for line in tpu_estimate.lines:
        assert f"| {line.item} |" in text
    assert f"| **per day** | | **${tpu_estimate.daily_total:,.2f}** |" in text


# --- the price file -------------------------------------------------------------------------
def _document() -> dict:
    return copy.deepcopy(yaml.safe_load(prices.PRICES_PATH.read_text()))


def test_every_price_has_a_unit_a_region_a_date_and_a_source():
    book = load_prices()
    for price in book.prices.values():
        assert price.unit in prices.UNITS
        assert price.source.startswith("https://cloud.google.com/")
        assert price.read <= datetime.date.today()
        assert book.fallback_region in price.regions


def _broken(edit) -> str:
    document = _document()
    edit(document)
    with pytest.raises(PriceFileError) as error:
        parse_prices(document)
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda d: d["prices"]["e2-vcpu"].update(unit="vCPU-month"),
            "prices.yaml: prices.e2-vcpu.unit: 'vCPU-month'; allowed: vCPU-hour,",
        ),
        (
            lambda d: d["prices"]["e2-vcpu"]["regions"].update({"us-central1": "cheap"}),
            "prices.yaml: prices.e2-vcpu.regions.us-central1: 'cheap' is not a number >= 0",
        ),
        (
            lambda d: d["prices"]["storage-standard"]["regions"].pop("us-central1"),
            "prices.storage-standard.regions: no us-central1 (the fallback_region)",
        ),
        (
            lambda d: d["prices"]["e2-memory"].update(read="last week"),
            "prices.e2-memory.read: 'last week' is not a date (YYYY-MM-DD)",
        ),
        (
            lambda d: d["prices"]["static-external-ip"].update(source="a blog"),
            "prices.static-external-ip.source: 'a blog' is not an https:// source URL",
        ),
        (
            lambda d: d["prices"]["e2-vcpu"].pop("seen_in"),
            "prices.e2-vcpu.seen_in: None: a non-empty text is needed",
        ),
        (
            lambda d: d["machine_types"].update({"c3-standard-4": {"family": "c3"}}),
            "machine_types.c3-standard-4.family: 'c3' has no price c3-vcpu",
        ),
        (
            lambda d: d["assumptions"].pop("export_downloads"),
            "assumptions: missing export_downloads; the assumptions are",
        ),
        (
            lambda d: d["unpriced"].update(gpu="see the console"),
            "unpriced.gpu: 'see the console' is not an https:// source URL",
        ),
    ],
)
def test_a_malformed_price_file_is_one_line_naming_the_entry(edit, expected):
    assert expected in _broken(edit)


def test_an_unreadable_price_file_is_one_line(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text("prices: [unclosed\n")
    with pytest.raises(PriceFileError) as error:
        load_prices(path)
    assert str(error.value).startswith("prices.yaml: cannot be read: ")
    assert "\n" not in str(error.value)
