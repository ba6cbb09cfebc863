"""One flag picks the distribution engine.

- `none` (any backend): one device.
- `jax-data-parallel` (jax): `keras.distribution.DataParallel` over all
  local devices; with `--num-processes` > 1 (or JAX's cluster environment)
  `jax.distributed` is initialised first, for several hosts.
- `tf-mirrored` (tensorflow): `tf.distribute.MirroredStrategy` (all local
  GPUs, or the given devices).
- `tf-multi-worker` (tensorflow): `tf.distribute.MultiWorkerMirroredStrategy`
  from `TF_CONFIG`.
- `tf-tpu` (tensorflow): `tf.distribute.TPUStrategy`.

PyTorch: single device only. Keras 3 has no data-parallel engine for the
torch backend; use JAX or TensorFlow for several devices.
"""

import contextlib
import os

import keras

from kbert import backend as kbert_backend
from kbert.backend.tensorflow import replica_sum

__all__ = ["ENGINES", "distribution_scope", "replica_sum"]

ENGINES = ("none", "jax-data-parallel", "tf-mirrored", "tf-multi-worker", "tf-tpu")


def distribution_scope(engine="none", devices=None, tpu=None):
    """Sets up `engine`; returns (context manager to build and compile in,
    number of replicas). Build and compile the model inside the context."""
    backend = kbert_backend.name()
    if engine not in ENGINES:
        raise ValueError(f"unknown distribution engine {engine!r}; use one of {ENGINES}")
    needs = {
        "jax-data-parallel": "jax",
        "tf-mirrored": "tensorflow",
        "tf-multi-worker": "tensorflow",
        "tf-tpu": "tensorflow",
    }
    if engine in needs and needs[engine] != backend:
        extra = " (the torch backend trains on one device only)" if backend == "torch" else ""
        raise ValueError(
            f"engine {engine!r} needs KERAS_BACKEND={needs[engine]}, not {backend}{extra}"
        )
    if engine == "none":
        return contextlib.nullcontext(), 1
    if engine == "jax-data-parallel":
        if int(os.environ.get("KBERT_NUM_PROCESSES", "1")) > 1 or os.environ.get(
            "JAX_COORDINATOR_ADDRESS"
        ):
            keras.distribution.initialize()
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
