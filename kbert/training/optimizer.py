"""The original BERT optimisation: AdamW (weight decay 0.01, not on LayerNorm
and biases), linear warm-up then linear decay, global-norm clipping 1.0;
LAMB for large batches."""

import keras
from keras import ops

from kbert import backend
from kbert.backend import keras_internals, trainer

NO_DECAY = ("gamma", "beta", "bias")
EPSILON = 1e-6  # Adam's epsilon in the original BERT's optimization.py


@keras.saving.register_keras_serializable(package="kbert")
class WarmupLinearDecay(keras.optimizers.schedules.LearningRateSchedule):
    """lr(step) = peak * step / warmup before `warmup_steps`, then
    peak * (1 - step / total_steps) (as the original `optimization.py`: the
    decay line starts at 0 and warm-up cuts into it, so the rate after
    warm-up is peak * (1 - warmup / total)).

    Args:
        peak_learning_rate: float.
        total_steps: int. steps to decay to 0 over.
        warmup_steps: int. linear warm-up steps.
        from_peak: bool. decay from the peak at the end of warm-up,
            peak * (total - step) / (total - warmup), as transformers'
            `get_linear_schedule_with_warmup`.

    Example:
    >>> float(WarmupLinearDecay(1e-4, 100, 10)(5))
    5e-05
    >>> [round(float(WarmupLinearDecay(1e-4, 100, 10, f)(10)), 9) for f in (False, True)]
    [9e-05, 0.0001]
    """

    def __init__(self, peak_learning_rate, total_steps, warmup_steps=0, from_peak=False):
        if total_steps < 1:
            raise ValueError(f"total_steps must be at least 1, got {total_steps}")
        if from_peak and not 0 <= warmup_steps < total_steps:
            raise ValueError(
                f"from_peak needs warmup_steps ({warmup_steps}) below total_steps ({total_steps})"
            )
        self.peak_learning_rate = float(peak_learning_rate)
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.from_peak = bool(from_peak)

    def __call__(self, step):
        step = ops.cast(step, "float32")
        # relu, not maximum(0.0, .): a Python constant becomes a host-to-device
        # copy on torch, which synchronises the stream every step.
        if self.from_peak:
            left = (self.total_steps - step) / (self.total_steps - self.warmup_steps)
            decay = self.peak_learning_rate * ops.relu(left)
        else:
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
            "from_peak": self.from_peak,
        }


def _multi_tensor(present):
    return (
        backend.is_torch() and bool(present) and all(g.dtype == present[0].dtype for g in present)
    )


def global_clip_scale(grads, clip):
    """clip / max(norm, clip) for the global norm of `grads` (None entries
    skipped), a float32 scalar; NaN for a non-finite norm. The norm is the
    dense gradient's on every backend (TensorFlow's sparse embedding
    gradients repeat a row per lookup: `trainer.norm_parts`)."""
    present = [g for g in grads if g is not None]
    if _multi_tensor(present):
        norm = trainer.grouped_global_norm(present)
    else:
        parts = trainer.norm_parts(present)
        norm = ops.sqrt(sum(ops.sum(ops.square(ops.cast(g, "float32"))) for g in parts))
    scale = clip / (ops.relu(norm - clip) + clip)  # = clip / max(norm, clip)
    return scale + (norm - norm)  # inf - inf and NaN - NaN are NaN: poison a non-finite norm


def clip_by_global_norm(grads, clip):
    """g * clip / max(norm, clip), NaN for a non-finite norm (as Keras).

    Keras' own version turns Python constants into tensors, a host-to-device
    copy each that synchronises the torch backend's stream every step;
    here constants only meet tensors through arithmetic operators. On torch
    the norms and the scaling are one multi-tensor kernel each.
    """
    present = [g for g in grads if g is not None]
    multi_tensor = _multi_tensor(present)
    scale = global_clip_scale(grads, clip)
    if multi_tensor:
        scaled = iter(trainer.grouped_scale(present, scale))
        return [None if g is None else next(scaled) for g in grads]
    return [None if g is None else g * ops.cast(scale, g.dtype) for g in grads]


class ReplicaExactClipping(keras_internals.OptimizerShims):
    """Global-norm clipping of the global (replica-summed) gradient, without
    host-device synchronisation (see `clip_by_global_norm` and
    `kbert.backend.tensorflow.clip_summed`)."""

    def clip_gradients(self, grads):
        def clip(g):
            return clip_by_global_norm(g, self.global_clipnorm)

        summed = trainer.clip_summed(grads, clip)
        return summed if summed is not None else clip(grads)

    def clip_scale(self, grads):
        """The factor `clip_gradients` multiplies every gradient by."""
        return global_clip_scale(grads, self.global_clipnorm)


class NoDecayNames:
    """`no_decay`: names of the variables kept out of the weight decay (any
    variable whose name contains one), given to `exclude_from_weight_decay`
    at construction and kept in the config, so an optimizer reloaded from a
    `.keras` file excludes what it excluded (Keras saves no exclusions). A
    config without it (saved before it existed) gets `NO_DECAY`, what
    `compile` pinned then."""

    def __init__(self, *args, no_decay=NO_DECAY, **kwargs):
        super().__init__(*args, **kwargs)
        self.no_decay = tuple(no_decay or ())
        if self.no_decay:
            self.exclude_from_weight_decay(var_names=list(self.no_decay))

    def get_config(self):
        return {**super().get_config(), "no_decay": list(self.no_decay)}


@keras.saving.register_keras_serializable(package="kbert")
class AdamW(NoDecayNames, ReplicaExactClipping, keras_internals.adamw_base()):
    """keras.optimizers.AdamW with replica-exact global-norm clipping; on
    torch, an update with no host-device synchronisation (step count and
    bias corrections on the device), which a CUDA graph can capture.

    `corrected_epsilon=True` adds epsilon to the bias-corrected root of the
    second moment, as `torch.optim.AdamW` and optax do (Keras adds it to
    the uncorrected one); saved in the config."""

    updates_on_device = backend.is_torch()
    # On torch the update applies the weight decay: in the same pass as
    # Adam where torch's fused CPU kernel runs (see `torch_step.adam_update`).
    defers_weight_decay = backend.is_torch()

    def __init__(self, *args, corrected_epsilon=False, **kwargs):
        super().__init__(*args, **kwargs)
        # epsilon added to the bias-corrected root of the second moment
        # (torch.optim.AdamW, optax) rather than before the correction (Keras)
        self.corrected_epsilon = bool(corrected_epsilon)
        if backend.is_torch():
            trainer.count_in_place(keras_internals.iterations_variable(self))

    def get_config(self):
        return {**super().get_config(), "corrected_epsilon": self.corrected_epsilon}

    def defers_clipping(self):
        """On torch, in kbert's training step (whose gradients are its own):
        the update scales the gradients, in the fused CPU pass where it runs."""
        return trainer.owns_gradients()

    def parallel_update(self, grads, variables, learning_rate):
        """The multi-tensor update Keras' torch optimizer calls."""
        trainer.adam_update(self, grads, variables, learning_rate)

    def update_step(self, gradient, variable, learning_rate):
        """Keras' per-variable update; on TensorFlow through the fused
        kernel (`kbert.backend.tensorflow.fused_adam_update`)."""
        if backend.is_tensorflow() and trainer.fused_adam_update(
            self, gradient, variable, learning_rate
        ):
            return
        if not self.corrected_epsilon:
            super().update_step(gradient, variable, learning_rate)
            return
        # Keras' Adam.update_step with epsilon scaled by sqrt(1 - beta_2^t)
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        gradient = ops.cast(gradient, dtype)
        local_step = ops.cast(self.iterations + 1, dtype)
        beta_1_power = ops.power(ops.cast(self.beta_1, dtype), local_step)
        beta_2_power = ops.power(ops.cast(self.beta_2, dtype), local_step)
        m, v = keras_internals.adam_slot_variables(self, variable)
        alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        self.assign_add(m, (gradient - m) * (1 - self.beta_1))
        self.assign_add(v, (ops.square(gradient) - v) * (1 - self.beta_2))
        if self.amsgrad:
            v_hat = keras_internals.adam_velocity_hat(self, variable)
            self.assign(v_hat, ops.maximum(v_hat, v))
            v = v_hat
        epsilon = ops.cast(self.epsilon, dtype) * ops.sqrt(1 - beta_2_power)
        self.assign_sub(variable, m * alpha / (ops.sqrt(v) + epsilon))


@keras.saving.register_keras_serializable(package="kbert")
class Lamb(NoDecayNames, ReplicaExactClipping, keras.optimizers.Lamb):
    """keras.optimizers.Lamb with replica-exact global-norm clipping."""


def create_optimizer(
    learning_rate=1e-4,
    num_train_steps=10_000,
    num_warmup_steps=100,
    weight_decay=0.01,
    clipnorm=1.0,
    kind="adamw",
    epsilon=EPSILON,
    no_decay=NO_DECAY,
    from_peak=False,
    corrected_epsilon=False,
):
    """AdamW (or LAMB) with the BERT schedule and weight-decay exclusions.

    The defaults are the original BERT's recipe. A plain `torch.optim.AdamW`
    with weight decay and `get_linear_schedule_with_warmup` (the loop many
    transformers examples write, and `benchmarks/seq2seq.py`'s reference)
    is `epsilon=1e-8, no_decay=(), from_peak=True, corrected_epsilon=True`.

    Args:
        learning_rate: float. peak learning rate.
        num_train_steps: int. total optimisation steps (decay to 0).
        num_warmup_steps: int. linear warm-up steps.
        weight_decay: float. decoupled weight decay.
        clipnorm: float or None. global-norm clipping.
        kind: str. "adamw" or "lamb".
        epsilon: float. added to the root of the second moment (the
            original BERT's 1e-6; transformers' default is 1e-8).
        no_decay: names of variables kept out of the weight decay (any
            variable whose name contains one): LayerNorm's `gamma` and
            `beta` and every `bias` by default; () decays every weight.
        from_peak: bool. after warm-up, decay from the peak rather than
            along the original BERT's line (`WarmupLinearDecay`).
        corrected_epsilon: bool (AdamW). add epsilon to the bias-corrected
            root of the second moment, as torch's AdamW and optax do, rather
            than to the uncorrected one, as Keras does: Keras' epsilon is in
            effect epsilon / sqrt(1 - beta_2^t) of torch's, 32x larger at
            the first step, 3x at step 100, equal only after some thousands.
    """
    schedule = WarmupLinearDecay(learning_rate, num_train_steps, num_warmup_steps, from_peak)
    common = dict(
        learning_rate=schedule,
        weight_decay=weight_decay,
        global_clipnorm=clipnorm,
        no_decay=tuple(no_decay or ()),
    )
    if kind == "adamw":
        optimizer = AdamW(
            beta_1=0.9,
            beta_2=0.999,
            epsilon=epsilon,
            corrected_epsilon=corrected_epsilon,
            **common,
        )
    elif corrected_epsilon:
        raise ValueError(f"corrected_epsilon is an AdamW setting; kind={kind!r} has none")
    elif kind == "lamb":
        optimizer = Lamb(beta_1=0.9, beta_2=0.999, epsilon=epsilon, **common)
    else:
        raise ValueError(f"unknown optimizer {kind!r}; use 'adamw' or 'lamb'")
    return optimizer


def exclude_from_weight_decay(optimizer, model):
    """Pins the optimizer's own weight-decay exclusions to `model`'s
    variables by identity.

    The variables its name patterns (`exclude_from_weight_decay(var_names=)`)
    and variable list already pick, matched once here rather than by a
    regular expression in the step, which keeps the step traceable by
    torch.compile. An optimizer without exclusions decays every weight, as
    its maker asked. A no-op for optimizers without weight decay or already
    built.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not getattr(inner, "weight_decay", None) or inner.built:
        return
    excluded = keras_internals.weight_decay_excluded(inner, model.trainable_variables)
    if excluded is not None:
        inner.exclude_from_weight_decay(var_list=excluded)
