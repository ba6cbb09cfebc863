"""`Dense`: keras.layers.Dense whose matrix product and bias add run as one
fused operation where the backend has one (see `kbert.backend.ops`), and
which Keras' `quantize` ("int8", "int4", "float8") converts like its own
Dense."""

import keras
from keras import ops

from kbert.backend.ops import fused_dense, packed_weight_cache


@keras.saving.register_keras_serializable(package="kbert")
class Dense(keras.layers.Dense):
    """keras.layers.Dense with the bias added inside the matrix product.

    Same arguments, variables (`kernel`, `bias`) and results as
    `keras.layers.Dense`; only the float, unquantized path changes (LoRA is
    included: `self.kernel` already adds it). `quantize(mode)` and the
    quantized call are Keras' own (per-output-channel abs-max int8 kernel,
    per-token int8 inputs; float8 with delayed scaling).

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
            # Layer.__call__ sends quantized layers to `quantized_call`; this
            # is for callers of `call` itself (kbert's torch sublayer_call).
            return self.quantized_call(inputs, training=training)
        kernel = ops.cast(self.kernel, self.compute_dtype)
        bias = None if self.bias is None else ops.cast(self.bias, self.compute_dtype)
        x = fused_dense(
            ops.cast(inputs, self.compute_dtype), kernel, bias, cache=self.packed_weight
        )
        if self.activation is not None:
            x = self.activation(x)
        return x

    def quantize(self, mode=None, type_check=True, config=None):
        """Keras' `Dense.quantize`. Keras refuses subclasses unless they
        declare that its hooks fit them: this class changes only the float
        call, so they do (subclasses of this class must declare it again)."""
        if type_check and type(self) is not Dense:
            # Keras' wording: Model.quantize turns this error into a warning.
            raise NotImplementedError(
                f"Layer {type(self).__name__} does not have a `quantize` method implemented."
            )
        super().quantize(mode, type_check=False, config=config)
