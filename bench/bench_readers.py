"""Reader benchmark: read + tokenize from Parquet and jsonl.zst vs text, vs raw `tokenizers`;
peak RSS of reading a Parquet file by row groups vs `pyarrow.parquet.read_table`.

    .venv/bin/python bench/bench_readers.py            # 20 MB corpus; RSS on a 200 MB Parquet
    .venv/bin/python bench/bench_readers.py --quick    # 5 MB; RSS on 50 MB
    .venv/bin/python bench/bench_readers.py --rss-mb 0 # skip the RSS comparison

One generated corpus (examples/generate_corpus.py, seeded) is written three ways holding the
same documents: text (one paragraph each), jsonl.zst (one JSON line each, zstd level 3) and
Parquet (one row each, row groups of about 4 MB). A WordPiece tokenizer (vocab 32,000) is
trained on 5 MB with the payload's tokenizer stage, then, in this one process:

* read: ``corpus.iter_groups`` over each file alone (documents/s, input MB/s);
* read + tokenize: each group's documents through ``Tokenizer.encode_batch_fast`` (what the
  encoder calls), timed end to end, in corpus tokens/s;
* raw: ``encode_batch_fast`` and ``encode_batch`` on the same documents held in memory, in
  batches of one group (4096 documents for the plain baseline), timed around the calls only.

Every measurement runs ``--rounds`` times, interleaved, and its best is printed (the machine
may be shared).

Peak RSS (VmHWM of a fresh child each): importing pyarrow + the payload alone; iterating the
big Parquet file's groups (one row group at a time, text column only); and
``pq.read_table(path, columns=["text"])`` of the same file. Figures are printed, not asserted.
Each child has a timeout, so the run is bounded. The full ``encode`` from every format comes
once the encoder reads groups (bench/bench_encode.py measures it on text).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "bench"))
CHILD_TIMEOUT_S = 1800
ROW_GROUP_BYTES = 4 << 20

RSS_CHILD = r"""
import json, sys
from pathlib import Path
import pyarrow.parquet as pq
from payload.data import corpus
from payload.spec import CorpusSpec

mode, path = sys.argv[1], sys.argv[2]
documents = 0
if mode == "groups":
    stats = corpus.CorpusStats()
    for group in corpus.iter_groups(CorpusSpec(paths=(path,)), stats):
        documents += len(group.documents)
elif mode == "read_table":
    table = pq.read_table(path, columns=["text"])
    documents = table.num_rows
    texts = table.column(0).to_pylist()  # what a reader hands on: Python strings
    documents = len(texts)
hwm = next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines()
           if l.startswith("VmHWM:"))
print(json.dumps({"documents": documents, "rss_mb": hwm / 1024}))
"""


def rss_child(mode: str, path: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", RSS_CHILD, mode, str(path)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])},
    )
    if result.returncode != 0:
        raise SystemExit(f"{mode} child failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def write_formats(root: Path, docs: list[str], stem: str) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    paths = {
        "text": root / f"{stem}.txt",
        "jsonl.zst": root / f"{stem}.jsonl.zst",
        "parquet": root / f"{stem}.parquet",
    }
    paths["text"].write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    with paths["jsonl.zst"].open("wb") as raw:
        writer = zstandard.ZstdCompressor(level=3).stream_writer(raw)
        for doc in docs:
            writer.write(json.dumps({"text": doc}, ensure_ascii=False).encode() + b"\n")
        writer.flush(zstandard.FLUSH_FRAME)
    mean = max(1, sum(len(d.encode()) for d in docs) // max(len(docs), 1))
    rows = max(1, ROW_GROUP_BYTES // mean)
    pq.write_table(pa.table({"text": docs}), paths["parquet"], row_group_size=rows)
    return paths


def read_and_tokenize(tok: object, path: Path) -> dict[str, float]:
    from payload.data import corpus
    from payload.spec import CorpusSpec

    spec = CorpusSpec(paths=(str(path),))
    stats = corpus.CorpusStats()
    start = time.perf_counter()
    documents = sum(len(g.documents) for g in corpus.iter_groups(spec, stats))
    read_s = time.perf_counter() - start
    stats = corpus.CorpusStats()
    tokens = 0
    start = time.perf_counter()
    for group in corpus.iter_groups(spec, stats):
        encodings = tok.encode_batch_fast(group.documents, add_special_tokens=False)  # type: ignore[attr-defined]
        tokens += sum(len(e.ids) for e in encodings)
    both_s = time.perf_counter() - start
    return {"documents": documents, "read_s": read_s, "both_s": both_s, "tokens": tokens}


def raw_throughput(tok: object, batches: list[list[str]], method: str) -> tuple[float, int]:
    tokens = 0
    seconds = 0.0
    for batch in batches:
        start = time.perf_counter()
        encodings = getattr(tok, method)(batch, add_special_tokens=False)
        seconds += time.perf_counter() - start
        tokens += sum(len(e.ids) for e in encodings)
    return tokens / seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=20.0, help="corpus size (MB of text)")
    parser.add_argument("--rss-mb", type=float, default=200.0, help="Parquet for RSS; 0 skips")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repeats (best kept)")
    parser.add_argument("--quick", action="store_true", help="5 MB; RSS on 50 MB; one round")
    parser.add_argument("--keep", type=Path, help="work directory to keep (default: temp)")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.rss_mb, args.rounds = 5.0, 50.0, 1
    os.environ.pop("TOKENIZERS_PARALLELISM", None)
    with tempfile.TemporaryDirectory(prefix="bench-readers-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        throughput(root, args.mb, args.rounds)
        if args.rss_mb:
            peak_rss(root, args.rss_mb)


def _documents(path: Path) -> list[str]:
    from payload.data import corpus
    from payload.spec import CorpusSpec

    groups = corpus.iter_groups(CorpusSpec(paths=(str(path),)), corpus.CorpusStats())
    return [d for g in groups for d in g.documents]


def throughput(root: Path, mb: float, rounds: int) -> None:
    from bench_encode import VOCAB, write_job
    from generate_corpus import write_corpus
    from tokenizers import Tokenizer

    from payload import spec
    from payload.core.status import StatusWriter
    from payload.data import corpus, tokenizer

    source = root / "generated.txt"
    sample = root / "sample.txt"
    print(f"generating {mb:g} MB corpus ...", flush=True)
    write_corpus(source, int(mb * 1e6), seed=1, rich=True)
    write_corpus(sample, int(min(mb, 5.0) * 1e6), seed=7, rich=True)
    print(f"training a wordpiece tokenizer (vocab {VOCAB}) on 5 MB ...", flush=True)
    tok_job = spec.load_job(str(write_job(root, sample, "tok", 1)))
    tokenizer.train_tokenizer(tok_job, StatusWriter(tok_job.paths.status, "tok"))
    tok = Tokenizer.from_file(str(Path(tok_job.paths.tokenizer, "tokenizer.json")))
    tok.encode_special_tokens = True

    groups = corpus.iter_groups(spec.CorpusSpec(paths=(str(source),)), corpus.CorpusStats())
    batches = [g.documents for g in groups]
    docs = [d for b in batches for d in b]
    paths = write_formats(root, docs, "corpus")

    plain = [docs[i : i + 4096] for i in range(0, len(docs), 4096)]
    del docs
    # Rounds interleave every measurement and keep each one's best, so that a busy shared
    # machine does not favour whichever ran while it was quiet.
    best: dict[str, float] = {}
    results: dict[str, dict[str, float]] = {}
    corpus_tokens = 0
    for round_ in range(rounds):
        print(f"round {round_ + 1} of {rounds} ...", flush=True)
        for label, batch_list, method in [
            ("raw fast (group batches)", batches, "encode_batch_fast"),
            ("raw fast (4096 documents)", plain, "encode_batch_fast"),
            ("raw encode_batch (group batches)", batches, "encode_batch"),
        ]:
            tps, corpus_tokens = raw_throughput(tok, batch_list, method)
            best[label] = max(best.get(label, 0.0), tps)
        for name, path in paths.items():
            r = read_and_tokenize(tok, path)
            if r["tokens"] != corpus_tokens:
                raise SystemExit(f"{name}: {r['tokens']} tokens, not {corpus_tokens}")
            kept = results.setdefault(name, r)
            kept["read_s"] = min(kept["read_s"], r["read_s"])
            kept["both_s"] = min(kept["both_s"], r["both_s"])
    fast_tps = best["raw fast (group batches)"]
    raw_tps = best["raw encode_batch (group batches)"]

    print()
    print(
        f"corpus: {mb:g} MB of text, {results['text']['documents']} documents, "
        f"{corpus_tokens} tokens; {os.cpu_count()} CPU cores"
    )
    print(f"best of {rounds} rounds each")
    for label, tps in best.items():
        print(f"{label:33s}: {tps / 1e3:8.0f}k tokens/s")
    text_tps = corpus_tokens / results["text"]["both_s"]
    for name, path in paths.items():
        r = results[name]
        tps = corpus_tokens / r["both_s"]
        size = path.stat().st_size / 1e6
        print(
            f"{name:9s} {size:7.1f} MB file: read {r['documents'] / r['read_s'] / 1e3:7.0f}k "
            f"docs/s ({size / r['read_s']:6.1f} MB/s); read+tokenize {tps / 1e3:6.0f}k "
            f"tokens/s = {tps / text_tps:.2f}x text, {tps / fast_tps:.2f}x raw fast, "
            f"{tps / raw_tps:.2f}x raw encode_batch"
        )


def peak_rss(root: Path, mb: float) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from generate_corpus import write_corpus

    print(f"\ngenerating a {mb:g} MB corpus as Parquet for RSS ...", flush=True)
    big_text = root / "big.txt"
    write_corpus(big_text, int(mb * 1e6), seed=2, rich=True)
    docs = _documents(big_text)
    big_text.unlink()
    big = root / "big.parquet"
    mean = max(1, sum(len(d.encode()) for d in docs) // len(docs))
    rows = max(1, ROW_GROUP_BYTES // mean)
    pq.write_table(pa.table({"text": docs}), big, row_group_size=rows)
    count = len(docs)
    del docs
    meta = pq.ParquetFile(big).metadata
    baseline = rss_child("import", big)
    by_groups = rss_child("groups", big)
    whole = rss_child("read_table", big)
    if not by_groups["documents"] == whole["documents"] == count:
        raise SystemExit(f"row counts differ: {by_groups}, {whole}, {count}")
    print(
        f"Parquet {big.stat().st_size / 1e6:.0f} MB on disk ({mb:g} MB of text, "
        f"{meta.num_row_groups} row groups of ~{ROW_GROUP_BYTES >> 20} MB, {count} rows)"
    )
    print(f"peak RSS, imports only             : {baseline['rss_mb']:7.0f} MB")
    print(f"peak RSS, corpus.iter_groups       : {by_groups['rss_mb']:7.0f} MB")
    print(f"peak RSS, pq.read_table + to_pylist: {whole['rss_mb']:7.0f} MB")


if __name__ == "__main__":
    main()
