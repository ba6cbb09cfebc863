"""The trainer's door: everything models and training ask of the
backend-specific engines, in one module.

`kbert.models` and `kbert.training` import `kbert.backend` (which backend
runs), `kbert.backend.ops` (the layers' fused operations),
`kbert.backend.keras_internals` (private Keras API) and this module; the
engines behind it (`jax_compile`, `jax_cache`, `torch_step`, `torch_ddp`,
`torch_ops`, `tensorflow`, `replicas`) are theirs to call, not the models'
(an import-linter contract in pyproject.toml says so). Each function names
what it does for a model, and picks the engine of the running backend.

- `state_of(model)`: what the trainer keeps between calls
  (`kbert.backend.state.TrainerState`).
- `BackendTrainer`: the Keras `Model` hooks of a task (the step functions
  and their compiler options, per-backend train / test / predict steps,
  metrics across processes).
- fit and predict: `fit_context`, `predict_context`, `warm_up`,
  `plan_steps`, `ahead_compiler`, `compile_predict_ahead`,
  `variables_kept_on_error`, `with_callback`.
- the backbone's loop programs: `layers_in_loop`, `note_looped`.
- data parallelism: `replica_sum`, `ddp_*`, `graphs_training`.
- the optimizer's fused updates: `grouped_global_norm`, `grouped_scale`,
  `norm_parts`, `clip_summed`, `fused_adam_update`, `adam_update`, `count_in_place`,
  `owns_gradients`.
"""

import contextlib

from kbert import backend
from kbert.backend import jax_cache, jax_compile, keras_internals
from kbert.backend import replicas as _replicas
from kbert.backend import tensorflow as tf_backend
from kbert.backend.state import state_of  # noqa: F401  (what the trainer keeps on a model)

if backend.is_torch():
    from kbert.backend import torch_ddp, torch_ops, torch_step, torch_trace

# A training run (its optimizer's schedule, else its `fit`), `evaluate`
# or `predict` of at least this many steps gets XLA's autotuned programs
# on a GPU (see `kbert.backend.jax_compile`).
AUTOTUNE_MIN_STEPS = jax_compile.AUTOTUNE_MIN_STEPS
# The total steps of a learning-rate schedule made for a run of unknown
# length (no decay): not a run's length.
UNKNOWN_RUN_STEPS = jax_compile.UNKNOWN_RUN_STEPS


class BackendTrainer(keras_internals.TrainerShims):
    """The per-backend parts of a task's Keras trainer: step functions made
    with the planned compiler options (JAX), kbert's own steps (torch),
    logs of several workers (TensorFlow), metrics across torch-ddp
    processes."""

    def make_train_function(self, force=False):
        return self._make_step(super().make_train_function, "train", force)

    def make_test_function(self, force=False):
        return self._make_step(super().make_test_function, "test", force)

    def make_predict_function(self, force=False):
        return self._make_step(super().make_predict_function, "predict", force)

    def _make_step(self, make, kind, force):
        """Keras' `make_*_function` with the planned compiler options; a
        step made without a plan (train_on_batch, ...) runs an unknown
        number of times: `jax_compile.step_options(self, None)`."""
        jax_compile.plan(self, None, (kind,), replace=False)
        if backend.is_jax():
            jax_cache.use_compilation_cache()
        making = force or getattr(self, f"{kind}_function") is None
        wrap = None
        if making:
            wrap = jax_compile.first_programs_wrapper(self, kind) or jax_compile.predict_wrapper(
                self, kind
            )
        with keras_internals.jax_jit_options(self, kind, wrap):
            return make(force)

    def predict_on_batch(self, x):
        if backend.is_jax():
            return keras_internals.jax_predict_on_batch(self, x, super().predict_on_batch)
        if backend.is_tensorflow():
            direct = tf_backend.direct_predict(self, x)
            if direct is not None:
                return direct(x)
        return super().predict_on_batch(x)

    def train_step(self, *args, **kwargs):
        if backend.is_torch() and torch_step.runs_our_step(self):
            # Keras' torch step synchronises the GPU stream several times;
            # kbert's does not.
            return torch_step.task_train_step(self, *args, **kwargs)
        return tf_backend.multi_worker_logs(self, super().train_step(*args, **kwargs))

    def predict_step(self, *args, **kwargs):
        if backend.is_torch():
            return torch_step.task_predict_step(self, super().predict_step, *args, **kwargs)
        return super().predict_step(*args, **kwargs)

    def test_step(self, *args, **kwargs):
        if backend.is_torch():
            # Validation inside fit gets host batches too, and Keras' loss
            # and metric constants are made on the device.
            return torch_step.task_test_step(self, super().test_step, *args, **kwargs)
        return tf_backend.multi_worker_logs(self, super().test_step(*args, **kwargs))

    def get_metrics_result(self):
        if ddp_active():
            # every process's totals and counts, not process 0's alone
            return torch_ddp.global_metrics_result(self, super().get_metrics_result)
        return super().get_metrics_result()


# --- fit and predict -------------------------------------------------------


def fit_context(model):
    """Around a `fit`: on torch, batches made on the host and copied
    without blocking by kbert's step, replayed as a CUDA graph on a GPU
    where it can."""
    return torch_step.fit_context(model) if backend.is_torch() else contextlib.nullcontext()


def predict_context(model):
    """Around a `predict`: on torch with a GPU, the forward replayed as a
    CUDA graph per shape."""
    return torch_step.predict_context(model) if backend.is_torch() else contextlib.nullcontext()


def traces_inference(model):
    """Whether small inference batches replay TorchScript traces (torch on
    a CPU: `kbert.backend.torch_trace`)."""
    return backend.is_torch() and torch_trace.enabled(model)


def warm_up(model):
    """Work a `fit` can start before its data is ready (on torch with a
    GPU, the Adam kernel's compilation)."""
    if backend.is_torch():
        torch_step.warm_up(model)


def plan_steps(model, steps, kinds, replace=True):
    """Records how many batches the coming call runs, which decides the
    compiler options of the steps it makes (`jax_compile.plan`)."""
    jax_compile.plan(model, steps, kinds, replace=replace)


def clear_step_plan(model):
    """Forgets planned compiler options (a new `compile` makes new steps)."""
    keras_internals.clear_step_compiler_options(model)


def ahead_compiler(model, batches, held_out, epochs, callbacks):
    """On JAX, where it applies: a callback compiling the batch shapes to
    come in background threads, as (callbacks with it, its `close`);
    else None."""
    if not (backend.is_jax() and jax_compile.applies(model, callbacks)):
        return None
    ahead = jax_compile.AheadCompiler(batches, held_out, epochs)
    return jax_compile.with_callback(callbacks, ahead), ahead.close


def with_callback(callbacks, callback):
    """`callbacks` (None, a list or a CallbackList) with `callback` added."""
    return jax_compile.with_callback(callbacks, callback)


def compile_predict_ahead(model, batches):
    """On JAX with a jitted predict step, each bucket's program compiled
    ahead, side by side (on a GPU)."""
    if backend.is_jax() and model.jit_compile and not model.run_eagerly:
        model.make_predict_function()
        jax_compile.compile_predict_ahead(model, batches)


def variables_kept_on_error(model):
    """On JAX, the model's variables kept usable when a call fails inside
    Keras' loop."""
    return keras_internals.jax_variables_kept_on_error(model)


# --- the backbone's loop programs ------------------------------------------


def layers_in_loop():
    """Whether the step being traced runs the backbone's blocks as one loop
    (JAX's first, fast-compiling programs)."""
    return jax_compile.layers_in_loop()


def note_looped():
    """Records that a traced step ran the blocks as one loop."""
    jax_compile.note_looped()


# --- data parallelism --------------------------------------------------------


def replica_sum(value):
    """(the sum of `value` over replicas, the replica count)."""
    return _replicas.replica_sum(value)


def ddp_active():
    """Whether this process trains with torch-ddp."""
    return backend.is_torch() and torch_ddp.active()


def ddp_initialize():
    """Starts torch-ddp's process group: (rank, process count)."""
    return torch_ddp.initialize()


def ddp_rank():
    return torch_ddp.rank()


def ddp_world_size():
    return torch_ddp.world_size()


def ddp_barrier():
    """Waits for every torch-ddp process."""
    torch_ddp.barrier()


def ddp_gather_ints(value):
    """The int `value` of every torch-ddp process, process 0 first."""
    return torch_ddp.gather_ints(value)


def ddp_rows(batch_size):
    """The slice of a global batch's rows this torch-ddp process takes."""
    return torch_ddp.rows(batch_size)


def graphs_training(model):
    """Whether torch replays `model`'s training step as CUDA graphs."""
    return backend.is_torch() and torch_step.graphs_training(model)


# --- the optimizer's fused updates -------------------------------------------


def grouped_global_norm(tensors):
    """torch: the global norm of same-dtype tensors in one multi-tensor call."""
    return torch_ops.global_norm(tensors)


def grouped_scale(tensors, scale):
    """torch: every tensor times `scale` in one multi-tensor call."""
    return torch_ops.scale_all(tensors, scale)


def norm_parts(grads):
    """`grads` as parts whose squares sum to the global squared norm: on
    TensorFlow an embedding's sparse gradient with its repeated rows merged
    (`kbert.backend.tensorflow.merged_rows`); elsewhere `grads` itself."""
    if not backend.is_tensorflow():
        return grads
    return [tf_backend.merged_rows(g) for g in grads]


def clip_summed(grads, clip_by_global_norm):
    """TensorFlow: gradients summed over replicas, then clipped by their
    global norm (`kbert.backend.tensorflow.clip_summed`)."""
    return tf_backend.clip_summed(grads, clip_by_global_norm)


def fused_adam_update(optimizer, gradient, variable, learning_rate):
    """TensorFlow: one fused Adam(W) update where it applies (True), else False."""
    return tf_backend.fused_adam_update(optimizer, gradient, variable, learning_rate)


def adam_update(optimizer, grads, variables, learning_rate):
    """torch: every variable's Adam(W) update in fused kernels."""
    return torch_step.adam_update(optimizer, grads, variables, learning_rate)


def count_in_place(variable):
    """torch: `variable` (the iteration count) incremented in place."""
    return torch_step.count_in_place(variable)


def owns_gradients():
    """torch: whether kbert's step holds the gradients the update reads."""
    return backend.is_torch() and torch_step.owns_gradients()
