"""Decode loops as one compiled program per input shapes.

`compile_decoding(fn, variables)` returns (callable, path): on JAX `fn`
traced once per input shapes with `jax.jit`, the model's variables passed
in as arguments (a `keras.StatelessScope` maps them), so weights changed
by a later `fit` are read, not baked in; on TensorFlow a `tf.function`
(one trace per input shapes); on torch `fn` itself under `torch.no_grad()`,
its loops (`decode_loop`) replayed as CUDA graphs on a GPU
(`kbert.backend.torch_decoding`), eager elsewhere. `path` is a str, or on
torch an object whose `path` attribute names the path taken so far
(`decoding_path_name`).

`decode_loop(cond, body, state, constants, max_iterations)` is the loop a
decoding program runs: `keras.ops.while_loop` over `body(constants,
*state)` on JAX and TensorFlow; on torch one step function with static
shapes, called (or replayed) per token, the end checked on the host every
few steps.
"""

import contextlib

import keras

from kbert import backend

# torch on a CPU: run the CUDA-graph logic without CUDA (tests)
EMULATE_GRAPHS_ON_CPU = False


def weight_casts(variables):
    """On torch, the kept mixed-precision casts of `variables` that the
    decoding programs of one model share (`torch_decoding.WeightCasts`);
    None elsewhere (a compiled program casts each weight once)."""
    if not backend.is_torch():
        return None
    from kbert.backend import torch_decoding

    return torch_decoding.WeightCasts(variables)


def compile_decoding(fn, variables, casts=None):
    """(callable, path): `fn(*arrays)` compiled for the backend; on torch
    with `casts` (`weight_casts`), weights read under autocast come from
    its kept copies."""
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

    from kbert.backend import keras_internals, torch_decoding

    graphs = None
    if str(keras_internals.torch_device()).startswith("cuda"):
        graphs = torch_decoding.LoopGraphs(variables)
    elif EMULATE_GRAPHS_ON_CPU:
        graphs = torch_decoding.LoopGraphs(variables, emulate=True)

    def run(*args):
        kept = casts.active() if casts is not None else contextlib.nullcontext()
        with torch.no_grad(), torch_decoding.active(graphs), kept:
            return fn(*args)

    return run, graphs if graphs is not None else "eager"


def decoding_path_name(path):
    """The name of a path `compile_decoding` returned ("jax.jit",
    "tf.function", "torch-cuda-graph" or "eager")."""
    return path if isinstance(path, str) else path.path


def decode_loop(cond, body, state, constants, max_iterations):
    """The final state of `while cond(*state): state = body(constants,
    *state)`, at most `max_iterations` times.

    `state` is a tuple of tensors (nested structures allowed) whose shapes
    and dtypes `body` keeps; its last element is the decoder's cache, which
    on torch may change after the loop's end (steps past the end run with
    the rest of the state held). `cond` and `body` may close over tensors
    that depend on shapes only; data flows through `state` and `constants`.
    """
    if backend.is_torch():
        from kbert.backend import torch_decoding

        return torch_decoding.decode_loop(cond, body, state, constants, max_iterations)
    return keras.ops.while_loop(
        lambda *s: cond(*s), lambda *s: tuple(body(constants, *s)), tuple(state)
    )


def cache_write(cache, index, values):
    """`values` (B, T, ...) written into `cache` (B, S, ...) at positions
    [index, index + T) of axis 1: `keras.ops.slice_update`; on torch with
    a tensor `index`, in place (the step replayed as a CUDA graph keeps its
    cache in its own buffers). Returns the cache."""
    if backend.is_torch() and not isinstance(index, int):
        from kbert.backend import torch_decoding

        return torch_decoding.cache_write(cache, index, values)
    start = (0, index) + (0,) * (len(cache.shape) - 2)
    return keras.ops.slice_update(cache, start, values)
