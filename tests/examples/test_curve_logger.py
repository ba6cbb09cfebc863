"""kbert.training.callbacks.CurveLogger, the recorder behind the pre-training curves."""

import keras
import numpy as np

from kbert.training.callbacks import CurveLogger, read_curves


def constant_model(dropout=0.0):
    """Predicts 0 and never learns (zero weights, learning rate 0): the loss
    of a batch whose targets are all t is exactly t**2."""
    inputs = keras.Input((1,))
    hidden = keras.layers.Dropout(dropout)(keras.layers.Dense(4)(inputs))
    outputs = keras.layers.Dense(1, kernel_initializer="zeros", use_bias=False)(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", metrics=["mae"])
    return model


def batches(values, batch_size=2):
    y = np.repeat(np.asarray(values, "float32"), batch_size)[:, None]
    return np.ones_like(y), y


def test_points_are_window_means_every_n_steps_with_held_out_at_each_epoch(tmp_path):
    path = str(tmp_path / "curves.jsonl")
    x, y = batches(range(1, 11))
    held_out = batches([3.0, 3.0])
    model = constant_model()
    curves = CurveLogger(path, every=2, validation_data=held_out)
    model.fit(x, y, batch_size=2, epochs=2, steps_per_epoch=5, shuffle=False, verbose=0,
              callbacks=[curves])  # fmt: skip
    points = read_curves(path)
    train = [p for p in points if p["split"] == "train"]
    # Every 2 steps, and the steps left at an epoch's end (Keras resets its means each epoch).
    assert [p["step"] for p in train] == [2, 4, 5, 6, 8, 10]
    expected = [(1 + 4) / 2, (9 + 16) / 2, 25, 36, (49 + 64) / 2, (81 + 100) / 2]
    np.testing.assert_allclose([p["loss"] for p in train], expected, rtol=1e-5)
    np.testing.assert_allclose([p["mae"] for p in train], [1.5, 3.5, 5, 6, 7.5, 9.5], rtol=1e-5)
    held = [p for p in points if p["split"] == "held_out"]
    assert [p["step"] for p in held] == [5, 10]
    np.testing.assert_allclose([p["loss"] for p in held], [9.0, 9.0], rtol=1e-6)


def test_a_resumed_run_drops_the_points_after_its_start_and_continues(tmp_path):
    path = str(tmp_path / "curves.jsonl")
    x, y = batches(range(1, 5))
    model = constant_model()
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0,
              callbacks=[CurveLogger(path, every=1)])  # fmt: skip
    with open(path, "a") as f:  # written after the last checkpoint by a run that was killed
        f.write('{"step": 6, "split": "train", "loss": 1e9}\n')
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0,
              callbacks=[CurveLogger(path, every=1)])  # fmt: skip
    points = read_curves(path)
    assert [p["step"] for p in points] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert max(p["loss"] for p in points) < 1e9


def test_held_out_evaluation_leaves_training_unchanged(tmp_path):
    """Same seed, with and without held-out evaluation: the same weights
    (evaluation draws from no random stream that training uses)."""
    x = np.random.default_rng(0).normal(size=(32, 1)).astype("float32")
    y = 2 * x

    def train(callbacks):
        keras.utils.set_random_seed(7)
        model = constant_model(dropout=0.5)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=4, epochs=4, steps_per_epoch=2, verbose=0,
                  callbacks=callbacks)  # fmt: skip
        return [keras.ops.convert_to_numpy(w) for w in model.weights]

    plain = train([])
    evaluated = train([CurveLogger(str(tmp_path / "c.jsonl"), every=1, validation_data=(x, y))])
    for a, b in zip(plain, evaluated):
        np.testing.assert_array_equal(a, b)
