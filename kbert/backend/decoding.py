"""Decode loops as one compiled program per input shapes.

`compile_decoding(fn, variables)` returns (callable, path): on JAX `fn`
traced once per input shapes with `jax.jit`, the model's variables passed
in as arguments (a `keras.StatelessScope` maps them), so weights changed
by a later `fit` are read, not baked in; on TensorFlow a `tf.function`
(one trace per input shapes); on torch `fn` itself, run eagerly under
`torch.no_grad()` (its loop is a Python loop over the step).
"""

import keras

from kbert import backend


def compile_decoding(fn, variables):
    """(callable, path name): `fn(*arrays)` compiled for the backend."""
    if backend.is_jax():
        import jax

        variables = list(variables)

        def pure(values, *args):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return fn(*args)

        jitted = jax.jit(pure)
        return (lambda *args: jitted([v.value for v in variables], *args)), "jax.jit"
    if backend.is_tensorflow():
        import tensorflow as tf

        return tf.function(fn, autograph=False), "tf.function"
    import torch

    def eager(*args):
        with torch.no_grad():
            return fn(*args)

    return eager, "eager"
