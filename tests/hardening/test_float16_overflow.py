"""float16 training survives overflowing steps through dynamic loss scaling."""

import keras
import numpy as np

import kbert
from kbert.training import create_optimizer
from tests.harness import TINY
from tests.models.test_pretrainer import batch


def test_float16_overflow_steps_are_skipped_and_training_continues():
    keras.config.set_dtype_policy("mixed_float16")
    model = kbert.BertPreTrainer(kbert.BertBackbone(**TINY))
    optimizer = keras.optimizers.LossScaleOptimizer(
        create_optimizer(1e-3, 100, 0), initial_scale=2.0**40
    )
    model.compile(optimizer=optimizer)
    x, y = batch(seed=0)
    before = [np.array(keras.ops.convert_to_numpy(v)) for v in model.trainable_weights]
    losses = [float(model.train_on_batch(x, y, return_dict=True)["loss"]) for _ in range(30)]
    assert all(np.isfinite(losses))  # the loss itself never overflows (computed in float32)
    scale = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
    assert scale < 2.0**40  # overflowing steps halved the scale ...
    applied = int(keras.ops.convert_to_numpy(optimizer.inner_optimizer.iterations))
    assert 0 < applied < 30  # ... were skipped, and later steps were applied
    after = [keras.ops.convert_to_numpy(v) for v in model.trainable_weights]
    assert all(np.all(np.isfinite(a)) for a in after)
    assert any(not np.array_equal(a, b) for a, b in zip(after, before))
    assert losses[-1] < losses[0]
