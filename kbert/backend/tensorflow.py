"""TensorFlow distribution helpers: replica sums, replica-exact clipping,
multi-worker logs. TensorFlow is imported only when the backend is
TensorFlow and a strategy is active."""

from kbert import backend
from kbert.backend import keras_internals


def _replica_context():
    """The tf.distribute replica context with more than one replica, or None."""
    if not backend.is_tensorflow():
        return None
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        return context
    return None


def replica_sum(value):
    """(sum of `value` over the replicas in sync, number of replicas).

    Under a TensorFlow strategy each replica computes its loss on its slice
    of the global batch and the gradients are summed; normalising by global
    totals (not per-replica ones) makes distributed training equal to
    single-device training on the same global batch. JAX data parallelism
    computes on the global batch already, so there it is the identity.
    """
    context = _replica_context()
    if context is None:
        return value, 1
    import tensorflow as tf

    return context.all_reduce(tf.distribute.ReduceOp.SUM, value), context.num_replicas_in_sync


def clip_summed(grads, clip_by_global_norm):
    """Global-norm clipping of the *summed* gradient under a TF strategy,
    or None outside one.

    Keras clips each replica's gradients before they are summed across
    replicas, so with several replicas the clipped update differs from
    single-device training. Here the gradients are all-reduced first,
    clipped, and divided by the replica count (the optimizer's own sum then
    restores the clipped global gradient)."""
    context = _replica_context()
    if context is None:
        return None
    import tensorflow as tf

    replicas = context.num_replicas_in_sync
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, grads)
    return [g / replicas for g in clip_by_global_norm(summed)]


def multi_worker_logs(model, logs):
    """Keras' TensorFlow trainer averages logs across MultiWorkerMirrored
    workers with `strategy.reduce("MEAN", v, axis=0)`, which fails on scalar
    logs ("Invalid reduction dimension 0 for input with 0 dimensions"). Give
    them a length-1 axis there; the reduction makes them scalars again."""
    if not backend.is_tensorflow():
        return logs
    strategy = keras_internals.distribute_strategy(model)
    if strategy is None or not isinstance(logs, dict):
        return logs
    import tensorflow as tf

    if not isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) or not keras_internals.in_multi_worker_mode(strategy):
        return logs
    return {
        k: tf.reshape(v, (1,)) if tf.is_tensor(v) and v.shape.rank == 0 else v
        for k, v in logs.items()
    }
