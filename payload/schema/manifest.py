"""manifest.json: what a shard set contains, written last, never overwritten.

The trainer trusts only the manifest: counts, hashes, lengths and the tokenizer it was
made with live here, not in file names. ``verify_shards`` catches a missing, truncated or
altered shard (a TFRecord cut between records would otherwise read as a shorter file).

The held-out split (``eval_shards``, ``eval_records``, ``eval_tokens``) has its own shards
and checksums, made from documents that never reach the training shards. It is optional:
a manifest written before it existed, or with ``data.eval_fraction: 0``, has none.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any

from payload.core import storage
from payload.core.errors import DataError
from payload.schema.job import OBJECTIVES

MANIFEST_NAME = "manifest.json"
# 3: encoding a pure function of the documents (held-out split by a hash of each document,
#    packing within groups, per-source use, Hub commits: `held_out`, `sources`,
#    `hub_revisions`); 2: raw packed-id records
#    (1 wrapped them in tf.train.Example). Shards of 2 and 3 have the same record format,
#    so the trainer reads both.
FORMAT_VERSION = 3
READABLE_VERSIONS = (2, 3)
SPECIAL_ROLES = ("pad", "unk", "cls", "sep", "mask", "bos", "eos")


@dataclass(frozen=True)
class Shard:
    name: str
    records: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    format_version: int
    objective: str
    seq_length: int
    vocab_size: int
    token_dtype: str
    tokenizer_sha256: str
    special_ids: Mapping[str, int]
    shards: tuple[Shard, ...]
    total_records: int
    total_tokens: int
    # How the corpus was read: files, documents, skipped inputs, dropped tail tokens...
    corpus: Mapping[str, int] = field(default_factory=dict)
    packing: str = ""
    eval_shards: tuple[Shard, ...] = ()
    eval_records: int = 0
    eval_tokens: int = 0
    # Format 3: the held-out rule and the fraction it used ({"rule": str, "fraction": float}),
    # and per corpus source: budget (None: none), tokens, documents, exhausted.
    held_out: Mapping[str, Any] = field(default_factory=dict)
    sources: tuple[Mapping[str, Any], ...] = ()
    # Format 3: the commit of every Hub dataset read ({"<owner>/<name>": "<40 hex>"}).
    hub_revisions: Mapping[str, str] = field(default_factory=dict)

    @property
    def all_shards(self) -> tuple[Shard, ...]:
        return self.shards + self.eval_shards

    def to_json(self) -> str:
        # Not dataclasses.asdict: it deep-copies, and mappingproxy values cannot be copied.
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["shards"] = [asdict(shard) for shard in self.shards]
        data["eval_shards"] = [asdict(shard) for shard in self.eval_shards]
        data["special_ids"] = dict(self.special_ids)
        data["corpus"] = dict(self.corpus)
        data["held_out"] = dict(self.held_out)
        data["sources"] = [dict(source) for source in self.sources]
        data["hub_revisions"] = dict(self.hub_revisions)
        if self.format_version < 3:  # written as that format was (tests read old manifests)
            del data["held_out"], data["sources"], data["hub_revisions"]
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, *, where: str = MANIFEST_NAME) -> Manifest:
        try:
            data = json.loads(text)
            shards = _shards(data["shards"])
            manifest = cls(
                format_version=int(data["format_version"]),
                objective=str(data["objective"]),
                seq_length=int(data["seq_length"]),
                vocab_size=int(data["vocab_size"]),
                token_dtype=str(data["token_dtype"]),
                tokenizer_sha256=str(data["tokenizer_sha256"]),
                special_ids=MappingProxyType(
                    {str(k): int(v) for k, v in data["special_ids"].items()}
                ),
                shards=shards,
                total_records=int(data["total_records"]),
                total_tokens=int(data["total_tokens"]),
                corpus=MappingProxyType(
                    {str(k): int(v) for k, v in data.get("corpus", {}).items()}
                ),
                packing=str(data.get("packing", "")),
                eval_shards=_shards(data.get("eval_shards", [])),
                eval_records=int(data.get("eval_records", 0)),
                eval_tokens=int(data.get("eval_tokens", 0)),
                held_out=MappingProxyType(_held_out(data.get("held_out", {}))),
                sources=tuple(_source(s) for s in data.get("sources", [])),
                hub_revisions=MappingProxyType(
                    {str(k): str(v) for k, v in data.get("hub_revisions", {}).items()}
                ),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DataError(f"invalid manifest {where}: {type(exc).__name__}: {exc}") from None
        manifest.check(where)
        return manifest

    def check(self, where: str = MANIFEST_NAME) -> None:
        """Internal consistency; a DataError names what is wrong."""
        if self.format_version not in READABLE_VERSIONS:
            raise DataError(
                f"manifest {where} has format_version {self.format_version}; this payload "
                f"reads versions {', '.join(map(str, READABLE_VERSIONS))}: re-run "
                "`tpu-payload encode --force`"
            )
        if self.objective not in OBJECTIVES:
            raise DataError(
                f"manifest {where}: objective {self.objective!r} is not one of "
                f"{', '.join(OBJECTIVES)}"
            )
        if self.token_dtype not in ("uint16", "uint32"):
            raise DataError(f"manifest {where}: token_dtype {self.token_dtype!r} is not supported")
        if unknown := set(self.special_ids) - set(SPECIAL_ROLES):
            raise DataError(f"manifest {where}: unknown special roles {sorted(unknown)}")
        if not self.shards:
            raise DataError(f"manifest {where} lists no shards")
        if sum(s.records for s in self.shards) != self.total_records:
            raise DataError(f"manifest {where}: shard records do not add up to total_records")
        if self.total_tokens != self.total_records * self.seq_length:
            raise DataError(f"manifest {where}: total_tokens != total_records * seq_length")
        if sum(s.records for s in self.eval_shards) != self.eval_records:
            raise DataError(f"manifest {where}: eval shard records do not add up to eval_records")
        if self.eval_tokens != self.eval_records * self.seq_length:
            raise DataError(f"manifest {where}: eval_tokens != eval_records * seq_length")
        names = [s.name for s in self.all_shards]
        if len(set(names)) != len(names) or any("/" in n or n.startswith(".") for n in names):
            raise DataError(f"manifest {where}: shard names must be unique plain file names")


def _held_out(data: Any) -> dict[str, Any]:
    return {"rule": str(data["rule"]), "fraction": float(data["fraction"])} if data else {}


def _source(data: Any) -> Mapping[str, Any]:
    budget = data["budget"]
    return MappingProxyType(
        {
            "budget": None if budget is None else int(budget),
            "tokens": int(data["tokens"]),
            "documents": int(data["documents"]),
            "exhausted": bool(data["exhausted"]),
        }
    )


def _shards(entries: Any) -> tuple[Shard, ...]:
    return tuple(
        Shard(
            name=str(s["name"]),
            records=int(s["records"]),
            bytes=int(s["bytes"]),
            sha256=str(s["sha256"]),
        )
        for s in entries
    )


def manifest_path(data_dir: str) -> str:
    return storage.join(data_dir, MANIFEST_NAME)


def load_manifest(data_dir: str) -> Manifest:
    path = manifest_path(data_dir)
    try:
        text = storage.read_text(path)
    except FileNotFoundError:
        raise DataError(
            f"no {MANIFEST_NAME} in {data_dir}: the data is missing or unfinished; "
            "run `tpu-payload encode --job ...` first"
        ) from None
    except UnicodeDecodeError:
        raise DataError(f"invalid manifest {path}: not UTF-8 text") from None
    return Manifest.from_json(text, where=path)


def shard_paths(data_dir: str, manifest: Manifest, *, split: str = "train") -> list[str]:
    """Paths of the training shards, or of the held-out ones with ``split="eval"``."""
    shards = manifest.eval_shards if split == "eval" else manifest.shards
    return [storage.join(data_dir, shard.name) for shard in shards]


def verify_shards(
    data_dir: str,
    manifest: Manifest,
    *,
    checksums: bool = True,
    names: Collection[str] | None = None,
) -> None:
    """DataError naming the first shard (training or held-out) that is missing, of the wrong
    size or altered (`checksums`: read every byte for its sha256; else existence and size).

    `names`: only these shards (a host of a slice checks the files its own input pipelines
    read; every name must be in the manifest)."""
    shards = manifest.all_shards
    if names is not None:
        unknown = set(names) - {shard.name for shard in shards}
        if unknown:
            raise ValueError(f"not shards of {MANIFEST_NAME}: {sorted(unknown)}")
        shards = tuple(shard for shard in shards if shard.name in names)
    for shard in shards:
        path = storage.join(data_dir, shard.name)
        try:
            actual = storage.size(path)
        except FileNotFoundError:
            raise DataError(
                f"shard {shard.name} listed in {MANIFEST_NAME} is missing from {data_dir}"
            ) from None
        if actual != shard.bytes:
            raise DataError(
                f"shard {shard.name} has {actual} bytes, manifest says {shard.bytes} "
                "(truncated or replaced): re-run `tpu-payload encode --force`"
            )
        if checksums and storage.sha256(path) != shard.sha256:
            raise DataError(
                f"shard {shard.name} does not match its sha256 in {MANIFEST_NAME} (altered): "
                "re-run `tpu-payload encode --force`"
            )


def write_manifest(data_dir: str, manifest: Manifest) -> None:
    """Create-only: a finished manifest is never overwritten (DataError if one exists)."""
    manifest.check()
    path = manifest_path(data_dir)
    try:
        storage.write_text(path, manifest.to_json(), if_absent=True)
    except storage.AlreadyExists:
        raise DataError(
            f"{path} already exists; a finished manifest is never overwritten "
            "(use --force to rebuild the data)"
        ) from None


def as_dict(manifest: Manifest) -> dict[str, Any]:
    return json.loads(manifest.to_json())


def special_ids_of(manifest: Manifest) -> dict[str, int]:
    """Role (pad, mask, ...) -> token id, as plain ints."""
    return {str(k): int(v) for k, v in manifest.special_ids.items()}
