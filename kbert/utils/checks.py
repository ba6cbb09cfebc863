"""Eager input checks that run before a backend gathers out of range.

Out-of-range ids are clamped silently by XLA gathers and crash torch with a
device-side assert, so they are checked on concrete values here. Traced
values (inside jit / tf.function / torch.compile) are not checked: those
calls come from `fit`/`predict`, whose inputs are checked separately.
"""

import keras
import numpy as np

from kbert import backend as kbert_backend


def is_concrete(x):
    """True if `x` holds values we can read without tracing or graph mode."""
    if isinstance(x, np.ndarray):
        return True
    backend = kbert_backend.name()
    if backend == "jax":
        import jax

        return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly() and hasattr(x, "numpy")
    if backend == "torch":
        import torch

        return isinstance(x, torch.Tensor) and not torch.compiler.is_compiling()
    return False


def check_token_ids(token_ids, vocabulary_size, name="token_ids"):
    values = keras.ops.convert_to_numpy(token_ids)
    if values.size == 0:
        return
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= vocabulary_size:
        bad = high if high >= vocabulary_size else low
        raise ValueError(
            f"{name} contains id {bad}, outside the vocabulary [0, {vocabulary_size}); "
            "tokenize with this model's vocabulary, or build the model with a "
            "larger vocabulary_size"
        )


def check_sequence_length(length, max_sequence_length):
    if isinstance(length, (int, np.integer)) and length > max_sequence_length:
        raise ValueError(
            f"sequence length {length} exceeds max_sequence_length="
            f"{max_sequence_length}; truncate the inputs (the preprocessor's "
            "sequence_length) or build the model with a larger max_sequence_length"
        )


def check_class_ids(values, count, kind="classification", meaning="class ids", hint=""):
    """Labels -> int64 array, or a ValueError naming the first bad label:
    fractional values, or ids outside [0, count)."""
    values = np.asarray(values)
    if values.dtype.kind == "f" and not np.all(np.mod(values, 1) == 0):
        raise ValueError(f"{kind} labels must be integers ({meaning}){hint}")
    values = values.astype("int64")
    if values.size and (values.min() < 0 or values.max() >= count):
        bad = values.max() if values.max() >= count else values.min()
        raise ValueError(
            f"label {bad} is outside [0, {count}): labels are {meaning} 0..{count - 1}"
        )
    return values
