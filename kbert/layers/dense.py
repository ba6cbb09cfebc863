"""`Dense`: keras.layers.Dense whose matrix product and bias add run as one
fused operation where the backend has one (see `kbert.backend.ops`)."""

import keras
from keras import ops

from kbert.backend.ops import fused_dense, packed_weight_cache


@keras.saving.register_keras_serializable(package="kbert")
class Dense(keras.layers.Dense):
    """keras.layers.Dense with the bias added inside the matrix product.

    Same arguments, variables (`kernel`, `bias`) and results as
    `keras.layers.Dense`; only the float, unquantized path changes (LoRA is
    included: `self.kernel` already adds it). Quantized layers keep Keras'
    own call.

    Example:
    >>> layer = Dense(4)
    >>> tuple(layer(keras.ops.ones((2, 3, 8))).shape)
    (2, 3, 4)
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Not a Keras-tracked attribute: a cache, never saved.
        object.__setattr__(self, "packed_weight", packed_weight_cache())

    def call(self, inputs, training=None):
        if self.quantization_mode is not None:
            return super().call(inputs, training=training)
        kernel = ops.cast(self.kernel, self.compute_dtype)
        bias = None if self.bias is None else ops.cast(self.bias, self.compute_dtype)
        x = fused_dense(
            ops.cast(inputs, self.compute_dtype), kernel, bias, cache=self.packed_weight
        )
        if self.activation is not None:
            x = self.activation(x)
        return x
