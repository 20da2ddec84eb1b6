"""The encode stage as an Apache Beam pipeline (``data.runner: beam``): same output as local.

The pipeline runs the rules of ``payload/data/encode/rules.py`` (``GroupTokenizer``,
``within_budget``, ``held_out_fraction``, ``pack_group``), ``records.frame_records`` and
the outputs of ``payload/data/encode/outputs.py`` (``shard_names``, ``build_manifest``), and
writes the same shards and the same manifest, byte for byte, as the local encoder
(``payload/data/encode/local.py``; ``tests/payload/test_encode_beam.py`` checks 1, 2 and 4
workers); it imports neither the stage's door nor the local runner. What the local encoder
gets from reading in order, the pipeline gets from small side inputs:

1. read: one element per corpus file (source, file number, path) -> its groups
   (``corpus.iter_groups`` on that file alone) and its reading statistics;
2. tokenize each group (a ``DoFn`` that loads the tokenizer once per worker);
3. budget (only with ``data.max_tokens``): every group's token count, gathered into one
   list, gives each group the tokens of its budget before it; later documents are dropped;
4. the held-out fraction from the total of tokens used (one number);
5. pack each group; every group's sequence counts, gathered into one list, give each group
   its first row in the global order, hence its shards and its place in them (the held-out
   cap applied in that order);
6. write: pieces keyed by shard, grouped, sorted by row, framed and written under the
   shard's final name (a whole file per write: a local temp file renamed, or one object
   upload); their names, records, bytes and sha256 go to a summary file;
7. the launching process reads the summary and writes ``stage.json`` and then
   ``manifest.json`` (create-only) itself, with ``encode_outputs.build_manifest``.

The manifest is the commit point: until it exists the data is unfinished (the trainer waits
for it), and a re-run removes what an unfinished run left (as the local runner does) and
starts again. A retried Beam bundle rewrites the same shard with the same bytes.

Runners (``data.beam.runner``): ``DirectRunner`` runs Beam's Python ``FnApiRunner`` here,
with ``data.beam.workers`` processes (``direct_running_mode=multi_processing``). Beam 2.77's
``DirectRunner`` first tries the Prism runner, which downloads its binary from GitHub at
first use (``apache_beam/runners/portability/prism_runner.py``); we call the FnApiRunner,
which DirectRunner falls back to, directly. ``DataflowRunner`` submits the job to Dataflow
with ``data.beam.options`` (docs/encoding-at-scale.md); only Dataflow can show that part.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.transforms.combiners import ToList

from payload.core import records, storage
from payload.core.errors import CorpusError, DataError, UserError
from payload.data import corpus
from payload.data.encode import outputs, rules
from payload.schema import manifest as mf
from payload.spec import JobSpec

if TYPE_CHECKING:
    from payload.core.status import StatusWriter

SUMMARY_PREFIX = ".beam-summary-"
POLL_SECONDS = 10
_WHILE_RUNNING = re.compile(r" \[while running '[^\n]*'\]$")  # Beam's note on the step
_USER_ERROR = re.compile(r"\b(CorpusError|DataError|SpecError|StorageError): ([^\n]+)")


def pipeline_args(job: JobSpec) -> list[str]:
    """The Beam command-line options for the job's runner (``data.beam``)."""
    spec = job.data.beam
    if spec.runner == "DirectRunner":
        workers = spec.workers or 1
        mode = "multi_processing" if workers > 1 else "in_memory"
        # Worker processes log a failed bundle's traceback; the launcher reports user errors
        # in one line (see _run), so the local workers log only what is critical.
        return [
            f"--direct_num_workers={workers}",
            f"--direct_running_mode={mode}",
            "--default_sdk_harness_log_level=CRITICAL",
        ]
    args = ["--runner=DataflowRunner"]
    options = dict(spec.options)
    options.setdefault("job_name", _job_name(job.name))
    for name, value in sorted(options.items()):
        if name == "no_use_public_ips":
            args.append("--no_use_public_ips" if value else "--use_public_ips")
        elif isinstance(value, bool):
            if value:
                args.append(f"--{name}")
        else:
            args.append(f"--{name}={value}")
    return args


def _job_name(name: str) -> str:
    """A Dataflow job name ([-a-z0-9], starting with a letter) from the payload job's name."""
    cleaned = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    return f"tpu-payload-encode-{cleaned}"[:63].rstrip("-")


def _runner(job: JobSpec) -> Any:
    if job.data.beam.runner == "DirectRunner":
        return FnApiRunner()
    return None  # named by --runner


# --------------------------------------------------------------------------- DoFns


class _ReadFile:
    """(source, file number, path) -> ((source, file, group), Group) and its statistics."""

    def __init__(self, corpus_spec: Any, n_sources: int, group_bytes: int):
        self.corpus_spec = corpus_spec
        self.n_sources = n_sources
        self.group_bytes = group_bytes

    def __call__(self, item: tuple[int, int, str]) -> Iterator[Any]:
        source, number, path = item
        only: list[list[str]] = [[] for _ in range(self.n_sources)]
        only[source] = [path]
        stats = corpus.CorpusStats()
        read = Metrics.counter("encode", "bytes_read")
        per_source = Metrics.counter("encode", f"source{source}_bytes_read")
        documents = Metrics.counter("encode", "documents_read")
        groups = corpus.iter_groups(
            self.corpus_spec, stats, group_bytes=self.group_bytes, sources=only
        )
        for group in groups:
            read.inc(group.nbytes)
            per_source.inc(group.nbytes)
            documents.inc(len(group.documents))
            yield ((source, number, group.index), group)
        yield beam.pvalue.TaggedOutput("stats", (source, stats.as_dict()))


class _Tokenize(beam.DoFn):
    def __init__(self, tokenizer_path: str, tokenizer_sha: str, plan: rules.Plan):
        super().__init__()
        self.tokenizer_path = tokenizer_path
        self.tokenizer_sha = tokenizer_sha
        self.plan = plan
        self.tokenize: rules.GroupTokenizer | None = None

    def setup(self) -> None:
        import hashlib  # noqa: PLC0415

        from payload.data.tokenizer import tokenizer_json  # noqa: PLC0415

        raw = tokenizer_json(self.tokenizer_path)
        if hashlib.sha256(raw).hexdigest() != self.tokenizer_sha:
            raise DataError(f"{self.tokenizer_path} changed while the pipeline ran")
        self.tokenize = rules.GroupTokenizer(raw.decode("utf-8"), self.plan)

    def process(
        self, element: tuple[rules.GroupKey, corpus.Group]
    ) -> Iterator[rules.TokenizedGroup]:
        if self.tokenize is None:  # Beam calls setup() first; a runner that did not: do it now
            self.setup()
        key, group = element
        yield self.tokenize(key, group)  # type: ignore[misc]


def _budget_positions(
    sizes: list[tuple[rules.GroupKey, int]], budgets: list[int | None], keys: list[int]
) -> dict[rules.GroupKey, int]:
    """Each group's tokens of its budget before it, in the global order."""
    spent: dict[int, int] = {}
    out = {}
    for key, tokens in sorted(sizes):
        which = keys[key[0]]
        out[key] = spent.get(which, 0)
        spent[which] = out[key] + tokens
    return out


def _apply_budget(
    group: rules.TokenizedGroup,
    positions: dict[rules.GroupKey, int] | None,
    budgets: list[int | None],
) -> Iterator[Any]:
    keep = group.documents
    if positions is not None:
        keep = rules.within_budget(group, positions[group.key], budgets[group.source])
    exhausted = keep < group.documents
    if keep:
        used = rules.truncated(group, keep)
        yield used
        yield beam.pvalue.TaggedOutput(
            "use", (group.source, (used.tokens, used.documents, exhausted, group.long_words))
        )
    elif exhausted:
        yield beam.pvalue.TaggedOutput("use", (group.source, (0, 0, True, 0)))


def _layout(counts: list[tuple[rules.GroupKey, int, int]], plan: rules.Plan) -> dict[str, Any]:
    """Each group's first training and held-out row in the global order, and the totals."""
    train = held = 0
    first: dict[rules.GroupKey, tuple[int, int]] = {}
    for key, n_train, n_held in sorted(counts):
        first[key] = (train, held)
        train += n_train
        held += n_held
    kept = min(held, plan.eval_max_sequences)
    return {
        "first": first,
        "train": train,
        "eval": kept,
        "overflow": held - kept,
        "shards": outputs.shard_count(train, plan.records_per_shard),
        "eval_shards": outputs.shard_count(kept, plan.records_per_shard),
    }


def _pieces(
    packed: rules.PackedGroup, layout: dict[str, Any], plan: rules.Plan
) -> Iterator[tuple[tuple[str, int], tuple[int, bytes]]]:
    """(("shard"|"eval", shard number), (row in shard, framed records)) of one group."""
    train_first, eval_first = layout["first"][packed.key]
    per = plan.records_per_shard
    for prefix, all_rows, start, end in (
        ("shard", packed.train, train_first, layout["train"]),
        ("eval", packed.held_out, eval_first, layout["eval"]),
    ):
        rows = all_rows[: max(0, end - start)]  # held out: the cap, in the global order
        at = 0
        while at < len(rows):
            row = start + at
            shard, offset = divmod(row, per)
            take = rows[at : at + per - offset]
            yield (prefix, shard), (offset, records.frame_records(take, plan.token_dtype))
            at += len(take)


def _write_shard(
    item: tuple[tuple[str, int], Iterable[tuple[int, bytes]]],
    data_dir: str,
    layout: dict[str, Any],
    plan: rules.Plan,
) -> dict[str, Any]:
    import hashlib  # noqa: PLC0415

    (prefix, number), pieces = item
    data = b"".join(framed for _, framed in sorted(pieces, key=lambda p: p[0]))
    count = layout["shards"] if prefix == "shard" else layout["eval_shards"]
    name = outputs.shard_names(prefix, count)[number]
    storage.write_bytes(storage.join(data_dir, name), data)
    total = layout["train"] if prefix == "shard" else layout["eval"]
    records_in = min(plan.records_per_shard, total - number * plan.records_per_shard)
    return {
        "prefix": prefix,
        "number": number,
        "name": name,
        "records": records_in,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def _summary(
    seed: None,
    *,
    shards: list[dict[str, Any]],
    stats: list[tuple[int, dict[str, int]]],
    uses: list[tuple[int, tuple[int, int, bool, int]]],
    dropped: list[tuple[int, int, int]],
    fraction: float,
    layout: dict[str, Any],
    path: str,
    plan: rules.Plan,
) -> None:
    """Everything the manifest needs, in one small JSON file the launcher reads."""
    totals = corpus.CorpusStats()
    for _source, counts in stats:
        totals.add(corpus.CorpusStats(**counts))
    per_source: dict[int, list[Any]] = {}
    long_words = 0
    for source, (tokens, documents, exhausted, words) in uses:
        entry = per_source.setdefault(source, [0, 0, False])
        entry[0] += tokens
        entry[1] += documents
        entry[2] = entry[2] or exhausted
        long_words += words
    totals.long_words = long_words
    summary = {
        "shards": sorted(shards, key=lambda s: (s["prefix"], s["number"])),
        "stats": totals.as_dict(),
        "sources": {str(k): v for k, v in per_source.items()},
        "dropped_tokens": sum(d[0] for d in dropped),
        "eval_dropped_tokens": sum(d[1] for d in dropped) + layout["overflow"] * plan.width,
        "eval_documents": sum(d[2] for d in dropped),
        "fraction": fraction,
    }
    storage.write_text(path, json.dumps(summary, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- pipeline


def build(
    pipeline: Any,
    job: JobSpec,
    prepared: rules.Prepared,
    files: list[tuple[int, int, str]],
    summary_path: str,
) -> None:
    """The encode pipeline on ``pipeline`` (see the module docstring for its steps)."""
    plan = prepared.plan
    budgets = rules.source_budgets(job)
    keys = [rules.budget_key(job, i) for i in range(len(budgets))]
    data_dir = job.paths.data
    read = (
        pipeline
        | "files" >> beam.Create(files)
        | "spread files" >> beam.Reshuffle()
        | "read"
        >> beam.FlatMap(_ReadFile(job.corpus, len(budgets), corpus.GROUP_BYTES)).with_outputs(
            "stats", main="groups"
        )
    )  # fmt: skip
    tokenized = (
        read.groups
        | "spread groups" >> beam.Reshuffle()
        | "tokenize" >> beam.ParDo(_Tokenize(job.paths.tokenizer, prepared.tokenizer_sha, plan))
    )
    positions = None
    if job.data.max_tokens is not None:
        positions = beam.pvalue.AsSingleton(
            tokenized
            | "sizes" >> beam.Map(lambda g: (g.key, g.tokens))
            | "all sizes" >> ToList()
            | "budget positions" >> beam.Map(_budget_positions, budgets, keys)
        )
    used = tokenized | "budget" >> beam.FlatMap(_apply_budget, positions, budgets).with_outputs(
        "use", main="groups"
    )
    fraction = (
        used.use
        | "used tokens" >> beam.Map(lambda u: u[1][0])
        | "total" >> beam.CombineGlobally(sum)
        | "fraction" >> beam.Map(lambda n: rules.held_out_fraction(plan, n))
    )
    packed = used.groups | "pack" >> beam.Map(
        rules.pack_group, beam.pvalue.AsSingleton(fraction), plan
    )
    layout = beam.pvalue.AsSingleton(
        packed
        | "counts" >> beam.Map(lambda p: (p.key, len(p.train), len(p.held_out)))
        | "all counts" >> ToList()
        | "layout" >> beam.Map(_layout, plan)
    )
    shards = (
        packed
        | "pieces" >> beam.FlatMap(_pieces, layout, plan)
        | "by shard" >> beam.GroupByKey()
        | "write" >> beam.Map(_write_shard, data_dir, layout, plan)
    )
    dropped = packed | "dropped" >> beam.Map(
        lambda p: (p.train_dropped_tokens, p.eval_dropped_tokens, p.eval_documents)
    )

    def gathered(pcoll: Any, label: str) -> Any:
        return beam.pvalue.AsSingleton(pcoll | label >> ToList())

    _ = (
        pipeline
        | "summary seed" >> beam.Create([None])
        | "summary"
        >> beam.Map(
            _summary,
            shards=gathered(shards, "all shards"),
            stats=gathered(read.stats, "all stats"),
            uses=gathered(used.use, "all uses"),
            dropped=gathered(dropped, "all dropped"),
            fraction=beam.pvalue.AsSingleton(fraction),
            layout=layout,
            path=summary_path,
            plan=plan,
        )
    )


def encode(job: JobSpec, status: StatusWriter) -> mf.Manifest:
    """Run the pipeline, then write stage.json and the manifest (local runner's output)."""
    if outputs.is_complete(job):
        manifest = mf.load_manifest(job.paths.data)
        outputs.check_current(job, manifest)
        return manifest
    from apache_beam.options.pipeline_options import PipelineOptions  # noqa: PLC0415

    prepared = rules.prepare(job)
    sources = corpus.resolve_sources(job.corpus)
    files = [(s, 0, path) for s, paths in enumerate(sources) for path in paths]
    files = [(s, number, path) for number, (s, _, path) in enumerate(files)]
    data_dir = job.paths.data
    runner = job.data.beam.runner
    status.update(
        stage=outputs.STAGE,
        progress=0.0,
        message=f"encoding {len(files)} files on Apache Beam ({runner})",
    )
    storage.remove_tree(data_dir)  # leftovers of an unfinished run (there is no manifest)
    storage.makedirs(data_dir)
    summary_path = storage.join(data_dir, f"{SUMMARY_PREFIX}{uuid.uuid4().hex[:12]}.json")
    try:
        pipeline = beam.Pipeline(runner=_runner(job), options=PipelineOptions(pipeline_args(job)))
        build(pipeline, job, prepared, files, summary_path)
        _run(pipeline, status)
        summary = json.loads(storage.read_text(summary_path))
        storage.remove(summary_path)
        manifest = _manifest(job, prepared, summary, [path for _, _, path in files])
        outputs.write_stage_and_manifest(job, manifest)
    except BaseException:
        storage.remove_tree(data_dir)  # nothing half-written: no shards without a manifest
        raise
    outputs.complete_status(status, manifest, job, beam_runner=runner)
    return manifest


def _run(pipeline: Any, status: StatusWriter) -> None:
    """Run and wait, reporting Beam's counters in status.json; user errors in one line."""
    from apache_beam.runners.runner import PipelineState  # noqa: PLC0415

    # A local runner logs every failed bundle with its traceback (Beam's worker logging);
    # a user error is reported once, in one line, below. Dataflow keeps its logs.
    beam_logger = logging.getLogger("apache_beam")
    level = beam_logger.level
    if isinstance(pipeline.runner, FnApiRunner):
        beam_logger.setLevel(logging.CRITICAL)
    try:
        result = pipeline.run()
        while not PipelineState.is_terminal(result.state):
            result.wait_until_finish(duration=POLL_SECONDS * 1000)
            _report(result, status)
            time.sleep(0.1)
        state = result.wait_until_finish()
    except Exception as exc:
        found = _USER_ERROR.search(str(exc))
        if found:
            error = {"CorpusError": CorpusError}.get(found.group(1), DataError)
            message = _WHILE_RUNNING.sub("", found.group(2)).strip()
            raise error(message) from None
        raise
    finally:
        beam_logger.setLevel(level)
    _report(result, status)
    if state != PipelineState.DONE:
        raise DataError(f"the Beam pipeline ended in state {state} (see the runner's logs)")


def _report(result: Any, status: StatusWriter) -> None:
    try:
        counters = result.metrics().query()["counters"]
    except Exception:  # metrics are progress only; some runners have none
        return
    figures: dict[str, int] = {}
    for counter in counters:
        name = counter.key.metric.name
        figures[name] = figures.get(name, 0) + int(counter.committed or counter.attempted or 0)
    if figures:
        metrics: dict[str, Any] = dict(figures)
        status.update(stage=outputs.STAGE, **metrics)


def _manifest(
    job: JobSpec, prepared: rules.Prepared, summary: dict[str, Any], files: list[str]
) -> mf.Manifest:
    stats = corpus.CorpusStats(**summary["stats"])
    corpus.require_text(stats, job.corpus)
    budgets = rules.source_budgets(job)
    uses = []
    for i, budget in enumerate(budgets):
        tokens, documents, exhausted = summary["sources"].get(str(i), [0, 0, False])
        uses.append(outputs.SourceUse(budget, tokens, documents, exhausted))
    # One shared budget: every source it covers is exhausted with it (as the local runner).
    keys = [rules.budget_key(job, i) for i in range(len(budgets))]
    for i, use in enumerate(uses):
        use.exhausted = any(u.exhausted for j, u in enumerate(uses) if keys[j] == keys[i])
    shards = [
        mf.Shard(name=s["name"], records=s["records"], bytes=s["bytes"], sha256=s["sha256"])
        for s in summary["shards"]
    ]
    train = [
        s for s, raw in zip(shards, summary["shards"], strict=True) if raw["prefix"] == "shard"
    ]
    held = [s for s, raw in zip(shards, summary["shards"], strict=True) if raw["prefix"] == "eval"]
    if not train:
        raise CorpusError(
            f"corpus too small: {summary['dropped_tokens']} tokens do not fill one sequence of "
            f"data.seq_length={job.data.seq_length} (sequences are packed within groups "
            f"of about {corpus.GROUP_BYTES >> 20} MiB of text)"
        )
    totals = outputs.Totals(
        stats=stats,
        sources=uses,
        fraction=float(summary["fraction"]),
        dropped_tokens=summary["dropped_tokens"],
        eval_documents=summary["eval_documents"],
        eval_dropped_tokens=summary["eval_dropped_tokens"],
    )
    return outputs.build_manifest(job, prepared, train, held, totals, files=files)


def main(argv: list[str] | None = None) -> int:
    """``python -m payload.data.encode.beam --job JOB``: the encode stage on Beam, as the CLI runs
    it."""
    import argparse  # noqa: PLC0415

    from payload import spec  # noqa: PLC0415
    from payload.core.status import StatusWriter  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m payload.data.encode.beam")
    parser.add_argument("--job", required=True)
    args = parser.parse_args(argv)
    try:
        job = spec.load_job(args.job)
        manifest = encode(job, StatusWriter(job.paths.status, job.name))
    except UserError as exc:
        print(f"error: {exc}", file=__import__("sys").stderr)
        return 2
    print(f"{manifest.total_records} sequences in {job.paths.data}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
