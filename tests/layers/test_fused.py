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


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the cuDNN key-length path is JAX's")
def test_key_reordering_makes_any_mask_exact_for_key_lengths():
    """The JAX GPU path moves real keys to the front so cuDNN's per-row key
    counts express any padding mask; checked here with XLA's kernel, values
    and gradients, on left-, right-, randomly- and fully-padded rows."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(4, 16, 2, 8)).astype("float32")) for _ in range(3))
    keep = rng.random((4, 16)) < 0.6
    keep[1] = False
    keep[2] = np.arange(16) >= 5
    keep[3] = np.arange(16) < 9
    keep = jnp.asarray(keep)

    def reference(q, k, v):
        mask = jnp.logical_or(keep, ~jnp.any(keep, axis=1, keepdims=True))[:, None, None, :]
        return jax.nn.dot_product_attention(q, k, v, scale=0.3, mask=mask)

    def reordered(q, k, v):
        return fused._jax_cudnn(q, k, v, keep, 0.3, implementation="xla")

    np.testing.assert_allclose(reordered(q, k, v), reference(q, k, v), atol=1e-6)
    loss = lambda f: lambda *a: (f(*a) ** 2).sum()  # noqa: E731
    for a, b in zip(jax.grad(loss(reordered), (0, 1, 2))(q, k, v), jax.grad(loss(reference), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("approximate", [False, True])
def test_gelu_values(approximate):
    x = np.linspace(-6, 6, 101).astype("float32")
    ours = keras.ops.convert_to_numpy(fused.fused_gelu(keras.ops.convert_to_tensor(x), approximate))
    ref = keras.ops.convert_to_numpy(keras.activations.gelu(keras.ops.convert_to_tensor(x), approximate=approximate))
    np.testing.assert_allclose(ours, ref, atol=1e-6)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the custom gradient is JAX's")
@pytest.mark.parametrize("approximate", [False, True])
def test_gelu_gradient_is_autodiff_of_gelu(approximate):
    import jax
    import jax.numpy as jnp

    x = jnp.linspace(-8, 8, 1001, dtype=jnp.float32)
    weights = jnp.cos(x)
    got = jax.jit(jax.grad(lambda v: (fused.fused_gelu(v, approximate) * weights).sum()))(x)
    want = jax.grad(lambda v: (jax.nn.gelu(v, approximate=approximate) * weights).sum())(x)
    np.testing.assert_allclose(got, want, atol=2e-6)
    x16 = x.astype(jnp.bfloat16)  # bfloat16 in, bfloat16 gradient out, computed in float32
    got16 = jax.grad(lambda v: (fused.fused_gelu(v, approximate).astype(jnp.float32) * weights).sum())(x16)
    assert got16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got16, "float32"), jax.grad(
        lambda v: (jax.nn.gelu(v, approximate=approximate) * weights).sum())(x16.astype(jnp.float32)), atol=1e-2)


def _embedding_inputs():
    rng = np.random.default_rng(3)
    tokens, positions, segments = (rng.normal(size=s).astype("float32") for s in ((4, 6, 8), (6, 8), (3, 8)))
    return tokens, positions, segments, rng.integers(0, 3, (4, 6)).astype("int32")


def test_embedding_sum_values():
    tokens, positions, segments, ids = _embedding_inputs()
    inputs = [keras.ops.convert_to_tensor(a) for a in (tokens, positions, segments, ids)]
    out = keras.ops.convert_to_numpy(fused.fused_embedding_sum(*inputs))
    np.testing.assert_allclose(out, tokens + segments[ids] + positions[None], atol=1e-6)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the custom gradient is JAX's")
def test_embedding_sum_gradient_is_autodiff_of_the_plain_sum():
    """The JAX path gathers both tables (no broadcast, see fused.py) and
    replaces the scatter-add gradient with a batch sum and a one-hot product."""
    import jax

    tokens, positions, segments, ids = _embedding_inputs()
    weights = np.random.default_rng(4).normal(size=tokens.shape).astype("float32")

    def loss(f):
        return lambda t, p, s: (f(t, p, s) * weights).sum()

    plain = lambda t, p, s: t + s[ids] + p[None]  # noqa: E731
    fused_sum = lambda t, p, s: fused.fused_embedding_sum(t, p, s, ids)  # noqa: E731
    got = jax.jit(jax.grad(loss(fused_sum), (0, 1, 2)))(tokens, positions, segments)
    want = jax.grad(loss(plain), (0, 1, 2))(tokens, positions, segments)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="the oneDNN path is torch's CPU inference")
def test_torch_cpu_inference_path_is_exact_and_follows_weight_updates():
    import torch

    rng = np.random.default_rng(2)
    x = torch.as_tensor(rng.normal(size=(3, 7, 16)).astype("float32"))
    layer = Dense(12, activation="gelu")
    layer.build(x.shape)
    kernel, bias = layer.get_weights()
    expected = lambda k, b: keras.activations.gelu(x @ torch.as_tensor(k) + torch.as_tensor(b), approximate=False)  # noqa: E731
    with torch.no_grad():
        assert fused.fused_dense_path(x) == "torch-onednn-packed"
        np.testing.assert_allclose(layer(x).numpy(), expected(kernel, bias).numpy(), atol=1e-5)
        layer.set_weights([kernel * 2, bias + 1])  # in-place update: the reordered weight must follow
        np.testing.assert_allclose(layer(x).numpy(), expected(kernel * 2, bias + 1).numpy(), atol=1e-5)
        layer.kernel.assign(kernel * 3)
        np.testing.assert_allclose(layer(x).numpy(), expected(kernel * 3, bias + 1).numpy(), atol=1e-5)
        unbiased = Dense(12, use_bias=False)
        unbiased.build(x.shape)
        np.testing.assert_allclose(unbiased(x).numpy(), (x @ torch.as_tensor(unbiased.get_weights()[0])).numpy(),
                                   atol=1e-5)
    assert fused.fused_dense_path(x) == "torch-linear"  # autograd on: the differentiable path
    out = layer(x)
    out.sum().backward()
    assert layer.kernel.value.grad is not None
