"""ELECTRA (replaced-token detection) against BERT (masked LM) at equal training compute.

    .venv/bin/python bench/bench_electra_vs_bert.py [--bert-steps 300] [--out DIR]
        [--pt-python .venv-pt/bin/python]

What it does, all through the real `tpu-payload` CLI (`train.backend: jax`):
1. One WordPiece tokenizer (vocabulary 2,000) trained on the bundled corpus
   (examples/corpus/*.txt), and the corpus encoded with it twice, once per objective (the
   same packing: [CLS] + 127 tokens, 128 per sequence).
2. BERT tiny (2 layers, 128 wide, 2 heads, intermediate 512) pre-trained for --bert-steps
   steps; ELECTRA whose discriminator has the same shape (embedding_size 128, so no
   projection) with the recipe's generator (generator_hidden_size 0.25: 32 wide, 1 head,
   intermediate 128), pre-trained for as many steps as the same training FLOPs buy. Same
   batch (32 x 128), learning rate (2e-3, 10% warm-up, linear decay), seed, held-out split.
3. The same fine-tuning task for both exports (BERT's export, ELECTRA's export/discriminator)
   and for the same BERT shape with random weights (the floor): a word-order task built
   deterministically from the bundled corpus (`order_task`): each sentence as written
   (label 1) or with its words in a seeded random order (label 0), split by document (a
   document's sentences are all in training or all in the test). A first version that
   swapped one pair of adjacent words was not learnt by any of the three in 3 epochs (test
   accuracy 0.51-0.55, training loss flat at 0.69), so it told nothing. Fine-tuning:
   AutoModelForSequenceClassification.from_pretrained in transformers 5 (PyTorch, the
   .venv-pt environment), the same settings for each, test accuracy reported.
   Why this task and not "are two sentences in their original order": the bundled
   corpus's sentences are drawn independently from templates, so the order of two of them
   carries no signal to learn; the order of words inside a sentence does.

How FLOPs are counted (`training_flops_per_step`): 6 x (matmul parameters a token goes
through) per token for each network's forward + backward pass (2 per multiply-add forward,
twice that backward), plus attention's score and value products, 6 x 2 x S x W per token
per layer; the MLM heads (dense + output projection) only at the masked slots (the
compiled step gathers them: data.max_predictions = 24 slots per 128-token sequence);
embedding lookups, LayerNorms, softmaxes, biases and the Gumbel sampling are not counted.
ELECTRA's step = the generator's (at every token) + its head at the masked slots + the
discriminator's (at every token) with its one-logit head at every token.

What it measures: these two tiny models, a few hundred steps on this machine's CPU, one
seed, one small synthetic task. It says nothing about ELECTRA's or BERT's quality at the
paper's scale. Figures are printed, not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_jax_loop import cli as _payload_cli  # tpu-payload in a child, errors fatal

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "examples" / "corpus"
SEQ, BATCH, VOCAB = 128, 32, 2000
TINY = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}
ELECTRA_CONFIG = {
    **TINY,
    "intermediate_size": 512,
    "embedding_size": 128,
    "generator_hidden_size": 0.25,
}
FINETUNE = {"epochs": 3, "batch": 32, "learning_rate": 5e-4, "max_length": 64, "seed": 0}


# ------------------------------------------------------------------ the fine-tuning task


def order_task(corpus: Path, seed: int = 0) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(train, test) examples (text, label): every sentence of the corpus with at least 4
    words, as written (1) or with its words shuffled (0, never the written order),
    alternately; documents (blank-line separated) 0-79 of each 100 train, 80-99 test."""
    rng = random.Random(seed)
    train: list[tuple[str, int]] = []
    test: list[tuple[str, int]] = []
    index = 0
    for path in sorted(corpus.glob("*.txt")):
        documents = [d for d in path.read_text(encoding="utf-8").split("\n\n") if d.strip()]
        for number, document in enumerate(documents):
            target = train if number % 100 < 80 else test
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join(document.split())):
                words = sentence.split()
                if len(words) < 4:
                    continue
                label = index % 2
                index += 1
                if label == 0:
                    shuffled = list(words)
                    while shuffled == words:
                        rng.shuffle(shuffled)
                    words = shuffled
                target.append((" ".join(words), label))
    return train, test


def finetune(model_dir: str, tokenizer_dir: str, out: str, random_init: bool) -> None:
    """In the PyTorch environment: fine-tune a sequence classifier from `model_dir` (or, with
    `random_init`, its config with fresh weights) on order_task; write its accuracy."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    torch.manual_seed(FINETUNE["seed"])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if random_init:
        config = AutoConfig.from_pretrained(model_dir, num_labels=2)
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    train, test = order_task(CORPUS)

    def encode(examples: list[tuple[str, int]]) -> tuple[dict, torch.Tensor]:
        texts = [t for t, _ in examples]
        batch = tokenizer(
            texts,
            padding="max_length",
            truncation=True,
            max_length=FINETUNE["max_length"],
            return_tensors="pt",
        )
        batch.pop("token_type_ids", None)
        return dict(batch), torch.tensor([label for _, label in examples])

    train_inputs, train_labels = encode(train)
    test_inputs, test_labels = encode(test)
    optimizer = torch.optim.AdamW(model.parameters(), lr=FINETUNE["learning_rate"])
    steps = FINETUNE["epochs"] * (len(train) // FINETUNE["batch"])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / steps))
    order = torch.Generator().manual_seed(FINETUNE["seed"])
    started = time.perf_counter()
    model.train()
    losses = []
    for _ in range(FINETUNE["epochs"]):
        permutation = torch.randperm(len(train), generator=order)
        for start in range(0, len(train) - FINETUNE["batch"] + 1, FINETUNE["batch"]):
            rows = permutation[start : start + FINETUNE["batch"]]
            loss = model(
                **{k: v[rows] for k, v in train_inputs.items()}, labels=train_labels[rows]
            ).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        logits = model(**test_inputs).logits
    accuracy = float((logits.argmax(-1) == test_labels).float().mean())
    result = {
        "accuracy": accuracy,
        "train_examples": len(train),
        "test_examples": len(test),
        "first_loss": losses[0],
        "last_loss": sum(losses[-10:]) / len(losses[-10:]),
        "seconds": time.perf_counter() - started,
    }
    Path(out).write_text(json.dumps(result))


# ------------------------------------------------------------------ FLOPs


def _encoder_matmuls(width: int, inner: int, layers: int) -> int:
    """Multiply-add weights a token goes through in a BERT/ELECTRA encoder stack."""
    return layers * (4 * width * width + 2 * width * inner)


def training_flops_per_step(family: str, config, tokens: int, slots: int) -> int:
    """Forward + backward FLOPs of one optimizer step (the module docstring's rule)."""
    from payload.model import configs as model_lib

    vocab, seq = config.vocab_size, SEQ
    if family == "bert":
        h = config.hidden_size
        body = _encoder_matmuls(h, config.intermediate_size, config.num_hidden_layers)
        attention = 2 * seq * h * config.num_hidden_layers
        head = h * h + h * vocab
        return 6 * tokens * (body + attention) + 6 * slots * head
    gen = model_lib.generator_config(config)
    e, h, g = config.embedding_size, config.hidden_size, gen.hidden_size
    disc = _encoder_matmuls(h, config.intermediate_size, config.num_hidden_layers)
    disc += (e * h if e != h else 0) + h * h + h  # projection, dense, dense_prediction
    disc += 2 * seq * h * config.num_hidden_layers
    generator = _encoder_matmuls(g, gen.intermediate_size, gen.num_hidden_layers)
    generator += (e * g if e != g else 0) + 2 * seq * g * gen.num_hidden_layers
    generator_head = g * e + e * vocab
    return 6 * tokens * (disc + generator) + 6 * slots * generator_head


# ------------------------------------------------------------------ the runs


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`tpu-payload ARGS` with this repository's payload (bench_jax_loop.cli)."""
    return _payload_cli(REPO, *args)


def job_document(root: Path, objective: str, steps: int) -> dict:
    family = "bert" if objective == "mlm" else "electra"
    model: dict = {"family": family, "size": "tiny"}
    if family == "electra":
        model["config"] = ELECTRA_CONFIG
    return {
        "name": f"bench-{family}",
        "output": str(root / family),
        "corpus": {"paths": [str(CORPUS / "*.txt")]},
        "tokenizer": {"kind": "wordpiece", "vocab_size": VOCAB, "min_frequency": 2},
        "data": {"objective": objective, "seq_length": SEQ, "records_per_shard": 500},
        "model": model,
        "train": {
            "steps": steps,
            "global_batch_size": BATCH,
            "learning_rate": 2e-3,
            "warmup_steps": max(1, steps // 10),
            "checkpoint_every": steps,
            "log_every": max(1, steps // 5),
            "eval_every": 0,
            "shuffle_buffer": 2000,
            "backend": "jax",
            "seed": 0,
        },
    }


def write(root: Path, document: dict) -> Path:
    import yaml

    path = root / f"{document['name']}.yaml"
    path.write_text(yaml.safe_dump(document, allow_unicode=True))
    return path


def train_summary(path: Path) -> dict:
    started = time.perf_counter()
    cli("train", "--job", str(path))
    seconds = time.perf_counter() - started
    from payload.spec import load_job

    job = load_job(str(path))
    status = json.loads(Path(job.paths.status).read_text())
    metrics = status["stages"]["train"]["metrics"]
    return {"seconds": seconds, **metrics}


def run_finetune(
    pt_python: str, model_dir: Path, tokenizer_dir: Path, out: Path, random_init: bool
):
    args = [pt_python, __file__, "--finetune", str(model_dir), str(tokenizer_dir), str(out)]
    if random_init:
        args.append("--random-init")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(args, capture_output=True, text=True, check=False, env=env)
    if result.returncode != 0:
        sys.exit(f"fine-tuning {model_dir} failed:\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bert-steps", type=int, default=300)
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir(), "bench-electra-vs-bert")))
    parser.add_argument(
        "--pt-python",
        default=os.environ.get("PAYLOAD_PT_PYTHON", str(REPO / ".venv-pt" / "bin" / "python")),
    )
    parser.add_argument("--finetune", nargs=3, metavar=("MODEL", "TOKENIZER", "OUT"))
    parser.add_argument("--random-init", action="store_true")
    args = parser.parse_args()
    if args.finetune:
        finetune(*args.finetune, random_init=args.random_init)
        return

    sys.path.insert(0, str(REPO))
    from payload.model import configs as model_lib
    from payload.schema.manifest import load_manifest, special_ids_of
    from payload.spec import load_job

    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    bert_path = write(root, job_document(root, "mlm", args.bert_steps))
    cli("tokenizer", "--job", str(bert_path))
    cli("encode", "--job", str(bert_path))
    bert_job = load_job(str(bert_path))
    manifest = load_manifest(bert_job.paths.data)
    tokens = BATCH * SEQ
    slots = BATCH * bert_job.data.max_predictions
    configs = {
        family: model_lib.build_config(
            family,
            "tiny",
            ELECTRA_CONFIG if family == "electra" else {},
            vocab_size=manifest.vocab_size,
            special_ids=special_ids_of(manifest),
        )
        for family in ("bert", "electra")
    }
    flops = {f: training_flops_per_step(f, c, tokens, slots) for f, c in configs.items()}
    budget = flops["bert"] * args.bert_steps
    electra_steps = budget // flops["electra"]

    electra_path = write(root, job_document(root, "rtd", electra_steps))
    electra_job = load_job(str(electra_path))
    shutil.copytree(bert_job.paths.tokenizer, electra_job.paths.tokenizer)  # the same one
    cli("encode", "--job", str(electra_path))

    runs = {"bert": train_summary(bert_path), "electra": train_summary(electra_path)}
    targets = {
        "BERT (MLM)": (Path(bert_job.paths.export), False),
        "ELECTRA discriminator (RTD)": (Path(electra_job.paths.export, "discriminator"), False),
        "BERT shape, random weights": (Path(bert_job.paths.export), True),
    }
    scores = {
        name: run_finetune(
            args.pt_python,
            directory,
            Path(bert_job.paths.export),
            root / f"finetune-{i}.json",
            random_init,
        )
        for i, (name, (directory, random_init)) in enumerate(targets.items())
    }

    print(f"corpus: {CORPUS}/*.txt, WordPiece {manifest.vocab_size:,}, "
          f"{manifest.total_records:,} training sequences of {SEQ}")  # fmt: skip
    print(f"pre-training, batch {BATCH} x {SEQ}, the same schedule shape and seed:")
    for family, steps in (("bert", args.bert_steps), ("electra", electra_steps)):
        run = runs[family]
        total = flops[family] * steps
        params = model_lib.parameter_count(family, configs[family])
        print(
            f"  {family:8s} {params:>9,} params  {flops[family] / 1e9:7.2f} GFLOP/step x "
            f"{steps:4d} steps = {total / 1e12:6.2f} TFLOP  {run['seconds']:6.1f} s wall  "
            f"final train loss {run['loss']:.3f}  held-out (generator's) MLM acc "
            f"{run.get('eval_accuracy', float('nan')):.3f}"
        )
    train_n = scores["BERT (MLM)"]["train_examples"]
    test_n = scores["BERT (MLM)"]["test_examples"]
    print(
        f"fine-tuning (word order, {train_n} train / {test_n} test sentences, "
        f"{FINETUNE['epochs']} epochs, batch {FINETUNE['batch']}, lr {FINETUNE['learning_rate']}):"
    )
    for name, score in scores.items():
        print(
            f"  {name:30s} test accuracy {score['accuracy']:.3f}  "
            f"(train loss {score['first_loss']:.3f} -> {score['last_loss']:.3f}, "
            f"{score['seconds']:.0f} s)"
        )


if __name__ == "__main__":
    main()
