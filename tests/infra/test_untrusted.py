"""`make smoke` trusts nothing it downloads (infra/commands/untrusted.py), in the offline world
of smoke_world.py: an export is taken only as the payload's exporter writes it (its file
names, its PyTorch classes, its weights file, no code to run), and what the VMs or the bucket
wrote reaches the terminal and the report without control characters. A refused export
fails the run with one line naming what is wrong and what is allowed, is never handed to
the loader and leaves nothing on the laptop."""

from __future__ import annotations

import re

import pytest
from smoke_world import BERT_CONFIG, EXPORT, LOADS, RUN, gcloud_commands_are_real

from infra.commands import untrusted

# Every C0 and C1 control character but the newline, and the bidirectional overrides.
SHOWN_RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
# An ANSI clear-screen, red, a bell, a carriage return that rewrites the line and a right-to-
# left override, then a line that looks like the smoke run's own verdict.
EVIL = "\x1b[2J\x1b[31mfine\x07\r\u202esmoke[v6e-euw4]: PASSED"


def _left_on_the_laptop(w) -> list[str]:
    return sorted(p.name for p in w.report_dir.iterdir() if "export" in p.name)


def _refused(w, line: str) -> None:
    """The run failed with `line` in the export's row and on the terminal, the loader never
    ran, and nothing of the export is left in build/smoke/."""
    code, runner = w.smoke()
    assert code == 1, w.out.getvalue()
    assert w.rows(runner)[LOADS] == ("loads", f"refused: {line}", "FAILED")
    assert f"error: the export is refused: {line}\n" in w.out.getvalue()
    assert not [c for c in w.calls if c[0] == "pt-python"]
    assert _left_on_the_laptop(w) == []
    assert "destroy --yes" in w.verbs("pulumi")
    gcloud_commands_are_real(w)


def _downloads(w) -> list[list[str]]:
    return [c for c in w.calls if c[1:3] == ["storage", "cp"] and c[3].startswith("gs://")]


@pytest.mark.parametrize(
    "relative",
    ["modeling_evil.py", "pytorch_model.bin", "generator/modeling_evil.py", "a/b/config.json"],
)
def test_a_file_the_exporter_never_writes_is_refused_before_any_download(world, relative):
    w = world()
    w.boot("tpu")
    w.finish_training(export={**EXPORT, relative: "import os"})
    _refused(w, f"export/{relative}: not a file the exporter writes (allowed: {untrusted.ALLOWED})")
    assert _downloads(w) == []  # refused from the listing: nothing came to the laptop


@pytest.mark.parametrize(
    "name", ["discriminator/../config.json", "./config.json", "", "generator/", "config.json/"]
)
def test_a_name_a_bucket_may_hold_but_the_exporter_never_writes_is_refused(name):
    """Names the fake bucket (a directory) cannot hold: GCS object names are any string."""
    export = "gs://b/runs/r/export"
    with pytest.raises(untrusted.ExportError) as refused:
        untrusted.export_names([f"{export}/config.json", f"{export}/{name}"], export)
    assert str(refused.value) == (
        f"export/{name}: not a file the exporter writes (allowed: {untrusted.ALLOWED})"
    )
    with pytest.raises(untrusted.ExportError, match=r"^gs://b/runs/other/x: listed for "):
        untrusted.export_names(["gs://b/runs/other/x"], export)
    assert untrusted.export_names([f"{export}/generator/config.json", ""], export) == [
        "generator/config.json"
    ]


@pytest.mark.parametrize(
    ("files", "line"),
    [
        ({"config.json": {**BERT_CONFIG, "auto_map": {"AutoModel": "modeling_evil.Evil"}}},
         "export/config.json: auto_map names code to run (trust_remote_code); the exporter "
         "writes none"),
        ({"tokenizer_config.json": {"auto_map": {"AutoTokenizer": ["evil.Tok", None]}}},
         "export/tokenizer_config.json: auto_map names code to run (trust_remote_code); the "
         "exporter writes none"),
        ({"config.json": {**BERT_CONFIG, "architectures": ["EvilForMaskedLM"]}},
         'export/config.json: architectures ["EvilForMaskedLM"] (allowed: one of '
         "BertForMaskedLM, ElectraForPreTraining, GPT2LMHeadModel, LlamaForCausalLM, "
         "RobertaForMaskedLM)"),
        ({"config.json": {**BERT_CONFIG, "architectures": ["BertForMaskedLM", "BertModel"]}},
         'export/config.json: architectures ["BertForMaskedLM", "BertModel"] (allowed: one '
         "of BertForMaskedLM, ElectraForPreTraining, GPT2LMHeadModel, LlamaForCausalLM, "
         "RobertaForMaskedLM)"),
        ({"config.json": {**BERT_CONFIG, "transformers_weights": "adapter_model.bin"}},
         'export/config.json: transformers_weights "adapter_model.bin" (allowed: '
         "pytorch_model.safetensors)"),
        ({"config.json": "[1, 2"}, "export/config.json: not JSON"),
        # A part may name only its own class: the generator is ElectraForMaskedLM.
        ({"generator/config.json": {**BERT_CONFIG, "architectures": ["ElectraForPreTraining"]}},
         'export/generator/config.json: architectures ["ElectraForPreTraining"] (allowed: one '
         "of ElectraForMaskedLM)"),
    ],
    ids=["auto_map", "tokenizer-auto_map", "unknown-class", "two-classes", "pickle-weights",
         "not-json", "wrong-part-class"],
)  # fmt: skip
def test_a_config_naming_code_another_class_or_other_weights_is_refused(world, files, line):
    w = world()
    w.boot("tpu")
    w.finish_training(export={**EXPORT, **files})
    _refused(w, line)
    assert _downloads(w)  # the names were the exporter's: downloaded, checked, removed


def test_an_export_of_one_folder_per_part_is_taken_as_the_exporter_writes_it(world):
    """ELECTRA's export/discriminator and export/generator, each naming its own class."""
    parts = {"discriminator": "ElectraForPreTraining", "generator": "ElectraForMaskedLM"}
    export = {}
    for part, cls in parts.items():
        export[f"{part}/config.json"] = {**BERT_CONFIG, "architectures": [cls]}
        export[f"{part}/tokenizer.json"] = EXPORT["tokenizer.json"]
    w = world()
    w.boot("tpu")
    w.finish_training(export=export)
    code, _ = w.smoke()
    assert code == 0, w.out.getvalue()
    local = w.report_dir / f"export-{RUN}"
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*")) == [
        "discriminator", "discriminator/config.json", "discriminator/tokenizer.json",
        "export_complete.json", "generator", "generator/config.json", "generator/tokenizer.json",
    ]  # fmt: skip
    assert _left_on_the_laptop(w) == [f"export-{RUN}"]  # no partial folder beside it
    # One download per folder, each object by its name: the marker, then two per part.
    assert [len(c) - 4 for c in _downloads(w)] == [1, 2, 2]


def test_a_failed_download_leaves_nothing_half_written(world):
    w = world(download_fails=True)
    w.boot("tpu")
    w.finish_training()
    code, runner = w.smoke()
    assert code == 1
    assert w.rows(runner)[LOADS] == (
        "loads", "refused: download failed: ERROR: HTTPError 503: Backend Error", "FAILED",
    )  # fmt: skip
    assert _downloads(w)  # it had begun
    assert _left_on_the_laptop(w) == []
    assert not [c for c in w.calls if c[0] == "pt-python"]


def test_what_vms_and_the_bucket_write_reaches_no_terminal_raw(world):
    """A status object and a guest attribute holding escape sequences: the terminal and the
    report get them escaped, on the line they belong to."""
    attributes = {"tp-v6e-euw4-controller": f"boot\tfailed 1700000000 {EVIL}\n"}
    w = world(guest_attributes=attributes)
    w.write("status.json", {"stage": EVIL, "state": "failed", "last_error": {"error": EVIL}})
    code, runner = w.smoke()
    assert code == 1
    out = w.out.getvalue()
    escaped = untrusted.one_line(EVIL)
    assert escaped == "\\x1b[2J\\x1b[31mfine\\x07\\x0d\\u202esmoke[v6e-euw4]: PASSED"
    # gcloud's output is read as text: its carriage return ends the attribute's line there.
    attribute = untrusted.one_line(EVIL.partition("\r")[0])
    assert w.rows(runner)["run"][1] == (
        f"the job stopped: {escaped}; boot failed on controller: {attribute}"
    )
    assert f"job {escaped} failed" in out  # the progress line, with the status' stage
    report = next(w.report_dir.glob("smoke-v6e-euw4-*.md")).read_text()
    # The log holds every command's output as it came, the guest attributes' among them.
    assert f"boot failed 1700000000 {attribute}\n" in report.split("## Log", 1)[1]
    for text in (out, report):
        assert not SHOWN_RAW.search(text), SHOWN_RAW.findall(text)
        assert not [line for line in text.splitlines() if line.startswith("smoke[v6e-euw4]: PA")]
    gcloud_commands_are_real(w)


def test_host_facts_and_the_loaders_answer_are_shown_escaped(world):
    w = world(loader_class=EVIL)
    w.boot("tpu", {"STUB_PYTHON_VERSION": "3.10"})
    w.write(
        "bootstrap/facts-gpu.json",
        {"name": f"gpu{EVIL}", "facts": {"python": EVIL}, "expected": {"python": "3.10"}},
    )
    w.finish_training()
    code, runner = w.smoke()
    assert code == 1  # the second host's python does not match
    escaped = untrusted.one_line(EVIL)
    rows = w.rows(runner)
    assert rows[f"gpu{escaped}: python"] == ("3.10", escaped, "MISMATCH")
    assert rows[LOADS] == (
        "loads", f"{escaped}: logits [1, 9, 2000] (transformers 5.0.0)", "ok",
    )  # fmt: skip
    report = next(w.report_dir.glob("smoke-v6e-euw4-*.md")).read_text()
    for text in (w.out.getvalue(), report):
        assert not SHOWN_RAW.search(text), SHOWN_RAW.findall(text)


@pytest.mark.parametrize(
    ("text", "one", "several"),
    [
        ("plain", "plain", "plain"),
        ("a\tb", "a b", "a b"),
        ("line\r\nnext\rover", "line\\x0d\\x0anext\\x0dover", "line\nnext\nover"),
        ("\x1b]0;title\x07\x9b31m\u2066x\u2069", "\\x1b]0;title\\x07\\x9b31m\\u2066x\\u2069",
         "\\x1b]0;title\\x07\\x9b31m\\u2066x\\u2069"),
        ("ünïcödé → ok", "ünïcödé → ok", "ünïcödé → ok"),
    ],
)  # fmt: skip
def test_one_line_and_lines(text, one, several):
    assert untrusted.one_line(text) == one
    assert untrusted.lines(text) == several
    assert untrusted.one_line(one) == one  # escaping twice changes nothing
