"""Stage 1: train a tokenizer by streaming the corpus, save it for AutoTokenizer.

Pipeline per kind (all with NFKC normalization, then lowercasing if asked; no accent
stripping, which would decompose Hangul syllables into jamo):

* ``wordpiece``: BERT pre-tokenizer (whitespace + punctuation), WordPiece model and decoder.
* ``bpe``: byte-level BPE (GPT-2/RoBERTa style); every byte is in the alphabet, so nothing
  is ever unknown and decode(encode(text)) == text after normalization.
* ``unigram``: Metaspace pre-tokenizer and decoder, Unigram model (``min_frequency`` does not
  apply: the Unigram trainer prunes by likelihood).

Post-processor: ``[CLS] $A [SEP]`` (mlm, wordpiece), ``<s> $A </s>`` (mlm with bpe/unigram,
RoBERTa style; also clm, where <s>/</s> are BOS/EOS). A bare trained model has none.

Outputs in ``<output>/tokenizer/``: ``tokenizer_config.json``, ``special_tokens_map.json``,
``stage.json`` (the resolved job spec and corpus counts) and, written last as the completion
marker, ``tokenizer.json``. ``AutoTokenizer.from_pretrained(dir)`` loads the directory.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from payload import corpus, storage
from payload.errors import DataError, SpecError
from payload.spec import JobSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from payload.status import StatusWriter

TOKENIZER_FILE = "tokenizer.json"
STAGE_FILE = "stage.json"
HF_FILES = ("tokenizer_config.json", "special_tokens_map.json")
STAGE = "tokenizer"


def build_tokenizer(job: JobSpec) -> tuple[Tokenizer, Any]:
    """An untrained tokenizer and its trainer for ``job.tokenizer``."""
    from tokenizers import (  # noqa: PLC0415
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    spec = job.tokenizer
    unk = job.special_roles["unk"]
    steps = [normalizers.NFKC()]
    if spec.lowercase:
        steps.append(normalizers.Lowercase())
    specials = list(spec.special_tokens)
    if spec.kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token=unk, max_input_chars_per_word=100))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
        trainer = trainers.WordPieceTrainer(
            vocab_size=spec.vocab_size,
            min_frequency=spec.min_frequency,
            special_tokens=specials,
            continuing_subword_prefix="##",
            show_progress=False,
        )
    elif spec.kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=spec.vocab_size,
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
            vocab_size=spec.vocab_size,
            special_tokens=specials,
            unk_token=unk,
            show_progress=False,
        )
    tok.normalizer = normalizers.Sequence(steps)
    return tok, trainer


def set_post_processor(tok: Tokenizer, job: JobSpec) -> None:
    from tokenizers import processors  # noqa: PLC0415

    roles = job.special_roles
    first, last = (roles["cls"], roles["sep"]) if "cls" in roles else (roles["bos"], roles["eos"])
    ids = {t: tok.token_to_id(t) for t in (first, last)}
    if None in ids.values():
        raise RuntimeError(f"special tokens missing from the trained vocabulary: {ids}")
    if job.tokenizer.kind == "wordpiece" and job.data.objective == "mlm":
        pair = f"{first} $A {last} $B:1 {last}:1"
    else:
        pair = f"{first} $A {last} {last} $B:1 {last}:1"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{first} $A {last}", pair=pair, special_tokens=list(ids.items())
    )


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
    """Train, check and save the tokenizer; returns its directory. Skips if already complete."""
    out_dir = job.paths.tokenizer
    if is_complete(job):
        return out_dir
    files = corpus.resolve_files(job.corpus)
    total = corpus.total_bytes(files)
    stats = corpus.CorpusStats()
    status.update(
        stage=STAGE,
        progress=0.0,
        message=f"training a {job.tokenizer.kind} tokenizer on {len(files)} files",
    )
    tok, trainer = build_tokenizer(job)
    with _progress(total, f"tokenizer: reading {len(files)} files") as bar:
        done = 0

        def on_bytes(n: int) -> None:
            nonlocal done
            done += n
            bar.update(n)
            status.update(stage=STAGE, progress=0.9 * done / max(total, 1))

        batches = corpus.iter_document_batches(
            files, job.corpus.on_bad_input, stats, on_bytes=on_bytes
        )
        tok.train_from_iterator(batches, trainer)
    corpus.require_text(stats, job.corpus)
    vocab_size = tok.get_vocab_size()
    if vocab_size > job.tokenizer.vocab_size:
        raise SpecError(
            f"tokenizer.vocab_size: {job.tokenizer.vocab_size} is too small for this corpus: "
            f"its {len(job.tokenizer.special_tokens)} special tokens and its alphabet alone need "
            f"{vocab_size}; set tokenizer.vocab_size to at least {vocab_size}"
        )
    set_post_processor(tok, job)
    _save(tok, job, stats, out_dir)
    status.update(
        stage=STAGE,
        state="complete",
        message=f"vocabulary of {vocab_size} tokens in {out_dir}",
        vocab_size=vocab_size,
        **stats.as_dict(),
    )
    return out_dir


def _save(tok: Tokenizer, job: JobSpec, stats: corpus.CorpusStats, out_dir: str) -> None:
    """Write the HF files, then tokenizer.json last (create-only) as the completion marker."""
    with tempfile.TemporaryDirectory(prefix="tokenizer-") as tmp:
        _hf_wrapper(tok, job).save_pretrained(tmp)
        stage = {
            "stage": STAGE,
            "job": job.to_dict(),
            "corpus": stats.as_dict(),
            "vocab_size": tok.get_vocab_size(),
            "tokenizer_sha256": hashlib.sha256(Path(tmp, TOKENIZER_FILE).read_bytes()).hexdigest(),
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
