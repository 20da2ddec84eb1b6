"""The JAX backend's input: each process's input pipelines (input.make_batches: Grain, no
TensorFlow) -> the global batches on the device mesh, one array per feature split over the
mesh's batch axes (`jax.make_array_from_process_local_data`), and the chunks of several
batches one compiled call trains on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from payload.backends.jax import input as input_lib
from payload.backends.jax import mesh as mesh_lib
from payload.core import storage
from payload.data import input_order
from payload.schema import manifest as manifest_lib

if TYPE_CHECKING:
    from payload.backends.jax.runtime import Runtime
    from payload.schema.manifest import Manifest
    from payload.spec import JobSpec


class Pipelines:
    """This process's input: its input pipelines' shares of every global batch.

    An input pipeline (input.make_batches with its pipeline id) reads its own shard
    files. Normally there is one per process (host), as on the TF backend; `count` > the
    process count gives each process several, whose host batches are concatenated in
    pipeline order (a single process then reads exactly what `count` processes would:
    tests/payload/test_jax_multihost.py compares the two)."""

    def __init__(self, rt: Runtime, count: int | None = None):
        self.rt = rt
        self.count = count or rt.process_count
        if self.count % rt.process_count:
            raise ValueError(f"{self.count} input pipelines for {rt.process_count} processes")
        per = self.count // rt.process_count
        self.mine = range(rt.process_index * per, (rt.process_index + 1) * per)
        self.batch_sharding = mesh_lib.batch_sharding(rt.mesh, chunk=False)
        self.chunk_sharding = mesh_lib.batch_sharding(rt.mesh, chunk=True)

    def pipeline_batch(self, global_batch: int) -> int:
        return global_batch // self.count

    def datasets(
        self, job: JobSpec, manifest: Manifest, global_batch: int, **kwargs: Any
    ) -> list[input_lib.Batches]:
        """One numpy iterator per pipeline of this process (input.make_batches' batches)."""
        return [
            input_lib.make_batches(
                job,
                manifest,
                batch_size=self.pipeline_batch(global_batch),
                num_pipelines=self.count,
                pipeline_id=i,
                **kwargs,
            )
            for i in self.mine
        ]

    def plans(
        self, job: JobSpec, manifest: Manifest, global_batch: int, *, split: str = "train"
    ) -> list[input_order.PipelinePlan]:
        """What every input pipeline (of every process) reads of `split`, by pipeline id."""
        paths = manifest_lib.shard_paths(job.paths.data, manifest, split=split)
        shards = manifest.eval_shards if split == "eval" else manifest.shards
        return [
            input_order.plan_pipeline(
                paths,
                [s.records for s in shards],
                batch_size=self.pipeline_batch(global_batch),
                num_pipelines=self.count,
                pipeline_id=i,
            )
            for i in range(self.count)
        ]

    def files(self, job: JobSpec, manifest: Manifest, global_batch: int) -> list[str]:
        """The training shard files this process reads (for the log)."""
        plans = self.plans(job, manifest, global_batch)
        return [storage.basename(path) for i in self.mine for path in plans[i].files]

    @staticmethod
    def next_host_batch(iterators: list[Any]) -> dict[str, np.ndarray]:
        parts = [next(it) for it in iterators]
        if len(parts) == 1:
            return parts[0]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    @staticmethod
    def close(iterators: list[input_lib.Batches]) -> None:
        """Stop the pipelines' threads (reads ahead, prefetched batches)."""
        for it in iterators:
            it.close()

    def to_devices(self, arrays: dict[str, np.ndarray], *, chunk: bool) -> dict[str, Any]:
        """Host rows -> one global array per feature, split over the mesh (asynchronous)."""
        sharding = self.chunk_sharding if chunk else self.batch_sharding
        axis = 1 if chunk else 0
        out = {}
        for name, local in arrays.items():
            shape = list(local.shape)
            shape[axis] *= self.rt.process_count
            out[name] = jax.make_array_from_process_local_data(sharding, local, tuple(shape))
        return out


def stack(batches: list[dict[str, np.ndarray]], length: int) -> dict[str, np.ndarray]:
    """The batches on a leading axis of `length` (one compiled chunk shape); the slots past
    the real batches are zeros that the chunk does not run (steps.make_train_chunk's n)."""
    out = {}
    for key in batches[0]:
        stacked = np.stack([b[key] for b in batches])
        if len(batches) < length:
            pad = np.zeros((length - len(batches), *stacked.shape[1:]), stacked.dtype)
            stacked = np.concatenate([stacked, pad])
        out[key] = stacked
    return out
