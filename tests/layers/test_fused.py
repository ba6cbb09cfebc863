"""The backend-specific paths of kbert.layers.fused compute what the generic
Keras layers compute."""

import keras
import numpy as np
import pytest

from kbert.layers import Dense, Dropout, fused


def test_dense_equals_keras_dense_with_and_without_bias_and_lora():
    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
    for use_bias in (True, False):
        ours, ref = Dense(6, use_bias=use_bias, activation="gelu"), keras.layers.Dense(6, use_bias=use_bias, activation="gelu")
        ours.build(x.shape)
        ref.build(x.shape)
        ref.set_weights([w + 0.1 for w in ours.get_weights()])
        ours.set_weights(ref.get_weights())
        np.testing.assert_allclose(keras.ops.convert_to_numpy(ours(x)), keras.ops.convert_to_numpy(ref(x)), atol=1e-6)
    ours.enable_lora(2, b_initializer="ones")
    ref.enable_lora(2, b_initializer="ones")
    ref.set_weights(ours.get_weights())
    np.testing.assert_allclose(keras.ops.convert_to_numpy(ours(x)), keras.ops.convert_to_numpy(ref(x)), atol=1e-5)


def test_dense_gradient_matches_keras_dense():
    x = keras.ops.convert_to_tensor(np.random.default_rng(1).normal(size=(3, 4)).astype("float32"))
    ours, ref = Dense(5), keras.layers.Dense(5)
    ours.build((3, 4))
    ref.build((3, 4))
    ref.set_weights(ours.get_weights())
    model_a = keras.Sequential([keras.Input((4,)), ours])
    model_b = keras.Sequential([keras.Input((4,)), ref])
    for model in (model_a, model_b):
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        model.train_on_batch(x, np.ones((3, 5), "float32"))
    for a, b in zip(ours.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_dropout_rate_scale_and_seeding():
    x = np.ones((200, 500), "float32")
    out = keras.ops.convert_to_numpy(Dropout(0.1, seed=3)(x, training=True))
    kept = out != 0
    assert abs(kept.mean() - 0.9) < 0.005
    np.testing.assert_allclose(out[kept], 1 / 0.9, rtol=1e-6)
    again = keras.ops.convert_to_numpy(Dropout(0.1, seed=3)(x, training=True))
    np.testing.assert_array_equal(out, again)  # same seed, same mask
    layer = Dropout(0.1, seed=3)
    first, second = (keras.ops.convert_to_numpy(layer(x, training=True)) for _ in range(2))
    assert (first != second).mean() > 0.1  # the generator advances
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(layer(x, training=False)), x)


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_dropout_extreme_rates(rate):
    x = np.ones((4, 4), "float32")
    out = keras.ops.convert_to_numpy(Dropout(rate, seed=0)(x, training=True))
    np.testing.assert_array_equal(out, x if rate == 0 else np.zeros_like(x))


def test_paths_are_reported():
    backend = keras.backend.backend()
    assert fused.fused_dense_path() == ("torch-linear" if backend == "torch" else "keras-matmul-add")
    assert fused.fused_dropout_path() == ("jax-rbg" if backend == "jax" else f"keras-{backend}")
    assert fused.fused_attention_path("float32") == ("torch-sdpa" if backend == "torch" else f"keras-{backend}")
