"""The JAX step programs a run gets follow what the run will do (its
optimizer's schedule), not the size of one `fit` call."""

import keras
import numpy as np
import pytest

import kbert
from kbert.training import create_optimizer
from tests.harness import TINY

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="XLA compiler options")

N, T = 12, 16


@pytest.fixture
def gpu(monkeypatch):
    """Options as they are chosen on a GPU (the steps still run here)."""
    from kbert.backend import jax_compile

    monkeypatch.setattr(jax_compile, "_on_gpu", lambda: True)
    return jax_compile


def classifier():
    keras.utils.set_random_seed(1)
    backbone = kbert.BertBackbone(**{**TINY, "max_sequence_length": T}, dropout=0.0)
    return kbert.BertClassifier(backbone, 2, dropout=0.0)


def data():
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(5, 97, (N, T)).astype("int32"),
        "segment_ids": np.zeros((N, T), "int32"),
        "padding_mask": np.ones((N, T), "int32"),
    }
    return x, rng.integers(0, 2, N)


def planned(model, jax_compile, steps):
    """The training options a `fit` of `steps` steps plans (Keras' step not made)."""
    from kbert.backend import keras_internals

    keras_internals.clear_step_compiler_options(model)
    jax_compile.plan(model, steps, ("train", "test"))
    return keras_internals.step_compiler_options(model, "train")


def test_a_fit_of_a_long_schedule_gets_the_long_run_programs_from_its_first_piece(gpu):
    """A short `fit` of a long run (a piece of `fit_resumable`'s, a
    benchmark's) compiles with XLA's defaults (autotuning, no loop
    programs), as one `fit` of the whole run would; a run of unknown
    length is judged by its `fit`, and `autotune=False` still wins."""
    from kbert.backend import keras_internals

    model = classifier()
    fast = gpu.FAST_COMPILE_OPTIONS
    x, y = data()
    model.compile(optimizer=create_optimizer(1e-4, 100_000, 100))
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # 3 steps of a 100,000-step run
    assert keras_internals.step_compiler_options(model, "train") is None
    assert not gpu._blocks_loop(model, "train")  # no loop programs: they need `fast`
    for compile_args, steps, options in [
        ({"num_train_steps": 100_000}, 20, None),  # compile's schedule
        ({"num_train_steps": 2_000}, 20, fast),  # a short run
        ({}, 20, fast),  # no length given: the fit's 20 steps
        ({}, gpu.AUTOTUNE_MIN_STEPS, None),
        ({}, None, None),  # a dataset of unknown length
        ({"num_train_steps": 100_000, "autotune": False}, 20, fast),
        ({"autotune": True}, 20, None),
    ]:
        model.compile(learning_rate=1e-4, **compile_args)
        assert planned(model, gpu, steps) == options, compile_args
    # the schedule's total also through a loss-scaling wrapper and Keras' schedules
    schedules = keras.optimizers.schedules
    assert gpu.schedule_steps(create_optimizer(1e-4, 30_000, 10)) == 30_000
    scaled = keras.optimizers.LossScaleOptimizer(create_optimizer(1e-4, 30_000, 10))
    assert gpu.schedule_steps(scaled) == 30_000
    assert gpu.schedule_steps(keras.optimizers.Adam(schedules.PolynomialDecay(1e-4, 500))) == 500
    assert gpu.schedule_steps(keras.optimizers.Adam(1e-4)) is None
    assert (
        gpu.schedule_steps(keras.optimizers.Adam(schedules.ExponentialDecay(1e-4, 9, 0.5))) is None
    )


def test_a_shape_gets_its_own_program_by_the_steps_the_run_takes_of_it(gpu):
    """The own program of a shape (beside its loop program) pays from
    `OWN_PROGRAM_MIN_STEPS` steps: counted over the run the `fit` is a
    piece of, each shape in its share of the `fit`'s batches."""
    least = gpu.OWN_PROGRAM_MIN_STEPS
    assert gpu.steps_of_shape(20, 20, 1, None) == 20  # a 20-step fit, run unknown
    assert gpu.steps_of_shape(20, 20, 1, 3 * least) == 3 * least  # a piece of a longer run
    assert gpu.steps_of_shape(1, 100, 1, 10 * least) < least  # a partial batch's shape
    assert gpu.steps_of_shape(1_000, 1_000, 3, 100) == 3_000  # the fit is the longer
