"""Sums over the replicas training together, whichever engine runs them."""

from kbert import backend
from kbert.backend import tensorflow


def replica_sum(value):
    """(sum of `value` over the replicas in sync, number of replicas).

    Each replica computes its loss on its rows of the global batch and the
    replicas' gradients are summed; normalising by global totals (not
    per-replica ones) makes distributed training equal to single-device
    training on the same global batch. Replicas are those of a TensorFlow
    strategy or the processes of torch-ddp; JAX data parallelism computes
    on the global batch already, so there it is the identity.
    """
    if backend.is_torch():
        from kbert.backend import torch_ddp  # torch is imported on the torch backend only

        return torch_ddp.replica_sum(value) if torch_ddp.active() else (value, 1)
    return tensorflow.replica_sum(value)
