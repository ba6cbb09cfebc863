"""Every use of private Keras API in kbert, and nothing else.

This is the only module that imports `keras.src`, reads or overrides a
private Keras attribute or method, or patches Keras at run time. Each shim
says what it works around, the Keras versions it was checked on, and when
it can go. `tests/backend/test_keras_internals.py` asserts that every
private symbol used here exists with the expected signature, so a Keras
upgrade fails there first.

Checked on Keras 3.12.0 to 3.15.1 (the declared range in pyproject.toml;
`.ci/run` runs the smoke tests on 3.12.0).
"""

import contextlib
import sys
import threading

import keras

from kbert.backend.state import state_of

# --- models and layers ------------------------------------------------------


def flatten_layers(layer):
    """Every sublayer of `layer`, recursively, itself excluded.

    Works around: Keras has no public recursive layer walk
    (`Layer._flatten_layers`, 3.10-3.15)."""
    return layer._flatten_layers(include_self=False, recursive=True)


def loading_saved_model():
    """Whether this thread is inside Keras' `load_model` of a `.keras` file
    or directory while it builds the model from its config. Keras then
    sets every weight of every layer from the file, and fails the load if
    it cannot (`Layer._check_load_own_variables`, `_raise_loading_failure`).
    Not for Orbax checkpoints: their `set_state_tree` skips, silently,
    weights it finds under another key.

    Works around: Keras gives no sign that a build is part of a load; this
    looks on the call stack for `saving_lib._model_from_config` called by
    `_load_model_from_fileobj` or `_load_model_from_dir` (3.12-3.15).
    Elsewhere, or if those are renamed, it says False and the weights are
    drawn as in any build."""
    frame = sys._getframe(1)
    while frame is not None:
        if (
            frame.f_code.co_name == "_model_from_config"
            and frame.f_globals.get("__name__") == "keras.src.saving.saving_lib"
        ):
            caller = frame.f_back
            return (
                caller is not None
                and caller.f_globals.get("__name__") == "keras.src.saving.saving_lib"
                and caller.f_code.co_name in ("_load_model_from_fileobj", "_load_model_from_dir")
            )
        frame = frame.f_back
    return False


def in_symbolic_scope():
    """Whether Keras is inferring shapes and dtypes (`compute_output_spec`):
    on torch it runs the model on meta tensors, or where an operation has
    no meta kernel on real tensors of ones, inside this scope
    (`keras.src.backend.common.symbolic_scope.in_symbolic_scope`, 3.10-3.15;
    Keras exports the scope class but not the query)."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope as query

    return query()


def set_trainable(layer, value):
    """`layer.trainable = value`, carried to its sublayers and variables
    even when `layer.trainable` is `value` already.

    Works around: on TensorFlow, Keras' tracking `__setattr__` skips the
    assignment of the object an attribute already holds
    (`KerasAutoTrackable.__setattr__`, 3.12-3.15), so the property's setter
    does not run: a backbone rebuilt from a config that says
    `trainable=False` kept every weight trainable when a task froze it."""
    type(layer).trainable.fset(layer, bool(value))


def retrack_variables(model):
    """On torch, rebuilds each layer's `torch_params` from its current
    variables, as `Model.quantize` does after converting layers
    (`Model._post_quantize` / `TorchLayer._track_variables`, 3.12-3.15):
    kbert quantizes single layers of a model it rebuilds, and without this
    the parents keep the replaced float kernels alive."""
    if keras.backend.backend() != "torch":
        return
    for layer in [model, *flatten_layers(model)]:
        layer._track_variables()


def call_has_training_arg(model):
    """Whether `model.call` takes `training` (`Layer._call_has_training_arg`,
    3.10-3.15; Keras' own torch `train_step` reads it)."""
    return model._call_has_training_arg


def compute_loss(model, x, y, y_pred, sample_weight, training=True):
    """`Trainer._compute_loss` (3.5-3.15): `compute_loss` with the
    training flag, as Keras' own torch `train_step` calls it."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def loss_tracker(model):
    """The `Mean` metric behind the `loss` log (`Trainer._loss_tracker`,
    3.10-3.15), which Keras' torch `train_step` updates itself."""
    return model._loss_tracker


def compiled_losses_and_metrics(model):
    """The losses and metrics the user passed to `compile`, as given
    (`CompileLoss._user_loss`, `CompileMetrics._user_metrics` and
    `_user_weighted_metrics`, 3.10-3.15)."""
    found = []
    if getattr(model, "_compile_loss", None) is not None:
        found.append(model._compile_loss._user_loss)
    if getattr(model, "_compile_metrics", None) is not None:
        found += [
            model._compile_metrics._user_metrics,
            model._compile_metrics._user_weighted_metrics,
        ]
    return found


def distribute_strategy(model):
    """The tf.distribute strategy the model was built under, or None
    (`Trainer._distribute_strategy`, TensorFlow backend, 3.10-3.15)."""
    return getattr(model, "_distribute_strategy", None)


def in_multi_worker_mode(strategy):
    """Whether a MultiWorkerMirroredStrategy spans several workers
    (`extended._in_multi_worker_mode()`, TensorFlow 2.16-2.21)."""
    return strategy.extended._in_multi_worker_mode()


class TrainerShims:
    """Mixed into `kbert.models.Task` (before `keras.Model`).

    `_maybe_symbolic_build` (TensorFlowTrainer, 3.10-3.15): Keras' TensorFlow trainer
    builds the model from a sample batch that it reduces with
    `strategy.reduce` on the nested structure, which
    MultiWorkerMirroredStrategy rejects ("Attempt to convert a value
    ({'token_ids': PerReplica..."). A kbert task is built when it is
    constructed; when only the optimizer is left, build it directly. Can go
    when Keras builds distributed functional models without a sample batch.
    Without a strategy Keras leaves the optimizer to the first trace of the
    step, and a `tf.function` whose first trace creates variables is traced
    a second time (seconds of a short `fit` on a CPU): the optimizer is
    built here then too, in the default strategy's scope, with the
    variables the trace would have made.

    `__setattr__`: see `UNTRACKED`.
    """

    # `_jax_state` (JAXTrainer, 3.12-3.15): Keras' JAX `fit`, `evaluate` and
    # `predict` set it after every step to a dict of the step's state (for
    # BERT-base some 600 arrays), and `Layer.__setattr__` runs its tracker
    # over the whole structure each time, host time per step that a GPU
    # then waits for. The state holds arrays only,
    # nothing to track, so it is stored as a plain attribute. Can go when
    # Keras stores it untracked.
    UNTRACKED = frozenset({"_jax_state", "_jax_state_synced"})

    def __setattr__(self, name, value):
        if name in TrainerShims.UNTRACKED and not keras.config.is_nnx_enabled():
            object.__setattr__(self, name, value)
            return
        super().__setattr__(name, value)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        layers_built = all(layer.built for layer in self._flatten_layers())
        if layers_built and self.optimizer is not None and not self.optimizer.built:
            with self.distribute_strategy.scope():
                self.optimizer.build(self.trainable_variables)
        built = (
            layers_built
            and (self._compile_metrics is None or self._compile_metrics.built)
            and (self._compile_loss is None or self._compile_loss.built)
        )
        if built and distribute_strategy(self) is not None:
            return
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)


def callback_model(callback):
    """The model a callback is attached to, as `callback.model` without
    the state sync it runs on JAX (`Callback.model` calls
    `model.jax_state_sync()`: inside a `fit` it writes the step state into
    every variable, some 600 assigns for BERT-base, and the next step reads
    them back; from another thread, while a step runs, it writes a state
    that step then donates). For callbacks that use the model, not its
    variables' values, at every step or off the main thread
    (`Callback._model`, 3.10-3.15)."""
    return callback._model


def jax_state_unsynced(model):
    """Whether Keras' JAX loop holds a step state it has not written into
    the model's variables yet (`_jax_state`, `_jax_state_synced`,
    JAXTrainer 3.12-3.15): what `jax_state_sync()` would write."""
    return bool(getattr(model, "_jax_state", None)) and not model._jax_state_synced


def current_values(variables):
    """The values `variables` have where the caller runs: inside a
    `StatelessScope` (a JAX training step, whose variables are traced
    values there) the scope's, else the variables' own
    (`keras.src.backend.common.stateless_scope`, 3.10-3.15)."""
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    scope = get_stateless_scope()
    values = [None if scope is None else scope.get_current_value(v) for v in variables]
    return [v.value if value is None else value for v, value in zip(variables, values)]


@contextlib.contextmanager
def variables_bound(variables, values):
    """A `StatelessScope` in which `variables` hold `values`; yields a
    function giving each variable's value at that point (after assigns).
    For running a layer on other weights than its own, as a loop over
    layers does (3.10-3.15)."""
    from keras.src.backend.common.stateless_scope import StatelessScope

    with StatelessScope(state_mapping=list(zip(variables, values))) as scope:
        yield lambda variable: scope.get_current_value(variable)


# --- optimizers -------------------------------------------------------------


def adamw_base():
    """keras.optimizers.AdamW as the backend runs it fastest.

    Works around: on torch, Keras maps `keras.optimizers.AdamW` itself to a
    multi-tensor implementation (`torch._foreach_*`, a few kernels for all
    variables), but only for that exact class (`TorchOptimizer.__new__`): a
    subclass falls back to the per-variable update (about 20 kernels and
    several host syncs per variable). So kbert's subclass derives from the
    torch class (`keras.src.backend.torch.optimizers.torch_adamw.AdamW`,
    3.10-3.15). Can go if Keras dispatches subclasses too."""
    if keras.backend.backend() == "torch":
        from keras.src.backend.torch.optimizers import torch_adamw

        return torch_adamw.AdamW
    return keras.optimizers.AdamW


class OptimizerShims:
    """Mixed into kbert's optimizers, before the Keras class.

    `_clip_gradients` (BaseOptimizer, 3.10-3.15) is the hook Keras calls with
    the gradients before the update; kbert routes it to the public
    `clip_gradients(grads)` of the optimizer (replica-exact, sync-free
    clipping). `_parallel_update_step` (the torch parallel optimizers,
    3.10-3.15) is the multi-tensor update Keras' torch `_backend_update_step`
    calls; kbert routes it to `parallel_update(grads, variables,
    learning_rate)` when the optimizer defines one. `_apply_weight_decay`
    (BaseOptimizer / TorchOptimizer, 3.10-3.15), which Keras calls with the
    variables just before that update: an optimizer with
    `defers_weight_decay` true notes which variables to decay instead, for
    its update to apply (`take_deferred_decay`; `apply_weight_decay_now`
    applies Keras' decay to them). Likewise an optimizer whose
    `defers_clipping()` is true leaves the global-norm clipping's scale
    (its `clip_scale(grads)`) to its update (`take_deferred_clip_scale`).
    """

    defers_weight_decay = False

    def _apply_weight_decay(self, variables):
        if not self.defers_weight_decay:
            return super()._apply_weight_decay(variables)
        ids = frozenset(id(v) for v in variables if self.weight_decay and self._use_weight_decay(v))
        state_of(self).deferred_decay = ids

    def take_deferred_decay(self, variables):
        """For each of `variables`, whether Keras left its decay to this
        update (and forgets them)."""
        ids = state_of(self).take("deferred_decay", frozenset())
        return [id(v) in ids for v in variables]

    def apply_weight_decay_now(self, variables):
        """Keras' decoupled weight decay of `variables` (all to be decayed)."""
        if variables:
            super()._apply_weight_decay(variables)

    def _clip_gradients(self, grads):
        self.take_deferred_clip_scale()  # one left by an interrupted step
        if not self.global_clipnorm:
            return super()._clip_gradients(grads)
        if self.defers_clipping():
            # the scale only: the update multiplies the gradients by it
            state_of(self).clip_scale = self.clip_scale(grads)
            return grads
        return self.clip_gradients(grads)

    def defers_clipping(self):
        """Whether the update scales the gradients (see `_clip_gradients`)."""
        return False

    def take_deferred_clip_scale(self):
        """The clipping scale `_clip_gradients` left to this update, or None
        (and forgets it)."""
        return state_of(self).take("clip_scale")

    def _parallel_update_step(self, grads, variables, learning_rate):
        if hasattr(self, "parallel_update"):
            return self.parallel_update(grads, variables, learning_rate)
        return super()._parallel_update_step(grads, variables, learning_rate)


def learning_rate_object(optimizer):
    """What the optimizer was given as its learning rate: a variable, a
    schedule or a callable (`BaseOptimizer._learning_rate`, 3.10-3.15; the
    public `learning_rate` evaluates it)."""
    return getattr(optimizer, "_learning_rate", None)


def weight_decay_excluded(optimizer, variables):
    """Those of `variables` the optimizer keeps out of its weight decay, by
    its name patterns and variable list, or None when it has neither
    (`BaseOptimizer._exclude_from_weight_decay_pattern`,
    `_exclude_from_weight_decay` and `_use_weight_decay`, 3.10-3.15; Keras
    has no public reader of `exclude_from_weight_decay`'s settings)."""
    pattern = getattr(optimizer, "_exclude_from_weight_decay_pattern", None)
    if pattern is None and not getattr(optimizer, "_exclude_from_weight_decay", None):
        return None
    return [v for v in variables if not optimizer._use_weight_decay(v)]


def iterations_variable(optimizer):
    """The step counter variable itself (`BaseOptimizer._iterations`,
    3.10-3.15); the public `iterations` is a derived value under gradient
    accumulation."""
    return optimizer._iterations


def adam_slots(optimizer, variables):
    """(momentums, velocities, velocity hats or None) for `variables`, as
    torch tensors (`Adam._momentums`, `_velocities`, `_velocity_hats`,
    `_get_variable_index`, 3.10-3.15)."""
    index = optimizer._get_variable_index
    m = [torch_value(optimizer._momentums[index(v)]) for v in variables]
    v = [torch_value(optimizer._velocities[index(v)]) for v in variables]
    hats = None
    if optimizer.amsgrad:
        hats = [torch_value(optimizer._velocity_hats[index(v)]) for v in variables]
    return m, v, hats


def adam_slot_variables(optimizer, variable):
    """(momentum, velocity) Keras variables of one variable
    (`Adam._momentums`, `_velocities`, `_get_variable_index`, 3.10-3.15)."""
    index = optimizer._get_variable_index(variable)
    return optimizer._momentums[index], optimizer._velocities[index]


def adam_velocity_hat(optimizer, variable):
    """The amsgrad maximum of the velocity of one variable, a Keras variable
    (`Adam._velocity_hats`, `_get_variable_index`, 3.10-3.15)."""
    return optimizer._velocity_hats[optimizer._get_variable_index(variable)]


def torch_value(variable):
    """A torch Keras variable's parameter tensor (`Variable._value`,
    3.10-3.15). `variable.value` adds an autocast and symbolic-scope check per
    read (600 reads per BERT-base step) that an optimizer update does not
    need."""
    return variable._value


def add_variable_methods(variable, mixin):
    """Gives `variable` the methods of `mixin` (its class becomes a subclass
    of both); returns the variable.

    Works around: Keras variables have no hook for `assign_add`; kbert's
    torch step counter must add in place on the device (Keras turns the
    Python int into a tensor first, a synchronising copy). The variable's
    value and saving are unchanged."""
    base = type(variable)
    if not isinstance(variable, mixin):
        key = (mixin, base)
        if key not in _MIXED_CLASSES:  # one class per variable class, not per optimizer
            _MIXED_CLASSES[key] = type(f"{mixin.__name__}{base.__name__}", (mixin, base), {})
        variable.__class__ = _MIXED_CLASSES[key]
    return variable


_MIXED_CLASSES = {}


# --- the torch backend ------------------------------------------------------


def torch_device():
    """Keras' current torch device name (`keras.src.backend.torch.core.get_device`,
    3.10-3.15; honours `keras.device` scopes)."""
    from keras.src.backend.torch.core import get_device

    return get_device()


def autocast_scope(dtype):
    """The scope `Layer.__call__` enters to autocast a layer's inputs
    (`keras.src.backend.AutocastScope`, 3.10-3.15)."""
    from keras.src.backend import AutocastScope

    return AutocastScope(dtype)


def current_autocast_dtype():
    """The dtype of the active autocast scope, or None
    (`keras.src.backend.get_autocast_scope`, 3.10-3.15)."""
    from keras.src.backend import get_autocast_scope

    scope = get_autocast_scope()
    return scope.dtype if scope is not None else None


_AUTOCAST = threading.local()


@contextlib.contextmanager
def autocast_lookup(lookup):
    """Within the block (this thread), a variable value that Keras
    autocasts to `dtype` is `lookup(value, dtype)` where that returns a
    tensor, else Keras' own cast.

    Works around: Keras casts a mixed-precision variable on every read
    (`AutocastScope.maybe_cast`, 3.10-3.15); a decode step read once per
    token casts every weight of the decoder per token. Can go if Keras
    caches the casts of unchanged variables."""
    from keras.src.backend import AutocastScope

    if not getattr(AutocastScope.maybe_cast, "_kbert_lookup", False):
        original = AutocastScope.maybe_cast

        def maybe_cast(self, value):
            active = getattr(_AUTOCAST, "lookup", None)
            if active is not None and self.dtype is not None:
                found = active(value, self.dtype)
                if found is not None:
                    return found
            return original(self, value)

        maybe_cast._kbert_lookup = True
        AutocastScope.maybe_cast = maybe_cast
    previous = getattr(_AUTOCAST, "lookup", None)
    _AUTOCAST.lookup = lookup
    try:
        yield
    finally:
        _AUTOCAST.lookup = previous


_CONVERTERS = {}


@contextlib.contextmanager
def torch_convert_to_tensor(replacement_factory):
    """Within the block, the torch backend's `convert_to_tensor` is
    `replacement_factory(original)` in every Keras torch module that
    imported it by name.

    Works around: Keras' loss reduction and `Mean` metrics turn Python
    numbers into tensors inside the step; on a GPU each is a pageable
    host-to-device copy that synchronises the stream (and cannot be captured
    in a CUDA graph). Checked on 3.11-3.15. Can go if Keras creates such
    constants on the device."""
    from keras.src.backend.torch import core

    original = core.convert_to_tensor
    # the module list is found once: a scan of sys.modules on every
    # conversion would cost more than the conversion
    if _CONVERTERS.get("original") is not original:
        _CONVERTERS["original"] = original
        _CONVERTERS["modules"] = [
            m
            for name, m in list(sys.modules.items())
            if name.startswith("keras.src.backend.torch")
            and getattr(m, "convert_to_tensor", None) is original
        ]
    modules = _CONVERTERS["modules"]
    replacement = replacement_factory(original)
    for module in modules:
        module.convert_to_tensor = replacement
    try:
        yield
    finally:
        for module in modules:
            module.convert_to_tensor = original


_END = object()


def _host_iterator_class(base):
    class HostBatchIterator(base):
        """Keras' torch epoch iterator, with each batch made on the host."""

        def _get_iterator(self):
            loader = super()._get_iterator()

            def batches():
                with keras.device("cpu"):
                    iterator = iter(loader)
                while True:
                    with keras.device("cpu"):
                        batch = next(iterator, _END)
                    if batch is _END:
                        return
                    yield batch

            return batches()

    return HostBatchIterator


@contextlib.contextmanager
def torch_batches_on_host():
    """Within the block, Keras' torch `fit`/`evaluate` make each batch on the
    host (Keras' device scope set to "cpu" around each `next()` of the
    loader), replacing `keras.src.backend.torch.trainer.TorchEpochIterator`
    with a subclass that overrides `_get_iterator` (3.10-3.15).

    Works around: Keras' torch data adapters put each batch on the GPU with
    a blocking copy; kbert's step copies host batches without blocking. Can
    go if Keras offers non-blocking input copies."""
    from keras.src.backend.torch import trainer

    original = trainer.TorchEpochIterator
    trainer.TorchEpochIterator = _host_iterator_class(original)
    try:
        yield
    finally:
        trainer.TorchEpochIterator = original


@contextlib.contextmanager
def jax_variables_kept_on_error(model):
    """Within the block (a `fit`, `evaluate` or `predict` on JAX), an
    exception leaves the model's variables holding their latest values.

    Works around: Keras' JAX loops move variable values into a local state
    and empty the variables (`Variable._value = None`, through
    `_purge_model_variables`); they are written back from `model._jax_state`
    only when a loop ends. An exception raised before the first step has
    stored `_jax_state` (bad data from the iterator, a KeyboardInterrupt)
    leaves every variable empty, the trained weights lost. Here the values
    are written back from `_jax_state` when a step stored one (through the
    public `jax_state_sync`), else from references taken before the block
    (unchanged: no step ran). Checked on Keras 3.12-3.15."""
    if keras.backend.backend() != "jax":
        yield
        return
    variables = {id(v): v for v in model.variables}
    if getattr(model, "optimizer", None) is not None:
        variables.update({id(v): v for v in model.optimizer.variables})
    variables.update({id(v): v for v in model.metrics_variables})
    saved = [(v, v._value) for v in variables.values()]
    try:
        yield
    except BaseException:
        if getattr(model, "_jax_state", None):
            model.jax_state_sync()
        for variable, value in saved:
            if variable._value is None and value is not None:
                variable._value = value
        raise


def jax_step_function(model, kind="train"):
    """The jitted step Keras' JAX `fit` makes of `model.train_step`
    ("train") or `model.test_step` ("test"): `jax.jit(step,
    donate_argnums=0)` without a distribution (`JAXTrainer.make_train_function`
    / `make_test_function`, Keras 3.12-3.15), with the compiler options
    kbert gave Keras' jit (`jax_jit_options`). A jit of the same bound
    method and options shares JAX's compilation cache with Keras' own. Can
    go if Keras exposes its jitted steps."""
    import jax

    step = model.train_step if kind == "train" else model.test_step
    options = step_compiler_options(model, kind)
    return jax.jit(step, donate_argnums=0, compiler_options=options)


def step_compiler_options(model, kind):
    """The XLA compiler options of `model`'s `kind` step ("train", "test",
    "predict"): those Keras' current step was jitted with, or those planned
    for the next (`plan_step_compiler_options`); None: XLA's defaults."""
    return state_of(model).step_options.get(kind)


def step_compiler_options_planned(model, kind):
    """Whether `model`'s `kind` step has options planned (or made)."""
    return kind in state_of(model).step_options


def clear_step_compiler_options(model):
    """Forgets the planned options: Keras' `compile` drops its steps."""
    state_of(model).step_options = {}


def plan_step_compiler_options(model, kind, options):
    """Sets the compiler options of `model`'s next `kind` step; a step Keras
    already made keeps its own (and its compiled programs)."""
    function = {
        "train": model.train_function,
        "test": model.test_function,
        "predict": model.predict_function,
    }[kind]
    if function is None:
        state_of(model).step_options[kind] = dict(options) if options else None


_JIT_LOCK = threading.RLock()  # one rebinding of Keras' `jit` at a time


@contextlib.contextmanager
def jax_jit_options(model, kind, wrap=None):
    """Keras' JAX trainer jits the `kind` step it makes inside this context
    with `step_compiler_options(model, kind)`: `make_*_function` call the
    `jit` of `keras.src.backend.jax.trainer` (jax.jit, or nnx.jit under
    NNX, left alone), rebound here for the call (Keras 3.12-3.15); with
    `wrap`, Keras gets `wrap(jitted step)`. Can go if Keras' `compile`
    takes XLA compiler options."""
    options = step_compiler_options(model, kind)
    if not options or keras.backend.backend() != "jax":
        yield
        return
    import functools

    import jax
    from keras.src.backend.jax import trainer

    with _JIT_LOCK:
        if keras.config.is_nnx_enabled() or trainer.jit is not jax.jit:
            # not ours to rebind: the step gets no options, and the
            # ahead compiler must not use them either
            state_of(model).step_options[kind] = None
            yield
            return
        jit = functools.partial(jax.jit, compiler_options=options)
        trainer.jit = jit if wrap is None else lambda *a, **k: wrap(jit(*a, **k))
        try:
            yield
        finally:
            trainer.jit = jax.jit


def jax_predict_on_batch(model, x, keras_predict_on_batch):
    """Keras' JAX `predict_on_batch(x)` (the model's `predict_step` on the
    same state, jitted), without walking the layer tree four times and
    assigning every variable through `Variable.assign` at each call.

    Works around: `JAXTrainer.predict_on_batch` gathers
    `trainable_variables` and `non_trainable_variables` (each a recursive
    walk of the layer tree) to make the step's state, donates the state to
    its jitted step, and gathers them again to write every returned value
    back through `assign` (conversion, shape and dtype checks): several
    milliseconds per call for MobileBERT's 1,092 variables on a CPU, a
    large part of a batch-1 prediction. Here the two lists are kept for as
    long as the layer tree's fingerprint (`_variables_fingerprint`) is unchanged. Where
    Keras' step is a plain `jax.jit` (no compiler options, no kbert
    wrapper: on a CPU) the step is jitted here without donating the
    weights, so only the non-trainable state comes back and the
    fingerprint is checked while the program runs (a changed tree runs the
    batch again, on fresh lists); otherwise Keras' own jitted step runs,
    the fingerprint checked first, and its state is written back with
    `Variable._direct_assign`, as `assign` ends. Keras' own call runs where
    this cannot match it: a distribution (sharded state), Flax NNX
    variables, a loop holding unsynced state, a model not built yet
    (`JAXTrainer.predict_on_batch` and `predict_function`, `_jax_state`,
    `Layer._flatten_layers`, `_trainable_variables`,
    `_non_trainable_variables`, `_seed_generators`, `Variable._value`,
    `_direct_assign`, 3.12-3.15). Can go when Keras' `predict_on_batch`
    keeps its variable lists."""
    import numpy as np
    from keras.src.distribution import distribution_lib

    layers = model._flatten_layers()
    if (
        keras.config.is_nnx_enabled()
        or distribution_lib.distribution() is not None
        or jax_state_unsynced(model)
        or not all(layer.built for layer in layers)
    ):
        return keras_predict_on_batch(x)
    model.make_predict_function()
    cache = state_of(model).predict_on_batch
    if cache is None or cache.keras_step is not model.predict_function:
        cache = state_of(model).predict_on_batch = _PredictOnBatch(model)
    fresh = cache.refresh(model, layers) if cache.own_step is None or cache.key is None else False
    state = cache.values()
    if state is None:
        return keras_predict_on_batch(x)
    if cache.own_step is None:  # Keras' step donates what it gets: lists checked first

        def data():
            yield (x,)

        outputs, (trainable_values, non_trainable_values) = model.predict_function(state, data())
        cache.write_back(cache.trainable, trainable_values)
    else:
        try:
            outputs, non_trainable_values = cache.own_step(*state, x)
        except Exception:
            # a new shape traced on lists the tree no longer has
            if fresh or not cache.refresh(model, layers):
                raise
            fresh = True
            outputs, non_trainable_values = cache.own_step(*cache.values(), x)
        if not fresh and cache.refresh(model, layers):  # checked while it runs
            outputs, non_trainable_values = cache.own_step(*cache.values(), x)
    cache.write_back(cache.non_trainable, non_trainable_values)
    return keras.tree.map_structure(np.array, outputs)


class _PredictOnBatch:
    """The variable lists of `jax_predict_on_batch` for one Keras predict
    step (`keras_step`), the fingerprint they were taken at, and the step
    jitted without donation (`own_step`) where Keras' is a plain jit."""

    def __init__(self, model):
        import jax

        self.keras_step = model.predict_function
        self.key = self.trainable = self.non_trainable = None
        plain = (
            model.jit_compile
            and not model.run_eagerly
            and not step_compiler_options(model, "predict")
            and state_of(model).ahead_predict is None
        )
        self.own_step = None
        if plain:

            def step(trainable, non_trainable, x):
                return model.predict_step((trainable, non_trainable), (x,))

            self.own_step = jax.jit(step)

    def refresh(self, model, layers):
        """Takes the lists again if the fingerprint changed; whether it did."""
        key = _variables_fingerprint(model, layers)
        if key == self.key:
            return False
        self.key = key
        self.trainable = model.trainable_variables
        self.non_trainable = model.non_trainable_variables
        return True

    def values(self):
        """([trainable values], [non-trainable values]) as `Variable.value`
        gives them outside any scope (else None: Keras' call runs; neither
        a scope nor an unset value changes between the lists' refresh and
        the step's run within one call)."""
        from keras.src.backend.common.stateless_scope import in_stateless_scope
        from keras.src.backend.common.variables import get_autocast_scope

        if in_stateless_scope() or get_autocast_scope() is not None:
            return None
        state = ([v._value for v in self.trainable], [v._value for v in self.non_trainable])
        if any(value is None for values in state for value in values):
            return None
        return state

    @staticmethod
    def write_back(variables, values):
        for variable, value in zip(variables, values):
            variable._direct_assign(value)


def _variables_fingerprint(model, layers):
    """What `model.trainable_variables` and `non_trainable_variables`
    depend on (for `jax_predict_on_batch`): the model's layers in walk
    order, each one's trainable flag, tracked variables and seed
    generators, and each variable's trainable flag. Identities, not
    values."""
    key = [model.trainable]
    for layer in layers:
        trainable, non_trainable = layer._trainable_variables, layer._non_trainable_variables
        key.append((id(layer), layer._trainable, len(trainable), len(non_trainable)))
        key.extend(map(id, trainable))
        key.extend(map(id, non_trainable))
        key.extend([v._trainable for v in trainable])
        key.extend([v._trainable for v in non_trainable])
        key.extend([id(g.state) for g in layer._seed_generators])
    return tuple(key)


def jax_step_state(model, kind="train"):
    """The state Keras' JAX `fit` passes its jitted `train_step` ("train")
    or `test_step` ("test"): (trainable, non-trainable, optimizer,
    metrics) variable values, without the optimizer's for "test"; and
    `predict` its predict step ("predict"): (trainable, non-trainable)
    (`JAXTrainer._get_jax_state`, Keras 3.12-3.15). Can go with
    `jax_step_function`."""
    if kind == "predict":
        return model._get_jax_state(trainable_variables=True, non_trainable_variables=True)
    return model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=kind == "train",
        metrics_variables=True,
    )


# Set on a thread while it traces the gradient half of a split step.
_GRADIENTS_OUT = threading.local()
_GRADIENTS_LOCK = threading.Lock()
_GRADIENTS_USERS = {}  # id(optimizer) -> threads within `_gradients_out`


def jax_split_train_step(model):
    """Keras' JAX `train_step` as two functions, for programs that compile
    in parallel: `grads(trainable, non_trainable, optimizer, metrics,
    data)` -> (logs, gradients, non_trainable, metrics) and `update(
    trainable, optimizer, gradients)` -> (trainable, optimizer). `update`
    after `grads` is `train_step` (to float rounding across the program
    boundary). Relies on `JAXTrainer.train_step` (Keras 3.12-3.15) calling
    `self.optimizer.stateless_apply(optimizer_variables, grads,
    trainable_variables)` once and putting its results in the state's
    trainable and optimizer slots: while `grads` traces, the optimizer
    hands the gradients back instead (pinned by a test)."""
    optimizer = model.optimizer

    def grads(trainable, non_trainable, optimizer_values, metrics, data):
        state = (trainable, non_trainable, optimizer_values, metrics)
        with _gradients_out(optimizer):
            logs, state = model.train_step(state, data)
        return logs, state[0], state[1], state[3]

    def update(trainable, optimizer_values, gradients):
        return optimizer.stateless_apply(optimizer_values, gradients, trainable)

    return grads, update


@contextlib.contextmanager
def _gradients_out(optimizer):
    """Within, on this thread, `optimizer.stateless_apply` returns the
    gradients as the new trainable values and the optimizer's unchanged
    (an override on the optimizer while any thread is within; other
    threads get the real update)."""
    with _GRADIENTS_LOCK:
        users = _GRADIENTS_USERS.get(id(optimizer), 0)
        if not users:
            apply = type(optimizer).stateless_apply

            def stateless_apply(optimizer_values, gradients, trainable):
                if getattr(_GRADIENTS_OUT, "on", False):
                    return list(gradients), optimizer_values
                return apply(optimizer, optimizer_values, gradients, trainable)

            object.__setattr__(optimizer, "stateless_apply", stateless_apply)
        _GRADIENTS_USERS[id(optimizer)] = users + 1
    _GRADIENTS_OUT.on = True
    try:
        yield
    finally:
        _GRADIENTS_OUT.on = False
        with _GRADIENTS_LOCK:
            _GRADIENTS_USERS[id(optimizer)] -= 1
            if not _GRADIENTS_USERS[id(optimizer)]:
                del _GRADIENTS_USERS[id(optimizer)]
                object.__delattr__(optimizer, "stateless_apply")
