"""The private Keras API kbert relies on exists, with the signatures its shims
expect; and no module but `kbert.backend.keras_internals` touches it.

A Keras upgrade that moves one of these fails here first, naming the symbol.
"""

import ast
import inspect
import json
import pathlib

import keras
import numpy as np
import pytest

import kbert
from kbert.backend import keras_internals

KBERT = pathlib.Path(kbert.__file__).parent
INTERNALS = KBERT / "backend" / "keras_internals.py"
TINY = dict(
    vocabulary_size=50,
    num_layers=1,
    num_heads=2,
    hidden_dim=8,
    intermediate_dim=16,
    max_sequence_length=16,
)


def tiny_batch(rows):
    """`rows` inputs of 4 tokens, for the TINY backbone."""
    return {
        "token_ids": np.ones((rows, 4), "int32"),
        "segment_ids": np.zeros((rows, 4), "int32"),
        "padding_mask": np.ones((rows, 4), "int32"),
    }


def parameters(function):
    return list(inspect.signature(function).parameters)


def test_autocast_lookup_replaces_the_cast_of_a_mixed_precision_read():
    """`autocast_lookup` wraps `AutocastScope.maybe_cast`: within the block a
    mixed-precision layer reads what the lookup returns for its weight, and
    Keras' own cast where the lookup returns None; outside it, Keras' cast."""
    from keras.src.backend import AutocastScope

    assert parameters(AutocastScope.maybe_cast) == ["self", "value"]
    layer = keras.layers.Dense(2, use_bias=False, dtype="mixed_bfloat16")
    x = np.ones((1, 3), "float32")
    layer(x)
    kernel = layer.kernel.value
    expected = keras.ops.convert_to_numpy(layer(x)).astype("float32")
    zeros = keras.ops.zeros((3, 2), "bfloat16")
    seen = []

    def lookup(value, dtype):
        seen.append(dtype)
        return zeros if value is kernel else None

    with keras_internals.autocast_lookup(lookup):
        replaced = keras.ops.convert_to_numpy(layer(x)).astype("float32")
        with keras_internals.autocast_lookup(lambda value, dtype: None):
            declined = keras.ops.convert_to_numpy(layer(x)).astype("float32")
    np.testing.assert_array_equal(replaced, np.zeros((1, 2)))
    np.testing.assert_array_equal(declined, expected)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(layer(x)).astype("float32"), expected)
    assert "bfloat16" in seen


def test_a_callback_holds_its_model_as_model_returns_it():
    """`callback_model` reads `Callback._model`: the object `Callback.model`
    returns (after its JAX state sync)."""
    model = kbert.BertClassifier(kbert.BertBackbone(**TINY), num_classes=2)
    callback = keras.callbacks.Callback()
    callback.set_model(model)
    assert keras_internals.callback_model(callback) is model is callback.model


def test_private_methods_have_the_expected_signatures():
    from keras.src.trainers.trainer import Trainer

    assert parameters(keras.layers.Layer._flatten_layers)[:3] == [
        "self",
        "include_self",
        "recursive",
    ]
    assert {"x", "y", "y_pred", "sample_weight", "training"} <= set(
        parameters(Trainer._compute_loss)
    )
    optimizer = keras.optimizers.AdamW
    assert parameters(optimizer._clip_gradients) == ["self", "grads"]
    assert parameters(optimizer._get_variable_index) == ["self", "variable"]
    assert parameters(optimizer._apply_weight_decay) == ["self", "variables"]
    assert parameters(optimizer._use_weight_decay) == ["self", "variable"]
    assert not keras_internals.in_symbolic_scope()
    with keras.SymbolicScope():
        assert keras_internals.in_symbolic_scope()
    named = optimizer(weight_decay=0.1)
    named.exclude_from_weight_decay(var_names=["bias"])
    assert named._exclude_from_weight_decay_pattern is not None
    listed = optimizer(weight_decay=0.1)
    kernel = keras.Variable(np.ones((2,)), name="kernel")
    listed.exclude_from_weight_decay(var_list=[kernel])
    assert listed._exclude_from_weight_decay


def test_a_build_within_load_model_is_seen_as_one(tmp_path, monkeypatch):
    """`loading_saved_model` finds Keras' `saving_lib._model_from_config` on
    the stack during `load_model`, and nowhere else."""
    from keras.src.saving import saving_lib

    assert parameters(saving_lib._model_from_config)[0] == "config_json"
    assert callable(saving_lib._load_model_from_fileobj)
    assert callable(saving_lib._load_model_from_dir)
    seen = []
    original = kbert.BertBackbone.from_config.__func__

    def recording(cls, config):
        seen.append(keras_internals.loading_saved_model())
        return original(cls, config)

    monkeypatch.setattr(kbert.BertBackbone, "from_config", classmethod(recording))
    backbone = kbert.BertBackbone(**TINY)
    backbone.save(tmp_path / "backbone.keras")
    keras.saving.load_model(tmp_path / "backbone.keras")
    kbert.BertBackbone.from_config(backbone.get_config())
    # _model_from_config under another caller (Keras' Orbax loader, whose
    # state assignment skips weights silently): not a load that sets all
    saving_lib._model_from_config(
        json.dumps(keras.saving.serialize_keras_object(backbone)), None, False, True
    )
    assert seen == [True, False, False]


def test_private_state_of_a_compiled_model_and_its_optimizer():
    model = kbert.BertClassifier(kbert.BertBackbone(**TINY), num_classes=2)
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    assert keras_internals.call_has_training_arg(model) is True
    assert isinstance(keras_internals.loss_tracker(model), keras.metrics.Mean)
    losses, metrics, weighted = keras_internals.compiled_losses_and_metrics(model)
    assert losses == "sparse_categorical_crossentropy" and metrics == ["accuracy"]
    assert weighted is None
    layers = list(keras_internals.flatten_layers(model.backbone))
    assert any(isinstance(layer, keras.layers.LayerNormalization) for layer in layers)

    optimizer = model.optimizer
    assert isinstance(
        keras_internals.learning_rate_object(optimizer),
        keras.optimizers.schedules.LearningRateSchedule,
    )
    assert keras_internals.iterations_variable(optimizer) is not None
    optimizer.build(model.trainable_variables)
    for slots in ("_momentums", "_velocities"):
        assert len(getattr(optimizer, slots)) == len(model.trainable_variables)
    variable = model.trainable_variables[0]
    assert optimizer._get_variable_index(variable) == 0
    m, v = keras_internals.adam_slot_variables(optimizer, variable)
    assert m.shape == v.shape == variable.shape
    amsgrad = keras.optimizers.Adam(amsgrad=True)
    amsgrad.build([variable])
    assert keras_internals.adam_velocity_hat(amsgrad, variable).shape == variable.shape


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="the torch backend's internals")
def test_torch_backend_internals():
    from keras.src.backend import AutocastScope, get_autocast_scope
    from keras.src.backend.torch import core, trainer
    from keras.src.backend.torch.optimizers import torch_adamw

    assert issubclass(torch_adamw.AdamW, keras.optimizers.AdamW)
    assert parameters(torch_adamw.AdamW._parallel_update_step) == [
        "self",
        "grads",
        "variables",
        "learning_rate",
    ]
    assert parameters(core.convert_to_tensor)[:4] == ["x", "dtype", "sparse", "ragged"]
    assert isinstance(core.get_device(), str)
    assert parameters(trainer.TorchEpochIterator._get_iterator) == ["self"]
    assert parameters(AutocastScope.__init__)[:2] == ["self", "dtype"]
    assert get_autocast_scope() is None
    with keras_internals.autocast_scope("bfloat16"):
        assert keras_internals.current_autocast_dtype() == "bfloat16"
    variable = keras.Variable(np.ones(3, "float32"))
    import torch

    assert isinstance(keras_internals.torch_value(variable), torch.nn.Parameter)
    assert keras_internals.adamw_base() is torch_adamw.AdamW


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="the TF trainer's strategy")
def test_tensorflow_trainer_records_its_strategy():
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = kbert.BertClassifier(kbert.BertBackbone(**TINY), num_classes=2)
    assert keras_internals.distribute_strategy(model) is strategy
    assert hasattr(strategy.extended, "_in_multi_worker_mode")
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    assert parameters(TensorFlowTrainer._maybe_symbolic_build) == [
        "self",
        "iterator",
        "data_batch",
    ]


def _keras_private_names():
    """Underscore names Keras' public classes define (their private API)."""
    names = set()
    classes = [
        keras.Model,
        keras.layers.Layer,
        keras.layers.Dense,
        keras.layers.LayerNormalization,
        keras.optimizers.AdamW,
        keras.optimizers.Optimizer,
        keras.Variable,
        keras.metrics.Mean,
        keras.callbacks.Callback,
    ]
    for cls in classes:
        for klass in cls.__mro__:
            if klass.__module__.startswith("keras"):
                names |= {n for n in vars(klass) if n.startswith("_") and not n.startswith("__")}
    model = kbert.BertBackbone(**TINY)
    model.compile(optimizer="adam", loss="mse")
    names |= {n for n in vars(model) if n.startswith("_") and not n.startswith("__")}
    return names


def test_no_private_keras_access_outside_the_internals_module():
    """No `keras.src` import and no read, write or override of a private
    Keras attribute or method anywhere in kbert but keras_internals."""
    private = _keras_private_names()
    assert {"_flatten_layers", "_compile_loss", "_loss_tracker"} <= private
    offenders = []
    for path in sorted(KBERT.rglob("*.py")):
        if path == INTERNALS:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(KBERT.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("keras.src"):
                offenders.append(f"{where}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Import):
                offenders += [
                    f"{where}:{node.lineno} imports {a.name}"
                    for a in node.names
                    if a.name.startswith("keras.src")
                ]
            elif isinstance(node, ast.Attribute) and node.attr in private:
                offenders.append(f"{where}:{node.lineno} uses {node.attr}")
            elif isinstance(node, ast.FunctionDef) and node.name in private:
                offenders.append(f"{where}:{node.lineno} overrides {node.name}")
    assert offenders == [], offenders


def test_backend_checks_only_in_the_backend_package():
    offenders = []
    for path in sorted(KBERT.rglob("*.py")):
        if (KBERT / "backend") in path.parents:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "keras.backend.backend()" in line:
                offenders.append(f"{path.relative_to(KBERT.parent)}:{number}")
    assert offenders == [], offenders


def test_kbert_has_no_import_cycles():
    import grimp

    graph = grimp.build_graph("kbert")
    modules = sorted(m for m in graph.modules if m.startswith("kbert"))
    edges = {m: graph.find_modules_directly_imported_by(m) for m in modules}
    state, cycles = {}, []

    def visit(module, stack):
        state[module] = "open"
        for target in edges[module]:
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target) :] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[module] = "done"

    for module in modules:
        if module not in state:
            visit(module, [module])
    assert cycles == [], cycles


def test_jax_loop_state_that_the_error_shim_restores():
    if keras.backend.backend() != "jax":
        pytest.skip("the JAX trainer only")
    from keras.src.backend.jax.trainer import JAXTrainer

    assert callable(JAXTrainer.jax_state_sync) and callable(JAXTrainer._purge_model_variables)
    model = kbert.BertClassifier(kbert.BertBackbone(**TINY), num_classes=2)
    model.compile(optimizer="sgd")
    x = tiny_batch(2)
    model.fit(x, np.zeros(2), verbose=0)
    assert hasattr(model, "_jax_state") and model.variables[0]._value is not None

    class Stop(Exception):
        pass

    def failing():  # Keras peeks at the first batches; steps run on the later ones
        for _ in range(4):
            yield (x, np.zeros(2))
        raise Stop

    before = [keras.ops.convert_to_numpy(v) for v in model.trainable_variables]
    with pytest.raises(Stop):
        with keras_internals.jax_variables_kept_on_error(model):
            keras.Model.fit(model, failing(), steps_per_epoch=6, verbose=0)
    after = [keras.ops.convert_to_numpy(v) for v in model.trainable_variables]
    assert any(np.abs(a - b).max() > 0 for a, b in zip(after, before))  # the step's progress kept


def test_jax_step_state_set_without_tracking():
    """Keras' JAX loop stores each step's state in `_jax_state`; a kbert task
    keeps it a plain dict (Keras' tracker walked all of it every step), and
    a callback can still sync the model's variables from it."""
    if keras.backend.backend() != "jax":
        pytest.skip("the JAX trainer only")
    model = kbert.BertClassifier(kbert.BertBackbone(**TINY), num_classes=2)
    model.compile(optimizer="sgd")
    x = tiny_batch(4)
    before = keras.ops.convert_to_numpy(model.trainable_variables[-1])
    seen = []

    class Peek(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(type(self.model._jax_state))
            self.model.jax_state_sync()
            seen.append(keras.ops.convert_to_numpy(self.model.trainable_variables[-1]))

    model.fit(x, np.array([0, 1, 0, 1]), batch_size=2, verbose=0, callbacks=[Peek()])
    assert seen[0] is dict and seen[2] is dict
    assert np.abs(seen[1] - before).max() > 0  # the first step's update, synced
    assert np.abs(seen[3] - seen[1]).max() > 0
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model.trainable_variables[-1]), seen[3])


def test_torch_parameters_retracked_after_quantizing_single_layers():
    from kbert.layers import Dense

    model = keras.Sequential([keras.Input((4,)), Dense(3, name="dense")])
    model.get_layer("dense").dtype_policy = "int8_from_float32"  # quantizes the built layer
    keras_internals.retrack_variables(model)
    if keras.backend.backend() != "torch":
        return
    assert parameters(keras.layers.Layer._track_variables) == ["self"]
    # Only the current variables: the float kernel the int8 one replaced is gone.
    dtypes = sorted(str(p.dtype) for p in model.torch_params.values())
    assert dtypes == ["torch.float32", "torch.float32", "torch.int8"]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "loss_scale"])
def test_jax_split_train_step_is_keras_train_step(optimizer):
    """`jax_split_train_step`'s gradients then update give what Keras'
    `train_step` gives (logs and every state part), and the optimizer is
    left as it was (no instance override)."""
    if keras.backend.backend() != "jax":
        pytest.skip("the JAX trainer only")
    import jax

    if optimizer == "loss_scale":  # scaled gradients out, unscaled and checked in the update
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.AdamW())
    model = kbert.BertClassifier(kbert.BertBackbone(**TINY), num_classes=2)
    model.compile(optimizer=optimizer)
    x, y = tiny_batch(4), np.array([0, 1, 1, 0])
    x["token_ids"] = np.arange(16, dtype="int32").reshape(4, 4) + 3
    model.train_on_batch(x, y)  # builds the optimizer and metrics
    state = keras_internals.jax_step_state(model)
    grads, update = keras_internals.jax_split_train_step(model)
    logs, gradients, non_trainable, metrics = jax.jit(grads)(*state, (x, y))
    trainable, optimizer_values = jax.jit(update)(state[0], state[2], gradients)
    assert "stateless_apply" not in vars(model.optimizer)
    want_logs, want = jax.jit(model.train_step)(state, (x, y))
    np.testing.assert_allclose(float(logs["loss"]), float(want_logs["loss"]), rtol=1e-6)
    got = (trainable, non_trainable, optimizer_values, metrics)
    for part, want_part in zip(got, want):
        assert len(part) == len(want_part)
        for a, b in zip(part, want_part):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert any(np.abs(np.asarray(a) - np.asarray(b)).max() > 0 for a, b in zip(got[0], state[0]))


def test_trainer_state_is_one_untracked_object_per_model():
    """What the trainer keeps on a model lives in one `TrainerState`, past
    Keras' tracking: the model's weights and layers are unchanged by it."""
    from kbert.backend.state import TrainerState, state_of

    backbone = kbert.BertBackbone(50, 1, 2, 8, 16, max_sequence_length=8)
    weights = len(backbone.weights)
    state = state_of(backbone)
    assert isinstance(state, TrainerState) and state_of(backbone) is state
    state.compile_log = [backbone.weights[0]]  # a list holding a variable
    state.step_options["train"] = {"xla_gpu_autotune_level": 0}
    assert len(backbone.weights) == weights
    assert state.take("compile_log") == [backbone.weights[0]] and state.compile_log is None
    assert [k for k in vars(backbone) if k.startswith("_kbert")] == ["_kbert_state"]


def _classifier_against_keras_predict_on_batch():
    """(model, batch, both): a tiny classifier, a padded batch of two, and
    `both(batch)`, kbert's `predict_on_batch` checked against Keras' own."""
    backbone = kbert.BertBackbone(**dict(TINY, max_sequence_length=64))
    model = kbert.BertClassifier(backbone, num_classes=3)
    x = tiny_batch(2)
    x["token_ids"] = np.array([[5, 6, 7, 8], [9, 10, 11, 0]], "int32")
    x["padding_mask"] = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], "int32")

    def both(batch):
        ours = model.predict_on_batch(batch)
        keras_own = keras.Model.predict_on_batch(model, batch)
        np.testing.assert_allclose(ours, keras_own, rtol=1e-6, atol=1e-6)
        return ours

    return model, x, both


def test_jax_predict_on_batch_is_keras_predict_on_batch_as_the_model_changes():
    """kbert's JAX `predict_on_batch` (variable lists kept between calls)
    gives what Keras' own gives as the model changes under it: new weights,
    a frozen backbone (other lists, at a new shape too), quantized layers;
    the variables stay usable (nothing donated is left in them) and only
    the changes re-take the lists."""
    if keras.backend.backend() != "jax":
        pytest.skip("the JAX trainer only")
    from kbert.backend.state import state_of

    model, x, both = _classifier_against_keras_predict_on_batch()

    first = both(x)
    cache = state_of(model).predict_on_batch
    key = cache.key
    model.predict_on_batch(x)
    assert state_of(model).predict_on_batch is cache and cache.key is key  # lists kept
    weights = model.get_weights()
    model.set_weights([w + 0.5 for w in weights])
    assert np.abs(both(x) - first).max() > 1e-3  # new values read
    model.backbone.trainable = False  # other lists, same variables
    longer = {k: np.tile(v[:1], (2, 10)) for k, v in x.items()}  # 40 tokens: another bucket
    both(longer)  # a new shape, first traced on the lists of before
    assert cache.key != key
    both(x)
    model.backbone.trainable = True
    floating = both(x)
    model.quantize("int8")
    assert np.abs(both(x) - floating).max() > 0  # the int8 layers ran
    assert state_of(model).predict_on_batch is not cache  # Keras made a new step
    assert all(np.isfinite(w).all() for w in model.get_weights() if w.dtype.kind == "f")


def test_tensorflow_predict_on_batch_is_keras_predict_on_batch_as_the_model_changes():
    """kbert's TensorFlow `predict_on_batch` on a CPU (a concrete function
    with dynamic shapes, called directly) gives what Keras' own gives, at
    any length, with new weights and after `quantize` (which makes Keras
    remake its step, and kbert its function); XLA keeps Keras' call."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("the TensorFlow trainer only")
    from kbert.backend.state import state_of
    from kbert.backend.tensorflow import DirectPredict

    model, x, both = _classifier_against_keras_predict_on_batch()

    first = both(x)
    direct = state_of(model).predict_on_batch
    assert isinstance(direct, DirectPredict) and direct.calls == 1
    longer = {k: np.tile(v, (1, 5)) for k, v in x.items()}  # 20 tokens
    both(longer)
    assert state_of(model).predict_on_batch is direct and len(direct.functions) == 1
    model.set_weights([w + 0.5 for w in model.get_weights()])
    assert np.abs(both(x) - first).max() > 1e-3  # new values read
    floating = both(x)
    model.quantize("int8")
    assert np.abs(both(x) - floating).max() > 0  # the int8 layers ran
    assert state_of(model).predict_on_batch is not direct  # a new function
    xla = kbert.BertClassifier(model.backbone, num_classes=3)
    xla.jit_compile = True
    xla.predict_on_batch(x)
    assert state_of(xla).predict_on_batch is None  # Keras' XLA step
