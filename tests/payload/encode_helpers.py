"""The encode tests' helpers (test_encode.py, test_encode_budget.py, test_encode_formats.py,
test_encode_heldout.py, test_encode_beam.py): job specs for the encode stage, the packing and
held-out split rules computed independently, and the shards' rows read back."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import yaml

from payload import spec
from payload.core import records, storage
from payload.core.status import StatusWriter
from payload.data import corpus, tokenizer
from payload.schema import manifest as mf


def make_job(tmp_path: Path, corpus_paths: list[str], **overrides: object) -> spec.JobSpec:
    objective = overrides.pop("objective", "mlm")
    kind = overrides.pop("kind", "wordpiece")
    family = {"mlm": "bert" if kind == "wordpiece" else "roberta", "clm": "gpt2"}[objective]
    doc: dict = {
        "name": "enc",
        "output": overrides.pop("output", str(tmp_path / "out")),
        "corpus": {"paths": corpus_paths},
        "tokenizer": {"kind": kind, "vocab_size": 1500},
        # The packing tests want the whole corpus in the training shards; the held-out split
        # has its own tests below.
        "data": {
            "objective": objective,
            "seq_length": 32,
            "records_per_shard": 100,
            "eval_fraction": 0,
        },
        "model": {"family": family},
        "train": {"steps": 4},
    }
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        doc[section][key] = value
    path = tmp_path / "job.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return spec.load_job(str(path))


def status_for(job: spec.JobSpec) -> StatusWriter:
    return StatusWriter(job.paths.status, job.name, min_interval_s=0)


def prepared(job: spec.JobSpec) -> spec.JobSpec:
    tokenizer.train_tokenizer(job, status_for(job))
    return job


HELD_OUT_KEY = b"tpu-pretrain/held-out/v1"  # encode_rules.HELD_OUT_SALT, written out again here


def file_documents(path: str) -> list[str]:
    """A text file's documents: runs of non-blank lines (the reader's rule, restated)."""
    text = Path(path).read_text(encoding="utf-8-sig").replace("\r\n", "\n")
    return [d.strip() for d in re.split(r"\n[ \t\r\f\v]*\n", text) if d.strip()]


def groups_of(documents: list[str], group_bytes: int) -> list[list[str]]:
    """A file's documents cut where their UTF-8 text reaches group_bytes (corpus.iter_groups)."""
    groups: list[list[str]] = [[]]
    size = 0
    for document in documents:
        groups[-1].append(document)
        size += len(document.encode("utf-8"))
        if size >= group_bytes:
            groups.append([])
            size = 0
    return [g for g in groups if g]


def draw(document: str) -> float:
    digest = hashlib.blake2b(document.encode("utf-8"), digest_size=8, key=HELD_OUT_KEY).digest()
    return int.from_bytes(digest, "big") / 2**64


def expected_split(
    job: spec.JobSpec, files: list[str], fraction: float = 0.0, group_bytes: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, held-out rows): the packing and split rules, computed independently
    with the transformers tokenizer. Each group's streams are cut into windows on their own
    (the remainder dropped); a document is held out when its keyed blake2b draw < fraction."""
    tok = tokenizer.load_tokenizer(job.paths.tokenizer)
    length = job.data.seq_length
    width = length - 1 if job.data.objective == "mlm" else length
    out: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for path in files:
        for group in groups_of(file_documents(path), group_bytes or corpus.GROUP_BYTES):
            streams: dict[bool, list[int]] = {False: [], True: []}
            for document in group:
                ids = tok(document, add_special_tokens=False, split_special_tokens=True)
                ids = ids["input_ids"]
                if job.data.objective == "mlm":
                    piece = [*ids, tok.sep_token_id]
                else:
                    piece = [tok.bos_token_id, *ids, tok.eos_token_id]
                streams[draw(document) < fraction] += piece
            for held, stream in streams.items():
                rows = np.array(stream[: len(stream) // width * width], dtype=np.int64)
                rows = rows.reshape(-1, width)
                if job.data.objective == "mlm":
                    lead = np.full((len(rows), 1), tok.cls_token_id)
                    rows = np.concatenate([lead, rows], axis=1)
                out[held].append(rows)
    train = np.concatenate(out[False])
    held_out = np.concatenate(out[True])[: job.data.eval_max_sequences]
    return train, held_out


def expected_rows(
    job: spec.JobSpec, files: list[str], group_bytes: int | None = None
) -> np.ndarray:
    return expected_split(job, files, 0.0, group_bytes)[0]


def read_rows_python(data_dir: str) -> np.ndarray:
    manifest = mf.load_manifest(data_dir)
    rows = []
    for path in mf.shard_paths(data_dir, manifest):
        with storage.open_read(path) as handle:
            rows += [
                records.decode_record(r, manifest.token_dtype) for r in records.iter_records(handle)
            ]
    return np.stack(rows)


def read_rows_tf(data_dir: str) -> np.ndarray:
    import tensorflow as tf

    manifest = mf.load_manifest(data_dir)
    dataset = tf.data.TFRecordDataset(mf.shard_paths(data_dir, manifest)).batch(16)
    dataset = dataset.map(
        lambda s: records.parse_batch(s, manifest.seq_length, manifest.token_dtype)
    )
    return np.concatenate([batch.numpy() for batch in dataset])
