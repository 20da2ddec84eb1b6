"""Which attention implementation a job's model gets, as data: the one table that the JAX
backend's `attention.choose` (what the trainer runs) and the plan (`payload/plan/estimate.py`: what
a job is sized for, before anything exists) both read.

Framework-free, standard library only: the plan runs in the Pulumi program's environment,
which has no JAX (tests/infra/test_jobfit.py checks its import closure).

A case is (platform, chip, compute dtype, head sizes, mask, attention dropout, sequence
length). `kernel_of` names the kernel a chip has (cuDNN flash attention on NVIDIA GPUs,
Pallas splash attention on TPUs, none elsewhere); REQUIREMENTS lists what each kernel needs
of a case, each row with its source; `select` returns the kernel, or XLA's reference with
the first requirement the case misses. `train.precision: auto` computes in bfloat16 where
the chip does natively (`native_bf16`: TPUs, NVIDIA compute capability 8.0+), so `auto`
reaches a kernel there.

Sources (read 2026-11): jax 0.10.2 jax/_src/cudnn/fused_attention_stablehlo.py
(`check_layout`: query fp16/bf16/fp8 only; `check_is_flash_attention`: head size a multiple
of 8, at most 128, 256 from compute capability 9.0; a bias in training needs even sequence
lengths; `check_cudnn_version`: "cuDNN is not detected" without CUDA's cuDNN); cuDNN's
frontend attention page (SDPA on SM80 and newer, fp16/bf16); jax 0.10.2
jax/experimental/pallas/ops/tpu/splash_attention/splash_attention_kernel.py (blocks are
multiples of NUM_LANES = 128) and splash_attention_mask_info.py `process_mask` (a block
that does not divide the sequence raises); MaxText's blocks of 512 (configs/base.yml
`sa_block_*`, capped at the sequence length by attention_op.py `create_sa_config`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from payload.core.errors import SpecError

SETTINGS = ("auto", "fused", "reference")  # train.attention
IMPLEMENTATIONS = ("reference", "cudnn", "splash")
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MIN_CAPABILITY = (8, 0)
SPLASH_LANES = 128
SPLASH_BLOCK = 512


@dataclass(frozen=True)
class Chip:
    """What attention and precision depend on in an accelerator: its platform (tpu | gpu |
    cpu), a GPU's vendor (nvidia | amd; "" unknown) and an NVIDIA GPU's compute capability."""

    platform: str
    vendor: str = ""
    capability: tuple[int, int] | None = None
    name: str = ""

    def describe(self) -> str:
        if self.platform != "gpu":
            return self.name or self.platform
        what = self.name or f"{self.vendor or 'unknown'} GPU"
        if self.capability is not None:
            what += f" (compute capability {self.capability[0]}.{self.capability[1]})"
        return what


CPU = Chip("cpu")


def parse_capability(text: object) -> tuple[int, int] | None:
    """An NVIDIA compute capability ("9.0", 8.9, (8, 0)) as (major, minor), else None."""
    if isinstance(text, tuple) and len(text) == 2:
        return int(text[0]), int(text[1])
    parts = str(text or "").strip().split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def device_chip(
    platform: str, platform_version: str, device_kind: str, compute_capability: object
) -> Chip:
    """The chip of a JAX device from its attributes: `platform` (tpu, gpu, cuda, rocm, cpu),
    its client's `platform_version` (CUDA's says "cuda ...", ROCm's "rocm ...": jax's own
    test_util.is_device_rocm reads it so), `device_kind` and `compute_capability`."""
    version = platform_version.lower()
    if platform in ("gpu", "cuda", "rocm"):
        vendor = (
            "amd"
            if platform == "rocm" or "rocm" in version
            else "nvidia"
            if platform == "cuda" or "cuda" in version
            else ""
        )
        capability = parse_capability(compute_capability) if vendor == "nvidia" else None
        return Chip("gpu", vendor, capability, device_kind)
    return Chip(platform, name=device_kind)


def native_bf16(chip: Chip) -> bool:
    """Whether the chip computes bfloat16 natively: every TPU, NVIDIA GPUs of compute
    capability 8.0 (Ampere) and newer. `train.precision: auto` trains in mixed bfloat16
    there and in float32 elsewhere (the JAX backend has no float16 policy)."""
    if chip.platform == "tpu":
        return True
    return chip.vendor == "nvidia" and (chip.capability or (0, 0)) >= CUDNN_MIN_CAPABILITY


def compute_dtype(precision: str, chip: Chip) -> str:
    """The compute dtype of `train.precision` (auto | bf16 | fp32) on `chip`."""
    if precision == "bf16" or (precision == "auto" and native_bf16(chip)):
        return "bfloat16"
    return "float32"


def splash_block(seq_length: int) -> int | None:
    """Splash's block for a sequence: the largest multiple of 128 up to 512 that divides it
    (S = 640: 128, 768: 384, 1280: 256, 2048: 512); None where none does."""
    for block in range(SPLASH_BLOCK, 0, -SPLASH_LANES):
        if seq_length % block == 0:
            return block
    return None


@dataclass(frozen=True)
class Case:
    """One model's attention on one chip: `documents` is data.document_mask (a token reads
    its own packed document only), else each row's padding mask."""

    chip: Chip
    dtype: str
    head_sizes: tuple[int, ...]
    dropout: float
    seq_length: int
    documents: bool = False


@dataclass(frozen=True)
class Requirement:
    """What `kernel` needs of a case: `obstacle` says why a case fails it (None: it passes);
    `short` names it in the docs' tables."""

    kernel: str  # cudnn | splash | any
    needs: str
    short: str
    source: str
    obstacle: Callable[[Case], str | None]


def _dropout(case: Case) -> str | None:
    if case.dropout <= 0:
        return None
    return (
        f"the model's attention dropout {case.dropout:g} needs the attention probabilities, "
        "which a fused kernel never holds (set it to 0 in model.config for the kernel)"
    )


def _capability(case: Case) -> str | None:
    have = case.chip.capability
    if have is not None and have >= CUDNN_MIN_CAPABILITY:
        return None
    told = "unknown" if have is None else f"{have[0]}.{have[1]}"
    return (
        f"cuDNN flash attention needs an NVIDIA GPU of compute capability 8.0 or newer; "
        f"{case.chip.describe()} has {told}"
    )


def _dtype(case: Case) -> str | None:
    if case.dtype in CUDNN_DTYPES:
        return None
    return (
        f"cuDNN flash attention takes bfloat16/float16 only, this run computes in "
        f"{case.dtype} (train.precision: bf16 for the kernel)"
    )


def cudnn_max_head(chip: Chip) -> int:
    return 256 if (chip.capability or (0, 0)) >= (9, 0) else 128


def _heads(case: Case) -> str | None:
    most = cudnn_max_head(case.chip)
    if all(h % 8 == 0 and h <= most for h in case.head_sizes):
        return None
    return (
        f"cuDNN flash attention takes head sizes that are multiples of 8 up to {most} on "
        f"this GPU, this model's are {list(case.head_sizes)}"
    )


def _even(case: Case) -> str | None:
    if not case.documents or case.seq_length % 2 == 0:
        return None
    return (
        "cuDNN flash attention takes data.document_mask as a bias, which training accepts "
        f"for even sequence lengths only; data.seq_length is {case.seq_length}"
    )


def _blocks(case: Case) -> str | None:
    if splash_block(case.seq_length) is not None:
        return None
    return (
        f"splash attention tiles the sequence in blocks of a multiple of {SPLASH_LANES} "
        f"tokens; data.seq_length {case.seq_length} is not a multiple of {SPLASH_LANES}"
    )


_JAX = "jax 0.10.2 jax/_src/cudnn/fused_attention_stablehlo.py"
REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement("any", "no attention dropout", "dropout",
                "splash has no dropout; jax.nn.dot_product_attention exposes none", _dropout),
    Requirement("cudnn", "NVIDIA compute capability 8.0 or newer", "compute capability",
                "cuDNN frontend attention support matrix (SM80+)", _capability),
    Requirement("cudnn", "bfloat16 or float16", "dtype", f"{_JAX} check_layout", _dtype),
    Requirement("cudnn", "head sizes multiples of 8, up to 128 (256 from compute capability 9.0)",
                "head size", f"{_JAX} check_is_flash_attention", _heads),
    Requirement("cudnn", "with data.document_mask: an even sequence length", "odd sequence",
                f"{_JAX} check_is_flash_attention (a bias in training)", _even),
    Requirement("splash", "a sequence length that is a multiple of 128 (its block: the "
                "largest multiple of 128 up to 512 dividing it)", "sequence",
                "splash_attention_kernel.py NUM_LANES, mask_info.py process_mask", _blocks),
)  # fmt: skip


def kernel_of(chip: Chip) -> tuple[str | None, str]:
    """(the chip's fused kernel or None, why none)."""
    if chip.platform == "tpu":
        return "splash", ""
    if chip.platform == "gpu" and chip.vendor == "nvidia":
        return "cudnn", ""
    if chip.platform == "gpu":
        vendor = "an AMD (ROCm)" if chip.vendor == "amd" else "a non-NVIDIA"
        return None, (
            f"{chip.describe()} is {vendor} GPU; jax.nn.dot_product_attention's cuDNN "
            "kernel is NVIDIA's"
        )
    return None, (
        f"{chip.platform} has no fused attention kernel (cuDNN on NVIDIA GPUs, splash on TPUs)"
    )


def obstacle(case: Case) -> tuple[str | None, str | None, str]:
    """(the chip's kernel, the first requirement the case misses in words or None, its
    short name)."""
    kernel, missing = kernel_of(case.chip)
    if kernel is None:
        return None, missing, "no kernel"
    for row in REQUIREMENTS:
        if row.kernel in ("any", kernel):
            why = row.obstacle(case)
            if why is not None:
                return kernel, why, row.short
    return kernel, None, ""


@dataclass(frozen=True)
class Choice:
    """The implementation of a case, why, splash's block, and (`auto` keeping the reference
    on an accelerator) the one warning line the trainer logs and puts in status.json."""

    implementation: str
    reason: str
    block: int = 0
    warning: str = ""


def select(setting: str, case: Case) -> Choice:
    """`train.attention: setting` for a case: `reference` always; `auto` the chip's kernel
    where the case meets its requirements, else the reference (a warning on an
    accelerator); `fused` the kernel or a one-line SpecError."""
    if setting not in SETTINGS:
        raise SpecError(f"train.attention: {setting!r} is not one of {', '.join(SETTINGS)}")
    if setting == "reference":
        return Choice("reference", "train.attention: reference")
    kernel, why, _ = obstacle(case)
    if kernel is not None and why is None:
        block = (splash_block(case.seq_length) or 0) if kernel == "splash" else 0
        return Choice(kernel, f"train.attention: {setting} on {case.chip.describe()}", block)
    if setting == "fused":
        raise SpecError(f"train.attention: fused: {why}; use train.attention: auto or reference")
    warning = ""
    if case.chip.platform != "cpu":
        warning = (
            f"train.attention: auto runs XLA's reference attention on {case.chip.describe()} "
            f"(slower, [S, S] scores in memory): {why}"
        )
    return Choice("reference", f"auto: {why}", warning=warning)
