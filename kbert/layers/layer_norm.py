"""`LayerNorm`: keras.layers.LayerNormalization over the last axis, with the
fused JAX path of `kbert.backend.ops.fused_layer_norm`."""

import keras
from keras import ops

from kbert.backend.ops import fused_layer_norm


@keras.saving.register_keras_serializable(package="kbert")
class LayerNorm(keras.layers.LayerNormalization):
    """keras.layers.LayerNormalization (same arguments, variables `gamma` and
    `beta`, and results) whose common case, normalising the last axis with
    both a scale and an offset, runs through `fused_layer_norm`.

    Example:
    >>> layer = LayerNorm(epsilon=1e-12)
    >>> tuple(layer(keras.ops.ones((2, 3, 8))).shape)
    (2, 3, 8)
    """

    def call(self, inputs):
        last = len(inputs.shape) - 1
        if (
            self.rms_scaling
            or not (self.center and self.scale)
            or list(self.axis) not in ([-1], [last])
        ):
            return super().call(inputs)
        outputs = fused_layer_norm(inputs, self.gamma, self.beta, self.epsilon)
        return ops.cast(outputs, self.compute_dtype)
