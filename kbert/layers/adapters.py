"""Bottleneck adapters (Houlsby et al., 2019, "Parameter-Efficient Transfer
Learning for NLP").

Shapes: B batch, T tokens, H hidden, M adapter (bottleneck) width.
"""

import keras

from kbert.backend import keras_internals
from kbert.layers.activations import get_activation
from kbert.layers.config import ArgumentsConfig
from kbert.layers.dense import Dense
from kbert.layers.initializers import truncated_normal
from kbert.utils import checks

ADAPTER_LAYER_NAMES = ("attention_adapter", "output_adapter")


@keras.saving.register_keras_serializable(package="kbert")
class BottleneckAdapter(ArgumentsConfig, keras.layers.Layer):
    """x -> x + up(act(down(x))): a small residual MLP inserted after a
    sub-layer's output projection, before its residual add and LayerNorm.

    The up-projection starts at zero, so a freshly inserted adapter is the
    identity and a pretrained model's outputs do not change until training.

    Args:
        adapter_size: int. bottleneck width M.
        activation: str. nonlinearity in the bottleneck.
        initializer_range: float. stddev of the down-projection init.

    Example:
    >>> adapter = BottleneckAdapter(4)
    >>> x = keras.ops.ones((1, 3, 8))
    >>> bool(keras.ops.all(adapter(x) == x))
    True
    """

    def __init__(self, adapter_size, activation="gelu", initializer_range=0.02, **kwargs):
        super().__init__(**kwargs)
        checks.check_positive_ints(locals(), "adapter_size")
        self.store_arguments(locals())
        self.down = Dense(
            adapter_size,
            activation=get_activation(activation),
            kernel_initializer=truncated_normal(initializer_range),
            dtype=self.dtype_policy,
            name="down",
        )
        self.up = None

    def build(self, inputs_shape):
        self.down.build(inputs_shape)
        self.up = Dense(
            inputs_shape[-1], kernel_initializer="zeros", dtype=self.dtype_policy, name="up"
        )
        self.up.build(tuple(inputs_shape[:-1]) + (self.adapter_size,))
        self.built = True

    def call(self, inputs):
        return inputs + self.up(self.down(inputs))

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)


def train_only_adapters(backbone):
    """Freezes every backbone weight except the adapters and the LayerNorms
    (Houlsby et al. train those and the task head)."""
    if not getattr(backbone, "adapter_size", None):
        raise ValueError(
            "the backbone has no adapters; build it with adapter_size=M "
            "(e.g. `Task.from_preset(preset, adapter_size=64, freeze_backbone='adapters')`)"
        )
    backbone.trainable = True
    layer_norms = {
        id(v)
        for layer in keras_internals.flatten_layers(backbone)
        if isinstance(layer, keras.layers.LayerNormalization)
        for v in layer.weights
    }
    for v in backbone.weights:
        v.trainable = id(v) in layer_norms or any(
            f"/{name}/" in v.path for name in ADAPTER_LAYER_NAMES
        )
