"""Compiling a JAX `fit`'s step shapes ahead, in background threads.

On a GPU or TPU, XLA compiles the BERT-base training step for 10 to 20 s
per batch shape (benchmarks/RESULTS.md), and a `fit` meets several: the
full batches, the last partial batch, the validation batches and, with
length buckets, one shape per bucket. Keras compiles each the first time
a step of that shape runs, while the accelerator waits. Here, when the
loop starts (and at each epoch's start, for shapes a new order brings),
every shape of the coming batches is traced and compiled in background
threads, side by side and beside the steps (XLA releases the GIL while
it compiles; tracing holds it, so the traces run one at a time, in one
thread). Before each step the loop waits for its shape's compilation if
that is still running.
The executables land in JAX's compilation cache, where Keras' own `jit`
of the same step finds them: the programs, and the numbers, are the ones
Keras would have compiled.

A later `fit` of the same model reuses Keras' jitted step, which keeps
the programs of the shapes it ran (with first programs, below, the
step's wrapper keeps them): those shapes are not compiled again. A `fit`
that ends while programs no step needs are still compiling returns; they
finish in the background.

On a GPU, XLA also autotunes each matrix product of a new program (it
times candidate kernels). For BERT-base that is about half of a step
program's compilation, and it makes each step a few percent faster: it
repays itself after some 10,000 steps of that program
(benchmarks/RESULTS.md). `step_options` leaves it
out of the programs of runs of fewer than `AUTOTUNE_MIN_STEPS` steps
(`Task.compile(autotune=...)`). A run is what the training will do, not
one call: a `fit`'s training steps count the optimizer's learning-rate
schedule (`run_steps`: `Task.compile(num_train_steps=...)`,
`create_optimizer`'s total), so a long run fitted in pieces
(`fit_resumable`'s checkpoint-sized fits, a benchmark's short fits) gets
the programs of a long run from its first piece on.

A training program takes seconds to compile even so, a share per encoder
block and the largest for the optimizer's update, while the GPU waits.
So each training shape is also compiled, first, as a loop program
(`SplitProgram`): the step as two programs that compile side by side,
the gradients with the blocks run as one `lax.scan` over their stacked
weights (`BertBackbone.call` under `layers_in_loop()`: XLA compiles one
block instead of twelve) and the optimizer's update, one program for
every shape (`keras_internals.jax_split_train_step`). For BERT-base a
loop program compiles in about a third of the time of the step's own
program, and runs each step about a third slower. The steps run the loop
programs (`FirstPrograms`, which runs the ahead-compiled programs
itself), and switch to the step's own program once it is compiled, for
the shapes the run takes `OWN_PROGRAM_MIN_STEPS` steps of or more (over
all the `fit`'s epochs, or the schedule's steps: `steps_of_shape`); the
others, such as a last partial batch, run on their loop program only.
All compute the same step, to float rounding; the state passes from one
to the other. The loop programs trace first (the update first, whose
compilation is the longest, then the first batch's shape), then the own
programs (the shapes with the most batches first),
one at a time in one thread; the own programs compile once the first
batch's loop program has, so that they do not slow the compilation the
first step waits for. Only for programs compiled without autotuning
(which times candidate kernels on the GPU that the loop programs' steps
would be using) and backbones whose blocks can loop (`loops_layers`).

Only for batches whose shapes are known in advance (kbert's length
buckets on host arrays), with the step jitted (not `run_eagerly`, not
`jit_compile=False`, not under NNX), without a `keras.distribution`
(whose shardings Keras sets at call time) and with callbacks given as a
list (a `CallbackList` is used as given).
"""

import collections
import contextlib
import functools
import sys
import threading
import time
import warnings
import weakref
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import keras

from kbert import backend
from kbert.backend import jax_on_accelerator, keras_internals
from kbert.backend.state import state_of

# Background compilations run at once (their traces one at a time).
WORKERS = 4

# Fewer steps than this, run by a program that the GPU would autotune,
# compile without autotuning (see the module doc).
AUTOTUNE_MIN_STEPS = 10_000

# The total steps of `Task.compile`'s learning-rate schedule when it is
# given no `num_train_steps` (no decay): not a run's length.
UNKNOWN_RUN_STEPS = 10**9

# XLA compiler options for programs that run few steps: no GEMM
# autotuning, cuBLAS products chosen by its heuristics (Triton GEMMs
# untuned were far slower), and LLVM without its expensive passes (a
# shorter compilation for the same step: XLA's own kernels are
# element-wise and reductions, bound by memory).
FAST_COMPILE_OPTIONS = {
    "xla_gpu_autotune_level": 0,
    "xla_gpu_enable_triton_gemm": False,
    "xla_llvm_disable_expensive_passes": True,
}


# Set in a thread while it traces a loop program's gradients: the backbone
# runs its blocks as one loop (`BertBackbone.call`).
_LOOP = threading.local()


def layers_in_loop():
    """Whether the step this thread traces runs the encoder blocks in a loop."""
    return getattr(_LOOP, "on", False)


def note_looped():
    """Called by a backbone that ran its blocks as a loop in this trace."""
    _LOOP.looped = True


@contextlib.contextmanager
def _tracing_layers_in_loop():
    _LOOP.on, _LOOP.looped = True, False
    try:
        yield
    finally:
        _LOOP.on = False


# While a trace runs (0.5 to 2.5 s of Python holding the GIL, beside the
# steps when the programs load from the compilation cache), Python
# switches threads every this many seconds instead of its default 5 ms:
# the loop's thread, which gives the GIL up and takes it back many times
# a step, waits less for it.
TRACE_SWITCH_INTERVAL = 0.0005
_SWITCH_LOCK = threading.Lock()
_SWITCH = {"traces": 0, "saved": None, "set": None}


@contextlib.contextmanager
def _switching_often():
    """Within (on any number of threads at once): Python's thread switch
    interval at most `TRACE_SWITCH_INTERVAL`; restored when the last
    leaves, unless someone else changed it meanwhile."""
    with _SWITCH_LOCK:
        if _SWITCH["traces"] == 0:
            _SWITCH["saved"] = sys.getswitchinterval()
            if _SWITCH["saved"] > TRACE_SWITCH_INTERVAL:
                sys.setswitchinterval(TRACE_SWITCH_INTERVAL)
            _SWITCH["set"] = sys.getswitchinterval()
        _SWITCH["traces"] += 1
    try:
        yield
    finally:
        with _SWITCH_LOCK:
            _SWITCH["traces"] -= 1
            if _SWITCH["traces"] == 0 and sys.getswitchinterval() == _SWITCH["set"]:
                sys.setswitchinterval(_SWITCH["saved"])


def schedule_steps(optimizer):
    """The steps `optimizer`'s learning-rate schedule is laid out for, or
    None: kbert's `WarmupLinearDecay` (`create_optimizer`) `total_steps`,
    Keras' `PolynomialDecay` and `CosineDecay` (warm-up and decay steps);
    None for a constant rate, other schedules and `UNKNOWN_RUN_STEPS`."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    if inner is None or isinstance(inner, str):
        return None
    schedule = keras_internals.learning_rate_object(inner)
    schedules = keras.optimizers.schedules
    total = getattr(schedule, "total_steps", None)
    if total is None and isinstance(schedule, schedules.PolynomialDecay):
        total = schedule.decay_steps
    if total is None and isinstance(schedule, schedules.CosineDecay):
        total = schedule.decay_steps + (getattr(schedule, "warmup_steps", 0) or 0)
    if not isinstance(total, int) or total < 1 or total >= UNKNOWN_RUN_STEPS:
        return None
    return total


def run_steps(model, steps):
    """The training steps of the run a call of `model` of about `steps`
    steps (None: unknown) belongs to: the steps of its optimizer's
    schedule (`schedule_steps`), or the call's where that says more or
    the schedule nothing."""
    total = schedule_steps(getattr(model, "optimizer", None))
    if total is None:
        return steps
    return total if steps is None else max(total, steps)


def steps_of_shape(count, batches, epochs, run):
    """How many steps of one batch shape a run takes: `count` of a `fit`'s
    `batches` batches are of that shape, the `fit` runs `epochs` epochs of
    them, and the run `run` steps (None: this `fit`'s); a run longer than
    the `fit` (one piece of it) takes that shape in the same share."""
    steps = count * epochs
    fit = batches * epochs
    if run and fit and run > fit:
        steps = steps * run / fit
    return steps


def _on_gpu():
    import jax

    return jax.devices()[0].platform == "gpu"


def step_options(model, steps):
    """XLA compiler options for `model`'s step programs in a call that runs
    about `steps` steps (None: unknown, e.g. a `tf.data` dataset): without
    autotuning on a GPU for `autotune=False`, or for "auto" (the default)
    and fewer than `AUTOTUNE_MIN_STEPS` steps; None (XLA's defaults)
    otherwise and off a GPU."""
    autotune = getattr(model, "autotune", "auto")
    if autotune is True or not _on_gpu():  # TPU options differ
        return None
    if autotune is False or (steps is not None and steps < AUTOTUNE_MIN_STEPS):
        return dict(FAST_COMPILE_OPTIONS)
    return None


def plan(model, steps, kinds, replace=True):
    """Plans the compiler options (`step_options`) of `model`'s `kinds` steps
    that Keras has not made yet, for a call of about `steps` steps (with
    training steps among `kinds`: the run's, `run_steps`); with
    `replace=False`, only those not planned yet."""
    if not backend.is_jax():
        return
    if not replace:
        kinds = [k for k in kinds if not keras_internals.step_compiler_options_planned(model, k)]
    if kinds:
        if "train" in kinds:
            steps = run_steps(model, steps)
        options = step_options(model, steps)
        for kind in kinds:
            keras_internals.plan_step_compiler_options(model, kind, options)


# Whether a `fit` runs its first steps, and `predict` its first batches
# of each shape, on a program with the encoder blocks in a loop while the
# step's own program compiles (module doc, `compile_predict_ahead`).
FIRST_PROGRAMS = True

# A training shape gets the step's own program as well as its loop
# program when the `fit` runs at least this many steps of it: for
# BERT-base fine-tuning on SST-2 the own program is ready about half-way
# through an epoch of 2,105 steps, and the epoch is a little shorter with
# it than on the loop programs alone.
OWN_PROGRAM_MIN_STEPS = 2_000


def _shapes(data):
    """What selects a step's program for a batch: its tree structure and
    each array's shape and dtype (as JAX holds it)."""
    import jax
    import numpy as np

    def leaf(value):
        dtype = getattr(value, "dtype", None)
        dtype = np.result_type(value) if dtype is None else dtype
        return tuple(np.shape(value)), str(jax.dtypes.canonicalize_dtype(dtype))

    leaves, tree = jax.tree_util.tree_flatten(data)
    return tree, tuple(leaf(value) for value in leaves)


class _StepWrapper:
    """Keras' jitted step (`step`), wrapped: attributes are the step's, and
    `_run` runs a program compiled for the batch, falling back to the step
    where the program does not fit it."""

    def __init__(self, step):
        self.step = step
        self.programs = {}

    def _run(self, program, state, data):
        """(`program(state, data)`, True); on a mismatch (structure, shapes,
        placement: raised before donating) the shape's programs are dropped
        and Keras' step runs the batch: (its outputs, False)."""
        try:
            return program(state, data), True
        except (TypeError, ValueError):
            if _any_deleted(state):  # raised after donating (a SplitProgram's update)
                raise
            self.programs.pop(_shapes(data), None)
            return self.step(state, data), False

    def __getattr__(self, name):
        if name == "step":
            raise AttributeError(name)
        return getattr(self.step, name)


class FirstPrograms(_StepWrapper):
    """Keras' jitted training step (`step`), which runs a batch on the
    programs `AheadCompiler` compiled for it (`programs`: `_shapes` ->
    [future of the loop program or None, future of the step's own or
    None]): the step's own once compiled, until then (or, for a shape
    without one, always) the loop program. It keeps the step's own
    programs, and the loop programs of shapes that have no own, as long as
    Keras keeps the step (Keras' jit never ran them: a later `fit` would
    compile them again on the main thread)."""

    def __init__(self, step):
        super().__init__(step)
        self.update = None  # future of the update program of the loop programs
        self.steps_run = 0  # steps run on a loop program

    def __call__(self, state, data):
        entry = self.programs.get(_shapes(data)) if self.programs else None
        if entry is not None:
            loop, own = entry
            program, looped = None, False
            if own is not None and _succeeded(own):
                program = own.result()
            elif loop is not None and _succeeded(loop):
                program, looped = loop.result(), True
            if program is not None:
                out, ran = self._run(program, state, data)
                self.steps_run += looped and ran
                return out
        return self.step(state, data)

    def forget_loops(self):
        """A `fit` has ended: drops the loop programs of shapes whose own
        program compiled or is compiling, and the futures of programs that
        did not compile."""
        for key, (loop, own) in list(self.programs.items()):
            if own is not None and (not own.done() or _succeeded(own)):
                self.programs[key] = [None, own]
            elif loop is not None and _succeeded(loop):
                self.programs[key] = [loop, None]
            else:
                del self.programs[key]
        if self.update is not None and not _succeeded(self.update):
            self.update = None


def _any_deleted(tree):
    """Whether an array of `tree` was donated (or deleted)."""
    import jax

    return any(
        getattr(leaf, "is_deleted", None) is not None and leaf.is_deleted()
        for leaf in jax.tree_util.tree_leaves(tree)
    )


def _succeeded(future):
    return future.done() and not future.cancelled() and future.exception() is None


def _first_programs(model):
    return state_of(model).first_programs


def first_programs_apply(model, kind):
    """Whether `model`'s `kind` step runs first programs: training steps of
    a `fit` on an accelerator (`enabled`; the ahead compiler makes them),
    compiled without autotuning, of a model whose backbone can loop its
    blocks."""
    return kind == "train" and enabled() and _blocks_loop(model, kind)


def _blocks_loop(model, kind):
    """Whether `model`'s `kind` programs can have loop programs: first
    programs on (`FIRST_PROGRAMS`), the step's programs compiled without
    autotuning, a backbone whose blocks can loop, called by the task."""
    if not FIRST_PROGRAMS:
        return False
    if not getattr(model, "calls_backbone", True):  # e.g. a distiller walks the blocks itself
        return False
    options = keras_internals.step_compiler_options(model, kind)
    backbone = getattr(model, "backbone", None)
    loops = getattr(backbone, "loops_layers", None)
    return bool(options) and options.get("xla_gpu_autotune_level") == 0 and bool(loops and loops())


def _lower_looped(jitted, *args):
    """`jitted.lower(*args)` with the backbone's blocks in a loop; raises
    `NotLooped` where the trace did not loop them."""
    with _tracing_layers_in_loop():
        lowered = jitted.lower(*args)
        if not getattr(_LOOP, "looped", False):
            raise NotLooped()
    return lowered


def first_program_steps(model):
    """How many training steps of `model` ran on a loop program, or None
    where its step has no first programs."""
    programs = _first_programs(model)
    return None if programs is None else programs.steps_run


def compile_log(model):
    """The step programs compiled ahead for `model` (by a `fit`'s
    `AheadCompiler` and by `compile_predict_ahead`), in the order they
    finished: step kind ("train", "test", "predict"), shape key (empty for
    the loop programs' update; for "predict" the first input's shape),
    whether part of a loop program, `trace_begin` and
    `compile_begin` (`time.perf_counter()`), seconds tracing and
    compiling."""
    return list(state_of(model).compile_log or ())


def _log_of(model):
    """The list `compile_log` reads, made on first use (on the caller's
    thread; appended to by the compiling threads)."""
    state = state_of(model)
    if state.compile_log is None:
        state.compile_log = []
    return state.compile_log


def _record(log, kind, shape, loop, begin, traced, start):
    """Appends a program compiled from `start` (traced from `begin` to
    `traced`) to a `compile_log` list."""
    log.append(
        {
            "kind": kind,
            "shape": [int(v) for v in shape],
            "loop": loop,
            "trace_begin": begin,
            "trace_seconds": traced - begin,
            "compile_begin": start,
            "compile_seconds": time.perf_counter() - start,
        }
    )


def first_programs_wrapper(model, kind):
    """For `Task._make_step`: a function wrapping Keras' jitted `kind` step
    in a `FirstPrograms` (kept on the model, as Keras keeps its step), or
    None."""
    if kind != "train":
        return None
    if not first_programs_apply(model, kind):
        state_of(model).first_programs = None  # a new step, plain
        return None

    def wrap(step):
        programs = FirstPrograms(step)
        state_of(model).first_programs = programs
        return programs

    return wrap


class AheadPredict(_StepWrapper):
    """Keras' jitted predict step (`step`), which runs a batch on the
    programs compiled ahead for its shape (`programs`: `_shapes` -> [future
    of the loop program or None, future of the step's own],
    `compile_predict_ahead`): the step's own once compiled, until then the
    loop program, else as Keras would. Kept on the model as Keras keeps
    its step, with the programs."""

    def __init__(self, step):
        super().__init__(step)
        self.loop_batches = 0  # batches run on a loop program

    def __call__(self, state, data):
        key = _shapes(data)
        entry = self.programs.get(key) if self.programs else None
        if entry is None:
            return self.step(state, data)
        loop, own = entry
        if loop is not None and not _succeeded(own):
            wait_futures([loop, own], return_when=FIRST_COMPLETED)  # whichever compiles first
            if own.done() and not _succeeded(own):
                wait_futures([loop])  # the own program failed: the loop program, if it compiles
            if _succeeded(loop) and not _succeeded(own):
                out, ran = self._run(loop.result(), state, data)  # own compiling, or failed
                self.loop_batches += ran
                return out
        try:
            program = own.result()
        except Exception:  # noqa: BLE001 (the step compiles it)
            self.programs.pop(key, None)
            return self.step(state, data)
        return self._run(program, state, data)[0]


def predict_wrapper(model, kind):
    """For `Task._make_step`: a function wrapping Keras' jitted predict
    step in an `AheadPredict` (kept on the model), on a GPU or TPU; or
    None. Keras applies it only to a step jitted with compiler options
    (`keras_internals.jax_jit_options`), which `step_options` gives on a
    GPU only: a TPU runs Keras' step, compiling each shape as it comes."""
    if kind != "predict":
        return None
    state_of(model).ahead_predict = None  # a new step, plain
    if not enabled():
        return None

    def wrap(step):
        programs = AheadPredict(step)
        state_of(model).ahead_predict = programs
        return programs

    return wrap


def compile_predict_ahead(model, batches):
    """Traces (one at a time, in batch order) and compiles (side by side)
    in background threads the predict programs of the shapes of `batches`
    (`BucketedBatches`) that `model`'s predict step has none of: Keras
    would compile them one after the other as the batches reach them,
    while the accelerator waits. Only where the step is an `AheadPredict`
    (`predict_wrapper`; Keras' jitted step, with compiler options).

    As for training (module doc), each shape also gets a loop program
    (the encoder blocks as one `lax.scan`), traced and compiled first,
    which runs its batches until the step's own program is compiled:
    where the own programs compile without autotuning and the backbone's
    blocks can loop: a loop program traces and compiles in about two thirds
    of the own program's time and runs its batches a little slower."""
    programs = state_of(model).ahead_predict
    if programs is None or model.predict_function is None or not len(batches):
        return
    new = {}
    for index in batches.first_of_each_shape():
        key = _shapes(batches[index])
        if key not in programs.programs and key not in new:
            new[key] = (_spec(batches[index]), batches.shape_key(index))
    if not new:
        return
    state = keras_internals.jax_step_state(model, "predict")  # before any future exists
    step = programs.step
    keras_step = getattr(step, "__wrapped__", None)  # what Keras jitted
    loops = keras_step is not None and _blocks_loop(model, "predict")
    loop_jobs, own_jobs = [], []  # (future, spec, shape, loop)
    for key, (spec, shape) in new.items():
        loop, own = (Future() if loops else None), Future()
        entry = programs.programs[key] = [loop, own]
        if loop is not None:
            loop_jobs.append((loop, spec, shape, True))
            own.add_done_callback(functools.partial(_drop_loop, entry))
        own_jobs.append((own, spec, shape, False))
    jobs = loop_jobs + own_jobs  # traced in this order
    if loops:
        import jax

        options = keras_internals.step_compiler_options(model, "predict")

        def loop_predict_step(state, data):  # a function of its own: JAX caches traces by it
            return keras_step(state, data)

        loop_step = jax.jit(loop_predict_step, donate_argnums=0, compiler_options=options)
    pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kbert-compile")
    log = _log_of(model)

    def compile_program(future, lowered, shape, loop, begin, traced):
        try:
            start = time.perf_counter()
            program = _compile(lowered, loop)
            _record(log, "predict", shape, loop, begin, traced, start)
            future.set_result(program)
        except BaseException as error:  # noqa: BLE001
            if not future.done():
                future.set_exception(error)

    def trace_all():
        try:
            for future, spec, shape, loop in jobs:
                args = (state, spec)
                future.set_running_or_notify_cancel()
                try:
                    with _switching_often():
                        begin = time.perf_counter()
                        lowered = _lower_looped(loop_step, *args) if loop else step.lower(*args)
                        traced = time.perf_counter()
                    pool.submit(compile_program, future, lowered, shape, loop, begin, traced)
                except BaseException as error:  # noqa: BLE001 (the step compiles it)
                    if not future.done():
                        future.set_exception(error)
        finally:
            pool.shutdown(wait=False)

    tracer = ThreadPoolExecutor(1, thread_name_prefix="kbert-compile-trace")
    tracer.submit(trace_all)
    tracer.shutdown(wait=False)


def _drop_loop(entry, own):
    """Once a shape's own predict program compiled: its entry of
    `AheadPredict.programs` lets the loop program go."""
    if _succeeded(own):
        entry[0] = None


def predict_loop_batches(model):
    """How many predict batches of `model` ran on a loop program (over its
    predict step's life), or None where its step compiles nothing ahead."""
    programs = state_of(model).ahead_predict
    return None if programs is None else programs.loop_batches


class NotLooped(Exception):
    """The step traced for a loop program does not loop its blocks (e.g.
    rows packing several examples): it would be the step's own program."""


def _compile(lowered, loop=False):
    """Compiles a traced step program (`loop`: one with the blocks in a loop)."""
    return lowered.compile()


class SplitProgram:
    """A loop program: the training step as two programs,
    `keras_internals.jax_split_train_step`'s gradients (with the blocks in
    a loop) and then the optimizer's update, which compile side by side
    (about half the time of the step as one program, for slightly slower
    steps) and the update of which serves every shape."""

    def __init__(self, grads, update):
        self.grads, self.update = grads, update

    def __call__(self, state, data):
        trainable, non_trainable, optimizer, metrics = state
        logs, gradients, non_trainable, metrics = self.grads(
            trainable, non_trainable, optimizer, metrics, data
        )
        trainable, optimizer = self.update(trainable, optimizer, gradients)
        return logs, (trainable, non_trainable, optimizer, metrics)


# The programs each model's jitted Keras steps have run: model -> {kind:
# (weak reference to Keras' step function, {(batch structure, shape
# key)})}. Keras keeps its step function from one `fit` to the next (until
# `compile` makes a new one), and with it those programs.
_RAN = weakref.WeakKeyDictionary()


def _keras_step(model, kind):
    """Keras' step function for `kind` (`train_function`, `test_function`),
    or None before Keras made one."""
    return model.train_function if kind == "train" else model.test_function


def ran_shapes(model, kind):
    """The programs the current Keras step of `kind` has run, as (batch
    structure, shape key) pairs (a set to add to; empty for a new step
    function)."""
    function = _keras_step(model, kind)
    if function is None:
        return set()
    steps = _RAN.setdefault(model, {})
    entry = steps.get(kind)
    if entry is None or entry[0]() is not function:
        entry = steps[kind] = (weakref.ref(function), set())
    return entry[1]


def enabled():
    """Whether a JAX `fit` compiles its shapes ahead: on a GPU or TPU (a
    CPU has no idle cores to spare while steps run), without a
    `keras.distribution`."""
    return jax_on_accelerator() and keras.distribution.distribution() is None


def applies(model, callbacks):
    """Whether `model.fit(..., callbacks=callbacks)` can compile ahead: a
    jitted step Keras makes from `train_step` itself, callbacks we can add
    to without changing the caller's objects."""
    return (
        enabled()
        and model.jit_compile
        and not model.run_eagerly
        and not keras.config.is_nnx_enabled()
        and not isinstance(callbacks, keras.callbacks.CallbackList)
    )


def with_callback(callbacks, callback):
    """`fit`'s `callbacks` argument (None, a callback or a list) with
    `callback` added, as a new list."""
    return keras.tree.flatten(callbacks) + [callback] if callbacks else [callback]


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


def _structure(batch):
    """The structure, dtypes and ranks of a batch: with its shape key
    (rows, length), what fixes the program Keras compiles for it."""
    leaves = keras.tree.map_structure(
        lambda v: None if v is None else (str(v.dtype), v.ndim), batch
    )
    return repr(leaves)


class AheadCompiler(keras.callbacks.Callback):
    """A callback for a JAX `fit` on kbert's bucketed batches (see module doc).

    Args:
        batches: the training batches (`kbert.training.batching.BucketedBatches`:
            indexable, with `shape_key(index)` and `first_of_each_shape()`).
        validation: the validation `BucketedBatches`, or None.
        epochs: int. the epochs the `fit` runs.
    """

    def __init__(self, batches, validation=None, epochs=1):
        super().__init__()
        self.batches, self.validation = batches, validation
        self.epochs = max(int(epochs), 1)
        self.begun = 0  # epochs begun
        self.pending = {}  # (step kind, shape key) -> Future of the step's own program
        self.first_pending = {}  # (step kind, shape key) -> Future of its loop program
        self.tracer = self.pool = None
        # JAX caches executables by the traced function, held weakly: the
        # jitted steps live as long as the loop does
        self.steps = {}
        self.structure = {}  # step kind -> `_structure` of its batches
        self.running = {}  # step kind -> shape keys of the steps started last
        self.trace_lock = threading.Lock()  # the model is traced by one thread at a time
        # the step's own programs compile once the loop program of the first
        # batch has (the one the first step waits for)
        self.gate = threading.Event()
        self.closed = False
        self.warned = False
        self.first = None  # the model's FirstPrograms, when it has first programs
        self.shapes = {}  # (step kind, shape key) -> its batches' `_shapes`
        self.update = None  # future of the loop programs' update program, made here
        self.run = None  # the training steps of the run (`schedule_steps`), where known

    @property
    def owner(self):
        """The model, without the state sync of `self.model` (which this
        callback needs only where it reads the variables' values: the
        state its traces start from, before the first step). Used before
        every step and in the compiling threads."""
        return keras_internals.callback_model(self)

    def _schedule(self, key, trace, loop=False, lead=False, future=None, update=None):
        """A future (`future`, or a new one) of the program of `key`:
        `trace()` (-> lowered) runs in the tracing thread, in the order
        scheduled, then the program compiles in the pool; the step's own
        programs once the gate opens. `lead`: the loop program that opens
        the gate. `update`: the future of the update program this one
        pairs with (a `SplitProgram`)."""
        future = Future() if future is None else future

        def compile_program(lowered, begin, traced):
            try:
                if not loop:
                    self.gate.wait()
                if update is not None and update.cancelled():  # the loop has ended
                    raise CancelledError()
                start = time.perf_counter()
                program = _compile(lowered, loop)
                self._log(key, loop, begin, traced, start)
                if update is not None:
                    program = SplitProgram(program, update.result())
                future.set_result(program)
            except BaseException as error:  # noqa: BLE001 (the step compiles it)
                future.set_exception(error)
            finally:
                if lead:
                    self.gate.set()

        def trace_program():
            if not future.set_running_or_notify_cancel():
                if lead:
                    self.gate.set()
                return
            try:
                with self.trace_lock, _switching_often():
                    self._check_open()
                    begin = time.perf_counter()
                    lowered = trace()
                    traced = time.perf_counter()
            except BaseException as error:  # noqa: BLE001
                future.set_exception(error)
                if lead:
                    self.gate.set()
                return
            try:
                self.pool.submit(compile_program, lowered, begin, traced)
            except (RuntimeError, AttributeError):  # the loop has ended: compile here
                compile_program(lowered, begin, traced)

        self.tracer.submit(trace_program)
        return future

    def _own_trace(self, kind, spec):
        if kind not in self.steps:
            self.steps[kind] = (
                keras_internals.jax_step_function(self.model, kind),
                keras_internals.jax_step_state(self.model, kind),
            )
        step, state = self.steps[kind]
        return lambda: step.lower(state, spec)

    def _loop_functions(self):
        """The jitted halves of the loop programs and the state they trace
        from."""
        if "loop" not in self.steps:
            import jax

            options = keras_internals.step_compiler_options(self.owner, "train")
            grads, update = keras_internals.jax_split_train_step(self.owner)
            self.steps["loop"] = (
                jax.jit(grads, donate_argnums=(1, 3), compiler_options=options),
                jax.jit(update, donate_argnums=(0, 1), compiler_options=options),
                keras_internals.jax_step_state(self.model, "train"),
            )
        return self.steps["loop"]

    def _loop_trace(self, spec):
        grads, _, state = self._loop_functions()

        return lambda: _lower_looped(grads, *state, spec)

    def _update_trace(self):
        import jax

        _, update, (trainable, _, optimizer, _) = self._loop_functions()
        gradients = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in trainable]
        return lambda: update.lower(trainable, optimizer, gradients)

    def _loops_apply(self, batches):
        """Whether this fit's training shapes can run on loop programs."""
        model = self.owner
        first = _first_programs(model)
        if first is None or not first_programs_apply(model, "train"):
            return False
        self.first = first
        return not getattr(batches, "packing", False)  # packed rows skip the backbone's call

    def _submit(self, kind, batches, epochs):
        """Schedules the programs of each shape of `batches` that the `kind`
        step has none of yet, for a fit of `epochs` more epochs: training
        shapes a loop program (where the blocks can loop) and, if a fit
        runs at least `OWN_PROGRAM_MIN_STEPS` steps of it (`steps_of_shape`:
        in this `fit`, or in the run of the optimizer's schedule it is a
        piece of; or it has no loop program), the step's own. Traced in
        this order: the update program the loop programs share (once per
        model; the longest of the programs the first step waits for), the
        loop program of the first batch's shape, the other loop programs,
        the step's own programs (the shapes with the most batches first)."""
        if not len(batches):
            if kind == "train":
                self.gate.set()
            return
        if kind not in self.structure:
            self.structure[kind] = _structure(batches[0])
        ran = ran_shapes(self.owner, kind)
        counts = collections.Counter(batches.shape_key(i) for i in range(len(batches)))
        firsts = sorted(
            batches.first_of_each_shape(),
            key=lambda i: (i != 0, -counts[batches.shape_key(i)], i),
        )
        loops = kind == "train" and self._loops_apply(batches)
        loop_jobs, own_jobs = [], []
        for index in firsts:
            key = (kind, batches.shape_key(index))
            if key in self.pending or key in self.first_pending:
                continue
            kept_loop = kept_own = None
            if kind == "train" and self.first is not None:  # what FirstPrograms holds
                self.shapes[key] = _shapes(batches[index])
                kept_loop, kept_own = self.first.programs.get(self.shapes[key], (None, None))
            if kept_own is not None and _succeeded(kept_own):
                continue  # compiled in an earlier fit
            ran_it = self._ran_key(key) in ran  # Keras' step holds the program
            if kept_own is not None and not kept_own.done():  # still compiling, from an earlier fit
                self.pending[key] = kept_own
            elif ran_it:
                continue
            elif not loops or (
                steps_of_shape(counts[key[1]], len(batches), epochs, self.run)
                >= OWN_PROGRAM_MIN_STEPS
            ):
                own_jobs.append((key, index))
            if kept_loop is not None and _succeeded(kept_loop):
                self.first_pending[key] = kept_loop  # kept from an earlier fit
            elif loops and not ran_it:
                loop_jobs.append((key, index))
        update, new_update = None, False
        if loop_jobs:  # the update program the loop programs share
            update = self.first.update
            if update is None or (update.done() and not _succeeded(update)):
                update, new_update = Future(), True
                self.first.update = self.update = update
        if new_update:  # traced first: the longest compilation the first step waits for
            self._schedule((kind, ()), self._update_trace(), loop=True, future=update)
        for key, index in loop_jobs:
            lead = key[1] == batches.shape_key(0) and not self.gate.is_set()
            trace = self._loop_trace(_spec(batches[index]))
            self.first_pending[key] = self._schedule(
                key, trace, loop=True, lead=lead, update=update
            )
        if kind == "train" and not any(key[1] == batches.shape_key(0) for key, _ in loop_jobs):
            self.gate.set()  # no loop program for the first step to wait for
        for key, index in own_jobs:
            self.pending[key] = self._schedule(key, self._own_trace(kind, _spec(batches[index])))

    def _log(self, key, loop, begin, traced, start):
        """Records a compiled program in the model's `compile_log`."""
        _record(self.log, *key, loop, begin, traced, start)

    def on_train_begin(self, logs=None):
        self.log = _log_of(self.owner)
        self.run = schedule_steps(self.owner.optimizer)  # the run this fit is part of
        self.tracer = ThreadPoolExecutor(1, thread_name_prefix="kbert-compile-trace")
        self.pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kbert-compile")
        self._submit("train", self.batches, self.epochs)
        self._offer("train")
        if self.validation is not None:
            self._submit("test", self.validation, self.epochs)

    def _offer(self, kind):
        """Gives the model's `FirstPrograms` the `kind` programs compiling."""
        if self.first is None:
            return
        for key in {**self.first_pending, **self.pending}:
            if key[0] == kind and key in self.shapes:
                self.first.programs[self.shapes[key]] = [
                    self.first_pending.get(key),
                    self.pending.get(key),
                ]

    def on_epoch_begin(self, epoch, logs=None):
        self.begun += 1
        if self.pool is not None and self.begun > 1:  # shapes a new shuffle of the batches brings
            self._submit("train", self.batches, max(self.epochs - self.begun + 1, 1))
            self._offer("train")

    def _wait(self, kind, key):
        future = self.pending.get((kind, key))
        if future is None:
            return
        try:
            future.result()
        except Exception as error:  # Keras compiles the shape itself
            self._warn(error)

    def _ran_key(self, key):
        """What identifies a program of Keras' `kind` step: the batch
        structure (keys, dtypes, ranks) and the shape key."""
        kind, shape = key
        return self.structure.get(kind), shape

    def _commit(self, kind):
        """The steps of `kind` started last have run: Keras' step holds
        their programs."""
        ran = ran_shapes(self.owner, kind)
        ran.update(self._ran_key(key) for key in self.running.pop(kind, ()))

    def _wait_range(self, kind, batches, first):
        self._commit(kind)  # a new step starts: the previous ones ended
        count = getattr(self.owner, "steps_per_execution", 1) or 1
        self.running[kind] = []
        for index in range(first, min(first + count, len(batches))):
            key = (kind, batches.shape_key(index))
            loop, own = self.first_pending.get(key), self.pending.get(key)
            if loop is not None and own is not None:  # whichever compiles first
                wait_futures([loop, own], return_when=FIRST_COMPLETED)
                if not _succeeded(own):
                    if self._ready(loop):
                        continue  # a step on the loop program
                    self._wait(*key)
            elif loop is not None:
                if self._ready(loop):
                    continue  # a step on the loop program: not one of Keras' programs
            else:
                self._wait(*key)  # the step's own program
            self.running[kind].append(key)

    def _ready(self, future):
        """Waits for a loop program; whether it compiled."""
        try:
            future.result()
            return True
        except NotLooped:
            return False
        except Exception as error:
            self._warn(error)
            return False

    def _warn(self, error):
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"kbert: compiling a step program ahead failed ({type(error).__name__}: "
                f"{str(error)[:200]}); the step compiles it when it first runs."
            )

    def on_train_batch_begin(self, batch, logs=None):
        self._wait_range("train", self.batches, batch)

    def on_test_batch_begin(self, batch, logs=None):
        if self.validation is not None and batch < len(self.validation):
            self._wait_range("test", self.validation, batch)

    def on_test_end(self, logs=None):
        self._commit("test")

    def on_train_end(self, logs=None):
        self._commit("train")
        self.close()

    def _check_open(self):
        if self.closed:  # the loop has ended: the model is not traced again
            raise CancelledError()

    def close(self):
        """Cancels the programs not traced yet (and the loop programs whose
        update program was not). Those traced compile in the background
        (their programs land in JAX's cache): a short `fit` that ran all
        its steps on loop programs returns without waiting for its steps'
        own programs. A trace in progress is waited for, and none starts
        after this."""
        if self.tracer is not None:
            futures = [*self.first_pending.values(), *self.pending.values(), self.update]
            for future in filter(None, futures):
                future.cancel()
            with self.trace_lock:
                self.closed = True
            self.gate.set()  # compiles waiting for a cancelled loop program
            self.tracer.shutdown(wait=False)
            self.pool.shutdown(wait=False)
            self.tracer = self.pool = None
        if self.first is not None:
            self.first.forget_loops()
        self.pending, self.steps, self.first_pending = {}, {}, {}
