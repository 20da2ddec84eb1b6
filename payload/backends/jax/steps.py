"""The JAX backend's training step: the TF backend's loss (payload/model/configs.py loss_terms) in
keras.ops, and several optimizer steps per compiled call.

On JAX, Keras' own `steps_per_execution` is a Python loop around a one-step compiled
function (the spike in docs/backends.md measured no gain from it), so the steps of one call
are a `jax.lax.fori_loop` inside one `jax.jit`: the host dispatches once per `steps_per_call`
steps. The model and the optimizer run through Keras' stateless API (`stateless_call`,
`stateless_apply`): the state is an explicit pytree of arrays that the caller keeps, and
writes back into the Keras variables only when it checkpoints or exports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import keras

from payload.backends.jax import mesh as mesh_lib
from payload.model import configs


@dataclass
class TrainState:
    trainable: list[Any]
    non_trainable: list[Any]
    optimizer: list[Any]

    @classmethod
    def of(cls, model: keras.Model, optimizer: keras.optimizers.Optimizer) -> TrainState:
        return cls(
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in optimizer.variables],
        )

    def write_back(self, model: keras.Model, optimizer: keras.optimizers.Optimizer) -> None:
        """Into the Keras variables (before a checkpoint, an evaluation or the export)."""
        pairs = (
            (model.trainable_variables, self.trainable),
            (model.non_trainable_variables, self.non_trainable),
            (optimizer.variables, self.optimizer),
        )
        for variables, values in pairs:
            for variable, value in zip(variables, values, strict=True):
                variable.assign(value)


jax.tree_util.register_pytree_node(
    TrainState,
    lambda s: ((s.trainable, s.non_trainable, s.optimizer), None),
    lambda _, children: TrainState(*children),
)


def loss_terms(logits: Any, labels: Any, weights: Any) -> tuple[Any, Any, Any]:
    """(sum of per-token cross entropies, sum of weights, number correct), weighted: the TF
    backend's loss_terms, on float32 logits."""
    logits = jnp.asarray(logits, jnp.float32)
    per_token = -jnp.take_along_axis(
        jax.nn.log_softmax(logits, axis=-1), labels[..., None].astype(jnp.int32), axis=-1
    )[..., 0]
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return (per_token * weights).sum(), weights.sum(), (correct * weights).sum()


def chunked_loss_terms(
    features: Any,
    kernel: Any,
    bias: Any,
    labels: Any,
    weights: Any,
    *,
    devices: int | None = None,
    memory_bytes: int | None = None,
    budget: int | None = None,
    mesh: Any = None,
) -> Any:
    """loss_terms of the logits features @ kernel (+ bias), as [3] float32 sums, without the
    logits of the whole batch: the positions are cut into chunks and a `lax.scan` computes
    one chunk's logits, their logsumexp, the label's logit and the argmax at a time.

    Pure in its arguments: the chunk is payload/model/configs.py loss_chunk_length for the rows one
    device holds (`devices`: how many the batch's rows are split over; default the size of
    `mesh`, else 1) under
    `budget` bytes of float32 logits (default model.loss_chunk_budget(`memory_bytes`), the
    memory of one device; None: not known).

    MaxText's vocabulary tiling (src/maxtext/utils/vocabulary_tiling.py at e591f30: tiles
    along batch x sequence, a custom_vjp whose backward scan recomputes each tile's logits
    and adds the head's gradient into an accumulator of the parameters' float32 dtype):
    - forward: the matmul in the compute dtype (bf16 x bf16 under mixed_bfloat16) with its
      float32 result kept (`preferred_element_type`): the logits are never rounded to bf16;
    - backward (`_chunk_backward`): per chunk the float32 softmax minus the one-hot label,
      weighted, cast to the compute dtype; both backward GEMMs then run in the compute dtype
      with float32 accumulation (d features = d logits @ kernel^T; d kernel = features^T @
      d logits), and the kernel's (and bias's) gradient is summed over the chunks in ONE
      float32 accumulator, cast to its dtype once at the end. Autodiff of the forward would
      instead run both GEMMs float32 x bf16 and add the chunks' kernel gradients in the
      kernel's dtype (bf16), one read-modify-write of a [H, V] array per chunk;
    - only the features are kept for the backward pass, so at most one chunk's logits exist.

    features [B, S, H], kernel [H, V], bias [V] or None, labels [B, S], weights [B, S]. The
    chunks run along S, every chunk holding all B rows: the rows stay split over the devices
    as the batch is (mesh.batch_sharding), so a chunk needs no resharding. On `mesh`, a
    chunk's logits are held to those rows (mesh.keep_rows): the head's kernel is gathered
    (FSDP), not the features of the whole batch. It is gathered whole, in the compute dtype,
    once before the chunks (mesh.whole): left to itself the TPU compiler of v5e and v6e
    contracts each chunk against the kernel's FSDP shards in a windowed einsum whose
    partial sums are whole float32 chunks of logits, three alive at once (125m on
    v5litepod-8: 786 MB of logits at the step's peak; gathered: one chunk, 262 MB, and the
    kernel's 37 MB; docs/performance.md)."""
    rows, length = labels.shape
    # The trainer splits B over every device of the mesh (not the devices this process
    # sees: a program compiled for another topology must size its chunks for that one).
    if devices is None:
        devices = int(mesh.size) if mesh is not None else 1
    per_device = max(1, rows // max(1, int(devices)))
    if budget is None:
        budget = configs.loss_chunk_budget(memory_bytes)
    size = configs.loss_chunk_length(per_device, length, kernel.shape[-1], budget)
    return _chunked(features, kernel, bias, labels, weights, size=size, mesh=mesh)


def _chunked(
    features: Any, kernel: Any, bias: Any, labels: Any, weights: Any, *, size: int, mesh: Any
) -> Any:
    """chunked_loss_terms over chunks of `size` positions (a divisor of the length)."""
    rows, length = labels.shape
    count = length // size
    has_bias = bias is not None
    compute = features.dtype

    def split(x: Any) -> Any:  # [B, S, ...] -> [count, B, size, ...]
        return jnp.swapaxes(x.reshape(rows, count, size, *x.shape[2:]), 0, 1)

    def logits_of(x: Any, k: Any, b: Any) -> Any:
        logits = jnp.einsum("bsh,hv->bsv", x, k, preferred_element_type=jnp.float32)
        logits = mesh_lib.keep_rows(logits, mesh)
        return logits + b.astype(jnp.float32) if has_bias else logits

    def forward(x: Any, k: Any, b: Any, y: Any, w: Any) -> Any:
        k = mesh_lib.whole(k.astype(compute), mesh)

        def body(totals: Any, chunk: tuple[Any, Any, Any]) -> tuple[Any, None]:
            xc, yc, wc = chunk
            logits = logits_of(xc, k, b)
            target = jnp.take_along_axis(logits, yc[..., None].astype(jnp.int32), axis=-1)
            per_token = jax.nn.logsumexp(logits, axis=-1) - target[..., 0]
            correct = (jnp.argmax(logits, axis=-1) == yc).astype(jnp.float32)
            wc = wc.astype(jnp.float32)
            sums = jnp.stack([(per_token * wc).sum(), wc.sum(), (correct * wc).sum()])
            return totals + sums, None

        totals, _ = jax.lax.scan(body, jnp.zeros([3], jnp.float32), (split(x), split(y), split(w)))
        return totals

    def backward(residuals: tuple[Any, ...], cotangent: Any) -> tuple[Any, ...]:
        x, k_in, b, y, w = residuals
        k = mesh_lib.whole(k_in.astype(compute), mesh)
        # The sums' cotangents: the loss sum's flows into the logits; the weight sum and the
        # argmax count are flat in them (weights' own gradient below, for completeness).
        d_loss, d_weights, d_correct = cotangent[0], cotangent[1], cotangent[2]

        def body(carry: tuple[Any, Any], chunk: tuple[Any, Any, Any]) -> tuple[Any, Any]:
            dk, db = carry
            xc, yc, wc = chunk
            logits = logits_of(xc, k, b)
            labels = yc[..., None].astype(jnp.int32)
            lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
            per_token = (lse - jnp.take_along_axis(logits, labels, axis=-1))[..., 0]
            correct = (jnp.argmax(logits, axis=-1) == yc).astype(jnp.float32)
            hot = jnp.arange(logits.shape[-1]) == labels
            dlogits = (jnp.exp(logits - lse) - hot) * (wc.astype(jnp.float32) * d_loss)[..., None]
            dlogits = mesh_lib.keep_rows(dlogits, mesh)
            low = dlogits.astype(compute)
            dx = jnp.einsum("bsv,hv->bsh", low, k, preferred_element_type=jnp.float32)
            dk = dk + jnp.einsum("bsh,bsv->hv", xc, low, preferred_element_type=jnp.float32)
            if has_bias:
                db = db + dlogits.sum(axis=(0, 1))
            dw = per_token * d_loss + d_weights + correct * d_correct
            return (dk, db), (dx.astype(x.dtype), dw.astype(w.dtype))

        start = (jnp.zeros(k_in.shape, jnp.float32), jnp.zeros(b.shape, jnp.float32))
        (dk, db), (dx, dw) = jax.lax.scan(body, start, (split(x), split(y), split(w)))

        def join(parts: Any, like: Any) -> Any:  # [count, B, size, ...] -> [B, S, ...]
            return jnp.swapaxes(parts, 0, 1).reshape(like.shape)

        return join(dx, x), dk.astype(k_in.dtype), db.astype(b.dtype), None, join(dw, w)

    @jax.custom_vjp
    def terms(x: Any, k: Any, b: Any, y: Any, w: Any) -> Any:
        return forward(x, k, b, y, w)

    def terms_forward(x: Any, k: Any, b: Any, y: Any, w: Any) -> tuple[Any, tuple[Any, ...]]:
        return forward(x, k, b, y, w), (x, k, b, y, w)

    terms.defvjp(terms_forward, backward)
    bias_in = bias if has_bias else jnp.zeros([], jnp.float32)
    return forward_first(terms(features, kernel, bias_in, labels, weights))


@jax.custom_vjp
def forward_first(sums: Any) -> Any:
    """The identity, whose backward pass waits for its forward value: the loss's sums are
    computed before the backward pass starts. Under jax.checkpoint the backward pass of the
    chunked loss recomputes its logits and needs nothing the forward chunks computed, so
    XLA is free to run the forward chunks (whose sums are only reported) last, after the
    layers' backward loop, and does on a TPU: the final hidden states and the head's
    features then stay alive through that loop, the step's peak (1B on v5e:4x4: 66 MB a
    chip, docs/performance.md). An optimization barrier on (cotangent, forward sums) orders
    the two without changing a value."""
    return sums


def _forward_first_fwd(sums: Any) -> tuple[Any, Any]:
    return sums, sums


def _forward_first_bwd(sums: Any, cotangent: Any) -> tuple[Any]:
    cotangent, _ = jax.lax.optimization_barrier((cotangent, sums))
    return (cotangent,)


forward_first.defvjp(_forward_first_fwd, _forward_first_bwd)


def lm_loss_terms(
    model: keras.Model,
    trainable: list[Any],
    non_trainable: list[Any],
    inputs: Mapping[str, Any],
    *,
    labels: Any,
    weights: Any,
    training: bool,
    memory_bytes: int | None = None,
) -> tuple[Any, list[Any]]:
    """([3] float32 sums of loss_terms, the new non-trainable state) of a language model
    (models.MaskedLM, CausalLM, LlamaCausalLM) on a batch, by chunked_loss_terms: its rows
    split over the model's mesh (all of its devices), `memory_bytes` per device (None: not
    known; program.build passes the runtime's Facts.device_memory)."""
    head, non_trainable = model.stateless_call(
        trainable, non_trainable, inputs, training=training, head_inputs=True
    )
    mesh = getattr(model, "mesh", None)
    terms = chunked_loss_terms(
        head.features, head.kernel, head.bias, labels, weights,
        memory_bytes=memory_bytes, mesh=mesh,
    )  # fmt: skip
    return terms, non_trainable


# ELECTRA (data.objective rtd): the recipe's weights (payload/model/configs.py, from
# google-research/electra configure_pretraining.py).
DISC_WEIGHT = configs.ELECTRA_DISC_WEIGHT
GEN_WEIGHT = configs.ELECTRA_GEN_WEIGHT
# The sums of one RTD pass, in this order (rtd_terms): the generator's MLM loss, masked
# positions and correct predictions; the discriminator's loss, real tokens and correct
# decisions; replaced tokens predicted replaced (tp), original tokens predicted replaced
# (fp), replaced tokens predicted original (fn).
RTD_TERMS = (
    "generator_loss",
    "masked",
    "generator_correct",
    "discriminator_loss",
    "tokens",
    "discriminator_correct",
    "tp",
    "fp",
    "fn",
)
# Streams of jax.random keys for the generator's samples: training folds in the step (and
# the micro-batch), evaluation a fixed seed and the batch index.
SAMPLE_STREAM = 0x5EED


def sample_key(seed: Any, *counters: Any) -> Any:
    """The uint32 key data the ELECTRA model samples with (models.Electra `sample_key`)."""
    key = jax.random.fold_in(jax.random.key(seed), SAMPLE_STREAM)
    for counter in counters:
        key = jax.random.fold_in(key, counter)
    return jax.random.key_data(key)


def rtd_terms(outputs: Mapping[str, Any], batch: Mapping[str, Any]) -> Any:
    """[len(RTD_TERMS)] float32 sums of one RTD pass (models.Electra outputs): the generator's
    cross entropy at the masked positions, and the discriminator's sigmoid cross entropy
    over every real token (attention_mask; google-research/electra run_pretraining.py
    _get_discriminator_output weighs by input_mask), a logit > 0 meaning replaced."""
    generator_loss, masked, generator_correct = loss_terms(
        outputs["generator"], batch["masked_lm_ids"], batch["masked_lm_weights"]
    )
    logits = jnp.asarray(outputs["discriminator"], jnp.float32)
    labels = outputs["replaced"]
    weights = batch["attention_mask"].astype(jnp.float32)
    # sigmoid cross entropy, the stable form of tf.nn.sigmoid_cross_entropy_with_logits
    per_token = jnp.maximum(logits, 0.0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits)))
    predicted = (logits > 0).astype(jnp.float32)
    return jnp.stack(
        [
            generator_loss,
            masked,
            generator_correct,
            (per_token * weights).sum(),
            weights.sum(),
            ((predicted == labels).astype(jnp.float32) * weights).sum(),
            (predicted * labels * weights).sum(),
            (predicted * (1.0 - labels) * weights).sum(),
            ((1.0 - predicted) * labels * weights).sum(),
        ]
    )


def rtd_inputs(batch: Mapping[str, Any], key_data: Any) -> dict[str, Any]:
    """models.Electra's inputs for one RTD pass of a masked batch."""
    names = ("input_ids", "attention_mask", "masked_lm_positions", "masked_lm_ids")
    inputs = {name: batch[name] for name in names}
    inputs["masked_lm_weights"] = batch["masked_lm_weights"]
    inputs["sample_key"] = key_data
    return inputs


def model_inputs(objective: str, batch: Mapping[str, Any]) -> tuple[dict[str, Any], Any, Any]:
    """(model inputs, labels, weights) of a batch of payload.backends.tf.input's pipeline."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if objective == "mlm":
        inputs["masked_lm_positions"] = batch["masked_lm_positions"]
        return inputs, batch["masked_lm_ids"], batch["masked_lm_weights"]
    return inputs, batch["labels"], batch["label_weights"]


def make_rtd_gradients(
    model: keras.Model, *, seed: int, accum_steps: int, micro_batches: Callable[[Any], Any]
) -> Callable[[TrainState, Mapping[str, Any]], tuple[Any, Any, Any, Any]]:
    """make_train_chunk's gradients for objective rtd (ELECTRA)."""

    def rtd_loss_fn(
        trainable: list[Any],
        non_trainable: list[Any],
        batch: Mapping[str, Any],
        key_data: Any,
        denominators: Any,
    ):
        """The ELECTRA loss's share of `batch`: GEN_WEIGHT x the generator's loss sum over
        the WHOLE batch's masked positions + DISC_WEIGHT x the discriminator's loss sum over
        the whole batch's real tokens (`denominators`), so micro-batch shares add up to the
        batch's loss."""
        outputs, non_trainable = model.stateless_call(
            trainable, non_trainable, rtd_inputs(batch, key_data), training=True
        )
        terms = rtd_terms(outputs, batch)
        loss = GEN_WEIGHT * terms[0] / denominators[0] + DISC_WEIGHT * terms[3] / denominators[1]
        return loss, (non_trainable, terms)

    rtd_loss_and_grads = jax.value_and_grad(rtd_loss_fn, has_aux=True)

    def rtd_gradients(state: TrainState, batch: Mapping[str, Any]):
        """(loss, the generator's accuracy, non-trainable state, gradients) of ELECTRA's
        loss on the batch; the generator samples with a key of (train.seed, the step, the
        micro-batch): a resumed run draws what the uninterrupted run drew."""
        step = state.optimizer[0]  # iterations
        denominators = jnp.stack(
            [
                jnp.maximum(batch["masked_lm_weights"].astype(jnp.float32).sum(), 1.0),
                jnp.maximum(batch["attention_mask"].astype(jnp.float32).sum(), 1.0),
            ]
        )
        if accum_steps == 1:
            (loss, (non_trainable, terms)), grads = rtd_loss_and_grads(
                state.trainable,
                state.non_trainable,
                batch,
                sample_key(seed, step),
                denominators,
            )
        else:

            def body(carry: tuple[Any, ...], indexed: tuple[Any, Mapping[str, Any]]):
                non_trainable, grads, loss, terms = carry
                index, micro = indexed
                (part, (non_trainable, part_terms)), part_grads = rtd_loss_and_grads(
                    state.trainable, non_trainable, micro, sample_key(seed, step, index),
                    denominators,
                )  # fmt: skip
                grads = jax.tree.map(jnp.add, grads, part_grads)
                return (non_trainable, grads, loss + part, terms + part_terms), None

            zeros = jax.tree.map(jnp.zeros_like, state.trainable)
            start = (
                state.non_trainable,
                zeros,
                jnp.zeros([], jnp.float32),
                jnp.zeros([len(RTD_TERMS)], jnp.float32),
            )
            (non_trainable, grads, loss, terms), _ = jax.lax.scan(
                body, start, (jnp.arange(accum_steps), micro_batches(batch))
            )
        accuracy = terms[2] / jnp.maximum(terms[1], 1.0)
        return loss, accuracy, non_trainable, grads

    return rtd_gradients


def carried_layouts(state_sharding: Any) -> Callable[[TrainState], TrainState]:
    """The identity on the state, holding each array of it, as the step loop carries it, in
    the layout its argument and its result have (the devices' default layout for its shard:
    the layout the trainer's arrays have). Left to itself the TPU compiler carries some of
    them in another layout (1B Llama on v5e:4x4: the q, k and v kernels and their AdamW
    slots, the hidden axis minor) and copies them into it on entering the loop and back on
    leaving it, beside the donated arguments: 93 MB a chip more (docs/performance.md; hlo.py
    relaid_state counts such arrays). Without shardings (a CPU test) or off a TPU: the
    identity (the CPU and GPU programs are unchanged)."""
    if state_sharding is None:
        return lambda state: state
    from jax.experimental.layout import Layout, with_layout_constraint  # noqa: PLC0415

    leaves, tree = jax.tree.flatten(state_sharding)
    devices = leaves[0].mesh.devices.flat if leaves else []
    device = next(iter(devices), None)
    if device is None or device.platform != "tpu":
        return lambda state: state

    def pin(state: TrainState) -> TrainState:
        values = jax.tree.leaves(state)
        out = []
        for value, sharding in zip(values, leaves, strict=True):
            shard = sharding.shard_shape(value.shape)
            default = device.client.get_default_layout(value.dtype, shard, device)
            order = tuple(Layout.from_pjrt_layout(default).major_to_minor)
            # A matrix only where its shard's default layout is row-major: a constraint names
            # the whole array's layout, and where the shard's default differs (Llama 125m's
            # embedding [32000, 576] split 16 ways: shards [32000, 36], its long axis minor)
            # the partitioner met it by all-gathering the float32 array in every step (6 per
            # step of the table and its slots on v5e:4x4; hlo.py counts gathers by dtype).
            # A stack over the layers [L, ...] (rank 3: models.LlamaLayers, and its AdamW
            # slots) in its default whatever it is: where that default puts L inside (125m's
            # [30, 36, 576] shards on v5e:4x4 lay out (1, 0, 2)) the compiler otherwise
            # carries the stacks L-major, copied in and out of the loop (125m there: 21
            # arrays; pinned, 0.99 -> 0.87 GiB a chip, every gather still bf16).
            row_major = value.ndim > 0 and order == tuple(range(value.ndim))
            pinned = row_major or value.ndim >= 3
            out.append(with_layout_constraint(value, Layout(order)) if pinned else value)
        return jax.tree.unflatten(tree, out)

    return pin


def make_train_chunk(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    objective: str,
    *,
    state_sharding: Any = None,
    accum_steps: int = 1,
    seed: int = 0,
    memory_bytes: int | None = None,
) -> Callable[..., tuple[TrainState, dict[str, Any]]]:
    """A compiled function (state, batches with a leading [K] axis[, n]) -> (state, metrics
    [K]): the first n optimizer steps of the K batches in one call (n defaults to K; metrics
    past n are 0). The loss is the mean over the batch's predicted tokens, computed a chunk
    of tokens at a time (chunked_loss_terms: the whole batch's logits never exist).

    `n` is traced, not static: a chunk cut short by a log/checkpoint/eval boundary runs the
    same compiled program with the batches' tail unused, instead of compiling another one
    (on a TPU a compilation of a large model takes minutes). `state_sharding` (the
    trainer's: replicated over the mesh) pins where the new state lives; the old state's
    buffers are donated to it (no second copy of the weights and optimizer slots).

    `accum_steps` (train.grad_accum_steps) > 1 splits each batch into that many micro-batches
    (rows i, i + N, i + 2N, ... form micro-batch i: every device keeps its own rows) run one
    after another in a `lax.scan`: the gradients of each micro-batch's SUM of token losses
    are added up and divided by the whole batch's token count, so loss and gradients are
    the big batch's (not a mean of micro-batch means, which would weigh a token by its
    micro-batch's size), and the optimizer steps once per batch. Activations are held for
    one micro-batch at a time.

    `objective` rtd (ELECTRA): the loss is GEN_WEIGHT x the generator's MLM loss +
    DISC_WEIGHT x the discriminator's loss (rtd_gradients); the reported accuracy is the
    generator's at the masked positions; `seed` (train.seed) seeds the generator's samples.
    `memory_bytes`: one device's memory, which sizes the loss's chunks (lm_loss_terms)."""

    def sums_fn(trainable: list[Any], non_trainable: list[Any], batch: Mapping[str, Any]):
        inputs, labels, weights = model_inputs(objective, batch)
        terms, non_trainable = lm_loss_terms(
            model, trainable, non_trainable, inputs, labels=labels, weights=weights,
            training=True, memory_bytes=memory_bytes,
        )  # fmt: skip
        return terms[0], (non_trainable, terms[1], terms[2])

    sums_and_grads = jax.value_and_grad(sums_fn, has_aux=True)

    def micro_batches(batch: Mapping[str, Any]) -> dict[str, Any]:
        def split(x: Any) -> Any:
            parts = x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:])
            return jnp.swapaxes(parts, 0, 1)  # [N, B / N, ...]

        return {name: split(x) for name, x in batch.items()}

    def gradients(state: TrainState, batch: Mapping[str, Any]):
        """(loss, accuracy, non-trainable state, gradients) of the whole batch's mean."""
        if accum_steps == 1:
            (loss_sum, (non_trainable, weight_sum, correct)), grads = sums_and_grads(
                state.trainable, state.non_trainable, batch
            )
        else:

            def body(carry: tuple[Any, ...], micro: Mapping[str, Any]):
                non_trainable, grads, loss_sum, weight_sum, correct = carry
                (part, (non_trainable, weights, right)), part_grads = sums_and_grads(
                    state.trainable, non_trainable, micro
                )
                grads = jax.tree.map(jnp.add, grads, part_grads)
                totals = (loss_sum + part, weight_sum + weights, correct + right)
                return (non_trainable, grads, *totals), None

            zero = jnp.zeros([], jnp.float32)
            zeros = jax.tree.map(jnp.zeros_like, state.trainable)
            start = (state.non_trainable, zeros, zero, zero, zero)
            (non_trainable, grads, loss_sum, weight_sum, correct), _ = jax.lax.scan(
                body, start, micro_batches(batch)
            )
        denominator = jnp.maximum(weight_sum, 1.0)
        grads = jax.tree.map(lambda g: g / denominator, grads)
        return loss_sum / denominator, correct / denominator, non_trainable, grads

    rtd_gradients = make_rtd_gradients(
        model, seed=seed, accum_steps=accum_steps, micro_batches=micro_batches
    )

    def one_step(state: TrainState, batch: Mapping[str, Any]):
        compute = rtd_gradients if objective == "rtd" else gradients
        loss, accuracy, non_trainable, grads = compute(state, batch)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in grads))
        trainable, optimizer_vars = optimizer.stateless_apply(
            state.optimizer, grads, state.trainable
        )
        return TrainState(trainable, non_trainable, optimizer_vars), (loss, accuracy, norm)

    pin = carried_layouts(state_sharding)

    def train_chunk(state: TrainState, batches: Mapping[str, Any], n: Any = None):
        batches = dict(batches)
        k = next(iter(batches.values())).shape[0]
        if n is None:
            n = k
        zeros = jnp.zeros([k], jnp.float32)

        def body(i: Any, carry: tuple[TrainState, tuple[Any, Any, Any]]):
            state, (losses, accuracies, norms) = carry
            batch = {name: jax.lax.dynamic_index_in_dim(x, i, keepdims=False)
                     for name, x in batches.items()}  # fmt: skip
            state, (loss, accuracy, norm) = one_step(pin(state), batch)
            return pin(state), (losses.at[i].set(loss), accuracies.at[i].set(accuracy),
                           norms.at[i].set(norm))  # fmt: skip

        state, (losses, accuracies, norms) = jax.lax.fori_loop(
            0, n, body, (state, (zeros, zeros, zeros))
        )
        return state, {"loss": losses, "accuracy": accuracies, "grad_norm": norms}

    if state_sharding is None:
        return jax.jit(train_chunk)
    return jax.jit(train_chunk, out_shardings=(state_sharding, None), donate_argnums=0)
