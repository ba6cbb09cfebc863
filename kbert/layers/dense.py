"""`Dense`: keras.layers.Dense whose matrix product and bias add run as one
fused operation where the backend has one (see `kbert.backend.ops`), and
which Keras' `quantize` ("int8", "int4", "float8") converts like its own
Dense."""

import keras
from keras import ops

from kbert.backend.ops import (
    float8_matmul,
    float8_matmul_path,
    fused_dense,
    int8_dequantize,
    int8_product,
    int8_quantize,
    packed_weight_cache,
)


@keras.saving.register_keras_serializable(package="kbert")
class Dense(keras.layers.Dense):
    """keras.layers.Dense with the bias added inside the matrix product.

    Same arguments, variables (`kernel`, `bias`) and results as
    `keras.layers.Dense`; only the float, unquantized path changes (LoRA is
    included: `self.kernel` already adds it). `quantize(mode)` and the
    quantized call are Keras' own (per-output-channel abs-max int8 kernel,
    per-token int8 inputs; float8 with delayed scaling), except that int8
    inference (not training, no LoRA) computes the int8 product with
    `kbert.backend.ops.int8_product`, the backend's integer kernel, where
    Keras' `ops.matmul` runs a generic int32 product: the same integers,
    the same scaling.

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

    def quantized_call(self, inputs, training=None):
        if self.quantization_mode == "int8" and self._int8_inference(training):
            return self._int8_inference_call(inputs)
        if self.quantization_mode == "float8" and self._float8_product_training(training):
            return self._float8_product_call(inputs)
        return super().quantized_call(inputs, training=training)

    def _int8_inference(self, training):
        """Whether an int8 call takes `_int8_inference_call`: inference with
        Keras' per-token abs-max input quantizer and no LoRA (Keras' own
        call keeps the gradient and the other quantizers)."""
        return (
            not training
            and not self.lora_enabled
            and type(getattr(self, "inputs_quantizer", None)) is keras.quantizers.AbsMaxQuantizer
        )

    def _int8_inference_call(self, inputs):
        """Keras' int8 forward with the backend's integer product."""
        quantizer = self.inputs_quantizer
        x, inputs_scale = int8_quantize(inputs, quantizer.value_range, quantizer.epsilon)
        x = int8_dequantize(
            int8_product(x, self.kernel, self.compute_dtype),
            self.kernel_scale,
            inputs_scale,
            self.bias,
            self.compute_dtype,
        )
        if self.activation is not None:
            x = self.activation(x)
        return x

    def _float8_product_training(self, training):
        """Whether a float8 call takes `_float8_product_call`: training
        without LoRA on a backend with `kbert.backend.ops.float8_matmul`
        (Keras' own call keeps inference and the rest)."""
        return bool(training) and not self.lora_enabled and float8_matmul_path() != "keras-qdq"

    def _float8_product_call(self, inputs):
        """Keras' float8 training call with the float8 product of
        `kbert.backend.ops.float8_matmul` (same scales, same updates)."""
        state = (
            self.inputs_scale,
            self.inputs_amax_history,
            self.kernel_scale,
            self.kernel_amax_history,
            self.outputs_grad_scale,
            self.outputs_grad_amax_history,
        )
        x = float8_matmul(
            inputs,
            ops.convert_to_tensor(self.kernel),  # no LoRA here: the kernel variable
            [ops.convert_to_tensor(v) for v in state],
            self.compute_dtype,
        )
        if self.bias is not None:
            bias = self.bias
            if self.compute_dtype == "float32":  # Keras rounds it through bfloat16
                bias = ops.cast(ops.cast(bias, "bfloat16"), bias.dtype)
            x = ops.add(x, bias)
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
