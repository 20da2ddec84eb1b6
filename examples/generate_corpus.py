"""Seeded generator of the bundled Korean/English corpus (and of larger benchmark corpora).

Every sentence template and word list below was written for this project. The output is
plain UTF-8 text, one document per paragraph, documents separated by a blank line (the
corpus format described in payload/data/readers.py).

    python examples/generate_corpus.py                      # rewrites examples/corpus/mixed.txt
    python examples/generate_corpus.py --mb 50 --out /tmp/c.txt --seed 1
"""

from __future__ import annotations

import argparse
import itertools
import random
import re
from collections.abc import Iterator
from pathlib import Path

PEOPLE_EN = ["Mina", "Joon", "Sora", "Daniel", "Hana", "Priya", "Tomas", "Yuna", "Owen", "Jiho"]
PLACES_EN = [
    "the harbor market",
    "a small library in Daejeon",
    "the rooftop garden",
    "the night train to Busan",
    "a noisy lab on the fourth floor",
    "the riverside park",
    "an old bakery near the station",
    "the mountain trail above Jeonju",
]
THINGS_EN = [
    "a notebook full of sketches",
    "two cups of barley tea",
    "a broken umbrella",
    "the training logs from last night",
    "a bag of tangerines",
    "a map with the bus routes",
    "a tiny language model",
    "a box of old photographs",
]
VERBS_EN = ["carried", "found", "shared", "forgot", "repaired", "described", "borrowed", "sorted"]
TIMES_EN = [
    "early in the morning",
    "after the rain stopped",
    "just before midnight",
    "on a windy Sunday",
    "during the long lunch break",
    "while the kettle was heating",
]
FEELINGS_EN = ["calm", "curious", "tired but happy", "surprised", "restless", "hopeful"]
TOPICS_EN = [
    ("the tokenizer", "splits text into pieces that the model can count"),
    ("the learning rate", "decides how far each update moves the weights"),
    ("a checkpoint", "lets a preempted job continue where it stopped"),
    ("the manifest", "records how many sequences every shard holds"),
    ("masked language modeling", "hides a few tokens and asks the model to guess them"),
    ("a warm-up phase", "keeps the first updates small while statistics settle"),
    ("packing", "joins short documents so that no position is wasted on padding"),
    ("the input pipeline", "parses whole batches at once instead of single records"),
]
EN_TEMPLATES = [
    "{p} {v} {t} at {pl} {tm}.",
    "At {pl}, {p} felt {f} and {v} {t}.",
    "{tm}, {p} walked to {pl} with {t}.",
    "Nobody expected {p} to bring {t} to {pl}.",
    "{p} said that {topic} {why}.",
    "In the notes, {topic} {why}, and {p} underlined it twice.",
    "{p} and {p2} argued about whether {topic} really {why}.",
    "The sign at {pl} was written in Korean and English.",
    "{p} was {f} because {t} was still at {pl}.",
    "When {p2} arrived {tm}, {p} had already {v} {t}.",
]

PEOPLE_KO = ["민아", "준호", "소라", "하나", "지호", "유나", "서준", "다은", "태오", "예린"]
PLACES_KO = [
    "항구 시장",
    "대전의 작은 도서관",
    "옥상 정원",
    "부산행 밤기차",
    "사 층의 시끄러운 연구실",
    "강변 공원",
    "역 앞의 오래된 빵집",
    "전주 위쪽 산길",
]
THINGS_KO = [
    "스케치가 가득한 공책",
    "보리차 두 잔",
    "부러진 우산",
    "어젯밤의 학습 기록",
    "귤 한 봉지",
    "버스 노선이 그려진 지도",
    "작은 언어 모델",
    "오래된 사진 상자",
]
VERBS_KO = [
    "들고 왔다",
    "찾았다",
    "나누었다",
    "잊어버렸다",
    "고쳤다",
    "설명했다",
    "빌렸다",
    "정리했다",
]
TIMES_KO = [
    "이른 아침에",
    "비가 그친 뒤에",
    "자정 직전에",
    "바람 부는 일요일에",
    "긴 점심시간 동안",
    "주전자가 끓는 동안",
]
FEELINGS_KO = [
    "차분했다",
    "궁금했다",
    "피곤하지만 행복했다",
    "놀랐다",
    "들떠 있었다",
    "희망에 찼다",
]
TOPICS_KO = [
    ("토크나이저는", "글을 모델이 셀 수 있는 조각으로 나눈다"),
    ("학습률은", "한 번의 갱신이 가중치를 얼마나 움직일지 정한다"),
    ("체크포인트는", "중단된 작업이 멈춘 곳에서 다시 시작하게 해 준다"),
    ("매니페스트는", "각 샤드에 몇 개의 시퀀스가 있는지 기록한다"),
    ("마스크 언어 모델링은", "몇 개의 토큰을 가리고 모델에게 맞혀 보라고 한다"),
    ("워밍업 단계는", "통계가 자리 잡는 동안 처음 갱신을 작게 유지한다"),
    ("패킹은", "짧은 문서를 이어 붙여 패딩으로 낭비되는 자리가 없게 한다"),
    ("입력 파이프라인은", "레코드를 하나씩이 아니라 배치 단위로 해석한다"),
]
KO_TEMPLATES = [
    "{p}(는) {tm} {pl}에서 {t}(을) {v}.",
    "{pl}에서 {p}(는) {f}.",
    "{tm} {p}(는) {t}(을) 들고 {pl}까지 걸어갔다.",
    "{p}(가) {pl}에 {t}(을) 가져올 줄은 아무도 몰랐다.",
    "{p}의 말에 따르면 {topic} {why}.",
    "공책에는 {topic} {why}고 적혀 있었고, {p}(는) 그 줄에 두 번 밑줄을 그었다.",
    "{p}(와) {p2}(는) {topic} 정말로 {why}는지를 두고 오래 이야기했다.",
    "{pl}의 안내판은 한국어와 영어로 쓰여 있었다.",
    "{t}(이) 아직 {pl}에 있어서 {p}(는) {f}.",
    "{p2}(가) {tm} 도착했을 때 {p}(는) 이미 {t}(을) {v}.",
]
MIXED = [
    "{p_en} wrote in the margin: “{ko_sentence}”",
    "{ko_sentence} ({p_en} translated it as: {en_sentence})",
    "오늘의 메모 — {en_sentence}",
    "{en_sentence} 그리고 {ko_sentence}",
]


WORDS_EN = (
    TOPICS_EN,
    PEOPLE_EN,
    EN_TEMPLATES,
    PLACES_EN,
    THINGS_EN,
    VERBS_EN,
    TIMES_EN,
    FEELINGS_EN,
)
WORDS_KO = (
    TOPICS_KO,
    PEOPLE_KO,
    KO_TEMPLATES,
    PLACES_KO,
    THINGS_KO,
    VERBS_KO,
    TIMES_KO,
    FEELINGS_KO,
)


def _fill(rng: random.Random, words: tuple[list, ...]) -> str:
    """One sentence from a language's templates and word lists (draw order is fixed)."""
    topics, people, templates, places, things, verbs, times, feelings = words
    topic, why = rng.choice(topics)
    p, p2 = rng.sample(people, 2)
    return rng.choice(templates).format(
        p=p,
        p2=p2,
        pl=rng.choice(places),
        t=rng.choice(things),
        v=rng.choice(verbs),
        tm=rng.choice(times),
        f=rng.choice(feelings),
        topic=topic,
        why=why,
    )


def _en(rng: random.Random) -> str:
    text = _fill(rng, WORDS_EN)
    return text[0].upper() + text[1:]


PARTICLES = {"은": "은는", "는": "은는", "이": "이가", "가": "이가", "을": "을를", "를": "을를"}
PARTICLES |= {"과": "과와", "와": "과와"}
_PARTICLE = re.compile(r"(\S)\((은|는|이|가|을|를|과|와)\)")


def _has_final_consonant(syllable: str) -> bool:
    code = ord(syllable) - 0xAC00
    return 0 <= code < 11172 and code % 28 != 0


def _particles(text: str) -> str:
    """Pick 은/는, 이/가, 을/를, 과/와 by whether the previous syllable ends in a consonant."""

    def pick(match: re.Match[str]) -> str:
        before, marked = match.groups()
        with_final, without_final = PARTICLES[marked]
        return before + (with_final if _has_final_consonant(before) else without_final)

    return _PARTICLE.sub(pick, text)


def _ko(rng: random.Random) -> str:
    return _particles(_fill(rng, WORDS_KO))


LATIN_SYLLABLES = [
    c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")
]
HANGUL_SYLLABLES = [chr(0xAC00 + i) for i in range(0, 11172, 13)]


def lexicon(seed: int, size: int = 60_000) -> list[str]:
    """Made-up words (Latin and Hangul syllables), for corpora with a realistic vocabulary."""
    rng = random.Random(seed)  # noqa: S311  (reproducible text, not security)
    words: dict[str, None] = {}
    while len(words) < size:
        syllables = HANGUL_SYLLABLES if rng.random() < 0.4 else LATIN_SYLLABLES
        words["".join(rng.choices(syllables, k=rng.randint(1, 4)))] = None
    return list(words)


def documents(seed: int, *, rich: bool = False) -> Iterator[str]:
    """An endless, deterministic stream of documents (paragraphs of 2-8 sentences).

    ``rich`` appends clauses of Zipf-distributed made-up words to sentences, so a tokenizer
    trained on the text needs tens of thousands of pieces (benchmarks).
    """
    rng = random.Random(seed)  # noqa: S311  (reproducible text, not security)
    words = lexicon(seed) if rich else []
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(words))))
    while True:
        kind = rng.random()
        sentences = []
        for _ in range(rng.randint(2, 8)):
            if kind < 0.4:
                sentences.append(_en(rng))
            elif kind < 0.8:
                sentences.append(_ko(rng))
            else:
                sentences.append(
                    rng.choice(MIXED).format(
                        p_en=rng.choice(PEOPLE_EN), ko_sentence=_ko(rng), en_sentence=_en(rng)
                    )
                )
        if rich:
            sentences = [
                s
                + " "
                + " ".join(rng.choices(words, cum_weights=cum_weights, k=rng.randint(3, 12)))
                for s in sentences
            ]
        # Some documents keep one sentence per line, others are a single long line.
        yield ("\n" if rng.random() < 0.3 else " ").join(sentences)


def write_corpus(path: Path, size_bytes: int, seed: int = 0, *, rich: bool = False) -> int:
    """Write documents until the file reaches ``size_bytes``; returns the document count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    written = count = 0
    with path.open("w", encoding="utf-8") as out:
        for doc in documents(seed, rich=rich):
            data = doc + "\n\n"
            out.write(data)
            written += len(data.encode("utf-8"))
            count += 1
            if written >= size_bytes:
                return count
    return count  # pragma: no cover - the generator is endless


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=0.25, help="size in MB (default 0.25)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rich", action="store_true", help="add Zipf-distributed made-up words")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "corpus" / "mixed.txt"
    )
    args = parser.parse_args()
    docs = write_corpus(args.out, int(args.mb * 1e6), args.seed, rich=args.rich)
    print(f"wrote {docs} documents to {args.out}")


if __name__ == "__main__":
    main()
