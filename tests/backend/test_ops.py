"""The backend-specific paths of kbert.backend.ops compute what the generic
Keras layers compute."""

import keras
import numpy as np
import pytest

from kbert import backend as kbert_backend
from kbert.backend import ops as fused
from kbert.layers import Dense, Dropout, LayerNorm

# CPU paths; where a GPU is present Keras computes there and they do not run.
cpu_only = pytest.mark.skipif(
    kbert_backend.on_accelerator(), reason="a CPU path; Keras uses the GPU here"
)


def test_dense_equals_keras_dense_with_and_without_bias_and_lora():
    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
    for use_bias in (True, False):
        ours, ref = (
            Dense(6, use_bias=use_bias, activation="gelu"),
            keras.layers.Dense(6, use_bias=use_bias, activation="gelu"),
        )
        ours.build(x.shape)
        ref.build(x.shape)
        ref.set_weights([w + 0.1 for w in ours.get_weights()])
        ours.set_weights(ref.get_weights())
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(ours(x)), keras.ops.convert_to_numpy(ref(x)), atol=1e-6
        )
    ours.enable_lora(2, b_initializer="ones")
    ref.enable_lora(2, b_initializer="ones")
    ref.set_weights(ours.get_weights())
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(ours(x)), keras.ops.convert_to_numpy(ref(x)), atol=1e-5
    )


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


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="kbert's own dropout path is JAX's")
def test_dropout_scales_half_precision_without_bias():
    """Kept bfloat16 values are x / (1 - rate) rounded once, not x times a
    bfloat16-rounded 1 / 0.9 (1.109, 0.16% low on every kept value)."""
    x = np.random.default_rng(2).uniform(1, 2, (200, 200)).astype("float32")
    x16 = keras.ops.cast(x, "bfloat16")
    out = keras.ops.convert_to_numpy(
        keras.ops.cast(Dropout(0.1, seed=1, dtype="bfloat16")(x16, training=True), "float32")
    )
    kept = out != 0
    ratio = out[kept] / keras.ops.convert_to_numpy(keras.ops.cast(x16, "float32"))[kept]
    assert abs(ratio.mean() * 0.9 - 1) < 3e-4  # unbiased: rounding errors average out
    np.testing.assert_allclose(ratio, 1 / 0.9, rtol=4e-3)  # each value: one bfloat16 rounding


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_dropout_extreme_rates(rate):
    x = np.ones((4, 4), "float32")
    out = keras.ops.convert_to_numpy(Dropout(rate, seed=0)(x, training=True))
    np.testing.assert_array_equal(out, x if rate == 0 else np.zeros_like(x))


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the custom gradient is JAX's")
def test_dropout_gradient_uses_the_forward_mask():
    import jax
    import jax.numpy as jnp

    class FixedSeed:  # a pure function of x for jax.grad: the seed does not advance
        def next(self):
            return jnp.array([7, 11], "uint32")

    x = jnp.linspace(-1, 1, 3000, dtype=jnp.float32).reshape(30, 100)
    weights = jnp.cos(x)
    out = fused.fused_dropout(x, 0.3, FixedSeed())
    grad = jax.jit(jax.grad(lambda v: (fused.fused_dropout(v, 0.3, FixedSeed()) * weights).sum()))(
        x
    )
    keep = np.asarray(out) != 0
    scale = 1 / 0.7
    assert abs(keep.mean() - 0.7) < 0.03
    np.testing.assert_allclose(np.asarray(out)[keep], np.asarray(x)[keep] * scale, rtol=1e-6)
    np.testing.assert_allclose(grad, np.where(keep, np.asarray(weights) * scale, 0), rtol=1e-6)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's custom gradients")
def test_dropout_and_key_permutation_differentiate_inside_lax_scan():
    """Their custom gradients take the mask and the key orders as arguments:
    a gradient through a lax.scan whose body draws them (as a scan over
    encoder blocks would) equals the one of the same steps unrolled."""
    import jax
    import jax.numpy as jnp

    from kbert.backend import jax_ops

    class Seed:  # the seed of each step, a traced scan input
        def __init__(self, seed):
            self.seed = seed

        def next(self):
            return self.seed

    seeds = jnp.arange(8, dtype=jnp.uint32).reshape(4, 2)
    keep = jnp.asarray(np.random.default_rng(0).uniform(size=(4, 3, 6)) < 0.7)
    x0 = jnp.linspace(-1, 1, 3 * 6 * 2 * 4, dtype=jnp.float32).reshape(3, 6, 2, 4)

    def step(x, inputs):
        seed, mask = inputs
        order = jnp.argsort(~mask, axis=1, stable=True).astype(jnp.int32)
        inverse = jnp.argsort(order, axis=1).astype(jnp.int32)
        x = jax_ops._permute_keys(x, order, inverse)
        return jax_ops.dropout(jnp.sin(x), 0.3, Seed(seed)), None

    def scanned(x):
        return (jax.lax.scan(step, x, (seeds, keep))[0] ** 2).sum()

    def unrolled(x):
        for i in range(4):
            x = step(x, (seeds[i], keep[i]))[0]
        return (x**2).sum()

    value, grad = jax.jit(jax.value_and_grad(scanned))(x0)
    want_value, want_grad = jax.jit(jax.value_and_grad(unrolled))(x0)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    assert float(jnp.abs(grad).sum()) > 0


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the hashed bits are JAX's")
def test_dropout_bits_hash_each_flat_index():
    """`dropout_bits` is the keyed hash of each element's row-major flat
    index: a numpy lowbias32 of the same index gives the same bits, with
    the single-iota index and with the per-axis one it keeps for arrays of
    2^32 elements or more."""
    from kbert.backend import jax_ops

    def mix(x):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        return x ^ (x >> np.uint32(16))

    shape, seed = (3, 5, 7), np.array([11, 29], "uint32")
    with np.errstate(over="ignore"):
        k0 = mix(seed[0] ^ np.uint32(0x9E3779B9))
        k1 = mix(seed[1] + np.uint32(0x85EBCA6B))
        want = mix(mix(np.arange(105, dtype="uint32").reshape(shape) ^ k0) + k1)
    np.testing.assert_array_equal(np.asarray(jax_ops.dropout_bits(shape, seed)), want)
    for limit in (2**32, 0):  # the single iota, and the per-axis index
        index = np.asarray(jax_ops._flat_index(shape, iota_limit=limit))
        np.testing.assert_array_equal(index, np.arange(105, dtype="uint32").reshape(shape))


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the hashed bits are JAX's")
def test_dropout_bits_are_uniform_and_uncorrelated():
    """What dropout needs from `dropout_bits`: uniform bits, and keep masks
    uncorrelated between neighbouring elements, neighbouring rows and
    successive seeds (correlations of 0.1-masks over 1M elements: |r| is
    about 0.001 by chance; a flaw such as a shifted copy gives 1)."""
    from kbert.backend import jax_ops

    shape = (256, 4096)
    seeds = [np.array([s, 3 * s + 1], "uint32") for s in range(4)]
    bits = [np.asarray(jax_ops.dropout_bits(shape, s)) for s in seeds]
    for b in bits:
        counts = np.bincount((b >> 28).ravel(), minlength=16)  # top 4 bits: 16 equal cells
        chi2 = ((counts - b.size / 16) ** 2 / (b.size / 16)).sum()
        assert chi2 < 50  # 15 degrees of freedom: P(chi2 > 50) ~ 1e-5
        low = np.bincount((b & 15).ravel(), minlength=16)  # low bits too
        assert ((low - b.size / 16) ** 2 / (b.size / 16)).sum() < 50
    masks = [(b < np.uint32(0.1 * 2**32)).astype("float32") for b in bits]
    m = masks[0]
    assert abs(m.mean() - 0.1) < 0.002

    def r(a, b):
        return abs(np.corrcoef(a.ravel(), b.ravel())[0, 1])

    assert r(m[:, 1:], m[:, :-1]) < 0.006  # neighbouring elements
    assert r(m[1:], m[:-1]) < 0.006  # neighbouring rows
    for other in masks[1:]:  # successive seeds (the generator advances per call)
        assert r(m, other) < 0.006
    assert r(m.ravel()[1:], masks[1].ravel()[:-1]) < 0.006  # no shifted copies across seeds


def test_paths_are_reported():
    backend = keras.backend.backend()
    assert fused.fused_dense_path() == (
        "torch-linear" if backend == "torch" else "keras-matmul-add"
    )
    assert fused.fused_dropout_path() == ("jax-hash" if backend == "jax" else f"keras-{backend}")
    from kbert.layers.attention import MultiHeadSelfAttention

    layer = MultiHeadSelfAttention(num_heads=2, hidden_dim=8, attention_dropout=0.1)
    assert layer.attention_path(False) == ("torch-sdpa" if backend == "torch" else "keras")
    assert layer.attention_path(True) == ("torch-sdpa" if backend == "torch" else "explicit")


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

    from kbert.backend import jax_ops

    def reordered(q, k, v):
        return jax_ops.cudnn_attention(q, k, v, keep, 0.3, implementation="xla")

    np.testing.assert_allclose(reordered(q, k, v), reference(q, k, v), atol=1e-6)
    loss = lambda f: lambda *a: (f(*a) ** 2).sum()  # noqa: E731
    for a, b in zip(
        jax.grad(loss(reordered), (0, 1, 2))(q, k, v), jax.grad(loss(reference), (0, 1, 2))(q, k, v)
    ):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("approximate", [False, True])
def test_gelu_values(approximate):
    x = np.linspace(-6, 6, 101).astype("float32")
    ours = keras.ops.convert_to_numpy(fused.fused_gelu(keras.ops.convert_to_tensor(x), approximate))
    ref = keras.ops.convert_to_numpy(
        keras.activations.gelu(keras.ops.convert_to_tensor(x), approximate=approximate)
    )
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
    got16 = jax.grad(
        lambda v: (fused.fused_gelu(v, approximate).astype(jnp.float32) * weights).sum()
    )(x16)
    assert got16.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(got16, "float32"),
        jax.grad(lambda v: (jax.nn.gelu(v, approximate=approximate) * weights).sum())(
            x16.astype(jnp.float32)
        ),
        atol=1e-2,
    )


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the custom gradient is JAX's")
@pytest.mark.parametrize("approximate", [False, True])
def test_gelu_keeps_only_its_input_for_the_backward_pass(approximate, capsys):
    """Autodiff of the float32 expression kept three float32 copies of the
    activation; the custom gradient keeps x, in its own dtype."""
    import jax.numpy as jnp
    from jax.ad_checkpoint import print_saved_residuals

    x = jnp.ones((2, 3, 8), jnp.bfloat16)
    capsys.readouterr()
    print_saved_residuals(lambda v: fused.fused_gelu(v, approximate), x)
    saved = [line for line in capsys.readouterr().out.splitlines() if "[" in line]
    assert len(saved) == 1 and saved[0].startswith("bf16[2,3,8] ")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_norm_equals_keras_layer_normalization(dtype):
    rng = np.random.default_rng(5)
    x = (rng.normal(size=(3, 7, 16)) * 3 + 1.5).astype("float32")
    ours, ref = (
        LayerNorm(epsilon=1e-12, dtype=dtype),
        keras.layers.LayerNormalization(epsilon=1e-12, dtype=dtype),
    )
    ours.build(x.shape)
    ref.build(x.shape)
    ours.set_weights([rng.normal(size=16).astype("float32") for _ in range(2)])
    ref.set_weights(ours.get_weights())
    tensor = keras.ops.cast(keras.ops.convert_to_tensor(x), dtype)
    got, want = (
        keras.ops.convert_to_numpy(keras.ops.cast(layer(tensor), "float32"))
        for layer in (ours, ref)
    )
    np.testing.assert_allclose(got, want, atol=1e-5 if dtype == "float32" else 3e-2)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the custom gradient is JAX's")
def test_layer_norm_gradient_is_autodiff_of_keras_layer_norm():
    import jax

    rng = np.random.default_rng(6)
    x = (rng.normal(size=(4, 5, 16)) * 2 - 0.7).astype("float32")
    gamma, beta = (rng.normal(size=16).astype("float32") for _ in range(2))
    weights = rng.normal(size=x.shape).astype("float32")

    def loss(f):
        return lambda x, g, b: (f(x, g, b) * weights).sum()

    from kbert.backend import jax_ops

    # the custom LayerNorm itself (`fused_layer_norm` takes it on a GPU or TPU)
    ours = lambda x, g, b: jax_ops.layer_norm(x, g, b, 1e-12)  # noqa: E731
    ref = lambda x, g, b: keras.ops.layer_normalization(x, g, b, epsilon=1e-12)  # noqa: E731
    np.testing.assert_allclose(ours(x, gamma, beta), ref(x, gamma, beta), atol=1e-5)
    got = jax.jit(jax.grad(loss(ours), (0, 1, 2)))(x, gamma, beta)
    want = jax.grad(loss(ref), (0, 1, 2))(x, gamma, beta)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=2e-5)


def _embedding_inputs():
    rng = np.random.default_rng(3)
    tokens, positions, segments = (
        rng.normal(size=s).astype("float32") for s in ((4, 6, 8), (6, 8), (3, 8))
    )
    return tokens, positions, segments, rng.integers(0, 3, (4, 6)).astype("int32")


def test_embedding_sum_values():
    tokens, positions, segments, ids = _embedding_inputs()
    inputs = [keras.ops.convert_to_tensor(a) for a in (tokens, positions, segments, ids)]
    out = keras.ops.convert_to_numpy(fused.fused_embedding_sum(*inputs))
    np.testing.assert_allclose(out, tokens + segments[ids] + positions[None], atol=1e-6)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the custom gradient is JAX's")
def test_embedding_sum_gradient_is_autodiff_of_the_plain_sum():
    """The JAX path gathers both tables (no broadcast, see kbert.backend.ops) and
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


@pytest.mark.parametrize("vocabulary", [97, 128])
def test_reverse_embedding_product_and_gradient_are_unchanged_by_padding(vocabulary, monkeypatch):
    """TokenEmbedding(reverse=True) pads the table to a multiple of
    REVERSE_PAD rows on JAX (tensor-core alignment): logits keep V columns
    and equal the unpadded product; the table's gradient too."""
    from kbert.layers import TokenEmbedding

    layer = TokenEmbedding(vocabulary, 16)
    layer.build((None,))
    layer.embeddings.assign(
        np.random.default_rng(5).normal(size=(vocabulary, 16)).astype("float32")
    )
    x = np.random.default_rng(6).normal(size=(3, 4, 16)).astype("float32")
    table = keras.ops.convert_to_numpy(layer.embeddings)
    padded = keras.ops.convert_to_numpy(layer(x, reverse=True))
    assert padded.shape == (3, 4, vocabulary)
    np.testing.assert_allclose(padded, x @ table.T, atol=1e-5)
    if keras.backend.backend() == "jax":
        import jax

        def table_gradient(pad):
            return jax.grad(lambda t: (_reverse_with(layer, t, pad, x) ** 2).sum())(table)

        np.testing.assert_allclose(table_gradient(64), table_gradient(0), atol=1e-4, rtol=1e-5)
        with pytest.raises(AssertionError):  # the check sees a wrong gradient
            np.testing.assert_allclose(
                table_gradient(64), 1.01 * table_gradient(0), atol=1e-4, rtol=1e-5
            )


def _reverse_with(layer, table, pad, x):
    """layer(x, reverse=True) with `table` in place of its variable and REVERSE_PAD = pad."""
    from keras.src.backend.common.stateless_scope import StatelessScope

    original = type(layer).REVERSE_PAD
    type(layer).REVERSE_PAD = pad
    try:
        with StatelessScope(state_mapping=[(layer.embeddings, table)]):
            return layer(x, reverse=True)
    finally:
        type(layer).REVERSE_PAD = original


@cpu_only
@pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="the oneDNN path is torch's CPU inference"
)
def test_torch_cpu_inference_path_is_exact_and_follows_weight_updates():
    import torch

    rng = np.random.default_rng(2)
    x = torch.as_tensor(rng.normal(size=(3, 7, 16)).astype("float32"))
    layer = Dense(12, activation="gelu")
    layer.build(x.shape)
    kernel, bias = layer.get_weights()

    def expected(k, b):
        product = x @ torch.as_tensor(k) + torch.as_tensor(b)
        return keras.activations.gelu(product, approximate=False)

    with torch.no_grad():
        assert fused.fused_dense_path(x) == "torch-onednn-packed"
        np.testing.assert_allclose(layer(x).numpy(), expected(kernel, bias).numpy(), atol=1e-5)
        layer.set_weights(
            [kernel * 2, bias + 1]
        )  # in-place update: the reordered weight must follow
        np.testing.assert_allclose(
            layer(x).numpy(), expected(kernel * 2, bias + 1).numpy(), atol=1e-5
        )
        layer.kernel.assign(kernel * 3)
        np.testing.assert_allclose(
            layer(x).numpy(), expected(kernel * 3, bias + 1).numpy(), atol=1e-5
        )
        unbiased = Dense(12, use_bias=False)
        unbiased.build(x.shape)
        np.testing.assert_allclose(
            unbiased(x).numpy(), (x @ torch.as_tensor(unbiased.get_weights()[0])).numpy(), atol=1e-5
        )
    assert fused.fused_dense_path(x) == "torch-linear"  # autograd on: the differentiable path
    out = layer(x)
    out.sum().backward()
    assert layer.kernel.value.grad is not None


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_sublayer_call_equals_calling_the_layer(policy, monkeypatch):
    """Inside an encoder block (under its autocast scope) `sublayer_call`
    gives what `layer(...)` gives: a Dense (autocast), a LayerNorm (no
    autocast: float32 gamma/beta) and a Dropout; on torch it skips
    `Layer.__call__`, elsewhere it is the call."""
    import kbert.layers.attention as attention
    import kbert.layers.encoder as encoder

    block = encoder.TransformerEncoderBlock(2, 16, 32, dropout=0.0, dtype=policy)
    x = keras.ops.convert_to_tensor(
        np.random.default_rng(0).normal(size=(2, 5, 16)), block.compute_dtype
    )
    mask = keras.ops.ones((2, 5), "int32")
    block(x, mask)
    with monkeypatch.context() as plain:
        for module in (attention, encoder):
            plain.setattr(
                module, "sublayer_call", lambda layer, *args, **kwargs: layer(*args, **kwargs)
            )
        expected = keras.ops.convert_to_numpy(keras.ops.cast(block(x, mask), "float32"))

    calls = []
    original = keras.layers.Layer.__call__

    def counting(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(keras.layers.Layer, "__call__", counting)
    got = keras.ops.convert_to_numpy(keras.ops.cast(block(x, mask), "float32"))
    np.testing.assert_array_equal(got, expected)
    if keras.backend.backend() == "torch":
        assert calls == ["TransformerEncoderBlock"], calls
    else:
        assert "Dense" in calls and "LayerNorm" in calls, calls


DATA_PARALLEL_ATTENTION = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, keras, numpy as np
from kbert.backend import jax_ops
rng = np.random.default_rng(0)
q, k, v = (rng.normal(size=(4, 6, 2, 8)).astype("float32") for _ in range(3))
keep = (np.arange(6)[None] < np.array([[6], [3], [1], [5]])).astype(bool)
keep[3] = keep[3][::-1]  # a left-padded row: the reordered-keys case
run = jax.jit(lambda *a: jax_ops.cudnn_attention(*a, 0.3, implementation="xla"))
single = np.asarray(run(q, k, v, keep))
keras.distribution.set_distribution(keras.distribution.DataParallel(devices=keras.distribution.list_devices("cpu")))
run = jax.jit(lambda *a: jax_ops.cudnn_attention(*a, 0.3, implementation="xla"))
sharded = run(q, k, v, keep)
assert len(sharded.sharding.device_set) == 2, sharded.sharding
np.testing.assert_allclose(np.asarray(sharded), single, atol=1e-6)
print("OK")
"""


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the JAX attention path")
def test_attention_under_data_parallel_pins_batch_shards():
    """Under keras.distribution.DataParallel the attention's operands are
    pinned to batch shards (what jax's cuDNN partitioner accepts) and the
    result equals the single-device one (XLA's kernel stands in for cuDNN)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=root, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-c", DATA_PARALLEL_ATTENTION],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_attention_dropout_is_unbiased_on_every_path():
    """Training with attention dropout (explicit softmax + dropout on JAX and
    TensorFlow; SDPA's own dropout on torch): outputs change from draw to
    draw, and their mean over many draws is the output without dropout
    (inverted dropout on the probabilities keeps the expectation)."""
    from kbert.layers.attention import MultiHeadSelfAttention

    layer = MultiHeadSelfAttention(num_heads=2, hidden_dim=8, attention_dropout=0.5)
    x = np.random.default_rng(8).normal(size=(2, 6, 8)).astype("float32")
    mask = np.array([[1] * 6, [1] * 4 + [0] * 2], "int32")
    layer(x, mask)
    want = keras.ops.convert_to_numpy(layer(x, mask, training=False))
    draws = np.stack(
        [keras.ops.convert_to_numpy(layer(x, mask, training=True)) for _ in range(1500)]
    )
    assert layer.attention_path(True) == (
        "torch-sdpa" if keras.backend.backend() == "torch" else "explicit"
    )
    assert np.abs(draws[0] - draws[1]).max() > 1e-3  # masks differ between calls
    assert np.abs(draws[0] - want).max() > 1e-3
    spread = draws.std(axis=0).max()
    np.testing.assert_allclose(draws.mean(axis=0), want, atol=5 * spread / np.sqrt(len(draws)))


def test_fill_padding_sets_the_padding_positions_only():
    """`fill_padding` keeps x where the mask is 1 and puts the number where
    it is 0, in x's dtype, on every backend (torch: `masked_fill`)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5)).astype("float32")
    mask = (np.arange(5) < np.array([[5], [2], [0]])).astype("int32")
    out = fused.fill_padding(
        keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(mask), -1e9
    )
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(out), np.where(mask > 0, x, np.float32(-1e9))
    )


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch's attention kernels")
def test_gpu_attention_leaves_out_cudnn_and_keeps_the_kernels_a_user_turned_off():
    """On a GPU kbert's attention lets torch pick any kernel that is on
    except cuDNN's (a plan per input shape); it turns on none that is off."""
    from torch.backends import cuda
    from torch.nn.attention import SDPBackend

    from kbert.backend import torch_ops

    flags = ("flash", "mem_efficient", "math", "cudnn")
    before = {name: getattr(cuda, f"{name}_sdp_enabled")() for name in flags}

    def switch(**on):
        for name in flags:
            getattr(cuda, f"enable_{name}_sdp")(on.get(name, True))

    try:
        switch()
        assert torch_ops._gpu_attention_kernels() == [
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH,
        ]
        switch(flash=False)
        kernels = torch_ops._gpu_attention_kernels()
        assert kernels == [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        switch(flash=False, mem_efficient=False, math=False)  # cuDNN alone: kept
        assert torch_ops._gpu_attention_kernels() is None
        switch(cudnn=False)  # already off: nothing to change
        assert torch_ops._gpu_attention_kernels() is None
    finally:
        switch(**before)


def _padded_batch(batch=6, length=9, hidden=16, seed=3):
    rng = np.random.default_rng(seed)
    lengths = np.array([length, 1, 4, 2, 7, 3][:batch])
    mask = (np.arange(length)[None] < lengths[:, None]).astype("int32")  # 1/2 padding
    mask[2] = mask[2, ::-1]  # padding first
    mask[4, 3] = 0  # a hole: attention needs no contiguous tokens
    x = rng.normal(size=(batch, length, hidden)).astype("float32")
    return x, mask


@cpu_only
def test_encoder_block_on_packed_tokens_equals_the_padded_block(monkeypatch):
    """Packing (eager torch and TensorFlow without XLA, on a CPU; batches
    with padding) changes nothing at the real tokens, forward or backward,
    and passes the inputs through at the padding."""
    from kbert.layers import encoder
    from kbert.layers.encoder import TransformerEncoderBlock

    x, mask = _padded_batch()
    block = TransformerEncoderBlock(4, 16, 32, dropout=0.0, attention_dropout=0.0, adapter_size=3)
    block.build(x.shape)
    name = keras.backend.backend()
    x_t, mask_t = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(mask)
    assert fused.token_packing_path(x_t, mask_t) == ("padded" if name == "jax" else "packed")
    with fused.portable_graph():  # graphs traced to be saved
        assert fused.token_packing_path(x_t, mask_t) == "padded"
    if name == "torch":  # too little padding to pay for packing
        full = np.ones_like(mask)
        assert fused.token_packing_path(x_t, keras.ops.convert_to_tensor(full)) == "padded"
    real = mask[..., None].astype(bool)
    packed = keras.ops.convert_to_numpy(block(x_t, mask_t))
    if name != "jax":  # the padding rows pass through
        np.testing.assert_array_equal(packed[~real[..., 0]], x[~real[..., 0]])
    with monkeypatch.context() as patch:
        patch.setattr(encoder, "token_packing", lambda *args: None)
        padded = keras.ops.convert_to_numpy(block(x_t, mask_t))
    np.testing.assert_allclose(np.where(real, packed, 0), np.where(real, padded, 0), atol=1e-5)
    as_bool = keras.ops.convert_to_numpy(block(x_t, keras.ops.cast(mask_t, "bool")))
    np.testing.assert_array_equal(as_bool, packed)  # a boolean mask, the same path
    if name == "tensorflow":
        import tensorflow as tf

        def gradients(packing):
            with monkeypatch.context() as patch:
                if not packing:
                    patch.setattr(encoder, "token_packing", lambda *args: None)
                with tf.GradientTape() as tape:
                    tape.watch(x_t)
                    out = block(x_t, mask_t, training=True)
                    loss = tf.reduce_sum(out * tf.cast(mask_t, "float32")[..., None])
                return tape.gradient(loss, [x_t, *block.trainable_variables])

        for a, b in zip(gradients(True), gradients(False)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        # Under XLA the shapes must be static: the block runs padded there.
        paths = []

        def probe(inputs):
            paths.append(fused.token_packing_path(inputs, mask_t))
            return inputs

        tf.function(probe, jit_compile=True)(x_t)
        tf.function(probe)(x_t)
        assert paths == ["padded", "packed"]
    if name != "torch":
        return
    import torch

    from kbert.backend import torch_ops

    def run(packing, group_cost=torch_ops.GROUP_COST):
        monkeypatch.setattr(torch_ops, "PACK_MIN_PADDING", 0.125 if packing else 2.0)
        monkeypatch.setattr(torch_ops, "GROUP_COST", group_cost)
        inputs = torch.tensor(x, requires_grad=True)
        assert fused.token_packing_path(inputs, mask_t) == ("packed" if packing else "padded")
        out = block(inputs, mask_t, training=True)
        (out * torch.tensor(mask)[..., None] * torch.arange(16.0)).sum().backward()
        grads = [v.value.grad.clone() for v in block.trainable_variables]
        for v in block.trainable_variables:
            v.value.grad = None
        return out.detach().numpy(), inputs.grad.numpy(), [g.numpy() for g in grads]

    padded, padded_dx, padded_grads = run(False)
    real = mask[..., None].astype(bool)
    # One attention group (these rows are short), then a group per 2 rows.
    for group_cost, groups in ((torch_ops.GROUP_COST, 1), (0, 3)):
        packing = torch_ops.TokenPacking(torch.tensor(mask) != 0)
        monkeypatch.setattr(torch_ops, "GROUP_COST", group_cost)
        assert len(packing.attention_groups()) == groups
        packed, packed_dx, packed_grads = run(True, group_cost)
        np.testing.assert_allclose(np.where(real, packed, 0), np.where(real, padded, 0), atol=1e-5)
        np.testing.assert_array_equal(packed[~real[..., 0]], x[~real[..., 0]])
        np.testing.assert_allclose(packed_dx * real, padded_dx * real, atol=1e-5)
        assert len(packed_grads) == len(padded_grads) == len(block.trainable_variables)
        for a, b in zip(packed_grads, padded_grads):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # inference: oneDNN's product on the packed rows
        np.testing.assert_allclose(
            np.where(real, block(torch.tensor(x), mask_t).numpy(), 0),
            np.where(real, padded, 0),
            atol=1e-5,
        )


@cpu_only
@pytest.mark.skipif(keras.backend.backend() != "torch", reason="packing is torch's CPU path")
def test_token_packing_needs_enough_padding_and_a_cpu_tensor(monkeypatch):
    import torch

    from kbert.backend import torch_ops

    x, mask = _padded_batch()
    mask = torch.tensor(mask)
    packing = torch_ops.token_packing(torch.tensor(x), mask)
    assert packing is not None and packing.index.tolist() == np.flatnonzero(mask.numpy()).tolist()
    # Every real token sits in one attention group, its row's tokens first.
    monkeypatch.setattr(torch_ops, "GROUP_COST", 0)
    groups = packing.attention_groups()
    assert sorted(torch.cat([g.rows for g in groups]).tolist()) == list(range(int(mask.sum())))
    tokens = torch.arange(int(mask.sum()), dtype=torch.float32)[:, None]  # packed order
    for g in groups:
        assert g.padding_mask.sum() == len(g.rows)
        layout = g.scatter(tokens)[..., 0]  # (b, T_g): each row's tokens first, in order
        for row, keep in zip(layout, g.padding_mask):
            assert not row[~keep].any()
            real = row[keep]
            assert bool(keep[: len(real)].all()) and bool((real[1:] > real[:-1]).all())
    rows = packing.gather(torch.tensor(x))
    assert rows.shape == (int(mask.sum()), 16)
    np.testing.assert_array_equal(packing.scatter(rows).numpy(), x * mask.numpy()[..., None])
    np.testing.assert_array_equal(packing.scatter(rows, base=torch.tensor(x)).numpy(), x)
    few = torch.ones_like(mask)
    few[0, -1] = 0  # 1 padding token in 54: packing would save too little
    assert torch_ops.token_packing(torch.tensor(x), few) is None
    assert torch_ops.token_packing(torch.tensor(x, device="meta"), mask) is None
    seen = []

    def traced(t):  # a trace would freeze one batch's token count
        seen.append(torch_ops.token_packing(t, mask))
        return t * 2

    torch.jit.trace(traced, torch.tensor(x), check_trace=False)
    assert seen == [None]
    # All padding: n = 0 rows, still defined.
    empty = torch_ops.token_packing(torch.tensor(x), torch.zeros_like(mask))
    assert empty.gather(torch.tensor(x)).shape == (0, 16)


@cpu_only
def test_tensorflow_graph_builds_the_packing_and_the_attention_mask_once():
    """A traced TensorFlow forward computes the padding mask's packing
    index and attention mask once for all blocks (per block they were a
    dozen graph operations that run one by one), with the outputs of eager
    calls, which build them per block."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("TensorFlow graphs")
    import collections

    import tensorflow as tf

    import kbert

    backbone = kbert.BertBackbone(97, 3, 2, 16, 32, max_sequence_length=16, dropout=0.0)
    x, mask = _padded_batch()
    inputs = {
        "token_ids": (np.arange(mask.size).reshape(mask.shape) % 90 + 1).astype("int32") * mask,
        "segment_ids": np.zeros_like(mask),
        "padding_mask": mask,
    }
    forward = tf.function(lambda x: backbone(x)["sequence_output"])
    spec = {k: tf.TensorSpec(v.shape, tf.int32) for k, v in inputs.items()}
    counts = collections.Counter(
        op.type for op in forward.get_concrete_function(spec).graph.get_operations()
    )
    assert counts["Where"] == 1 and counts["Any"] == 1  # not once per block
    assert counts["ScatterNd"] == 3  # the blocks still pack: one scatter each
    real = mask[..., None]
    traced = forward(inputs).numpy() * real
    eager = keras.ops.convert_to_numpy(backbone(inputs)["sequence_output"]) * real
    np.testing.assert_allclose(traced, eager, atol=1e-5)
