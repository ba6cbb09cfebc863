"""The state kbert's trainer keeps between calls, in one object per model
(or optimizer) instead of attributes stashed on Keras objects.

`state_of(obj)` returns it, made on first use and stored past Keras'
attribute tracking (and torch's module registration): Keras would track a
list of the model's variables as the model's own, and torch would register
a DistributedDataParallel wrapper holding the model as its submodule.
"""


class TrainerState:
    """What the trainer remembers about one model or optimizer.

    On a model:
        step_options: dict. XLA compiler options per step kind ("train",
            "test", "predict"), planned or in use (`keras_internals`).
        compile_log: list or None. programs compiled ahead (`jax_compile`).
        first_programs: the training step's `FirstPrograms`, or None.
        ahead_predict: the predict step's `AheadPredict`, or None.
        predict_on_batch: what `predict_on_batch` keeps between calls (JAX:
            `keras_internals.jax_predict_on_batch`; TensorFlow:
            `tensorflow.DirectPredict`), or None.
        ddp: the model's DistributedDataParallel wrapper, or None.
        ddp_synced: bool. process 0's weights broadcast and the dropout
            generator offset by the rank (torch-ddp).
        pending_rng: dict or None. backend generator state a resumed run
            restores when its first batch begins (`training.loop`).
    On an optimizer:
        deferred_decay: frozenset or None. ids of the variables whose weight
            decay Keras left to the fused update.
        clip_scale: the clipping scale left to the fused update, or None.
    """

    __slots__ = (
        "step_options",
        "compile_log",
        "first_programs",
        "ahead_predict",
        "predict_on_batch",
        "ddp",
        "ddp_synced",
        "pending_rng",
        "deferred_decay",
        "clip_scale",
    )

    def __init__(self):
        for name in self.__slots__:
            setattr(self, name, None)
        self.step_options = {}
        self.ddp_synced = False

    def take(self, name, default=None):
        """The field's value (`default` where unset), then unset."""
        value = getattr(self, name)
        setattr(self, name, None)
        return default if value is None else value


def state_of(obj):
    """`obj`'s `TrainerState`, made on first use."""
    state = obj.__dict__.get("_kbert_state")
    if state is None:
        state = TrainerState()
        object.__setattr__(obj, "_kbert_state", state)
    return state
