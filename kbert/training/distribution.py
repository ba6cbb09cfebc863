"""One flag picks the distribution engine.

- `none` (any backend): one device.
- `jax-data-parallel` (jax): `keras.distribution.DataParallel` over all
  devices. For several hosts (one process each), `jax.distributed` is
  initialised first, from `coordinator_address`, `num_processes` and
  `process_id` (or the environment: `KERAS_DISTRIBUTION_JOB_ADDRESSES`,
  `KERAS_DISTRIBUTION_NUM_PROCESSES`, `KERAS_DISTRIBUTION_PROCESS_ID`,
  `JAX_COORDINATOR_ADDRESS`, `KBERT_NUM_PROCESSES`, or a cluster JAX
  detects, such as SLURM or Cloud TPU). Every process feeds the same global
  `tf.data` batches; Keras gives each process its contiguous share of each
  batch (`DataParallel.distribute_dataset`). Process 0 writes checkpoints
  and logs into directories all processes share.
- `tf-mirrored` (tensorflow): `tf.distribute.MirroredStrategy` (all local
  GPUs, or the given devices).
- `tf-multi-worker` (tensorflow): `tf.distribute.MultiWorkerMirroredStrategy`
  from `TF_CONFIG`.
- `tf-tpu` (tensorflow): `tf.distribute.TPUStrategy`.
- `torch-ddp` (torch): one process per device, launched with `torchrun`
  (one or several hosts); gradients all-reduced by torch's
  DistributedDataParallel (see `kbert.backend.torch_ddp`). Every process
  feeds the same global batches to `fit`; each takes its rows of every
  batch (`shard_for_process`, which `fit` of kbert's models applies).
  Process 0 writes checkpoints and logs.
"""

import contextlib
import os

import keras
import numpy as np

from kbert import backend as kbert_backend
from kbert.backend import trainer
from kbert.backend.trainer import replica_sum

__all__ = [
    "ENGINES",
    "any_process",
    "barrier",
    "distribution_scope",
    "process_count",
    "process_index",
    "replica_sum",
    "same_on_all_processes",
    "shard_for_process",
    "torch_ddp_active",
]

ENGINES = ("none", "jax-data-parallel", "tf-mirrored", "tf-multi-worker", "tf-tpu", "torch-ddp")


def distribution_scope(
    engine="none",
    devices=None,
    tpu=None,
    coordinator_address=None,
    num_processes=None,
    process_id=None,
):
    """Sets up `engine`; returns (context manager to build and compile in,
    number of replicas). Build and compile the model inside the context.

    Args:
        engine: str. one of `ENGINES`.
        devices: list or None. the devices to replicate over (default: all).
        tpu: str or None. the TPU name or address for `tf-tpu`.
        coordinator_address: str or None. `host:port` of process 0, the same
            on every process (`jax-data-parallel` on several hosts).
        num_processes: int or None. processes in the run, one per host.
        process_id: int or None. this process, 0 to `num_processes - 1`.

    Example:

    ```python
    scope, replicas = distribution_scope("none")
    with scope:
        backbone = kbert.BertBackbone(vocabulary_size=100, num_layers=2, num_heads=2,
                                      hidden_dim=32, intermediate_dim=64)
        model = kbert.BertPreTrainer(backbone)
        model.compile(learning_rate=1e-4, num_train_steps=10)
    ```
    """
    backend = kbert_backend.name()
    if engine not in ENGINES:
        raise ValueError(f"unknown distribution engine {engine!r}; use one of {ENGINES}")
    needs = {
        "jax-data-parallel": "jax",
        "tf-mirrored": "tensorflow",
        "tf-multi-worker": "tensorflow",
        "tf-tpu": "tensorflow",
        "torch-ddp": "torch",
    }
    if engine in needs and needs[engine] != backend:
        raise ValueError(f"engine {engine!r} needs KERAS_BACKEND={needs[engine]}, not {backend}")
    given = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    given = [name for name, value in given.items() if value is not None]
    if given and engine != "jax-data-parallel":
        raise ValueError(
            f"{', '.join(given)} set up several JAX processes: use engine "
            f"'jax-data-parallel' (engine {engine!r} takes none; tf-multi-worker reads TF_CONFIG)"
        )
    if engine == "none":
        return contextlib.nullcontext(), 1
    if engine == "torch-ddp":
        _, count = trainer.ddp_initialize()
        return contextlib.nullcontext(), count
    if engine == "jax-data-parallel":
        _initialize_processes(coordinator_address, num_processes, process_id)
        found = devices or keras.distribution.list_devices()
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=found))
        return contextlib.nullcontext(), len(found)
    import tensorflow as tf

    if engine == "tf-mirrored":
        strategy = tf.distribute.MirroredStrategy(devices=devices)
    elif engine == "tf-multi-worker":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu or "")
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        strategy = tf.distribute.TPUStrategy(resolver)
    return strategy.scope(), strategy.num_replicas_in_sync


def _initialize_processes(coordinator_address, num_processes, process_id):
    """Starts `jax.distributed` when several processes are asked for (once)."""
    import jax

    if num_processes is None and os.environ.get("KBERT_NUM_PROCESSES"):
        num_processes = int(os.environ["KBERT_NUM_PROCESSES"])
    count = num_processes or int(os.environ.get("KERAS_DISTRIBUTION_NUM_PROCESSES") or 1)
    wanted = (
        count > 1
        or coordinator_address is not None
        or process_id is not None
        or os.environ.get("KERAS_DISTRIBUTION_JOB_ADDRESSES")
        or os.environ.get("JAX_COORDINATOR_ADDRESS")
    )
    if not wanted:
        return
    if not jax.distributed.is_initialized():
        # Keras fills what is None from its KERAS_DISTRIBUTION_* variables and
        # JAX from JAX_COORDINATOR_ADDRESS or the cluster it detects.
        keras.distribution.initialize(coordinator_address, num_processes, process_id)
    if num_processes is not None and jax.process_count() != num_processes:
        raise ValueError(
            f"num_processes={num_processes}, but jax.distributed runs "
            f"{jax.process_count()} processes; pass the same count to every process"
        )
    if process_id is not None and jax.process_index() != process_id:
        raise ValueError(
            f"process_id={process_id}, but jax.distributed was initialised as process "
            f"{jax.process_index()}; initialise it once, with this process's id"
        )


def torch_ddp_active():
    """Whether this process trains with `torch-ddp`."""
    return trainer.ddp_active()


def process_index():
    """This process's index among those training together (0 with one process)."""
    if trainer.ddp_active():
        return trainer.ddp_rank()
    if kbert_backend.name() == "jax":
        import jax

        return jax.process_index()
    return 0


def process_count():
    """How many processes train together (1 on one host)."""
    if trainer.ddp_active():
        return trainer.ddp_world_size()
    if kbert_backend.name() == "jax":
        import jax

        return jax.process_count()
    return 1


def same_on_all_processes(value, what):
    """Raises unless the int `value` is the same on every process; returns it.

    Args:
        value: int. this process's value.
        what: str. what the value is, for the error (with the usual fix).
    """
    if process_count() == 1:
        return value
    values = _gather(value)
    if len(set(values)) > 1:
        raise ValueError(
            f"the processes disagree on {what}: {values} (process 0 first); every "
            "process must see the same files (a shared directory) and the same arguments"
        )
    return value


def barrier(name):
    """Waits until every process reaches `barrier(name)` (nothing with one
    process): e.g. the others wait while process 0 writes shared files."""
    if process_count() == 1:
        return
    if trainer.ddp_active():
        trainer.ddp_barrier()
        return
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def any_process(flag):
    """Whether `flag` is true on any process; every process must call it."""
    if process_count() == 1:
        return bool(flag)
    return max(_gather(int(bool(flag)))) > 0


def _gather(value):
    """The int `value` of every process, process 0 first (a collective)."""
    if trainer.ddp_active():
        return trainer.ddp_gather_ints(value)
    from jax.experimental import multihost_utils

    return [int(v) for v in multihost_utils.process_allgather(np.int64(value))]


def shard_for_process(data):
    """Under `torch-ddp`: this process's rows of every batch of `data` (a
    batched `tf.data` dataset or a `keras.utils.PyDataset` of batches), the
    same split of each global batch that `kbert.backend.torch_ddp.rows`
    makes. Elsewhere `data` itself. Arrays are refused: they have no
    batches yet (let `fit` cut them into length buckets, its default, or
    pass a dataset)."""
    if not trainer.ddp_active():
        return data
    count, index = trainer.ddp_world_size(), trainer.ddp_rank()
    if isinstance(data, keras.utils.PyDataset):
        return _RowsOfBatches(data, trainer.ddp_rows)
    if type(data).__module__.startswith("tensorflow") and hasattr(data, "element_spec"):
        import tensorflow as tf

        def mine(*batch):
            first = tf.nest.flatten(batch)[0]
            size = tf.shape(first)[0]
            base, extra = size // count, size % count
            start = index * base + tf.minimum(index, extra)
            stop = start + base + tf.cast(index < extra, size.dtype)
            cut = tf.nest.map_structure(lambda t: t[start:stop], batch)
            return cut if len(cut) > 1 else cut[0]

        return data.map(mine)
    raise ValueError(
        "under torch-ddp, fit takes a batched tf.data dataset, a keras.utils.PyDataset, or "
        "arrays cut into batches by fit (bucket_lengths=True, the default); got "
        f"{type(data).__name__}"
    )


class _RowsOfBatches(keras.utils.PyDataset):
    """A PyDataset of global batches -> this process's rows of each."""

    def __init__(self, batches, rows):
        super().__init__()
        self.batches, self.rows = batches, rows

    def __len__(self):
        return len(self.batches)

    @property
    def num_batches(self):
        return len(self.batches)

    def __getitem__(self, index):
        batch = self.batches[index]
        first = keras.tree.flatten(batch)[0]
        part = self.rows(first.shape[0])
        return keras.tree.map_structure(lambda v: None if v is None else v[part], batch)

    def on_epoch_end(self):
        self.batches.on_epoch_end()
