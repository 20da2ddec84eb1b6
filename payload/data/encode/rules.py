"""The encode stage's rules: encoding as a pure function of the documents (the plan, the group
tokenizer, token budgets, the held-out draw, packing), run alike by every runner.

Encoding is a pure function of the documents: the same documents give the same shards and
the same manifest from any runner (``data.runner: local`` in ``payload/data/encode/local.py``,
``beam`` in ``payload/data/encode/beam.py``), any worker count and any input format (a text
paragraph, a JSON line and a Parquet row are each one document). Every step below depends
only on the documents, the tokenizer and the ``data`` settings, never on who computed it or
when.

Groups. The reader (``corpus.iter_groups``) cuts each file's documents into groups of about
1 MiB of text, ending at the file's end; groups are in a global order: (source, file,
group number). Each group is tokenized on its own (``GroupTokenizer``), by a local worker
process or by a Beam worker.

Token streams (no padding anywhere):

* ``mlm``: each document is ``d [SEP]`` (or ``d </s>`` in RoBERTa style); a stream is cut
  into windows of ``seq_length - 1`` tokens and every sequence is ``[CLS] + window``.
* ``clm``: each document is ``<s> d </s>``; a stream is cut into windows of ``seq_length``.

Packing is within each group: the group's training documents, concatenated in order, are
cut into windows, and the remainder shorter than a window is dropped and counted
(``dropped_tokens``; about half a window per group of ~1 MiB: a few hundredths of a
percent). The held-out documents of the group are packed the same way into their own stream.

Held-out split (``data.eval_fraction``): whole documents, chosen per document from a stable
hash of its text: ``blake2b(text, key=HELD_OUT_SALT)`` read as a number ``u`` in [0, 1); a
document is held out when ``u < f``. ``f`` is ``eval_fraction``, except on a corpus too small
for that share to reach ``eval_min_sequences``: with ``N`` the tokens of the corpus (all
used documents with their separators), ``f = eval_min_sequences * window / N`` (never above
``MAX_EVAL_FRACTION``) when ``N * eval_fraction`` is below that floor. The floor is so aimed
at, not guaranteed (documents fall either way by their hash). Held-out sequences past
``eval_max_sequences`` in the global order are dropped and counted (``eval_dropped_tokens``):
their documents do not go back to training, so on a large corpus lower ``eval_fraction``
rather than lean on the cap. No document contributes a token to both splits. Special tokens
written literally in the corpus (e.g. "[MASK]") are encoded as plain text.

Token budget (``data.max_tokens``): with unweighted sources (or plain ``corpus.paths``) one
budget for the whole corpus, consumed in corpus order; with weighted sources, source ``i``
gets ``floor(max_tokens * weight_i / sum of weights)``, consumed in that source's order.
Documents are used from the start while their tokens (separators included, both splits),
added up, stay within the budget: the first document that would pass it and every later one
of that budget are not used (its source is "exhausted"), so a budget is never exceeded. Tokens used,
documents, budget and whether it was exhausted are reported per source in status.json and
manifest.json. The reader still reads an exhausted source to its end (counted in the reading
statistics); its later groups are not packed.

What comes out (shard names, stage.json, the manifest, status.json) is
``payload/data/encode/outputs.py``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np

from payload.core import records
from payload.core.errors import DataError
from payload.data import corpus
from payload.data.tokenizer import WordLimit, max_word_length_of, tokenizer_json
from payload.spec import MASKED_OBJECTIVES, MAX_EVAL_FRACTION, JobSpec

# The held-out draw's key: fixed, so a document's split never changes between runs. A new
# value would re-split every corpus (and is a new format of the split, documented as such).
HELD_OUT_SALT = b"tpu-pretrain/held-out/v1"
HELD_OUT_RULE = "blake2b(document utf-8, key=HELD_OUT_SALT, 8 bytes) / 2**64 < fraction"


def packing_description(objective: str) -> str:
    if objective in MASKED_OBJECTIVES:  # rtd (ELECTRA) packs as mlm
        return (
            f"{objective}: [CLS] + (seq_length-1) tokens of each group's stream "
            "'doc [SEP] doc [SEP] ...' (remainder of each group dropped)"
        )
    return (
        "clm: seq_length tokens of each group's stream '<s> doc </s> <s> doc </s> ...'"
        " (remainder of each group dropped)"
    )


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Plan:
    """Everything the pure encoding functions need (picklable: sent to every worker)."""

    objective: str
    token_dtype: str
    first_id: int  # mlm: separator after each document; clm: BOS before each document
    last_id: int  # clm: EOS after each document (-1 for mlm)
    width: int  # tokens of a stream per sequence
    lead: int | None  # mlm: [CLS] at position 0 of every sequence
    seq_length: int
    records_per_shard: int
    eval_fraction: float
    eval_min_sequences: int
    eval_max_sequences: int
    # A longer document is tokenized in pieces (corpus.document_pieces) kept together.
    max_document_bytes: int = corpus.MAX_DOCUMENT_BYTES

    @property
    def floor_tokens(self) -> int:
        return self.eval_min_sequences * self.width


@dataclass(frozen=True)
class Prepared:
    """The tokenizer and what the manifest records about it, checked against the job."""

    plan: Plan
    tokenizer_text: str
    tokenizer_sha: str
    vocab_size: int
    special_ids: dict[str, int]


def prepare(job: JobSpec) -> Prepared:
    """Load and check the tokenizer; DataError when it does not fit the job."""
    tokenizer_bytes = tokenizer_json(job.paths.tokenizer)
    tokenizer_text = tokenizer_bytes.decode("utf-8")
    from tokenizers import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_str(tokenizer_text)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    trained_limit = max_word_length_of(tok)
    if trained_limit != job.tokenizer.max_word_length:
        raise DataError(
            f"tokenizer in {job.paths.tokenizer} was trained with max_word_length "
            f"{trained_limit or 'unlimited'} (job: tokenizer.max_word_length="
            f"{job.tokenizer.max_word_length}); re-run `tpu-payload tokenizer --force`"
        )
    token_dtype = records.token_dtype_for(vocab_size)
    found = {role: tok.token_to_id(token) for role, token in job.special_roles.items()}
    if any(i is None for i in found.values()):
        raise DataError(
            f"tokenizer in {job.paths.tokenizer} lacks special tokens {found}; "
            "re-run `tpu-payload tokenizer --force`"
        )
    special_ids = {role: int(i) for role, i in found.items()}
    data = job.data
    if data.objective in MASKED_OBJECTIVES:  # rtd (ELECTRA) packs as mlm
        first, last, width, lead = special_ids["sep"], -1, data.seq_length - 1, special_ids["cls"]
    else:
        first, last, width, lead = special_ids["bos"], special_ids["eos"], data.seq_length, None
    plan = Plan(
        objective=data.objective,
        token_dtype=token_dtype,
        first_id=first,
        last_id=last,
        width=width,
        lead=lead,
        seq_length=data.seq_length,
        records_per_shard=data.records_per_shard,
        eval_fraction=data.eval_fraction,
        eval_min_sequences=data.eval_min_sequences,
        eval_max_sequences=data.eval_max_sequences,
        max_document_bytes=corpus.MAX_DOCUMENT_BYTES,
    )
    return Prepared(
        plan=plan,
        tokenizer_text=tokenizer_text,
        tokenizer_sha=hashlib.sha256(tokenizer_bytes).hexdigest(),
        vocab_size=vocab_size,
        special_ids=special_ids,
    )


# --------------------------------------------------------------------------- pure steps

GroupKey = tuple[int, int, int]  # (source, file number in reading order, group in file)


@dataclass
class TokenizedGroup:
    """One group's documents as token ids (with their separators) and their held-out draws."""

    key: GroupKey
    source: int
    ids: np.ndarray  # every document's ids, concatenated in order
    lengths: np.ndarray  # tokens of each document (int64); they add up to len(ids)
    draws: np.ndarray  # each document's held-out draw u in [0, 1) (float64)
    long_words: int

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def documents(self) -> int:
        return len(self.lengths)


def held_out_draw(document: str) -> float:
    """The document's number in [0, 1): a keyed blake2b of its UTF-8 text (HELD_OUT_SALT)."""
    digest = hashlib.blake2b(document.encode("utf-8"), digest_size=8, key=HELD_OUT_SALT).digest()
    return int.from_bytes(digest, "big") / float(1 << 64)


class GroupTokenizer:
    """Tokenizes groups (in an encoder worker: local process or Beam worker)."""

    def __init__(self, tokenizer_text: str, plan: Plan):
        # One Rust thread per worker: the parallelism comes from the worker processes.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        from tokenizers import Tokenizer  # noqa: PLC0415

        tok = Tokenizer.from_str(tokenizer_text)
        tok.no_truncation()
        tok.no_padding()
        tok.encode_special_tokens = True  # corpus text "[MASK]" is text, not the mask token
        self.plan = plan
        self.word_limit = WordLimit(tok)

    def __call__(self, key: GroupKey, group: corpus.Group) -> TokenizedGroup:
        plan = self.plan
        texts: list[str] = []
        pieces: list[int] = []  # how many texts each document was tokenized as
        for document in group.documents:
            parts = corpus.document_pieces(document, plan.max_document_bytes)
            texts += parts
            pieces.append(len(parts))
        encodings, long_words = self.word_limit.encode(texts)
        flat: list[int] = []
        lengths: list[int] = []
        at = 0
        for count in pieces:
            start = len(flat)
            if plan.objective == "clm":
                flat.append(plan.first_id)
            for enc in encodings[at : at + count]:
                flat.extend(enc.ids)
            at += count
            flat.append(plan.last_id if plan.objective == "clm" else plan.first_id)
            lengths.append(len(flat) - start)
        return TokenizedGroup(
            key=key,
            source=group.source,
            ids=np.array(flat, dtype=np.dtype(plan.token_dtype)),
            lengths=np.array(lengths, dtype=np.int64),
            draws=np.array([held_out_draw(doc) for doc in group.documents], dtype=np.float64),
            long_words=long_words,
        )


def source_budgets(job: JobSpec) -> list[int | None]:
    """Each source's token budget (None: no budget): see the module docstring."""
    members = job.corpus.members
    budget = job.data.max_tokens
    if budget is None:
        return [None] * len(members)
    weights = [m.weight for m in members]
    if any(w is None for w in weights):
        return [budget] * len(members)  # one budget shared in corpus order: budget_key()
    total = sum(w for w in weights if w is not None)
    return [int(budget * (w or 0.0) / total) for w in weights]


def budget_key(job: JobSpec, source: int) -> int:
    """Which budget a source draws from: its own when weighted, else the corpus's (0)."""
    members = job.corpus.members
    weighted = job.data.max_tokens is not None and all(m.weight is not None for m in members)
    return source if weighted else 0


def within_budget(group: TokenizedGroup, tokens_before: int, budget: int | None) -> int:
    """How many of the group's documents are used: those whose running sum of tokens over
    every document of their budget so far (``tokens_before``: all documents of the groups
    before this one, used or not) stays within the budget."""
    if budget is None:
        return group.documents
    through_each = tokens_before + np.cumsum(group.lengths)
    return int(np.count_nonzero(through_each <= budget))  # a prefix: the sums only grow


def truncated(group: TokenizedGroup, keep: int) -> TokenizedGroup:
    if keep == group.documents:
        return group
    return TokenizedGroup(
        key=group.key,
        source=group.source,
        ids=group.ids[: int(group.lengths[:keep].sum())],
        lengths=group.lengths[:keep],
        draws=group.draws[:keep],
        long_words=group.long_words,
    )


def held_out_fraction(plan: Plan, total_tokens: int) -> float:
    """``f`` of the held-out rule for a corpus of ``total_tokens`` (module docstring)."""
    if plan.eval_fraction <= 0:
        return 0.0
    if reaches_floor(plan, total_tokens):
        return plan.eval_fraction
    return min(plan.floor_tokens / max(total_tokens, 1), MAX_EVAL_FRACTION)


def reaches_floor(plan: Plan, tokens: int) -> bool:
    """True when ``eval_fraction`` of ``tokens`` reaches the floor: f is then decided."""
    return tokens * plan.eval_fraction >= plan.floor_tokens


@dataclass
class PackedGroup:
    """One group's training and held-out sequences ([n, seq_length] each) and its counts."""

    key: GroupKey
    train: np.ndarray
    held_out: np.ndarray
    train_dropped_tokens: int
    eval_dropped_tokens: int
    eval_documents: int


def windows(ids: np.ndarray, plan: Plan) -> tuple[np.ndarray, int]:
    """(sequences of a stream, tokens of the remainder dropped)."""
    rows = len(ids) // plan.width
    block = ids[: rows * plan.width].reshape(rows, plan.width)
    if plan.lead is not None:
        lead = np.full((rows, 1), plan.lead, dtype=ids.dtype)
        block = np.concatenate([lead, block], axis=1)
    return block, len(ids) - rows * plan.width


def pack_group(group: TokenizedGroup, fraction: float, plan: Plan) -> PackedGroup:
    """Split the group's documents by their draws and cut each stream into sequences."""
    to_eval = group.draws < fraction
    mask = np.repeat(to_eval, group.lengths)
    train, train_rest = windows(group.ids[~mask], plan)
    held_out, eval_rest = windows(group.ids[mask], plan)
    return PackedGroup(
        key=group.key,
        train=train,
        held_out=held_out,
        train_dropped_tokens=train_rest,
        eval_dropped_tokens=eval_rest,
        eval_documents=int(np.count_nonzero(to_eval)),
    )
