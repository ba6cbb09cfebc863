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
