"""Checks every kbert layer/model/task gets (see DESIGN.md, Tests)."""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np

BACKENDS = ("jax", "torch", "tensorflow")
TINY = dict(
    vocabulary_size=97,
    num_layers=2,
    num_heads=4,
    hidden_dim=32,
    intermediate_dim=37,
    max_sequence_length=24,
    type_vocab_size=2,
)


def to_numpy(tree):
    return keras.tree.map_structure(lambda t: keras.ops.convert_to_numpy(t), tree)


def max_abs_diff(a, b):
    a, b = keras.tree.flatten(to_numpy(a)), keras.tree.flatten(to_numpy(b))
    assert len(a) == len(b)
    return max(
        float(np.max(np.abs(x.astype("float64") - y.astype("float64")))) for x, y in zip(a, b)
    )


def count_state_writes(model):
    """A list that records each time a JAX `fit` writes its step state into
    the model's variables (`jax_state_sync` with a state not yet written),
    which costs a write of every variable and a read at the next step."""
    from kbert.backend import keras_internals

    writes = []
    sync = model.jax_state_sync

    def counting():
        if keras_internals.jax_state_unsynced(model):
            writes.append(True)
        return sync()

    object.__setattr__(model, "jax_state_sync", counting)
    return writes


def backbone_inputs(batch=3, length=10, vocabulary_size=97, seed=0):
    """Random ids with ragged padding: row 0 full, the others padded."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, length), "int32")
    for row in range(1, batch):
        mask[row, max(1, length - 3 * row) :] = 0
    return {
        "token_ids": (rng.integers(1, vocabulary_size, (batch, length)) * mask).astype("int32"),
        "segment_ids": (rng.integers(0, 2, (batch, length)) * mask).astype("int32"),
        "padding_mask": mask,
    }


def check_config_round_trip(model):
    config = model.get_config()
    clone = type(model).from_config(config)
    assert clone.get_config() == config
    return clone


def check_eager_vs_compiled(model, x, atol=1e-5):
    eager = model(x, training=False)
    compiled = model.predict(x, verbose=0, batch_size=len(next(iter(x.values()))))
    assert max_abs_diff(eager, compiled) <= atol


def check_keras_round_trip(model, x, tmp_path, atol=1e-6):
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    restored = keras.saving.load_model(path)  # safe_mode=True by default
    assert type(restored) is type(model)
    assert max_abs_diff(model(x), restored(x)) <= atol
    return path


def check_preset_round_trip(model, x, tmp_path):
    directory = os.path.join(tmp_path, "preset")
    model.save_to_preset(directory)
    restored = type(model).from_preset(directory)
    assert max_abs_diff(model(x), restored(x)) == 0.0
    return directory


def load_in_backend(backend, artifact, inputs_path, outputs_path):
    """Loads a .keras artifact in a fresh process under `backend` and writes its outputs."""
    code = textwrap.dedent(
        f"""
        import numpy as np, keras, kbert
        x = dict(np.load({inputs_path!r}))
        model = keras.saving.load_model({artifact!r})
        y = keras.tree.flatten(keras.tree.map_structure(keras.ops.convert_to_numpy, model(x)))
        np.savez({outputs_path!r}, *y)
        """
    )
    env = dict(os.environ, KERAS_BACKEND=backend, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with np.load(outputs_path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]
