"""The original BERT optimisation: AdamW (weight decay 0.01, not on LayerNorm
and biases), linear warm-up then linear decay, global-norm clipping 1.0;
LAMB for large batches."""

import keras
from keras import ops

NO_DECAY = ("gamma", "beta", "bias")


@keras.saving.register_keras_serializable(package="kbert")
class WarmupLinearDecay(keras.optimizers.schedules.LearningRateSchedule):
    """lr(step) = peak * step / warmup before `warmup_steps`, then
    peak * (1 - step / total_steps) (as the original `optimization.py`).

    Args:
        peak_learning_rate: float.
        total_steps: int. steps to decay to 0 over.
        warmup_steps: int. linear warm-up steps.

    Example:
    >>> float(WarmupLinearDecay(1e-4, 100, 10)(5))
    5e-05
    """

    def __init__(self, peak_learning_rate, total_steps, warmup_steps=0):
        if total_steps < 1:
            raise ValueError(f"total_steps must be at least 1, got {total_steps}")
        self.peak_learning_rate = float(peak_learning_rate)
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step):
        step = ops.cast(step, "float32")
        # relu, not maximum(0.0, .): a Python constant becomes a host-to-device
        # copy on torch, which synchronises the stream every step.
        decay = self.peak_learning_rate * ops.relu(1.0 - step / self.total_steps)
        if self.warmup_steps <= 0:
            return decay
        warmup = self.peak_learning_rate * step / self.warmup_steps
        return ops.where(step < self.warmup_steps, warmup, decay)

    def get_config(self):
        return {
            "peak_learning_rate": self.peak_learning_rate,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
        }


class _ClipAfterAllReduce:
    """Global-norm clipping of the *summed* gradient under a TF strategy.

    Keras clips each replica's gradients before they are summed across
    replicas, so with several replicas the clipped update differs from
    single-device training. Here the gradients are all-reduced first,
    clipped, and divided by the replica count (the optimizer's own sum
    then restores the clipped global gradient).
    """

    def _clip_gradients(self, grads):
        if not self.global_clipnorm:
            return super()._clip_gradients(grads)
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            context = tf.distribute.get_replica_context()
            if context is not None and context.num_replicas_in_sync > 1:
                replicas = context.num_replicas_in_sync
                summed = context.all_reduce(tf.distribute.ReduceOp.SUM, grads)
                return [g / replicas for g in _clip_by_global_norm(summed, self.global_clipnorm)]
        return _clip_by_global_norm(grads, self.global_clipnorm)


def _clip_by_global_norm(grads, clip):
    """g * clip / max(norm, clip), NaN for a non-finite norm (as Keras).

    Keras' own version turns Python constants into tensors, a host-to-device
    copy each that synchronises the torch backend's stream every step;
    here constants only meet tensors through arithmetic operators.
    """
    present = [g for g in grads if g is not None]
    multi_tensor = (
        keras.backend.backend() == "torch"
        and bool(present)
        and all(g.dtype == present[0].dtype for g in present)
    )
    if multi_tensor:
        # torch: one multi-tensor kernel for all the norms and one for the
        # scaling, where the per-gradient form launches ~4 kernels per
        # variable (800 for BERT-base, a third of the step's launches).
        import torch

        norms = torch._foreach_norm(present, dtype=torch.float32)
        norm = torch.linalg.vector_norm(torch.stack(norms))
    else:
        norm = ops.sqrt(sum(ops.sum(ops.square(ops.cast(g, "float32"))) for g in present))
    scale = clip / (ops.relu(norm - clip) + clip)  # = clip / max(norm, clip)
    scale = scale + (norm - norm)  # inf - inf and NaN - NaN are NaN: poison a non-finite norm
    if multi_tensor:
        scaled = iter(torch._foreach_mul(present, scale.to(present[0].dtype)))
        return [None if g is None else next(scaled) for g in grads]
    return [None if g is None else g * ops.cast(scale, g.dtype) for g in grads]


def _adamw_base():
    """keras.optimizers.AdamW as the backend runs it fastest.

    On torch, Keras maps `keras.optimizers.AdamW` itself to a multi-tensor
    implementation (`torch._foreach_*`, a few kernels for all variables), but
    only for that exact class: a subclass falls back to the per-variable
    update (about 20 kernels and several host syncs per variable, which made
    a BERT-base step CPU-bound). So the subclass derives from the torch one.
    """
    if keras.backend.backend() == "torch":
        from keras.src.backend.torch.optimizers import torch_adamw

        return torch_adamw.AdamW
    return keras.optimizers.AdamW


@keras.saving.register_keras_serializable(package="kbert")
class AdamW(_ClipAfterAllReduce, _adamw_base()):
    """keras.optimizers.AdamW with replica-exact global-norm clipping; on
    torch, a step with no host-device synchronisation
    (`kbert.training.torch_step`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if keras.backend.backend() == "torch":
            from kbert.training.torch_step import count_in_place

            count_in_place(self._iterations)

    def _parallel_update_step(self, grads, variables, learning_rate):
        # Only the torch base has this method (Keras calls it from the
        # torch `_backend_update_step`).
        from kbert.training.torch_step import adam_update

        adam_update(self, grads, variables, learning_rate)


@keras.saving.register_keras_serializable(package="kbert")
class Lamb(_ClipAfterAllReduce, keras.optimizers.Lamb):
    """keras.optimizers.Lamb with replica-exact global-norm clipping."""


def create_optimizer(
    learning_rate=1e-4,
    num_train_steps=10_000,
    num_warmup_steps=100,
    weight_decay=0.01,
    clipnorm=1.0,
    kind="adamw",
):
    """AdamW (or LAMB) with the BERT schedule and weight-decay exclusions.

    Args:
        learning_rate: float. peak learning rate.
        num_train_steps: int. total optimisation steps (decay to 0).
        num_warmup_steps: int. linear warm-up steps.
        weight_decay: float. decoupled weight decay.
        clipnorm: float or None. global-norm clipping.
        kind: str. "adamw" or "lamb".
    """
    schedule = WarmupLinearDecay(learning_rate, num_train_steps, num_warmup_steps)
    common = dict(learning_rate=schedule, weight_decay=weight_decay, global_clipnorm=clipnorm)
    if kind == "adamw":
        optimizer = AdamW(beta_1=0.9, beta_2=0.999, epsilon=1e-6, **common)
    elif kind == "lamb":
        optimizer = Lamb(beta_1=0.9, beta_2=0.999, epsilon=1e-6, **common)
    else:
        raise ValueError(f"unknown optimizer {kind!r}; use 'adamw' or 'lamb'")
    optimizer.exclude_from_weight_decay(var_names=list(NO_DECAY))
    return optimizer


def exclude_from_weight_decay(optimizer, model):
    """Pins the LayerNorm/bias exclusion to `model`'s variables by identity.

    Same variables as the name patterns, but matched without a regular
    expression in the step, which keeps the step traceable by torch.compile.
    A no-op for optimizers without weight decay or already built.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not getattr(inner, "weight_decay", None) or inner.built:
        return
    excluded = [v for v in model.trainable_variables if any(n in v.name for n in NO_DECAY)]
    inner.exclude_from_weight_decay(var_list=excluded)
