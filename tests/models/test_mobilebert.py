"""MobileBertBackbone: the checks every backbone gets (config, eager vs
compiled, int8), its block in the registry and its
argument errors. Parity with transformers: tests/convert/test_mobilebert.py."""

import keras
import numpy as np
import pytest

import kbert
from kbert.layers.encoder import BLOCKS
from kbert.layers.mobilebert import MobileBertBlock
from tests import harness

TINY = dict(
    vocabulary_size=97,
    num_layers=2,
    num_heads=2,
    hidden_dim=32,
    intermediate_dim=24,
    max_sequence_length=24,
    embedding_dim=8,
    bottleneck_dim=16,
    num_feedforward_networks=3,
)


@pytest.fixture(scope="module")
def backbone():
    keras.utils.set_random_seed(0)
    return kbert.MobileBertBackbone(**TINY)


def test_outputs_config_and_compiled_call(backbone):
    x = harness.backbone_inputs()
    y = harness.to_numpy(backbone(x))
    assert y["sequence_output"].shape == (3, 10, 32) and y["pooled_output"].shape == (3, 32)
    clone = harness.check_config_round_trip(backbone)
    assert type(clone) is kbert.MobileBertBackbone
    assert clone.count_params() == backbone.count_params()
    config = backbone.get_config()
    assert config["backbone_type"] == "mobilebert"
    assert type(kbert.BertBackbone.from_config(config)) is kbert.MobileBertBackbone
    harness.check_eager_vs_compiled(backbone, x)
    assert BLOCKS["mobilebert"] is MobileBertBlock
    assert all(type(b) is MobileBertBlock for b in backbone.transformer_layers)


def test_padding_does_not_change_real_tokens(backbone):
    x = harness.backbone_inputs()
    y = harness.to_numpy(backbone(x))["sequence_output"]
    longer = {k: np.pad(v, ((0, 0), (0, 4))) for k, v in x.items()}
    z = harness.to_numpy(backbone(longer))["sequence_output"][:, :10]
    # each row's last real token sees a [PAD] next in both, but row 0 (full)
    # sees zeros in `x`: compare the rows that are padded in both
    mask = x["padding_mask"][1:, :, None]
    assert np.max(np.abs((y[1:] - z[1:]) * mask)) <= 1e-5


def test_int8_quantization(backbone):
    # last to use the module's backbone: quantize converts it in place
    x = harness.backbone_inputs()
    reference = harness.to_numpy(backbone(x))["pooled_output"]
    backbone.quantize("int8")
    kernels = [v for v in backbone.weights if v.path.endswith("/kernel")]
    assert any(keras.backend.standardize_dtype(v.dtype) == "int8" for v in kernels)
    quantized = backbone.predict(x, verbose=0)["pooled_output"]  # one compiled program
    assert 0 < np.max(np.abs(quantized - reference)) < 0.1 * np.max(np.abs(reference)) + 0.05


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(normalization="batch_norm"), "normalization must be one of"),
        (dict(bottleneck_dim=15), "not divisible by num_heads"),
        (dict(num_feedforward_networks=0), "num_feedforward_networks"),
        (dict(dropout=1.5), "dropout"),
        (dict(embedding_dim=0), "embedding_dim"),
    ],
)
def test_bad_arguments_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        kbert.MobileBertBackbone(**{**TINY, **overrides})


def test_a_bert_preset_is_not_taken_for_a_mobilebert(tmp_path):
    kbert.BertBackbone(**harness.TINY).save_to_preset(tmp_path / "bert")
    with pytest.raises(kbert.presets.PresetError, match="not a MobileBERT"):
        kbert.MobileBertBackbone.from_preset(tmp_path / "bert")


@pytest.mark.parametrize(
    "variant",
    [
        {},  # shared query/key bottleneck, values from the input (the checkpoint's)
        {"key_query_shared_bottleneck": False, "use_bottleneck_attention": True},
        {"use_bottleneck": False, "normalization": "layer_norm"},
    ],
)
def test_block_on_packed_tokens_equals_the_padded_block(monkeypatch, variant):
    """Where a backend packs a batch's real tokens (eager torch and
    TensorFlow without XLA, on a CPU), the bottlenecks and feed-forward
    networks run on them and attention on the padded batch: the real
    tokens' outputs are the padded block's, forward and backward; the
    padding rows pass through."""
    from kbert.backend import ops as fused
    from kbert.layers import mobilebert

    rng = np.random.default_rng(0)
    lengths = np.array([9, 1, 4, 2, 7, 3])
    mask = (np.arange(9)[None] < lengths[:, None]).astype("int32")
    mask[2] = mask[2, ::-1]  # padding first
    x = rng.normal(size=(6, 9, 16)).astype("float32")
    block = MobileBertBlock(4, 16, 24, attention_dropout=0.0, bottleneck_dim=8, **variant)
    block.build(x.shape)
    x_t, mask_t = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(mask)
    name = keras.backend.backend()
    packs = fused.token_packing_path(x_t, mask_t) == "packed"
    assert packs == (name != "jax")
    real = mask.astype(bool)

    def run(packing):
        with monkeypatch.context() as patch:
            if not packing:
                patch.setattr(mobilebert, "token_packing", lambda *args: None)
            if name == "torch":
                import torch

                inputs = torch.tensor(x, requires_grad=True)
                out = block(inputs, mask_t, training=True)
                (out * torch.tensor(mask)[..., None] * torch.arange(16.0)).sum().backward()
                grads = [inputs.grad.numpy()] + [
                    v.value.grad.clone().numpy() for v in block.trainable_variables
                ]
                for v in block.trainable_variables:
                    v.value.grad = None
                return out.detach().numpy(), grads
            if name == "tensorflow":
                import tensorflow as tf

                with tf.GradientTape() as tape:
                    tape.watch(x_t)
                    out = block(x_t, mask_t, training=True)
                    loss = tf.reduce_sum(
                        out * tf.cast(mask_t, "float32")[..., None] * tf.range(16.0)
                    )
                grads = tape.gradient(loss, [x_t, *block.trainable_variables])
                return out.numpy(), [np.asarray(g) for g in grads]
            return keras.ops.convert_to_numpy(block(x_t, mask_t)), []

    packed, packed_grads = run(True)
    padded, padded_grads = run(False)
    np.testing.assert_allclose(packed[real], padded[real], atol=1e-5)
    if packs:
        np.testing.assert_array_equal(packed[~real], x[~real])
    assert len(packed_grads) == len(padded_grads)
    for a, b in zip(packed_grads, padded_grads):
        if a.shape == x.shape:
            a, b = a[real], b[real]
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
