"""The status page in a real headless Chromium (Debian's `chromium`; `make test` installs it,
.ci/run too), rendered from a real local run: tokenizer -> encode -> train (the JAX backend,
a tiny GPT-2) through the real CLI, whose chief writes status.html as it goes, with the
history, goodput, ETA and events it recorded itself; then the watchdog's status, which no
local run writes (page_helpers.write_watch_status: a preemption and a restart), and
`tpu-payload page --run`.

The page is screenshotted at 1280x800 (kept as build/test-artifacts/status-page-1280x800.png,
and in the test's tmp directory), and Chromium's DOM (--dump-dom) has the four plots and the
same step, loss, ETA and goodput as status.json. Chromium runs headless with a throwaway
profile, no network (every request goes to a closed port on 127.0.0.1; the page asks for none:
its CSP forbids it), bounded by a timeout."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from page_helpers import write_watch_status
from PIL import Image
from train_helpers import job_document, run_cli, write_corpus, write_job

from payload.training import page

REPO = Path(__file__).resolve().parents[2]
ARTIFACT = REPO / "build" / "test-artifacts" / "status-page-1280x800.png"
CHROMIUM_TIMEOUT_S = 120
PLOTS = ("plot-loss", "plot-throughput", "plot-goodput", "plot-timeline")


def chromium() -> str:
    found = shutil.which("chromium")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: .ci/run and `make test` install it")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return found


def run_chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            binary,
            "--headless",
            "--no-sandbox",  # as root (CI); the page runs no script and fetches nothing
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-default-apps",
            "--dns-prefetch-disable",
            "--proxy-server=127.0.0.1:9",
            f"--user-data-dir={profile}",
            "--window-size=1280,800",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=CHROMIUM_TIMEOUT_S,
        check=False,
    )


class Dom(HTMLParser):
    """Each element's id -> (tag, its attributes, its text), from Chromium's serialised DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: dict[str, tuple[str, dict[str, str | None], list[str]]] = {}
        self._open: list[list[str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        text: list[str] = []
        if attributes.get("id"):
            self.elements[str(attributes["id"])] = (tag, attributes, text)
        self._open.append(text)

    def handle_endtag(self, tag: str) -> None:
        if self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        if self._open:
            self._open[-1].append(data)

    def text(self, element_id: str) -> str:
        return "".join(self.elements[element_id][2]).strip()


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A real run's root and its log (the CLI's stdout and stderr)."""
    tmp = tmp_path_factory.mktemp("status-page")
    corpus = write_corpus(tmp / "corpus.txt", lines=400)
    doc = job_document(
        tmp, corpus, "clm", "gpt2", steps=12, checkpoint_every=6, log_every=3, eval_every=6,
        backend="jax",
    )  # fmt: skip
    doc["data"].update(eval_fraction=0.1, eval_min_sequences=16)
    doc["grant_ends"] = "2099-12-31"
    job = write_job(tmp, doc)
    result = run_cli("run", "--job", str(tmp / "job.yaml"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return Path(job.paths.root), result.stdout + result.stderr


def test_the_trainer_wrote_the_page_as_it_went(real_run: tuple[Path, str]) -> None:
    root, _ = real_run
    status = json.loads((root / "status.json").read_text())
    markup = (root / "status.html").read_text()
    assert f'content="{page.CSP}"' in markup and "<script" not in markup.lower()
    assert re.search(r'id="state">complete<', markup), markup[:2000]
    step = status["stages"]["train"]["metrics"]["step"]
    assert f'id="step" data-value="{step}"' in markup


def test_the_page_in_chromium_matches_status_json(
    real_run: tuple[Path, str], tmp_path: Path
) -> None:
    binary = chromium()
    root, log = real_run
    status = json.loads((root / "status.json").read_text())  # what the run wrote itself
    assert [p[0] for p in status["history"]["train"]] == [3, 6, 9, 12], log[-3000:]
    assert [p[0] for p in status["history"]["eval"]] == [6, 12], log[-3000:]
    assert status["history"]["tokens_per_s"], log[-3000:]
    assert status["eta"]["tokens_done"] == status["eta"]["tokens_total"] == 12 * 16 * 32
    assert [s["end"] for s in status["goodput"]["starts"]] == ["finished"]
    assert [e["event"] for e in status["events"]] == ["finished"]
    write_watch_status(root)
    written = run_cli("page", "--run", str(root), timeout=300)
    assert written.returncode == 0, written.stderr
    url = (root / "status.html").as_uri()

    shot = tmp_path / "status-page-1280x800.png"
    taken = run_chromium(binary, tmp_path / "profile-shot", f"--screenshot={shot}", url)
    assert shot.exists(), taken.stderr[-3000:]
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, ARTIFACT)
    with Image.open(shot) as image:
        assert image.size == (1280, 800)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
    # A drawn page, not a blank or an error page: many colours (antialiased lines and text).
    assert colours is None or len(colours) > 200, f"{len(colours or [])} colours in {shot}"

    dumped = run_chromium(binary, tmp_path / "profile-dom", "--dump-dom", url)
    assert dumped.returncode == 0, dumped.stderr[-3000:]
    dom = Dom()
    dom.feed(dumped.stdout)
    for plot in PLOTS:
        assert plot in dom.elements, f"no {plot} in Chromium's DOM"
        assert dom.elements[plot][0] == "svg", dom.elements[plot]
    assert re.search(r'<svg [^>]*id="plot-loss"[\s\S]*?<path', dumped.stdout), "no lines"

    metrics: dict[str, Any] = status["metrics"] if "step" in status["metrics"] else (
        status["stages"]["train"]["metrics"]
    )  # fmt: skip
    assert dom.text("step") == str(metrics["step"])
    assert dom.elements["loss"][1]["data-value"] == str(metrics["loss"])
    assert dom.text("loss") == f"{metrics['loss']:.4f}"
    assert dom.elements["eta"][1]["data-value"] == status["eta"]["eta"]
    assert dom.text("eta") == page.utc(status["eta"]["eta"])
    assert dom.elements["grant-ends"][1]["data-value"] == "2100-01-01T00:00:00Z"
    assert "eta-warning" not in dom.elements  # the ETA is well before the grant's end
    assert dom.text("state") == status["state"]
    titles = dict(re.findall(r'id="(plot-[a-z]+)-card"><h2>([^<]*)</h2>', dumped.stdout))
    goodput = f"goodput {100 * status['goodput']['goodput']:.1f} %"
    assert titles["plot-goodput"].startswith(goodput), titles
    assert titles["plot-timeline"].endswith(": 1 start"), titles
    # The timeline names the preemption and the restart the watchdog reported.
    events = dumped.stdout.split('id="events"', 1)[1]
    assert "preempted" in events and "recreated" in events  # the watchdog's
    assert "finished" in events  # the trainer's own
