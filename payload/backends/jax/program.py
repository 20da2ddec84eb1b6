"""The trainer's programs, built from a mesh of real or abstract devices: the one builder.

    rt = runtime.runtime(precision, sharding, parameters)        # real devices (the trainer)
    rt = runtime.runtime_of(facts, topology_devices, ...)          # a TPU type (aot.py)
    programs = program.build(job, config, rt, seq_length=S, eval_batch=B or None)
    programs.train_chunk()(state, batches, n)   # jax.stages.Compiled, compiled on first use
    programs.eval_sums()(trainable, non_trainable, batch, index, totals)

`build` takes the job, the model's config (payload/model/configs.py build_config), a Runtime (the
mesh over real devices or a TPU topology's compile-only devices, and the explicit facts
runtime.Facts: platform, chip kind, device memory, precision) and returns the LOWERED
training chunk (steps.make_train_chunk: the trainer's attention, loss, donation, state
shardings and dtype policy) and held-out evaluation step (evaluate.make_eval_sums). The
trainer (train.py), `tpu-payload compile` (aot.py) and the benchmarks call it alike; the
trainer then runs the very executables compiled from it (a jax.stages.Compiled refuses an
argument of another shape, dtype or sharding: the real state and batches are checked
against these specifications at every call).

Nothing here queries a device (jax.devices, memory_stats, jax.device_count) or puts an
array on the mesh:
- the model and AdamW are Keras objects without values: created in a keras.StatelessScope,
  where Keras creates every variable with an initializer uninitialised (its shape, dtype and
  path only), and taken out of Keras' list of variables to initialise later. AdamW's own
  step counter is the exception Keras makes: its constructor creates it from the literal 0
  (keras/src/optimizers/base_optimizer.py), so the optimizer is constructed outside the
  scope and outside the mesh (a 4-byte scalar on the host's default device, never read: the
  program takes the counter as an argument);
- the state is a steps.TrainState of jax.ShapeDtypeStructs whose shardings are the
  trainer's: mesh.partition_spec of each variable's path and shape, the rule by which the
  trainer's Keras distribution (mesh.sharded_distribution) creates its variables;
- the batches are ShapeDtypeStructs of the input pipeline's features (FEATURES: the names
  and dtypes payload/backends/tf/masking.py documents) split over the mesh's batch axes
  (mesh.batch_sharding), for the training chunk's [steps_per_execution, B, ...] and the
  held-out batch [B, ...];
- the loss's chunks are sized by the mesh (steps.chunked_loss_terms takes the model's mesh),
  not by the devices this process sees, and by the facts' device memory (model.py
  loss_chunk_budget), not by a device queried here.
`fingerprints` are the SHA-256 of the lowered programs' text: the trainer logs them and
`tpu-payload compile --json` prints them, so a run shows it compiled what `compile` did.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import keras
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from payload.backends.jax import attention as attention_lib
from payload.backends.jax import compile_cache, models, steps
from payload.backends.jax import evaluate as jax_evaluate
from payload.backends.jax import mesh as mesh_lib
from payload.backends.jax.schedule import create_optimizer
from payload.core.errors import SpecError

if TYPE_CHECKING:
    from payload.backends.jax.runtime import Runtime
    from payload.spec import JobSpec

# The input pipeline's features per objective (payload/backends/tf/masking.py's table): name, dtype,
# and whether the second axis is the sequence ("seq") or the masked slots ("pred").
_CLM = (
    ("input_ids", "int32", "seq"),
    ("attention_mask", "int32", "seq"),
    ("labels", "int32", "seq"),
    ("label_weights", "float32", "seq"),
)
_MASKED = (
    ("input_ids", "int32", "seq"),
    ("attention_mask", "int32", "seq"),
    ("masked_lm_positions", "int32", "pred"),
    ("masked_lm_ids", "int32", "pred"),
    ("masked_lm_weights", "float32", "pred"),
)
FEATURES = {"clm": _CLM, "mlm": _MASKED, "rtd": _MASKED}

# XLA:CPU runs the weight gradients' dots (dW = X^T dY, contracting the batch's tokens) on
# Eigen: YNNPACK, which takes the other dots, does not take an operand contracted along its
# major dimension. XLA's oneDNN rewrite (its CPU compiler's option below) runs them as oneDNN
# matmuls: on this repository's 2-core AVX-512 CPU a 512 x 128 gradient over 4,096 tokens
# 5.1-5.7 -> 2.7-3.4 ms, and the tiny BERT job of bench/bench_backends.py 6.1-6.9 -> 7.3-8.2
# steps/s (four pairs; docs/performance.md), held-out loss unchanged. Training chunk only
# (the evaluation step has no weight gradients), CPU only (no such option elsewhere).
# XLA:CPU cannot serialize an executable with oneDNN custom calls (jaxlib 0.12.0.1: "MemoryError:
# std::bad_alloc"), so that chunk is never written to JAX's persistent compilation cache;
# CPU_ONEDNN_ENV=0 compiles it without oneDNN, cacheable (the restart test of the cache).
CPU_TRAIN_OPTIONS = {"xla_cpu_experimental_onednn_custom_call": True}
CPU_ONEDNN_ENV = "TPU_PAYLOAD_CPU_ONEDNN"


def train_compiler_options(accelerator: str) -> dict[str, Any] | None:
    """The XLA options the training chunk compiles with on `accelerator` (None: XLA's own)."""
    raw = os.environ.get(CPU_ONEDNN_ENV, "1")
    if raw not in ("0", "1"):
        raise SpecError(f"{CPU_ONEDNN_ENV}: {raw!r} must be 0 (off) or 1 (on, the default)")
    return dict(CPU_TRAIN_OPTIONS) if accelerator == "cpu" and raw == "1" else None


def batch_specs(
    objective: str,
    rows: int,
    *,
    seq_length: int,
    max_predictions: int,
    mesh: Any,
    steps_per_call: int | None = None,
) -> dict[str, jax.ShapeDtypeStruct]:
    """A batch of `rows` sequences as the input pipeline gives it, split over the mesh's
    batch axes; with `steps_per_call`, a training chunk of that many batches [K, B, ...]."""
    chunk = steps_per_call is not None
    sharding = mesh_lib.batch_sharding(mesh, chunk=chunk)
    lead = (int(steps_per_call),) if steps_per_call is not None else ()
    out = {}
    for name, dtype, axis in FEATURES[objective]:
        width = seq_length if axis == "seq" else max_predictions
        out[name] = jax.ShapeDtypeStruct((*lead, rows, width), dtype, sharding=sharding)
    return out


def with_attention(job: JobSpec, config: Any, seq_length: int, rt: Runtime) -> Runtime:
    """`rt` with the job's attention kernel for this model on this chip (attention.choose,
    payload/model/kernels.py's table: train.attention, the chip, the model's heads and dropout, the
    sequence, the precision, the document mask; the mesh the kernel runs on)."""
    chosen = attention_lib.choose(
        job.train.attention,
        chip=rt.chip,
        family=job.model.family,
        config=config,
        seq_length=int(seq_length),
        compute_dtype=rt.compute_dtype,
        document_mask=job.data.document_mask,
        mesh=rt.mesh,
    )
    return dataclasses.replace(rt, attention=chosen)


def _create_model(job: JobSpec, config: Any, seq_length: int, rt: Runtime) -> Any:
    """The job's Keras model: its family, config, remat policy, attention and document mask
    (the one call both builders below make)."""
    return models.create_model(
        job.model.family,
        config,
        int(seq_length),
        remat=job.train.remat,
        attention=rt.attention or attention_lib.REFERENCE,
        document_mask=job.data.document_mask,
    )


def build_model(job: JobSpec, config: Any, seq_length: int, rt: Runtime) -> tuple[Any, Any]:
    """(model, optimizer) with values: the model of the job with seeded initial weights
    (train.seed) in the runtime's precision, and AdamW built for its variables, every
    variable created sharded on the run's mesh (mesh.sharded_distribution). The trainer's
    (train._build) and the benchmark's (bench/bench_gpu.py) model; its state is what the
    programs of `build` take (Programs.state_shardings)."""
    keras.config.set_dtype_policy(rt.policy)
    # The initial weights and the dropout seeds (the input's randomness has its own seeds:
    # input.py).
    seed_keras(job.train.seed)
    with mesh_lib.sharded_distribution(rt.mesh, job.model.family).scope():
        model = _create_model(job, config, seq_length, rt)
        optimizer = create_optimizer(job.train)
        optimizer.build(model.trainable_variables)
    return model, optimizer


def seed_keras(seed: int) -> None:
    """`keras.utils.set_random_seed` (Python's, numpy's and Keras' global seeds) without the
    TensorFlow import it makes whenever TensorFlow is installed (to seed tf.data, which this
    backend does not use): Keras' lazy `tensorflow` module is told it is unavailable for
    the call (keras 3.15 `utils/rng_utils.py`, `utils/module_utils.py`)."""
    from keras.src.utils import module_utils  # noqa: PLC0415

    lazy = module_utils.tensorflow
    known = lazy._available
    lazy._available = False
    try:
        keras.utils.set_random_seed(seed)
    finally:
        lazy._available = known


def abstract_model(job: JobSpec, config: Any, seq_length: int, rt: Runtime) -> tuple[Any, Any]:
    """(model, optimizer) of the job as `build_model` builds them (the same family, config,
    remat, attention and dtype policy, AdamW built for the model's trainable variables),
    without a value in any variable (module docstring)."""
    from keras.src.backend.common import global_state  # noqa: PLC0415  (no public accessor)

    family = job.model.family
    keras.config.set_dtype_policy(rt.policy)
    optimizer = create_optimizer(job.train)  # its step counter: see the module docstring
    # A copy: Keras appends to the list object itself.
    pending = list(global_state.get_global_attribute("uninitialized_variables") or [])
    try:
        with (
            keras.StatelessScope(initialize_variables=False),
            mesh_lib.sharded_distribution(rt.mesh, family).scope(),
        ):
            model = _create_model(job, config, seq_length, rt)
            optimizer.build(model.trainable_variables)
    finally:
        # Keras initialises its list of pending variables when the next outermost
        # StatelessScope closes: stateless_call in the traced step would give every one a
        # value (on the mesh: on a TPU topology's devices, an error) and the step would
        # capture them as constants.
        global_state.set_global_attribute("uninitialized_variables", pending)
    return model, optimizer


def variable_spec(variable: Any, mesh: Any, family: str) -> jax.ShapeDtypeStruct:
    """A Keras variable as the trainer holds it: its shape and dtype, laid out on `mesh` by
    mesh.partition_spec (as mesh.sharded_distribution lays it out: axes padded with None)."""
    shape = tuple(int(d) for d in variable.shape)
    spec = mesh_lib.partition_spec(
        shape, int(mesh.shape["fsdp"]), path=str(variable.path), family=family
    )
    axes = list(spec) + [None] * (len(shape) - len(spec))
    return jax.ShapeDtypeStruct(shape, variable.dtype, sharding=NamedSharding(mesh, P(*axes)))


def state_specs(model: Any, optimizer: Any, mesh: Any, family: str) -> steps.TrainState:
    """The training state (steps.TrainState) as ShapeDtypeStructs with the trainer's shardings."""
    return steps.TrainState(
        [variable_spec(v, mesh, family) for v in model.trainable_variables],
        [variable_spec(v, mesh, family) for v in model.non_trainable_variables],
        [variable_spec(v, mesh, family) for v in optimizer.variables],
    )


def eval_terms(objective: str) -> int:
    """How many sums the evaluation step keeps (steps.RTD_TERMS for rtd; loss, weight,
    correct otherwise)."""
    return len(steps.RTD_TERMS) if objective == "rtd" else 3


@dataclass
class Programs:
    """The lowered training chunk and evaluation step of a job on a runtime (`build`)."""

    rt: Runtime  # with the attention chosen
    model: Any  # the Keras model without values (structure for tracing only)
    optimizer: Any
    state: steps.TrainState  # ShapeDtypeStructs with the trainer's shardings
    train_batches: dict[str, jax.ShapeDtypeStruct]  # [K, B, ...]
    train_lowered: Any  # jax.stages.Lowered
    eval_batches: dict[str, jax.ShapeDtypeStruct] | None
    eval_micro_batches: int
    eval_lowered: Any  # jax.stages.Lowered | None
    # The XLA options the training chunk compiled with (train_compiler_options; set when it
    # compiles): with any, the chunk is not in the persistent cache.
    train_options: dict[str, Any] | None = field(default=None, init=False)
    _compiled: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def state_shardings(self) -> steps.TrainState:
        return jax.tree.map(lambda s: s.sharding, self.state)

    def train_chunk(self) -> Any:
        """The compiled training chunk (compiled once, on first use)."""
        if "train" not in self._compiled:
            options = self.train_options = train_compiler_options(self.rt.accelerator)
            with compile_cache.not_written() if options else contextlib.nullcontext():
                self._compiled["train"] = self.train_lowered.compile(options)
        return self._compiled["train"]

    def eval_sums(self) -> Any:
        """The compiled evaluation step (None without a held-out set)."""
        if self.eval_lowered is None:
            return None
        if "eval" not in self._compiled:
            self._compiled["eval"] = self.eval_lowered.compile()
        return self._compiled["eval"]

    def fingerprints(self) -> dict[str, str]:
        """The SHA-256 (16 hex digits) of each lowered program's text, by program name."""
        out = {"train_chunk": _fingerprint(self.train_lowered)}
        if self.eval_lowered is not None:
            out["eval_step"] = _fingerprint(self.eval_lowered)
        return out


def _fingerprint(lowered: Any) -> str:
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()[:16]


def build(
    job: JobSpec,
    config: Any,
    rt: Runtime,
    *,
    seq_length: int,
    eval_batch: int | None,
    global_batch: int | None = None,
) -> Programs:
    """The trainer's programs for `job` (its model as `config`, sequences of `seq_length`
    tokens) on `rt` (a mesh of real or abstract devices and its facts): the training chunk
    of `rt.steps_per_execution` steps of `global_batch` rows (default train.
    global_batch_size), and, when `eval_batch` (the held-out global batch,
    evaluate.checked_eval_batch) is given, the evaluation step. The attention is chosen here
    (with_attention) unless `rt` carries one already. Lowered, not compiled: compiling is
    `train_chunk()` / `eval_sums()`, or `.compile()` of the lowered programs."""
    if rt.attention is None:
        rt = with_attention(job, config, seq_length, rt)
    objective, family = job.data.objective, job.model.family
    model, optimizer = abstract_model(job, config, seq_length, rt)
    state = state_specs(model, optimizer, rt.mesh, family)
    shardings = jax.tree.map(lambda s: s.sharding, state)
    rows = int(global_batch or job.train.global_batch_size)
    shapes: Mapping[str, int] = {
        "seq_length": int(seq_length),
        "max_predictions": int(job.data.max_predictions),
    }
    train_batches = batch_specs(
        objective, rows, mesh=rt.mesh, steps_per_call=rt.steps_per_execution, **shapes
    )
    chunk: Any = steps.make_train_chunk(
        model,
        optimizer,
        objective,
        state_sharding=shardings,
        accum_steps=job.train.grad_accum_steps,
        seed=job.train.seed,
        memory_bytes=rt.facts.device_memory,
    )
    scalar = jax.ShapeDtypeStruct((), "int32")
    train_lowered = chunk.lower(state, train_batches, scalar)
    eval_batches, eval_lowered, count = None, None, 1
    if eval_batch:
        count = jax_evaluate.micro_batches_of(job, int(eval_batch), rt.num_replicas)
        replicated = NamedSharding(rt.mesh, P())
        eval_batches = batch_specs(objective, int(eval_batch), mesh=rt.mesh, **shapes)
        totals = jax.ShapeDtypeStruct((eval_terms(objective),), "float32", sharding=replicated)
        sums = jax_evaluate.make_eval_sums(
            model, objective, count, out_sharding=replicated, memory_bytes=rt.facts.device_memory
        )
        eval_lowered = sums.lower(
            state.trainable, state.non_trainable, eval_batches, scalar, totals
        )
    return Programs(
        rt=rt,
        model=model,
        optimizer=optimizer,
        state=state,
        train_batches=train_batches,
        train_lowered=train_lowered,
        eval_batches=eval_batches,
        eval_micro_batches=count,
        eval_lowered=eval_lowered,
    )
