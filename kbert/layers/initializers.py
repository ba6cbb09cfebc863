"""BERT's truncated-normal initializer, and placeholders for the weights a
checkpoint is about to set.

A model loaded from a checkpoint is built, then its weights are set from
the checkpoint. Drawing each weight from its initializer at the build
would be most of the load's time: on JAX mostly compiling a sampling
program per weight shape, on torch the sampling itself ("Loading a
checkpoint" in benchmarks/RESULTS.md). Under `placeholders()`,
`truncated_normal` gives `Placeholder`s instead: zeros from host memory,
no draw and no program. `draw_unset` then draws the real values of the
weights the checkpoint did not set (a new adapter, a pooler a checkpoint
lacks) and gives the layers their real initializers back.
`placeholders_when_loading` does the same for the builds within Keras'
`load_model`, which then sets every weight from the file.
"""

import contextlib
import functools
import threading

import keras
import numpy as np

from kbert.backend import keras_internals

_STATE = threading.local()


def truncated_normal(stddev):
    """`keras.initializers.TruncatedNormal(stddev=stddev)`, or its
    `Placeholder` within `placeholders()` (on this thread)."""
    real = keras.initializers.TruncatedNormal(stddev=stddev)
    made = getattr(_STATE, "made", None)
    if made is None:
        return real
    made.append(Placeholder(real))
    return made[-1]


@contextlib.contextmanager
def placeholders():
    """Within, on this thread: `truncated_normal` gives placeholders, which
    the list this yields collects. The caller sets the weights after, then
    calls `draw_unset` with that list."""
    previous = getattr(_STATE, "made", None)
    _STATE.made = []
    try:
        yield _STATE.made
    finally:
        _STATE.made = previous


class Placeholder(keras.initializers.Initializer):
    """Zeros in place of `real`'s draw, for a weight that will be set. It
    counts the weights it made, so that `draw_unset` can tell that it found
    each of them."""

    def __init__(self, real):
        self.real = real
        self.made = 0

    def __call__(self, shape, dtype=None):
        self.made += 1
        if keras.distribution.distribution() is not None:
            # Keras may compile the initializer to place a sharded weight:
            # zeros made in the program, not a host array baked into it
            return keras.ops.zeros(shape, dtype=dtype)
        try:
            dtype = np.dtype(keras.backend.standardize_dtype(dtype or "float32"))
        except TypeError:  # bfloat16 and other types numpy lacks: the variable casts
            dtype = np.float32
        return np.zeros(shape, dtype)

    def get_config(self):
        return self.real.get_config()


def draw_unset(model, set_paths, made):
    """After `model` (built under `placeholders()`, which yielded `made`)
    had its weights set: draws from the real initializer each weight that a
    placeholder made and whose path is not in `set_paths`, and puts the
    real initializers back on the layers. A weight is found by its layer's
    `<name>_initializer` attribute (Keras' `kernel_initializer`,
    `embeddings_initializer`, ...); raises RuntimeError if some weight a
    placeholder made is not found."""
    set_paths = set(set_paths)
    found = 0
    for layer in [model, *keras_internals.flatten_layers(model)]:
        held = {
            name[: -len("_initializer")]: value
            for name, value in vars(layer).items()
            if name.endswith("_initializer") and isinstance(value, Placeholder)
        }
        if not held:
            continue
        for variable in layer.weights:
            placeholder = held.get(variable.name)
            if placeholder is None or variable.path != f"{layer.path}/{variable.name}":
                continue  # not a placeholder's, or a sublayer's weight
            found += 1
            if variable.path not in set_paths:
                variable.assign(placeholder.real(variable.shape, dtype=variable.dtype))
        for name, placeholder in held.items():
            setattr(layer, f"{name}_initializer", placeholder.real)
    expected = sum(placeholder.made for placeholder in made)
    if found != expected:
        raise RuntimeError(
            f"{model.name}: placeholders made {expected} weights but {found} were "
            "found on their layers; some would keep zeros"
        )


def placeholders_when_loading(from_config):
    """Decorates a model class's `from_config`: within Keras' `load_model`
    (which sets every weight after, and fails the load if it cannot) the
    model is built under `placeholders()`, and its layers get their real
    initializers back at once, so that a later build draws as any other.
    Elsewhere, and within an outer `placeholders()`, `from_config` as it is."""

    @functools.wraps(from_config)
    def wrapped(cls, config):
        if getattr(_STATE, "made", None) is not None or not keras_internals.loading_saved_model():
            return from_config(cls, config)
        with placeholders() as made:
            model = from_config(cls, config)
        draw_unset(model, [variable.path for variable in model.weights], made)
        return model

    return wrapped
