"""Keras' `quantize` on kbert layers and models: which layers convert, the
int8 arithmetic against a hand computation, save/reload of quantized models,
and float8 training steps."""

import warnings

import keras
import numpy as np
import pytest

import kbert
from kbert.backend import keras_internals
from kbert.layers import Dense
from kbert.layers.quantization import apply_quantization, quantized_layers
from tests import harness
from tests.harness import TINY

TINY = {**TINY, "num_layers": 1}

BLOCK_DENSES = ("self_attention/qkv", "self_attention/output", "intermediate_dense", "output_dense")
BACKBONE_QUANTIZED = {
    f"transformer_layer_{i}/{name}" for i in range(TINY["num_layers"]) for name in BLOCK_DENSES
} | {"pooler/dense", "embeddings/segment_embedding"}
# Leaf layers Keras' quantize passes over with a warning: nothing to
# quantize, or (TokenEmbedding, tied to the MLM decoder) kept float.
UNQUANTIZED = {"InputLayer", "Dropout", "Activation", "LayerNorm", "TokenEmbedding"}


def quantize(model, mode):
    """model.quantize(mode); returns the class names Keras warned about."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.quantize(mode)
    suffix = " does not have a `quantize` method implemented."
    return {
        str(w.message)[len("Layer ") : -len(suffix)]
        for w in caught
        if str(w.message).endswith(suffix)
    }


def pretraining_inputs():
    x = harness.backbone_inputs()
    x["mask_positions"] = np.array([[1, 2], [0, 3], [1, 1]], "int32")
    return x


@pytest.fixture
def classifier():
    return kbert.BertClassifier(kbert.BertBackbone(**TINY), num_classes=3)


def test_int8_quantizes_every_dense_projection_of_a_classifier(classifier):
    warned = quantize(classifier, "int8")
    assert warned <= UNQUANTIZED and "Dense" not in warned
    expected = BACKBONE_QUANTIZED | {"logits"}
    assert len(expected) == 4 * TINY["num_layers"] + 3
    assert quantized_layers(classifier) == {path: "int8_from_float32" for path in expected}
    for path in expected:  # the kernels themselves are int8 now
        layer = next(x for x in keras_internals.flatten_layers(classifier) if x.path == path)
        table = layer._embeddings if path.startswith("embeddings/") else layer._kernel
        assert keras.backend.standardize_dtype(table.dtype) == "int8"


def test_int8_pretrainer_heads_and_preset_reload(tmp_path):
    model = kbert.BertPreTrainer(kbert.BertBackbone(**TINY))
    x = pretraining_inputs()
    quantize(model, "int8")
    expected = BACKBONE_QUANTIZED | {"mlm_head/transform", "nsp_head/dense"}
    assert set(quantized_layers(model)) == expected
    # the backbone records its own layers, the task only its heads
    assert set(quantized_layers(model, exclude=[model.backbone])) == {
        "mlm_head/transform",
        "nsp_head/dense",
    }
    before = model(x)
    model.save_to_preset(tmp_path / "preset")
    again = kbert.BertPreTrainer.from_preset(tmp_path / "preset")
    assert quantized_layers(again) == quantized_layers(model)
    assert harness.max_abs_diff(again(x), before) == 0.0


@pytest.mark.smoke  # also on the oldest supported Keras
def test_int8_dense_matches_a_hand_computed_product():
    rng = np.random.default_rng(0)
    kernel = rng.normal(size=(6, 4)).astype("float32")
    bias = rng.normal(size=(4,)).astype("float32")
    x = rng.normal(size=(3, 6)).astype("float32")
    layer = Dense(4)
    layer.build((None, 6))
    layer.set_weights([kernel, bias])
    layer.quantize("int8")

    # Keras' abs-max scheme: the kernel per output channel (column), the
    # inputs per row, both to [-127, 127]; the int32 product is rescaled.
    kernel_scale = 127.0 / (np.abs(kernel).max(axis=0) + 1e-7)
    kernel_q = np.clip(np.round(kernel * kernel_scale), -127, 127)
    x_scale = 127.0 / (np.abs(x).max(axis=-1, keepdims=True) + 1e-7)
    x_q = np.clip(np.round(x * x_scale), -127, 127)
    expected = (x_q @ kernel_q) / (x_scale * kernel_scale) + bias

    np.testing.assert_array_equal(keras.ops.convert_to_numpy(layer._kernel), kernel_q)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(layer(x)), expected, rtol=1e-5)
    # kbert's torch encoder calls `call` directly: the same quantized product
    direct = keras.ops.convert_to_numpy(layer.call(keras.ops.convert_to_tensor(x)))
    np.testing.assert_allclose(direct, expected, rtol=1e-5)
    # and it approximates the float product to int8 precision
    assert np.abs(expected - (x @ kernel + bias)).max() < 0.05


@pytest.mark.parametrize("shape", [(2, 5, 24), (3, 24), (1, 1, 24), (19, 24)])
def test_int8_inference_product_is_keras_int8_product(shape):
    """Inference takes the backend's integer kernel (`int8_matmul_path`
    names it); training takes Keras' int8 call, whose gradient it keeps.
    Both compute the same integers, so the outputs are equal."""
    from kbert.backend import ops as backend_ops

    rng = np.random.default_rng(1)
    layer = Dense(16, activation="gelu")
    x = rng.normal(size=shape).astype("float32") * rng.uniform(0.1, 10, size=shape[:-1] + (1,))
    layer(x)
    layer.quantize("int8")
    inference = keras.ops.convert_to_numpy(layer(x))
    training = keras.ops.convert_to_numpy(layer(x, training=True))
    np.testing.assert_allclose(inference, training, rtol=1e-6, atol=1e-6)
    exact = rng.integers(-127, 128, size=(7, 24)).astype("int8")
    product = backend_ops.int8_matmul(exact, layer.kernel)
    assert keras.backend.standardize_dtype(product.dtype) == "int32"
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(product),
        exact.astype(np.int64) @ keras.ops.convert_to_numpy(layer.kernel).astype(np.int64),
    )
    expected_path = {
        "torch": "torch-int-mm",
        "tensorflow": "tf-float32-exact",  # a small product over few terms
        "jax": "keras-matmul-int32",  # few rows (on a CPU too)
    }[keras.backend.backend()]
    assert backend_ops.int8_matmul_path(exact, layer.kernel) == expected_path
    if keras.backend.backend() == "jax":
        from kbert.backend import jax_ops

        many = np.zeros((4, 64, 24), "int8")
        bf16 = kbert.backend.cpu_has_bf16_dot() and jax_ops.jax.default_backend() == "cpu"
        assert backend_ops.int8_matmul_path(many, layer.kernel) == (
            "jax-bf16-exact" if bf16 else "keras-matmul-int32"
        )


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow's CPU products")
def test_tensorflow_int8_products_are_exact_on_every_path(monkeypatch):
    """TensorFlow takes the float32 product for small kernels over at most
    1,024 terms (exact there) and oneDNN's int8 product otherwise: either
    gives the integers of the int64 product, at the extremes of Keras' int8
    range (-127..127) too, eagerly and in a graph of unknown rows."""
    import tensorflow as tf

    from kbert.backend import tensorflow as tf_backend

    if tf_backend.int8_matmul_path() != "tf-onednn-int8":
        pytest.skip("this TensorFlow build has no oneDNN int8 product")
    rng = np.random.default_rng(0)
    for depth, float_size in ((1024, 1 << 16), (1024, 0), (1100, 1 << 16)):
        monkeypatch.setattr(tf_backend, "FLOAT_KERNEL_SIZE", float_size)
        x = rng.choice(np.array([-127, 127], "int8"), (6, depth))
        kernel = np.full((depth, 5), -127, "int8")
        kernel[:, 1] = rng.integers(-127, 128, depth)
        expected = x.astype(np.int64) @ kernel.astype(np.int64)
        path = tf_backend.int8_matmul_path(tf.constant(x), tf.constant(kernel))
        assert path == ("tf-float32-exact" if depth <= 1024 and float_size else "tf-onednn-int8")
        np.testing.assert_array_equal(tf_backend.int8_matmul(x, kernel).numpy(), expected)
        graph = tf.function(
            tf_backend.int8_matmul,
            input_signature=[tf.TensorSpec([None, depth], tf.int8), tf.TensorSpec(None, tf.int8)],
        )
        np.testing.assert_array_equal(graph(x, tf.constant(kernel)).numpy(), expected)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's bfloat16 product")
@pytest.mark.parametrize("depth", [24, 1024, 1536, 3072])
def test_jax_bf16_int8_product_is_exact_past_float32_range(depth):
    """JAX's CPU path multiplies int8 values as bfloat16 with float32
    accumulation, over pieces of at most 1,024 terms: at the extremes of
    Keras' range (sums past 2**24 from 1,040 terms on) the int32 result is
    the int64 product, and the float32 result is that product's float32
    rounding (what Keras' dequantizer casts it to), bit for bit."""
    from kbert.backend import jax_ops

    rng = np.random.default_rng(depth)
    x = rng.choice(np.array([-127, 127], "int8"), (2, 6, depth))
    x[0, 0] = 127  # rows whose every term is +127 * 127: sums of 16,129 * depth
    kernel = np.full((depth, 5), 127, "int8")
    kernel[:, 1] = rng.integers(-127, 128, depth)
    kernel[:, 2] = -127
    expected = x.astype(np.int64) @ kernel.astype(np.int64)
    product = jax_ops.bf16_exact_product(x, kernel, "int32")
    assert str(product.dtype) == "int32"
    np.testing.assert_array_equal(np.asarray(product), expected)
    rounded = jax_ops.bf16_exact_product(x, kernel, "float32")
    assert str(rounded.dtype) == "float32"
    np.testing.assert_array_equal(np.asarray(rounded), expected.astype(np.float32))
    assert np.abs(expected).max() > 2**24 or depth <= 1024


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow's XLA product")
def test_tensorflow_int8_product_inside_xla_is_exact():
    """Inside XLA (`jit_compile=True`) on a CPU with bfloat16 dot
    instructions the int8 product of 256 rows or more runs as bfloat16 XLA
    dots with float32 accumulation over pieces of at most 1,024 terms: the
    int64 product's integers at the extremes of Keras' range, past 2**24
    too."""
    import tensorflow as tf

    from kbert.backend import tensorflow as tf_backend

    if not kbert.backend.cpu_has_bf16_dot() or tf.config.list_logical_devices("GPU"):
        pytest.skip("no bfloat16 dot instructions on this CPU")
    rng = np.random.default_rng(0)
    for depth, rows in ((24, 128), (1536, 128), (24, 2)):
        x = rng.choice(np.array([-127, 127], "int8"), (2, rows, depth))
        x[0, 0] = 127
        kernel = np.full((depth, 5), 127, "int8")
        kernel[:, 1] = rng.integers(-127, 128, depth)
        expected = x.astype(np.int64) @ kernel.astype(np.int64)
        paths = []

        def product(a, k):
            paths.append(tf_backend.int8_matmul_path(a, k))
            return tf_backend.int8_matmul(a, k)

        out = tf.function(product, jit_compile=True)(tf.constant(x), tf.constant(kernel))
        # fewer than 256 rows keep the int32 product (the kernel's conversion costs more)
        assert paths == ["tf-xla-bf16-exact" if 2 * rows >= 256 else "tf-matmul-int32"]
        assert out.dtype == tf.int32
        np.testing.assert_array_equal(out.numpy(), expected)


def test_int8_classifier_predict_matches_its_training_mode_forward():
    """A whole int8 model: `predict` (the integer kernels) gives what the
    training-mode forward (Keras' int8 calls; no dropout) gives."""
    backbone = kbert.BertBackbone(**TINY, dropout=0.0, attention_dropout=0.0)
    classifier = kbert.BertClassifier(backbone, num_classes=3, dropout=0.0)
    quantize(classifier, "int8")
    x = harness.backbone_inputs()
    predicted = classifier.predict(x, verbose=0)
    reference = keras.ops.convert_to_numpy(classifier(x, training=True))
    np.testing.assert_allclose(predicted, reference, rtol=1e-5, atol=1e-5)


def test_quantized_classifier_keras_file_and_preset_reload_identically(classifier, tmp_path):
    x = harness.backbone_inputs()
    quantize(classifier, "int8")
    before = harness.to_numpy(classifier(x))
    classifier.save(tmp_path / "model.keras")
    restored = keras.saving.load_model(tmp_path / "model.keras")
    assert quantized_layers(restored) == quantized_layers(classifier)
    np.testing.assert_array_equal(harness.to_numpy(restored(x)), before)

    classifier.save_to_preset(tmp_path / "preset")
    again = kbert.BertClassifier.from_preset(tmp_path / "preset")
    assert quantized_layers(again) == quantized_layers(classifier)
    np.testing.assert_array_equal(harness.to_numpy(again(x)), before)


def test_a_config_naming_a_layer_the_model_lacks_is_refused():
    backbone = kbert.BertBackbone(**TINY)
    with pytest.raises(ValueError, match="transformer_layer_7/output_dense"):
        apply_quantization(backbone, {"transformer_layer_7/output_dense": "int8_from_float32"})
    with pytest.raises(ValueError, match="float policy"):
        apply_quantization(backbone, {"pooler/dense": "float32"})


def test_float8_fit_steps_are_finite_and_update_the_scales(classifier):
    quantize(classifier, "float8")
    assert set(quantized_layers(classifier).values()) == {"float8_from_float32"}
    classifier.compile(learning_rate=1e-3)
    x = harness.backbone_inputs(batch=4)
    history = classifier.fit(x, np.array([0, 1, 2, 0]), batch_size=2, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    # delayed scaling ran inside the encoder: the input amax history holds
    # the steps' maxima instead of its zero initialisation
    dense = classifier.backbone.get_layer("transformer_layer_0").intermediate_dense
    assert keras.ops.convert_to_numpy(dense.inputs_amax_history)[0] > 0


@pytest.mark.parametrize("pack_rows", [None, True])
def test_float8_fit_on_raw_text_with_buckets_and_packed_rows(pack_rows):
    # Raw strings take fit's length buckets, and on JAX on a CPU packed rows
    # by default (`pack_rows=None`), whose classifier head JAX's step ran
    # without `training`: the head's float8 scales became 0 after the first
    # step and the loss NaN.
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad", "film", "not", "a"]
    texts = ["good film", "bad", "not a good film", "a bad bad film", "good", "not bad"] * 2
    labels = np.array([1, 0, 0, 0, 1, 1] * 2)
    keras.utils.set_random_seed(0)
    model = kbert.BertClassifier(
        kbert.BertBackbone(**{**TINY, "vocabulary_size": len(vocab)}),
        num_classes=2,
        preprocessor=kbert.BertPreprocessor(kbert.BertTokenizer(vocab), sequence_length=16),
    )
    quantize(model, "float8")
    model.compile(learning_rate=1e-3)
    history = model.fit(texts, labels, batch_size=4, epochs=1, pack_rows=pack_rows, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    for layer in keras_internals.flatten_layers(model):
        if layer.quantization_mode == "float8":  # every layer's scales stay usable
            for scale in (layer.inputs_scale, layer.kernel_scale, layer.outputs_grad_scale):
                value = float(keras.ops.convert_to_numpy(scale))
                assert np.isfinite(value) and value > 0, (layer.path, scale.name, value)


def test_int8_of_a_bfloat16_model_predicts_in_bfloat16():
    """quantize('int8') of a mixed_bfloat16 model: the int8 segment table's
    lookup comes back in the compute dtype (TensorFlow refused the sum of a
    bf16 token row and a float32 segment row)."""
    backbone = kbert.BertBackbone(**TINY, dtype="mixed_bfloat16")
    classifier = kbert.BertClassifier(backbone, num_classes=3)
    x = harness.backbone_inputs()
    reference = classifier.predict(x, verbose=0)
    quantize(classifier, "int8")
    predicted = classifier.predict(x, verbose=0)
    assert np.isfinite(predicted).all()
    assert np.abs(predicted - reference).max() < 0.1


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's float8 product")
@pytest.mark.parametrize("dtype", ["float32", "mixed_bfloat16"])
def test_jax_float8_training_product_matches_keras_float8(monkeypatch, dtype):
    """On JAX a float8 Dense in training multiplies the float8 tensors
    (`ops.float8_matmul`) where Keras multiplies their dequantized copies:
    the same outputs and gradients up to the rounding of the rescaling, and
    the same next scales and amax histories (the gradients of the
    overwrite-with-gradient variables: the inputs' exactly, the kernel's and
    the output gradients' up to that rounding), over three steps."""
    import jax

    from kbert.layers import dense as dense_module

    def run(path):
        monkeypatch.setattr(dense_module, "float8_matmul_path", lambda: path)
        keras.utils.set_random_seed(3)
        layer = Dense(24, activation="gelu", dtype=dtype)
        layer.build((2, 5, 16))
        layer.quantize("float8")
        rng = np.random.default_rng(0)
        trainable = [keras.ops.convert_to_tensor(v) for v in layer.trainable_variables]
        steps = []
        for step in range(3):
            x = keras.ops.convert_to_tensor(rng.normal(0, 1 + step, (2, 5, 16)).astype("float32"))

            def loss(variables):
                y, _ = layer.stateless_call(variables, [], x, training=True)
                return keras.ops.sum(keras.ops.square(keras.ops.cast(y, "float32"))), y

            (value, y), grads = jax.value_and_grad(loss, has_aux=True)(trainable)
            steps.append((np.asarray(y, "float32"), [np.asarray(g, "float32") for g in grads]))
            # what Keras' optimizer does: overwrite-with-gradient variables
            # take their gradient, the others an SGD step
            trainable = [
                g if v.overwrite_with_gradient else t - 1e-3 * g
                for v, t, g in zip(layer.trainable_variables, trainable, grads)
            ]
        return [v.path.split("/")[-1] for v in layer.trainable_variables], steps

    names, ours = run("jax-float8-dot")
    _, keras_steps = run("keras-qdq")
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    for (y, grads), (y_ref, grads_ref) in zip(ours, keras_steps):
        np.testing.assert_allclose(y, y_ref, rtol=tolerance, atol=tolerance * np.abs(y_ref).max())
        for name, g, g_ref in zip(names, grads, grads_ref):
            if name.startswith("inputs_"):  # from the same inputs: exact
                np.testing.assert_array_equal(g, g_ref, err_msg=name)
            elif name.startswith(("kernel_", "outputs_grad_")):  # equal up to rounding
                np.testing.assert_allclose(g, g_ref, rtol=tolerance, err_msg=name)
            else:
                atol = tolerance * np.abs(g_ref).max()
                np.testing.assert_allclose(g, g_ref, rtol=tolerance, atol=atol, err_msg=name)
    # the histories filled: every step's abs-max of inputs, kernel and gradients
    history = dict(zip(names, ours[-1][1]))
    assert (history["inputs_amax_history"][:1] > 0).all()


def test_float8_of_shared_layers_is_refused_and_int8_is_not():
    """float8's scale updates reach a Dense through its gradient, summed
    over the blocks a shared layer runs in (the scales grew 4x a step with
    4 shared layers): refused, for the backbone and for a task on it;
    int8 inference of the same model works."""
    shared = {**TINY, "num_layers": 3, "share_layers": True, "embedding_dim": 8}
    backbone = kbert.BertBackbone(**shared)
    classifier = kbert.BertClassifier(backbone, num_classes=2)
    for model in (backbone, classifier):
        with pytest.raises(ValueError, match="share_layers=True"):
            model.quantize("float8")
    assert not quantized_layers(classifier)
    x = harness.backbone_inputs()
    reference = classifier.predict(x, verbose=0)
    quantize(classifier, "int8")
    assert np.abs(classifier.predict(x, verbose=0) - reference).max() < 0.1
