"""Compiling a JAX `fit`'s step shapes ahead, in background threads.

On a GPU or TPU, XLA compiles the BERT-base training step for 10 to 20 s
per batch shape (benchmarks/RESULTS.md), and a `fit` meets several: the
full batches, the last partial batch, the validation batches and, with
length buckets, one shape per bucket. Keras compiles each the first time
a step of that shape runs, while the accelerator waits. Here, when the
loop starts, every shape it will meet is traced and compiled in background
threads, side by side and beside the steps (XLA releases the GIL while it
compiles; tracing holds it, so the first shape traces alone). Before each
step the loop waits for its shape's compilation if that is still running.
The executables land in JAX's compilation cache, where Keras' own `jit`
of the same step finds them: the programs, and the numbers, are the ones
Keras would have compiled.

Only for batches whose shapes are known in advance (kbert's length
buckets on host arrays) and without a `keras.distribution` (whose
shardings Keras sets at call time).
"""

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import keras

from kbert.backend import jax_on_accelerator, keras_internals

# Background compilations run at once; each also holds the GIL while it
# lowers (a second or two for BERT-base).
WORKERS = 4


def enabled():
    """Whether a JAX `fit` compiles its shapes ahead: on a GPU or TPU (a
    CPU has no idle cores to spare while steps run), without a
    `keras.distribution`."""
    return jax_on_accelerator() and keras.distribution.distribution() is None


def with_callback(callbacks, callback):
    """`fit`'s `callbacks` argument (None, a list or a `CallbackList`) with
    `callback` added."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.append(callback)
        return callbacks
    return list(callbacks or []) + [callback]


def _spec(tree):
    """Array specs (shape, dtype as JAX will hold it) of a structure of
    host arrays. Left unplaced, as Keras' batches are when traced: JAX
    keys its caches by the traced function, argument shapes and placement,
    and the executables compiled here must match the step's calls."""
    import jax

    def one(leaf):
        dtype = jax.dtypes.canonicalize_dtype(leaf.dtype)
        return jax.ShapeDtypeStruct(leaf.shape, dtype)

    return keras.tree.map_structure(lambda v: None if v is None else one(v), tree)


class AheadCompiler(keras.callbacks.Callback):
    """A callback for a JAX `fit` on kbert's bucketed batches (see module doc).

    Args:
        batches: the training batches (`kbert.models.batching.BucketedBatches`:
            indexable, with `shape_key(index)` and `first_of_each_shape()`).
        validation: the validation `BucketedBatches`, or None.
    """

    def __init__(self, batches, validation=None):
        super().__init__()
        self.batches, self.validation = batches, validation
        self.pending = {}  # (step kind, shape key) -> Future
        self.pool = None
        # JAX caches executables by the traced function, held weakly: the
        # jitted steps live as long as the loop does
        self.steps = []

    def _submit(self, kind, batches, first_traced, lead=False):
        """Compiles each shape of `batches` for the `kind` step in the pool.
        Tracing holds the GIL: the first shape of the `lead` call traces
        alone, every other once `first_traced` is set."""
        import jax

        model = self.model
        step = jax.jit(model.train_step if kind == "train" else model.test_step, donate_argnums=0)
        self.steps.append(step)
        state = keras_internals.jax_step_state(model, kind)

        def compile_shape(spec, first):
            try:
                if not first:
                    first_traced.wait()
                lowered = step.lower(state, spec)
            finally:
                if first:
                    first_traced.set()
            return lowered.compile()

        seen = set()
        for index in batches.first_of_each_shape():
            key = batches.shape_key(index)
            if key not in seen:
                job = functools.partial(compile_shape, _spec(batches[index]), lead and not seen)
                self.pending[(kind, key)] = self.pool.submit(job)
                seen.add(key)

    def on_train_begin(self, logs=None):
        self.pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kbert-compile")
        first_traced = threading.Event()
        self._submit("train", self.batches, first_traced, lead=True)
        if self.validation is not None:
            self._submit("test", self.validation, first_traced)

    def _wait(self, kind, key):
        future = self.pending.get((kind, key))
        if future is not None:
            try:
                future.result()
            except Exception:  # Keras compiles the shape itself
                pass

    def on_train_batch_begin(self, batch, logs=None):
        self._wait("train", self.batches.shape_key(batch))

    def on_test_batch_begin(self, batch, logs=None):
        if self.validation is not None and batch < len(self.validation):
            self._wait("test", self.validation.shape_key(batch))

    def on_train_end(self, logs=None):
        self.close()

    def close(self):
        """Cancels the compilations not started and waits for the running."""
        if self.pool is not None:
            for future in self.pending.values():
                future.cancel()
            self.pool.shutdown(wait=True)
            self.pool = None
        self.pending, self.steps = {}, []
