"""Quiet by default: the CLI prints its own lines; the frameworks' logs only when asked.

Measured on a CPU-only machine (TensorFlow 2.20, transformers 4.57.6, `make demo`), the
frameworks print, between the CLI's lines:

- TensorFlow's C++ log (``2026-… E …cuda_platform.cc:51] failed call to cuInit …``, the XLA
  notices ``Ignoring Assert operator …`` and ``Using tf.random.uniform with XLA compilation
  will ignore seeds`` — the "seed warning" is this C++ line, not a Python warning). All obey
  ``TF_CPP_MIN_LOG_LEVEL``, read once when TensorFlow is imported; cuInit's ERROR line needs
  level 3 (``CUDA_VISIBLE_DEVICES`` empty or ``-1`` does not silence it: measured).
- Two lines from Abseil's C++ log, which ``TF_CPP_MIN_LOG_LEVEL=3`` does not hide (measured;
  Abseil's threshold is set through its C++ API, which TensorFlow does not expose to
  Python): ``WARNING: All log messages before absl::InitializeLog() is called are written
  to STDERR`` and ``I0000 … device_compiler.h:196] Compiled cluster using XLA! This line is
  logged at most once for the lifetime of the process``. Both come once per process, at the
  first XLA compilation, straight to file descriptor 2. So `absorb_once_only_logs` makes
  that first compilation the strategy's own one-op probe (``strategy.host_xla_available``,
  cached; on a GPU host, where the strategy would not probe, it is one extra tiny compile),
  run with fd 2 captured; what it printed is written back minus the framework lines. Only
  TensorFlow's import and that probe run in the window, so nothing of ours is held back,
  and an error there still shows its traceback. Abseil lines from other call sites (none on
  a CPU host) would still show.
- transformers' ``TensorFlow and JAX classes are deprecated …`` banner (``warning_once`` on
  the loggers of the modules below), and, where TensorFlow is not installed (the JAX VMs),
  its import-time notice ``None of PyTorch, TensorFlow >= 2.0, or Flax have been found.
  Models won't be available …`` (the export uses its tokenizer classes only): filtered by
  their exact text; other transformers warnings still show.

No Python ``warnings`` were seen, and none are filtered. A ``TF_CPP_MIN_LOG_LEVEL`` the
caller set is kept. With ``--verbose`` or ``TPU_PAYLOAD_VERBOSE=1`` none of the above is
done: TensorFlow logs at its own default level (INFO, or the caller's level) and every
line reaches the terminal or the journal; the VMs' systemd units set TPU_PAYLOAD_VERBOSE=1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator, MutableMapping

from payload.core.errors import UserError

VERBOSE_ENV = "TPU_PAYLOAD_VERBOSE"
_VERBOSE_VALUES = {"1": True, "0": False, "": False}

# TensorFlow's C++ log level when the caller set none: 3 keeps FATAL only. An error that
# stops the work reaches Python as an exception (its traceback shows); ERROR lines that stop
# nothing (cuInit's on a machine without a GPU) are hidden with the rest: --verbose shows them.
QUIET_TF_LOG_LEVEL = "3"

DEPRECATION_BANNER = "TensorFlow and JAX classes are deprecated"
NO_FRAMEWORK_NOTICE = "None of PyTorch, TensorFlow >= 2.0, or Flax have been found"
# The transformers modules that log the banner (grep of transformers 4.57.6).
_BANNER_LOGGERS = (
    "transformers.modeling_tf_utils",
    "transformers.tokenization_utils_base",
    "transformers.feature_extraction_utils",
    "transformers.pipelines.base",
)

# Framework log lines, as the C++ loggers format them:
#   TSL/TensorFlow: "2026-11-23 19:24:37.397764: W tensorflow/…/assert_op.cc:39] …"
#   Abseil:         "I0000 00:00:1795461877.705283   11436 device_compiler.h:196] …"
#                   (before absl::InitializeLog the date is 0000 and the time 00:00:<epoch>)
# plus Abseil's one-time notice. FATAL lines are never dropped.
FRAMEWORK_LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWE] \S+:\d+\]"
    r"|[IWE]\d{4} [\d:]+\.\d+ +\d+ \S+:\d+\]"
    r"|WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"
)

# Commands that import TensorFlow (and XLA-compile) in this process.
_TENSORFLOW_COMMANDS = ("train", "run")


def configure(flag: bool, environ: MutableMapping[str, str]) -> bool:
    """Whether the frameworks' logs are asked for (``--verbose`` or TPU_PAYLOAD_VERBOSE=1);
    when not, set their quiet defaults. Called by the CLI before anything imports TensorFlow
    or transformers."""
    raw = environ.get(VERBOSE_ENV, "")
    if raw.strip() not in _VERBOSE_VALUES:
        raise UserError(f"{VERBOSE_ENV}: {raw!r} must be 1 (the frameworks' logs) or 0 / unset")
    verbose = flag or _VERBOSE_VALUES[raw.strip()]
    if not verbose:
        environ.setdefault("TF_CPP_MIN_LOG_LEVEL", QUIET_TF_LOG_LEVEL)
        for name in _BANNER_LOGGERS:
            logging.getLogger(name).addFilter(_drop_deprecation_banner)
        # transformers/__init__.py logs it on its own logger (transformers 4.57.6).
        logging.getLogger("transformers").addFilter(_drop_no_framework_notice)
    return verbose


def absorb_once_only_logs(command: str, *, verbose: bool, backend: str = "tf") -> None:
    """For the commands that train (quiet only): import TensorFlow and run the strategy's XLA
    probe with fd 2 captured, so Abseil's two once-per-process lines are spent there. The
    JAX backend imports no TensorFlow: JAX (jaxlib's XLA, Abseil's logging) is imported the
    same way instead (and payload.backends.tf.strategy, which needs tf_keras, is not)."""
    if verbose or command not in _TENSORFLOW_COMMANDS:
        return
    with framework_lines_dropped():
        if backend == "jax":
            import jax  # noqa: F401, PLC0415

            return
        from payload.backends.tf import strategy  # noqa: PLC0415  (imports TensorFlow)

        # Not on a TPU VM: no op runs there before the strategy initialises the TPU system
        # (and those hosts run verbose under systemd anyway).
        if not strategy.tpu_present():
            strategy.host_xla_available()


def _drop_deprecation_banner(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(DEPRECATION_BANNER)


def _drop_no_framework_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(NO_FRAMEWORK_NOTICE)


@contextlib.contextmanager
def framework_lines_dropped(also: re.Pattern[str] | None = None) -> Iterator[None]:
    """Capture file descriptor 2 for the block; afterwards write back every line that is not
    a framework log line (`FRAMEWORK_LINE`, or one `also` matches), also when the block
    raises."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [
                line
                for line in captured.read().decode("utf-8", "replace").splitlines(keepends=True)
                if not FRAMEWORK_LINE.match(line) and not (also and also.search(line))
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
