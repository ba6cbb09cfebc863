"""Raw text in a task's `fit`, `evaluate` and `predict`: strings (or
`(texts, pairs)` tuples, or lists of `(text, pair)` tuples) become model
inputs through the task's preprocessor; `tf.data` datasets of strings are
mapped through its in-graph form; model-input dicts pass through."""

import sys

import numpy as np


def is_text(x):
    """A string, or an array or list holding strings."""
    if isinstance(x, str):
        return True
    if isinstance(x, np.ndarray):
        return x.dtype.kind in ("U", "S", "O") and (
            x.size == 0 or isinstance(x.reshape(-1)[0], (str, bytes))
        )
    if isinstance(x, (list, tuple)):
        # any string: the preprocessor then names whatever is not one
        return any(isinstance(v, (str, bytes)) for v in x)
    return False


def _is_pair(p):
    return isinstance(p, tuple) and len(p) == 2 and all(isinstance(s, str) for s in p)


def is_pair_list(x):
    """A list of (text, pair) tuples of two strings."""
    return isinstance(x, list) and len(x) > 0 and all(_is_pair(p) for p in x)


def is_tf_dataset(x):
    """A `tf.data.Dataset` (without importing TensorFlow when nothing has)."""
    if "tensorflow" not in sys.modules:
        return False
    import tensorflow as tf

    return isinstance(x, tf.data.Dataset)


def preprocess_samples(preprocessor, x):
    """Raw strings (a list, an array, a (texts, pairs) tuple or a list of
    (text, pair) tuples) -> model inputs; anything else passes through."""
    if preprocessor is None or isinstance(x, dict) or x is None:
        return x
    if isinstance(x, tuple) and len(x) == 2 and all(_is_pair(v) for v in x):
        raise ValueError(
            "a tuple of two (str, str) tuples reads both as (texts, pairs) and as two "
            "(text, pair) examples: pass a list of (text, pair) tuples, or (texts, pairs) "
            "as two lists"
        )
    if isinstance(x, tuple) and len(x) == 2 and is_text(x[0]) and is_text(x[1]):
        return preprocessor(x[0], x[1])
    if is_pair_list(x):  # [(text, pair), ...]
        return preprocessor([p[0] for p in x], [p[1] for p in x])
    if is_text(x):
        return preprocessor(x)
    return x


def map_dataset(preprocessor, data, with_targets):
    """A tf.data dataset of raw strings mapped through the in-graph
    preprocessor. Elements are `x` (predict) or `(x, y[, w])`, where `x` is
    a string batch or a `(texts, pairs)` tuple."""
    import tensorflow as tf

    def convert_x(x):
        if isinstance(x, tuple) and len(x) == 2:
            return preprocessor(x[0], x[1])
        if isinstance(x, tf.Tensor) and x.dtype == tf.string:
            return preprocessor(x)
        return x

    if with_targets:
        return data.map(
            lambda x, *rest: (convert_x(x),) + rest, num_parallel_calls=tf.data.AUTOTUNE
        )
    return data.map(
        lambda *x: convert_x(x if len(x) > 1 else x[0]), num_parallel_calls=tf.data.AUTOTUNE
    )


def _holds_text(data, with_targets):
    """Whether a tf.data dataset's inputs hold strings."""
    import tensorflow as tf

    spec = data.element_spec
    if with_targets and isinstance(spec, tuple):
        spec = spec[0]
    return any(getattr(s, "dtype", None) == tf.string for s in tf.nest.flatten(spec))


def convert(task, x, y, with_targets=True):
    """(model inputs, checked targets) for a task's fit/evaluate/predict."""
    if is_tf_dataset(x):
        if task.preprocessor is None:
            return x, y
        refusal = getattr(task, "text_dataset_refusal", None)  # a model that cuts on the host
        if refusal and _holds_text(x, with_targets):
            raise ValueError(refusal)
        return map_dataset(task.preprocessor, x, with_targets), y
    if task.preprocessor is None and (
        is_text(x) or is_pair_list(x) or (isinstance(x, tuple) and len(x) == 2 and is_text(x[0]))
    ):
        conflict = getattr(task, "preprocessor_conflict", None)  # why a model has none
        if conflict:
            raise ValueError(conflict)
        raise ValueError(
            f"{type(task).__name__} got raw text but has no preprocessor to tokenize it; "
            "attach one: `model.preprocessor = kbert.BertPreprocessor.from_directory("
            "<directory with vocab.txt>, sequence_length=128)` (or "
            "`kbert.BertPreprocessor(kbert.BertTokenizer(<vocab.txt>, lowercase=...))`), "
            "or pass model inputs (a dict with token_ids, segment_ids, padding_mask)"
        )
    if (
        y is not None
        and isinstance(x, tuple)
        and len(x) == 2
        and all(isinstance(v, str) for v in x)
        and np.ndim(y) > 0
        and len(y) != 1
    ):
        raise ValueError(
            f"a tuple of two strings is one (text, pair) example, but {len(y)} targets came "
            "with it: pass several texts as a list, and pairs as (texts, pairs) or as a "
            "list of (text, pair) tuples"
        )
    if y is not None:
        checked = task.check_targets(y)
        y = y if checked is None else checked
    return task.preprocess_samples(x), y
