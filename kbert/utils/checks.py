"""Eager input checks that run before a backend gathers out of range.

Out-of-range ids are clamped silently by XLA gathers and crash torch with a
device-side assert, so they are checked on concrete values here. Traced
values (inside jit / tf.function / torch.compile) are not checked: those
calls come from `fit`/`predict`, whose inputs are checked separately.
"""

import keras
import numpy as np

from kbert import backend as kbert_backend
from kbert.backend import keras_internals


def cuda_graph_capturing(x):
    """Whether torch is capturing a CUDA graph on `x`'s device (a device
    read then invalidates the capture)."""
    import torch

    return x.is_cuda and torch.cuda.is_current_stream_capturing()


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

        return (
            isinstance(x, torch.Tensor)
            and not x.is_meta  # shapes only: Keras' symbolic build runs the model on these
            # or on tensors of ones where an operation has no meta kernel
            and not keras_internals.in_symbolic_scope()
            and not torch.compiler.is_compiling()
            and not torch.jit.is_tracing()  # a trace would freeze the host read
            and not cuda_graph_capturing(x)
        )
    return False


def is_shapes_only(x):
    """True for a torch meta tensor: Keras' symbolic build (`compute_output_spec`
    on the torch backend) runs the model on these for shapes and dtypes only."""
    if kbert_backend.name() != "torch":
        return False
    import torch

    return isinstance(x, torch.Tensor) and x.is_meta


def check_positive_ints(values, *names):
    """Raises a ValueError naming the first of `names` whose value in
    `values` (a constructor's `locals()`) is not a positive int; bools are
    refused too."""
    for name in names:
        value = values[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


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


def check_class_ids(
    values, count, kind="classification", meaning="class ids", hint="", per_example=False
):
    """Labels -> int64 array, or a ValueError naming the first bad label:
    not a number (a name, None), fractional, or outside [0, count).
    `per_example`: one label per example, so a column (N, 1) is flattened
    to (N,), and other shapes are refused (one-hot rows named as such)."""
    values = check_numbers(values, f"{kind} labels", f"{meaning} 0..{count - 1}")
    if per_example and values.ndim == 2 and values.shape[1] == 1:
        values = values[:, 0]
    if per_example and values.ndim != 1:
        one_hot = values.ndim == 2 and values.shape[1] == count and count > 1
        raise ValueError(
            f"{kind} labels must be one per example ({meaning}), got shape {values.shape}"
            + ("; these look one-hot: pass np.argmax(labels, axis=-1)" if one_hot else "")
        )
    if values.dtype.kind == "f" and not np.all(np.mod(values, 1) == 0):
        raise ValueError(f"{kind} labels must be integers ({meaning}){hint}")
    values = values.astype("int64")
    if values.size and (values.min() < 0 or values.max() >= count):
        bad = values.max() if values.max() >= count else values.min()
        raise ValueError(
            f"label {bad} is outside [0, {count}): labels are {meaning} 0..{count - 1}"
        )
    return values


def check_numbers(values, what, meaning):
    """`values` as a numeric NumPy array, or a ValueError naming the first
    entry that is not a number (a string such as a class name, None)."""
    values = np.asarray(values)
    if values.dtype.kind in "biuf":
        return values
    if values.dtype.kind in "USO":
        for value in values.reshape(-1):
            if isinstance(value, (bool, np.bool_)) or not isinstance(
                value, (int, float, np.integer, np.floating)
            ):
                value = value.item() if isinstance(value, np.generic) else value
                raise ValueError(
                    f"{what} must be numbers ({meaning}), got {value!r:.60} "
                    f"({type(value).__name__}); map names to ids first, e.g. "
                    "{name: i for i, name in enumerate(sorted(set(labels)))}"
                )
        return values.astype("float64")
    raise ValueError(f"{what} must be numbers ({meaning}), got an array of {values.dtype}")


# Model inputs checked on the host before a backend sees them, with the
# range each may take: (name, lower bound, upper bound attribute or value).
_INTEGER_INPUTS = ("token_ids", "segment_ids", "padding_mask", "mask_positions")


def _first_bad(values, low, high):
    """(index tuple, value) of the first entry outside [low, high), or None."""
    bad = (values < low) | (values >= high)
    if not bad.any():
        return None
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    return where, values[where].item()


def check_model_inputs(inputs, vocabulary_size, type_vocab_size, max_sequence_length):
    """Raises a ValueError naming the input, the bad value, its position and
    the allowed range, for model inputs (a dict of host arrays) that a
    backend would otherwise gather out of range (XLA clamps silently, torch
    asserts on the device) or that break the padding contract.

    Checks `token_ids` in [0, vocabulary_size), `segment_ids` in
    [0, type_vocab_size), `padding_mask` values 0/1, the token axis at most
    `max_sequence_length`, and `mask_positions` inside the token axis.
    Arrays that hold no values to read (tensors inside a traced step,
    torch's meta tensors of Keras' symbolic build) are not read. Cost: one
    pass over each array with numpy.
    """
    if not isinstance(inputs, dict):
        return
    arrays = {}
    for name in _INTEGER_INPUTS:
        value = inputs.get(name)
        if value is None or not is_concrete(value):
            continue
        value = keras.ops.convert_to_numpy(value) if not isinstance(value, np.ndarray) else value
        if value.dtype.kind not in "iub":
            if value.dtype.kind == "f" and value.size and not np.all(np.mod(value, 1) == 0):
                raise ValueError(f"{name} must hold integers, got {value.dtype} with fractions")
            if value.dtype.kind not in "f":
                raise ValueError(f"{name} must be an integer array, got dtype {value.dtype}")
        arrays[name] = value
    token_ids = arrays.get("token_ids")
    if token_ids is not None and token_ids.ndim >= 1:
        check_sequence_length(int(token_ids.shape[-1]), max_sequence_length)
    for name, high in (
        ("token_ids", vocabulary_size),
        ("segment_ids", type_vocab_size),
        ("padding_mask", 2),
    ):
        value = arrays.get(name)
        if value is None or value.size == 0:
            continue
        found = _first_bad(value, 0, high)
        if found is not None:
            where, bad = found
            allowed = {
                "token_ids": f"the vocabulary [0, {high})",
                "segment_ids": f"[0, {high})",
                "padding_mask": "0 or 1",
            }[name]
            hint = {
                "token_ids": "; tokenize with this model's vocabulary",
                "segment_ids": f" (type_vocab_size={high})",
                "padding_mask": " (1 for a token, 0 for padding)",
            }[name]
            raise ValueError(
                f"{name} holds {bad} at position {list(where)}, outside {allowed}{hint}"
            )
    positions = arrays.get("mask_positions")
    if positions is not None and positions.size and token_ids is not None:
        found = _first_bad(positions, 0, token_ids.shape[-1])
        if found is not None:
            where, bad = found
            raise ValueError(
                f"mask_positions holds {bad} at position {list(where)}, outside the "
                f"{token_ids.shape[-1]} token positions [0, {token_ids.shape[-1]})"
            )


class _HostChecked:
    """Set while a task's fit / evaluate / predict runs on inputs it has
    checked on the host: the model's eager `__call__` then skips reading
    device values (a host sync per step on torch)."""

    depth = 0


class inputs_checked_on_host:
    """Context manager: the inputs of the calls inside were checked."""

    def __enter__(self):
        _HostChecked.depth += 1

    def __exit__(self, *exc):
        _HostChecked.depth -= 1


def host_checked():
    return _HostChecked.depth > 0
