"""The block registry: a new kind of block is one class and one
`register_block` call, and a backbone built with its name runs it, saves
its name and loads again."""

import keras
import numpy as np
import pytest

import kbert
from kbert.layers import encoder
from kbert.layers.encoder import TransformerEncoderBlock, register_block


@keras.saving.register_keras_serializable(package="kbert_tests")
class PreLayerNormBlock(TransformerEncoderBlock):
    """x + Attn(LN(x)), then + FFN(LN(.)): another block structure, built
    from the same sublayers, with an option of its own."""

    def __init__(self, *args, residual_scale=1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.residual_scale = residual_scale

    def call(self, inputs, attention_mask, training=None):
        x = self.attention_layer_norm(inputs)
        x = inputs + self.residual_scale * self.self_attention(
            x, attention_mask=attention_mask, training=training
        )
        y = self.output_dense(self.intermediate_dense(self.output_layer_norm(x)))
        return x + self.residual_scale * y

    def get_config(self):
        return {**super().get_config(), "residual_scale": self.residual_scale}


@pytest.fixture
def pre_ln():
    register_block("pre_ln_test", PreLayerNormBlock)
    yield
    del encoder.BLOCKS["pre_ln_test"]


def inputs():
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], "int32")
    return {
        "token_ids": np.array([[5, 6, 7, 0], [8, 9, 5, 6]], "int32"),
        "segment_ids": np.zeros((2, 4), "int32"),
        "padding_mask": mask,
    }


def test_a_registered_block_builds_a_backbone_that_saves_its_name(pre_ln):
    config = dict(vocabulary_size=20, num_layers=2, num_heads=2, hidden_dim=8, intermediate_dim=16)
    backbone = kbert.BertBackbone(
        **config, block_type="pre_ln_test", block_options={"residual_scale": 0.5}
    )
    assert all(isinstance(b, PreLayerNormBlock) for b in backbone.transformer_layers)
    assert backbone.transformer_layers[0].residual_scale == 0.5
    out = keras.ops.convert_to_numpy(backbone(inputs())["sequence_output"])
    plain = kbert.BertBackbone(**config)
    plain.set_weights(backbone.get_weights())  # the same weights, another structure
    assert np.abs(keras.ops.convert_to_numpy(plain(inputs())["sequence_output"]) - out).max() > 1e-3

    saved = backbone.get_config()
    assert saved["block_type"] == "pre_ln_test" and saved["block_options"] == {
        "residual_scale": 0.5
    }
    again = kbert.BertBackbone.from_config(saved)
    again.set_weights(backbone.get_weights())
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(again(inputs())["sequence_output"]), out, atol=1e-6
    )
    assert "block_type" not in plain.get_config()  # the default stays out of configs


def test_an_unknown_block_type_is_named():
    with pytest.raises(ValueError, match="unknown block_type 'mobile'.*'bert'"):
        kbert.BertBackbone(20, 1, 2, 8, 16, block_type="mobile")
