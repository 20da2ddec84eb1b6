"""The encode stage on Apache Beam's local runner vs the local encoder, same ~50 MB, same bytes.

    .venv/bin/python bench/bench_encode_beam.py              # 50 MB, 2 workers each
    .venv/bin/python bench/bench_encode_beam.py --mb 5       # a quick run
    PAYLOAD_BEAM_PYTHON=/path/to/python bench/bench_encode_beam.py   # another Beam environment

The corpus is made in a temp directory from the bundled corpus (examples/corpus) by
repetition with variations: copy k of every document has its words rotated by k and a
"(copy k)" line, so every document is new text (its own held-out draw, its own tokens).
A WordPiece tokenizer (vocab 8,000) is trained on the bundled corpus, then the same job
(seq_length 128, held-out split 1%) is encoded twice, each as `python -m payload encode`
in a fresh process, timed around the whole command:

* local: data.runner local, data.workers = --workers (the payload environment, .venv);
* beam: data.runner beam, Beam's FnApiRunner with data.beam.workers = --workers processes
  (the Beam environment, .venv-beam: `make venv-beam`).

Both commands also run on a tiny corpus (one small file) to show the fixed cost of each
(process start, imports, a pipeline's setup). Every shard and the manifest are compared byte
for byte. Figures are printed, not asserted; the machine's other load shows in them.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 3600


def write_corpus(source: Path, out: Path, megabytes: float) -> int:
    """Copies of the bundled corpus's documents, each copy varied; returns bytes written."""
    documents = []
    for path in sorted(source.glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        documents += [d.strip() for d in re.split(r"\n\s*\n", text) if d.strip()]
    out.mkdir(parents=True, exist_ok=True)
    written = copy = 0
    target = int(megabytes * 1e6)
    file_bytes = 4_000_000  # several files, several groups each
    handle = None
    while written < target:
        copy += 1
        for document in documents:
            if handle is None or handle.tell() >= file_bytes:
                if handle is not None:
                    handle.close()
                handle = (out / f"part-{written // file_bytes:04d}.txt").open("w", encoding="utf-8")
            words = document.split(" ")
            k = copy % max(len(words), 1)
            varied = " ".join(words[k:] + words[:k])
            data = f"(copy {copy})\n{varied}\n\n"
            handle.write(data)
            written += len(data.encode("utf-8"))
            if written >= target:
                break
    if handle is not None:
        handle.close()
    return written


def write_job(root: Path, corpus: Path, workers: int, runner: str) -> Path:
    data: dict = {
        "objective": "mlm",
        "seq_length": 128,
        "records_per_shard": 10000,
        "eval_fraction": 0.01,
        "workers": workers,
        "runner": runner,
    }
    if runner == "beam":
        data["beam"] = {"workers": workers}
    document = {
        "name": f"bench-{runner}",
        "output": str(root / "out"),
        "corpus": {"paths": [str(corpus)]},
        "tokenizer": {"kind": "wordpiece", "vocab_size": 8000},
        "data": data,
        "model": {"family": "bert"},
        "train": {"steps": 1},
    }
    root.mkdir(parents=True, exist_ok=True)
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def encode(python: Path, job: Path, tokenizer_dir: Path) -> float:
    """Seconds of `python -m payload encode --job job` (tokenizer copied in first)."""
    out = job.parent / "out"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(tokenizer_dir, out / "tokenizer")
    started = time.perf_counter()
    result = subprocess.run(
        [str(python), "-m", "payload", "encode", "--job", str(job)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"encode failed ({python}):\n{result.stderr[-3000:]}")
    return seconds


def digests(data_dir: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(data_dir.iterdir())
        if p.name != "stage.json"
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=50.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    beam_python = Path(
        os.environ.get("PAYLOAD_BEAM_PYTHON") or REPO / ".venv-beam" / "bin" / "python"
    )
    if not beam_python.exists():
        raise SystemExit(f"no Beam environment at {beam_python}: `make venv-beam`")
    local_python = Path(sys.executable)

    sys.path.insert(0, str(REPO))
    from payload import spec
    from payload.core.status import StatusWriter
    from payload.data import tokenizer
    from payload.schema import manifest as mf

    with tempfile.TemporaryDirectory(prefix="bench-beam-") as tmp:
        root = Path(tmp)
        size = write_corpus(REPO / "examples" / "corpus", root / "corpus", args.mb)
        tiny = root / "tiny"
        tiny.mkdir()
        shutil.copy(REPO / "examples" / "corpus" / "mixed.txt", tiny / "mixed.txt")
        print(f"corpus: {size / 1e6:.1f} MB in {len(list((root / 'corpus').iterdir()))} files")

        tok_job = spec.load_job(
            str(write_job(root / "tok", REPO / "examples" / "corpus", 1, "local"))
        )
        tokenizer.train_tokenizer(tok_job, StatusWriter(tok_job.paths.status, "tok"))
        tokenizer_dir = Path(tok_job.paths.tokenizer)

        figures = {}
        for runner, python in (("local", local_python), ("beam", beam_python)):
            fixed = encode(python, write_job(root / f"{runner}-tiny", tiny, args.workers, runner),
                           tokenizer_dir)  # fmt: skip
            job = write_job(root / runner, root / "corpus", args.workers, runner)
            seconds = encode(python, job, tokenizer_dir)
            figures[runner] = (fixed, seconds, job.parent / "out" / "data")
            print(f"{runner:5s}: {seconds:7.1f} s (tiny corpus: {fixed:.1f} s)", flush=True)

        local_dir, beam_dir = figures["local"][2], figures["beam"][2]
        same = digests(local_dir) == digests(beam_dir)
        manifest = mf.load_manifest(str(local_dir))
        tokens = manifest.corpus["used_tokens"]
        local_s, beam_s = figures["local"][1], figures["beam"][1]
        print(f"tokens: {tokens:,} ({manifest.total_records:,} sequences + "
              f"{manifest.eval_records:,} held out, {len(manifest.shards)} shards)")  # fmt: skip
        for runner, (fixed, seconds, _) in figures.items():
            print(
                f"{runner:5s}: {tokens / seconds / 1e3:7.0f}k tokens/s, "
                f"{size / seconds / 1e6:5.2f} MB/s, fixed cost {fixed:.1f} s"
            )
        print(f"beam / local time: {beam_s / local_s:.2f}x; Beam overhead "
              f"{beam_s - local_s:+.1f} s on {size / 1e6:.0f} MB "
              f"({(beam_s - local_s) / local_s * 100:+.0f}%), of which fixed "
              f"{figures['beam'][0] - figures['local'][0]:+.1f} s")  # fmt: skip
        print(f"shards and manifest byte-identical: {same} "
              f"({len(digests(local_dir))} files)")  # fmt: skip
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
