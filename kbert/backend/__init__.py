"""Backend-specific code, in one place.

Layers and models call the public `keras.ops` and the named helpers here;
only this package asks which backend runs. The rest of kbert comes in
through four doors (an import-linter contract keeps the engines below
them out of every other package):

- this package: which backend runs, and on what device.
- `ops`: the fused operations and attention kernels the layers use
  (dense, dropout, attention, GELU, LayerNorm, embedding sum, sublayer
  calls), each with a `*_path()` that reports which implementation runs.
- `trainer`: what models and training ask of the engines (the step
  hooks, fit and predict set-up, data parallelism, fused optimizer
  updates), and `state_of(model)`, the one object (`state.TrainerState`)
  the trainer keeps on a model or optimizer.
- `keras_internals`: every use of private Keras API.

The engines:
- `jax_ops`, `torch_ops`: their JAX and torch implementations.
- `torch_step`: the torch backend's training step (no host-device
  synchronisation; replayed as a CUDA graph on a GPU).
- `torch_triton`: the torch backend's Adam update as a Triton kernel on a
  GPU.
- `torch_flex`: torch's FlexAttention over kbert's mask descriptions (the
  "torch-flex" attention implementation).
- `jax_compile`: a JAX `fit`'s batch shapes compiled ahead, in background
  threads, on a GPU or TPU.
- `tensorflow`: tf.distribute helpers (replica sums, multi-worker logs).
- `torch_ddp`, `replicas`, `jax_cache`: data parallelism on torch, sums
  over replicas, the JAX compilation cache.
"""

import functools

import keras


def name():
    """The Keras backend: "jax", "torch" or "tensorflow"."""
    return keras.backend.backend()


def is_jax():
    return keras.backend.backend() == "jax"


def is_torch():
    return keras.backend.backend() == "torch"


def is_tensorflow():
    return keras.backend.backend() == "tensorflow"


@functools.cache
def cpu_has_bf16_dot():
    """Whether this machine's CPU has bfloat16 dot-product instructions
    (x86 AVX512-BF16 or AMX-BF16; read from /proc/cpuinfo, so Linux only).
    There XLA's bfloat16 x bfloat16 -> float32 product runs at about 1.8x
    its float32 rate, and its int8 -> int32 product at about 1.3x."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def jax_on_accelerator():
    """Whether JAX runs on a GPU or TPU. There a new shape costs seconds of
    XLA compilation of the training step, more than shorter fine-tuning
    steps at batch sizes such as 32 save within an epoch: one shape per
    `fit` is faster than length buckets (benchmarks/RESULTS.md)."""
    if not is_jax():
        return False
    import jax

    return jax.default_backend() != "cpu"


def on_accelerator():
    """Whether the backend computes on a GPU or TPU (Keras' default device)."""
    if is_jax():
        return jax_on_accelerator()
    if is_tensorflow():
        import tensorflow as tf  # the backend: already imported by Keras

        return bool(tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"))
    from kbert.backend import keras_internals

    return not str(keras_internals.torch_device()).startswith("cpu")


def compiles_per_shape(model=None):
    """Whether a new input shape costs a compilation or a capture: XLA on
    JAX; on TensorFlow where the model is jit-compiled (Keras' default with
    a GPU or TPU; on a CPU Keras runs a `tf.function` with
    `reduce_retracing`, which takes any length after its second trace);
    CUDA graphs on torch with a GPU, torch.compile (`model.jit_compile`).
    False for eager torch on a CPU."""
    if is_jax():
        return True
    if is_tensorflow():
        jit = getattr(model, "jit_compile", None)
        return on_accelerator() if jit is None else jit is True
    if model is not None and getattr(model, "jit_compile", False) is True:
        return True
    from kbert.backend import keras_internals

    return str(keras_internals.torch_device()).startswith("cuda")
