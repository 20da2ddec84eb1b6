"""Tokenizer stage: real training on a small corpus, Korean round trips, HF loading."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from tokenizer_helpers import EXAMPLES, make_job

from payload import spec
from payload.core import storage
from payload.core.errors import CorpusError, SpecError
from payload.core.status import StatusWriter
from payload.data import tokenizer

KOREAN_ENGLISH = [
    "오늘 아침에 민아는 항구 시장에서 귤 한 봉지를 찾았다.",
    "The tokenizer splits text into pieces that the model can count.",
    "토크나이저는 글을 모델이 셀 수 있는 조각으로 나눈다 and then packs them.",
    "서준과 유나는 체크포인트 이야기를 했다. The checkpoints survive preemption.",
]


def status_for(job: spec.JobSpec) -> StatusWriter:
    return StatusWriter(job.paths.status, job.name, min_interval_s=0)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[spec.JobSpec, str]]:
    """One trained tokenizer per (kind, objective) on the bundled corpus."""
    out = {}
    for kind, objective in [
        ("wordpiece", "mlm"),
        ("bpe", "mlm"),
        ("unigram", "mlm"),
        ("bpe", "clm"),
    ]:
        tmp = tmp_path_factory.mktemp(f"{kind}-{objective}")
        job = make_job(tmp, kind=kind, objective=objective)
        out[f"{kind}-{objective}"] = (job, tokenizer.train_tokenizer(job, status_for(job)))
    return out


def _normalize_spaces(text: str) -> str:
    return "".join(text.split())


@pytest.mark.parametrize("name", ["wordpiece-mlm", "bpe-mlm", "unigram-mlm", "bpe-clm"])
def test_korean_english_round_trip(trained, name: str) -> None:
    job, out_dir = trained[name]
    tok = tokenizer.load_tokenizer(out_dir)
    for text in KOREAN_ENGLISH:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids, (name, text, tok.convert_ids_to_tokens(ids))
        decoded = tok.decode(ids)
        if job.tokenizer.kind == "wordpiece":
            # WordPiece forgets where spaces were around punctuation; nothing else is lost.
            assert _normalize_spaces(decoded) == _normalize_spaces(text)
        else:
            assert decoded == text
    if job.tokenizer.kind == "bpe":
        return  # byte-level pieces are bytes, not characters
    # Hangul syllables survive as syllables (no NFD jamo decomposition by the normalizer).
    pieces = tok.convert_ids_to_tokens(tok("항구 시장", add_special_tokens=False)["input_ids"])
    assert any("\uac00" <= ch <= "\ud7a3" for piece in pieces for ch in piece)
    assert not any("\u1100" <= ch <= "\u11ff" for piece in pieces for ch in piece)


def test_post_processor_and_special_tokens(trained) -> None:
    job, out_dir = trained["wordpiece-mlm"]
    tok = tokenizer.load_tokenizer(out_dir)
    tokens = tok.convert_ids_to_tokens(tok("hello 안녕")["input_ids"])
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    assert [tok.pad_token, tok.unk_token, tok.cls_token, tok.sep_token, tok.mask_token] == list(
        job.tokenizer.special_tokens
    )
    assert tok.convert_tokens_to_ids(list(job.tokenizer.special_tokens)) == [0, 1, 2, 3, 4]
    assert tok.model_max_length == 64

    _, clm_dir = trained["bpe-clm"]
    clm = tokenizer.load_tokenizer(clm_dir)
    ids = clm("hello 안녕")["input_ids"]
    assert ids[0] == clm.bos_token_id and ids[-1] == clm.eos_token_id
    assert clm.decode(ids, skip_special_tokens=True) == "hello 안녕"

    _, roberta_dir = trained["bpe-mlm"]
    rob = tokenizer.load_tokenizer(roberta_dir)
    assert rob.convert_ids_to_tokens(rob("x")["input_ids"])[:: len(rob("x")["input_ids"]) - 1] == [
        "<s>",
        "</s>",
    ]
    assert rob.mask_token == "<mask>"  # noqa: S105


def test_export_tokenizer_adds_bos_only_for_clm(trained, tmp_path: Path) -> None:
    """The export's copy: `<s> text` for a causal LM (generation continues the prompt),
    unchanged for mlm; the stage's own tokenizer.json (hashed by the manifest) is untouched."""
    from transformers import AutoTokenizer

    job, clm_dir = trained["bpe-clm"]
    before = Path(clm_dir, tokenizer.TOKENIZER_FILE).read_bytes()
    tokenizer.for_export(tokenizer.load_tokenizer(clm_dir), job).save_pretrained(tmp_path / "clm")
    assert Path(clm_dir, tokenizer.TOKENIZER_FILE).read_bytes() == before
    clm = AutoTokenizer.from_pretrained(tmp_path / "clm")
    encoded = clm("hello 안녕")
    assert set(encoded) == {"input_ids", "attention_mask"}
    ids = encoded["input_ids"]
    assert ids[0] == clm.bos_token_id and clm.eos_token_id not in ids
    assert ids[1:] == clm("hello 안녕", add_special_tokens=False)["input_ids"]
    assert clm.decode(ids, skip_special_tokens=True) == "hello 안녕"
    pair = clm("a", "b")["input_ids"]
    assert pair.count(clm.bos_token_id) == 2 and clm.eos_token_id not in pair
    config = json.loads((tmp_path / "clm" / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["add_eos_token"] is False

    for name in ("wordpiece-mlm", "bpe-mlm"):
        mlm_job, mlm_dir = trained[name]
        out = tmp_path / name
        tokenizer.for_export(tokenizer.load_tokenizer(mlm_dir), mlm_job).save_pretrained(out)
        assert (out / tokenizer.TOKENIZER_FILE).read_bytes() == Path(
            mlm_dir, tokenizer.TOKENIZER_FILE
        ).read_bytes()


def test_auto_tokenizer_loads_directory(trained) -> None:
    from transformers import AutoTokenizer

    _, out_dir = trained["unigram-mlm"]
    tok = AutoTokenizer.from_pretrained(out_dir)
    assert tok.is_fast
    assert tok.mask_token == "<mask>"  # noqa: S105
    assert sorted(p.name for p in Path(out_dir).iterdir()) == [
        "special_tokens_map.json",
        "stage.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_vocab_bounded_and_idempotent(trained) -> None:
    job, out_dir = trained["wordpiece-mlm"]
    assert len(tokenizer.load_tokenizer(out_dir)) <= job.tokenizer.vocab_size
    first = Path(out_dir, "tokenizer.json").read_bytes()
    # Complete: a second call does nothing.
    assert tokenizer.train_tokenizer(job, status_for(job)) == out_dir
    assert Path(out_dir, "tokenizer.json").read_bytes() == first
    assert tokenizer.tokenizer_sha256(out_dir) == hashlib.sha256(first).hexdigest()
    stage = json.loads(Path(out_dir, "stage.json").read_text())
    assert stage["tokenizer_sha256"] == hashlib.sha256(first).hexdigest()
    assert stage["job"]["tokenizer"]["kind"] == "wordpiece"
    assert stage["corpus"]["documents"] > 400


def test_lowercase_option(tmp_path: Path) -> None:
    job = make_job(tmp_path, lowercase=True)
    tok = tokenizer.load_tokenizer(tokenizer.train_tokenizer(job, status_for(job)))
    assert tok.decode(tok("Hana 하나", add_special_tokens=False)["input_ids"]) == "hana 하나"


def test_vocab_smaller_than_alphabet_is_a_spec_error(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    # 400 distinct Hangul syllables: more than 105 - 5 specials can hold.
    corpus.write_text(" ".join(chr(0xAC00 + 7 * i) for i in range(400)) + "\n", encoding="utf-8")
    job = make_job(tmp_path, vocab_size=105, corpus=[str(corpus)])
    with pytest.raises(SpecError, match=r"tokenizer\.vocab_size: 105 is too small for this corpus"):
        tokenizer.train_tokenizer(job, status_for(job))
    assert not tokenizer.is_complete(job)


def test_empty_and_binary_corpus(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    job = make_job(tmp_path, corpus=[str(empty)])
    with pytest.raises(CorpusError, match="corpus has no text"):
        tokenizer.train_tokenizer(job, status_for(job))
    assert not tokenizer.is_complete(job)

    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 10)
    job = make_job(tmp_path, corpus=[str(binary)], corpus__on_bad_input="fail")
    with pytest.raises(CorpusError, match=r"blob\.bin looks binary"):
        tokenizer.train_tokenizer(job, status_for(job))
    assert not storage.exists(job.paths.tokenizer + "/tokenizer.json")


@pytest.mark.emulator
def test_tokenizer_on_gcs(gcs_root: str, tmp_path: Path) -> None:
    corpus_uri = f"{gcs_root}/corpus/mixed.txt"
    storage.upload_file(str(EXAMPLES / "corpus" / "mixed.txt"), corpus_uri)
    job = make_job(tmp_path, corpus=[f"{gcs_root}/corpus/*.txt"], output=f"{gcs_root}/run")
    out_dir = tokenizer.train_tokenizer(job, status_for(job))
    assert out_dir == f"{gcs_root}/run/tokenizer"
    assert tokenizer.is_complete(job)
    tok = tokenizer.load_tokenizer(out_dir)
    assert tok.decode(tok("항구 시장", add_special_tokens=False)["input_ids"]) == "항구 시장"
