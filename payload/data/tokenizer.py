"""Stage 1: train a tokenizer by streaming the corpus, save it for AutoTokenizer.

Pipeline per kind (all with NFKC normalization, then lowercasing if asked; no accent
stripping, which would decompose Hangul syllables into jamo):

* ``wordpiece``: BERT pre-tokenizer (whitespace + punctuation), WordPiece model and decoder.
* ``bpe``: byte-level BPE (GPT-2/RoBERTa style); every byte is in the alphabet, so nothing
  is ever unknown and decode(encode(text)) == text after normalization.
* ``unigram``: Metaspace pre-tokenizer and decoder, Unigram model (``min_frequency`` does not
  apply: the Unigram trainer prunes by likelihood).

Word length. The last pre-tokenizer step cuts every word longer than
``tokenizer.max_word_length`` characters (for byte-level bpe: bytes, plus the ``Ġ`` of a
leading space) into pieces of at most that length. It lives in ``tokenizer.json``, so
training, encoding (see :class:`WordLimit`) and any later user of the tokenizer apply the
same rule; the trainers'
cost grows with the square of a word's length, and without it one whitespace-free line of a
few hundred KB takes minutes (and crashes the Unigram trainer). ``long_words`` counts the
words cut (status.json, stage.json, manifest.json).

Post-processor: ``[CLS] $A [SEP]`` (mlm, wordpiece), ``<s> $A </s>`` (mlm with bpe/unigram,
RoBERTa style; also clm, where <s>/</s> are BOS/EOS). A bare trained model has none. The
encoder never uses it (it adds the separators itself), so this stage's ``tokenizer.json``,
whose hash the data manifest records, keeps it as it is. The tokenizer the export ships
(:func:`for_export`) differs for clm only: BOS and no EOS, as Llama-style tokenizers do, so
``model.generate(**tok(prompt))`` continues the prompt instead of starting a new document
after ``</s>``. Training still packs ``<s> doc </s>``.

Outputs in ``<output>/tokenizer/``: ``tokenizer_config.json``, ``special_tokens_map.json``,
``stage.json`` (the resolved job spec and corpus counts) and, written last as the completion
marker, ``tokenizer.json``. ``AutoTokenizer.from_pretrained(dir)`` loads the directory.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from payload.core import storage
from payload.core.errors import DataError, SpecError
from payload.data import corpus
from payload.spec import MASKED_OBJECTIVES, JobSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from payload.core.status import StatusWriter

TOKENIZER_FILE = "tokenizer.json"
STAGE_FILE = "stage.json"
HF_FILES = ("tokenizer_config.json", "special_tokens_map.json")
STAGE = "tokenizer"
CONTINUING_PREFIX = "##"  # wordpiece's continuation tokens
# What the model of a causal LM export takes (GPT2TokenizerFast.model_input_names).
GPT2_INPUT_NAMES = ("input_ids", "attention_mask")
# Oniguruma (the tokenizers regex engine, Ruby syntax) has no (?s); [\s\S] matches anything.
_WORD_PIECE = "[\\s\\S]{{1,{limit}}}"
_WORD_PIECE_LIMIT = re.compile(r"^\[\\s\\S\]\{1,(\d+)\}$")


def build_tokenizer(
    job: JobSpec, *, continuation: Sequence[str] = (), vocab_size: int | None = None
) -> tuple[Tokenizer, Any]:
    """An untrained tokenizer and its trainer for ``job.tokenizer``.

    ``continuation`` (wordpiece): the ``##c`` tokens to number before training (see
    :func:`_continuation_tokens`); ``vocab_size``: the trainer's, instead of the job's.
    """
    from tokenizers import (  # noqa: PLC0415
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    spec = job.tokenizer
    size = spec.vocab_size if vocab_size is None else vocab_size
    unk = job.special_roles["unk"]
    steps = [normalizers.NFKC()]
    if spec.lowercase:
        steps.append(normalizers.Lowercase())
    specials = list(spec.special_tokens)
    if spec.kind == "wordpiece":
        tok = Tokenizer(
            models.WordPiece(unk_token=unk, max_input_chars_per_word=spec.max_word_length)
        )
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix=CONTINUING_PREFIX)
        trainer = trainers.WordPieceTrainer(
            vocab_size=size,
            min_frequency=spec.min_frequency,
            special_tokens=specials + list(continuation),
            continuing_subword_prefix=CONTINUING_PREFIX,
            show_progress=False,
        )
    elif spec.kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=size,
            min_frequency=spec.min_frequency,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    else:
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        trainer = trainers.UnigramTrainer(
            vocab_size=size,
            special_tokens=specials,
            unk_token=unk,
            show_progress=False,
        )
    tok.normalizer = normalizers.Sequence(steps)
    cut = pre_tokenizers.Split(
        Regex(_WORD_PIECE.format(limit=spec.max_word_length)), behavior="isolated"
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence([tok.pre_tokenizer, cut])
    return tok, trainer


def max_word_length_of(tok: Tokenizer) -> int | None:
    """The word-length limit saved in a tokenizer (None: trained without one)."""
    pre = json.loads(tok.to_str()).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    last = steps[-1] if steps else {}
    match = _WORD_PIECE_LIMIT.match(str(last.get("pattern", {}).get("Regex", "")))
    return int(match.group(1)) if last.get("type") == "Split" and match else None


# Unicode White_Space: what BertPreTokenizer (Rust char::is_whitespace) and Oniguruma's \s
# (byte-level BPE's regex) split on. Python's \s also holds \x1c-\x1f, so it is not used.
_WHITE_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


class WordLimit:
    """The tokenizer's word-length cut, counted, and skipped where it cannot change anything.

    Cutting costs a regex pass per word (1.4x the CPU time of encoding without it, on the
    bundled corpus; 1.14x with this class),
    yet only a document with a long enough run can have a word to cut. ``encode`` finds those
    documents on the normalized text with a conservative pattern (runs a word lies in: for
    byte-level BPE a quarter of the limit, since a character is up to 4 bytes, or a run of
    whitespace; for Metaspace everything between spaces) and sends only them through the
    cut; the rest go through an identical tokenizer without it. The ids are the same as the
    full tokenizer's (tested).
    """

    def __init__(self, tok: Tokenizer):
        from tokenizers import pre_tokenizers  # noqa: PLC0415

        limit = max_word_length_of(tok)
        if limit is None:
            raise DataError("tokenizer has no word-length limit: re-run `tokenizer --force`")
        from tokenizers import Tokenizer  # noqa: PLC0415

        self.limit = limit
        self.full = tok
        # Own copies of the steps, so counting never touches a tokenizer that is training.
        own = Tokenizer.from_str(tok.to_str())
        self._normalizer = own.normalizer
        self._split_words = own.pre_tokenizer[0]  # the kind's pre-tokenizer, before the cut
        if isinstance(self._split_words, pre_tokenizers.ByteLevel):
            k = max(1, limit // 4 - 1)
            pattern = f"[^{_WHITE_SPACE}]{{{k},}}|[{_WHITE_SPACE}]{{{k},}}"
        elif isinstance(self._split_words, pre_tokenizers.Metaspace):
            pattern = f"[^ ]{{{limit},}}"
        elif isinstance(self._split_words, pre_tokenizers.BertPreTokenizer):
            pattern = f"[^{_WHITE_SPACE}]{{{limit},}}"
        else:
            pattern = ""  # unknown word rules: always cut
        self._candidate = re.compile(pattern)
        self.uncut = None
        if pattern:
            self.uncut = Tokenizer.from_str(tok.to_str())
            self.uncut.pre_tokenizer = self._split_words
            self.uncut.encode_special_tokens = tok.encode_special_tokens

    def _normalize(self, doc: str) -> str:
        return self._normalizer.normalize_str(doc) if self._normalizer is not None else doc

    def _long_words(self, normalized: str) -> int:
        words = self._split_words.pre_tokenize_str(normalized)
        return sum(1 for word, _ in words if len(word) > self.limit)

    def count(self, documents: Iterable[str]) -> int:
        """How many words of ``documents`` the tokenizer cuts."""
        found = 0
        for doc in documents:
            normalized = self._normalize(doc)
            if self._candidate.search(normalized):
                found += self._long_words(normalized)
        return found

    def encode(self, documents: list[str]) -> tuple[list[Any], int]:
        """``full.encode_batch_fast(documents)`` without special tokens, and the words cut."""
        if self.uncut is None:
            return self.full.encode_batch_fast(documents, add_special_tokens=False), self.count(
                documents
            )
        cut: list[int] = []
        found = 0
        for i, doc in enumerate(documents):
            normalized = self._normalize(doc)
            if self._candidate.search(normalized):
                cut.append(i)
                found += self._long_words(normalized)
        if not cut:
            return self.uncut.encode_batch_fast(documents, add_special_tokens=False), 0
        out: list[Any] = [None] * len(documents)
        cut_set = set(cut)
        plain = [i for i in range(len(documents)) if i not in cut_set]
        for which, indices in ((self.uncut, plain), (self.full, cut)):
            batch = [documents[i] for i in indices]
            encodings = which.encode_batch_fast(batch, add_special_tokens=False)
            for i, enc in zip(indices, encodings, strict=True):
                out[i] = enc
        return out, found


def set_post_processor(tok: Tokenizer, job: JobSpec) -> None:
    from tokenizers import processors  # noqa: PLC0415

    roles = job.special_roles
    first, last = (roles["cls"], roles["sep"]) if "cls" in roles else (roles["bos"], roles["eos"])
    ids = {t: tok.token_to_id(t) for t in (first, last)}
    if None in ids.values():
        raise RuntimeError(f"special tokens missing from the trained vocabulary: {ids}")
    if job.tokenizer.kind == "wordpiece" and job.data.objective in MASKED_OBJECTIVES:
        pair = f"{first} $A {last} $B:1 {last}:1"
    else:
        pair = f"{first} $A {last} {last} $B:1 {last}:1"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{first} $A {last}", pair=pair, special_tokens=list(ids.items())
    )


def for_export(tok: PreTrainedTokenizerFast, job: JobSpec) -> PreTrainedTokenizerFast:
    """The tokenizer as the export ships it: for clm, ``tok(text)`` is ``<s> text`` (BOS only).

    The template is the one transformers 5 builds for ``add_bos_token=True,
    add_eos_token=False`` (``TokenizersBackend.update_post_processor`` in
    tokenization_utils_tokenizers.py), and both flags go into tokenizer_config.json:
    transformers 5 rebuilds the same post-processor from them, transformers 4.57's
    ``PreTrainedTokenizerFast`` keeps the one in tokenizer.json. It returns no
    ``token_type_ids`` (see below). mlm tokenizers are returned unchanged (``[CLS] … [SEP]`` /
    ``<s> … </s>`` is what BERT and RoBERTa expect).
    """
    if job.data.objective != "clm":
        return tok
    from tokenizers import processors  # noqa: PLC0415

    bos = job.special_roles["bos"]
    bos_id = tok.convert_tokens_to_ids(bos)
    if bos_id is None or bos_id == tok.unk_token_id:
        raise RuntimeError(f"BOS token {bos!r} missing from the trained vocabulary")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
    tok.init_kwargs.update(add_bos_token=True, add_eos_token=False)
    # No token_type_ids: GPT-2 adds the embedding of token_type_ids (token id 0, `<s>`) to
    # every position when it is passed, so `generate(**tok(prompt))` would see a shifted
    # input. transformers' own GPT2TokenizerFast declares the same two names.
    tok.model_input_names = list(GPT2_INPUT_NAMES)
    tok.init_kwargs["model_input_names"] = list(GPT2_INPUT_NAMES)
    return tok


def _hf_wrapper(tok: Tokenizer, job: JobSpec) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    roles = job.special_roles
    kwargs = {f"{role}_token": token for role, token in roles.items()}
    extra = [t for t in job.tokenizer.special_tokens if t not in roles.values()]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=job.data.seq_length,
        padding_side="right",
        additional_special_tokens=extra,
        **kwargs,
    )


def is_complete(job: JobSpec) -> bool:
    return storage.exists(storage.join(job.paths.tokenizer, TOKENIZER_FILE))


def tokenizer_json(tokenizer_dir: str) -> bytes:
    """The bytes of ``tokenizer.json`` (DataError if the tokenizer stage has not finished)."""
    try:
        return storage.read_bytes(storage.join(tokenizer_dir, TOKENIZER_FILE))
    except FileNotFoundError:
        raise DataError(
            f"no {TOKENIZER_FILE} in {tokenizer_dir}: run `tpu-payload tokenizer --job ...` first"
        ) from None


def tokenizer_sha256(tokenizer_dir: str) -> str:
    return hashlib.sha256(tokenizer_json(tokenizer_dir)).hexdigest()


def load_tokenizer(tokenizer_dir: str) -> PreTrainedTokenizerFast:
    """The trained tokenizer as a transformers fast tokenizer (local or gs:// directory)."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    tokenizer_json(tokenizer_dir)  # a clear DataError when the stage has not run
    if not storage.is_gcs(tokenizer_dir):
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    with tempfile.TemporaryDirectory(prefix="tokenizer-") as tmp:
        for name in (*HF_FILES, TOKENIZER_FILE):
            storage.download_file(storage.join(tokenizer_dir, name), str(Path(tmp, name)))
        return AutoTokenizer.from_pretrained(tmp)


def _progress(total: int, desc: str) -> Any:
    from tqdm import tqdm  # noqa: PLC0415

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, mininterval=0.5)


def train_tokenizer(job: JobSpec, status: StatusWriter) -> str:
    """Train, check and save the tokenizer; returns its directory. Skips if already complete.

    The result is a function of the job (corpus and settings), whatever the machine and its
    core count: see :func:`_continuation_tokens` (wordpiece, which reads the corpus twice)
    and :func:`_canonical_unigram` for what `tokenizers` would otherwise leave to chance.
    """
    out_dir = job.paths.tokenizer
    if is_complete(job):
        return out_dir
    sources = corpus.resolve_sources(job.corpus)
    files = list(dict.fromkeys(f for found in sources for f in found))
    total = corpus.total_bytes(files)
    passes = 2 if job.tokenizer.kind == "wordpiece" else 1
    stats = corpus.CorpusStats()
    status.update(
        stage=STAGE,
        progress=0.0,
        message=f"training a {job.tokenizer.kind} tokenizer on {len(files)} files",
    )
    with _progress(total * passes, f"tokenizer: reading {len(files)} files") as bar:
        done = 0

        def on_bytes(n: int) -> None:
            nonlocal done
            done += n
            bar.update(n)
            status.update(stage=STAGE, progress=0.9 * done / max(total * passes, 1))

        def read(counts: corpus.CorpusStats) -> Iterator[list[str]]:
            groups = corpus.iter_groups(job.corpus, counts, on_bytes=on_bytes, sources=sources)
            return (group.documents for group in groups)

        continuation: list[str] = []
        if job.tokenizer.kind == "wordpiece":
            scout, scout_trainer = build_tokenizer(job, vocab_size=0)  # no merges
            scout.train_from_iterator(read(corpus.CorpusStats()), scout_trainer)
            continuation = _continuation_tokens(scout, job)
        tok, trainer = build_tokenizer(job, continuation=continuation)
        counter = WordLimit(tok)  # before training, which holds the tokenizer
        tok.train_from_iterator(_counting_long_words(read(stats), counter, stats), trainer)
    corpus.require_text(stats, job.corpus)
    tok = canonical(tok, job, continuation)
    vocab_size = tok.get_vocab_size()
    if vocab_size > job.tokenizer.vocab_size:
        raise SpecError(
            f"tokenizer.vocab_size: {job.tokenizer.vocab_size} is too small for this corpus: "
            f"its {len(job.tokenizer.special_tokens)} special tokens and its alphabet alone need "
            f"{vocab_size}; set tokenizer.vocab_size to at least {vocab_size}"
        )
    set_post_processor(tok, job)
    digest = _save(tok, job, stats, out_dir)
    status.update(
        stage=STAGE,
        state="complete",
        message=f"vocabulary of {vocab_size} tokens in {out_dir}",
        vocab_size=vocab_size,
        tokenizer_sha256=digest,
        **stats.as_dict(),
    )
    return out_dir


# Why a trained vocabulary could depend on the run, in tokenizers 0.22.1 (the locked version;
# source read at huggingface/tokenizers tag v0.22.1). Every trainer keeps the corpus's words
# in an ahash AHashMap, whose hasher is seeded at random in each process (ahash's default
# `runtime-rng` feature, Cargo.toml of ahash; the Python wheel takes the defaults), so what
# follows the map's iteration order changes from run to run:
# * wordpiece (tokenizers/src/models/bpe/trainer.rs, `BpeTrainer::tokenize_words`, which the
#   WordPiece trainer runs): the `##c` token of every character seen inside a word is
#   numbered as the loop over that map first meets it, and the merge queue breaks ties in
#   count by those ids (`impl Ord for Merge`), so ties pick other merges and the vocabulary
#   itself changes (huggingface/tokenizers#1794; the upstream fix, PR #2066, is unreleased).
#   Byte-level bpe has no `##` tokens (every character is in the sorted initial alphabet).
# * unigram (tokenizers/src/models/unigram/trainer.rs): `UnigramTrainer::finalize` gives the
#   characters the EM model lacks the scores min_score + 0.0001 k in the order of an
#   AHashSet, and sorts by score keeping that order among equal scores; and the E step and
#   pruning sum floats over the sentences in the map's order, in chunks of
#   len / rayon::current_num_threads(), so the scores' last bits differ with the run and
#   with the machine's core count.
# No setting or environment variable reaches either (RAYON_NUM_THREADS fixes the chunks but
# not the order), so the stage feeds the WordPiece trainer every `##c` token up front, in
# code-point order, and writes Unigram scores in a canonical form.
# What is left, read in the same source and never seen here: the BPE merge queue (a d-ary
# heap) can hold two entries of one pair with equal counts (an old one re-queued with the
# current count next to a newer one with other word positions), and which pops first
# follows the heap's layout, hence the hash order of earlier pushes; and a Unigram prune
# between pieces whose losses differ by float noise, or a score within ~1e-15 of a rounding
# boundary, could still differ. Only a fix inside `tokenizers` removes those;
# tests/payload/test_reproducible.py holds the bundled corpus to byte-identical output.
# Unigram scores are kept to this many decimals: the float noise is ~1e-15, and
# sentencepiece itself stores a score as a 32-bit float (`optional float score` in
# sentencepiece_model.proto: about 1e-6 at the scores a vocabulary has).
UNIGRAM_SCORE_DECIMALS = 6
_UNIGRAM_PENALTY = 0.0001  # finalize's min_score_penalty_delta (unigram/trainer.rs)


def _continuation_tokens(scout: Tokenizer, job: JobSpec) -> list[str]:
    """The ``##c`` tokens a WordPiece trainer creates on this corpus, in code-point order.

    ``scout`` was trained with ``vocab_size=0``: all it holds is what the trainer adds
    before merging (special tokens, the alphabet, and one ``##c`` for every character seen
    after the first of a word). Given to the real trainer as extra special tokens, they are
    numbered in this order before it reads any word, so no id depends on the word map's
    order; :func:`canonical` then takes them off the special tokens again.
    """
    specials = set(job.tokenizer.special_tokens)
    return sorted(
        token
        for token in scout.get_vocab(with_added_tokens=False)
        if token.startswith(CONTINUING_PREFIX)
        and len(token) == len(CONTINUING_PREFIX) + 1
        and token not in specials
    )


def canonical(tok: Tokenizer, job: JobSpec, continuation: Sequence[str] = ()) -> Tokenizer:
    """The trained tokenizer in the form that depends only on the job (see above)."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    data = json.loads(tok.to_str())
    if continuation:  # wordpiece: the ##c tokens stay in the vocabulary, not as specials
        drop = set(continuation)
        data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in drop]
    if data["model"]["type"] == "Unigram":
        data["model"]["vocab"] = _canonical_unigram(
            data["model"]["vocab"], len(job.tokenizer.special_tokens)
        )
    return Tokenizer.from_str(json.dumps(data, ensure_ascii=False))


def _canonical_unigram(vocab: list[list[Any]], n_special: int) -> list[list[Any]]:
    """Unigram ``[piece, score]`` pairs as a function of the corpus (see above).

    The special tokens stay first, in their order. The characters ``finalize`` scored
    ``m, m + 0.0001, m + 0.0002, ...`` (``m`` the lowest score) in hash order get those
    scores in code-point order; every score is rounded to ``UNIGRAM_SCORE_DECIMALS``; the
    pieces are sorted by score, high to low, equal scores by piece.
    """
    head, body = vocab[:n_special], [(str(p), float(s)) for p, s in vocab[n_special:]]
    if body:
        lowest = min(score for _, score in body)
        ladder, penalty = set(), 0.0
        for _ in body:  # the same float steps as finalize, so equal scores are bitwise equal
            ladder.add(lowest + penalty)
            penalty += _UNIGRAM_PENALTY
        chars = [i for i, (p, s) in enumerate(body) if len(p) == 1 and s in ladder]
        scores = sorted(body[i][1] for i in chars)
        for i, score in zip(sorted(chars, key=lambda i: body[i][0]), scores, strict=True):
            body[i] = (body[i][0], score)
    body = [(p, round(s, UNIGRAM_SCORE_DECIMALS) + 0.0) for p, s in body]  # + 0.0: no -0.0
    body.sort(key=lambda pair: (-pair[1], pair[0]))
    return [list(pair) for pair in head] + [[p, s] for p, s in body]


def _counting_long_words(
    batches: Iterable[list[str]], counter: WordLimit, stats: corpus.CorpusStats
) -> Iterator[list[str]]:
    for batch in batches:
        stats.long_words += counter.count(batch)
        yield batch


def _save(tok: Tokenizer, job: JobSpec, stats: corpus.CorpusStats, out_dir: str) -> str:
    """Write the HF files, then tokenizer.json last (create-only) as the completion marker.

    Returns the sha256 of tokenizer.json: what the data manifest records and the encoder and
    trainer check (:func:`tokenizer_sha256`).
    """
    with tempfile.TemporaryDirectory(prefix="tokenizer-") as tmp:
        _hf_wrapper(tok, job).save_pretrained(tmp)
        digest = hashlib.sha256(Path(tmp, TOKENIZER_FILE).read_bytes()).hexdigest()
        stage = {
            "stage": STAGE,
            "job": job.to_dict(),
            "corpus": stats.as_dict(),
            "vocab_size": tok.get_vocab_size(),
            "tokenizer_sha256": digest,
        }
        Path(tmp, STAGE_FILE).write_text(json.dumps(stage, indent=2, ensure_ascii=False) + "\n")
        storage.remove_tree(out_dir)  # leftovers of an interrupted run (no tokenizer.json)
        for name in (*HF_FILES, STAGE_FILE):
            storage.upload_file(str(Path(tmp, name)), storage.join(out_dir, name))
        try:
            storage.upload_file(
                str(Path(tmp, TOKENIZER_FILE)),
                storage.join(out_dir, TOKENIZER_FILE),
                if_absent=True,
            )
        except storage.AlreadyExists:
            raise DataError(
                f"{out_dir} already holds a finished tokenizer (written concurrently?); "
                "use --force to retrain"
            ) from None
    return digest
