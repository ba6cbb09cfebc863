"""The fused operations kbert's layers call, each choosing its
implementation from the backend: dense, dropout, attention, GELU, LayerNorm,
the position + segment embedding sum, and sublayer calls. Every fast path
computes what the generic path computes (tests compare them); each
`*_path()` reports which one runs. Figures: `benchmarks/RESULTS.md`.

`fused_dense(x, kernel, bias)` computes x @ kernel + bias.
- torch: one `torch.nn.functional.linear` call, a GEMM with the bias added
  in its epilogue (`addmm`), as transformers' `nn.Linear` does; the generic
  `matmul` then `add` costs a second pass over the output.
- torch, float32 on CPU without autograd (inference): oneDNN's product on a
  weight reordered once into its blocked layout
  (`torch.ops.mkldnn._linear_pointwise`, what torch.compile's CPU freezing
  uses). The reordered weight is cached per layer and rebuilt when the
  kernel tensor changes (new tensor or in-place update).
- everything else: `keras.ops.matmul` + `keras.ops.add`; XLA fuses the add.

`fused_dropout(x, rate, seed_generator)` is inverted dropout.
- JAX: the keep mask compares a keyed hash of each element's index (two
  rounds of the lowbias32 mixer, keys from the layer's Keras seed) with
  (1 - rate) * 2^32, computed inside the fusion that applies the mask; a
  generator (threefry, or Philox) writes its bits to memory and reads them
  back. The hash is not a cryptographic generator; tests check what dropout
  needs: the keep rate, no correlation between neighbouring elements, rows
  or successive masks. Kept values are scaled in float32 and rounded once.
- everything else: `keras.random.dropout`.

Attention kernels, each one implementation of `kbert.layers.attention`'s
table (the layer chooses among them and reports which ran):
- `cudnn_attention`: JAX on a GPU, 16-bit inputs: cuDNN flash attention
  through `jax.nn.dot_product_attention` with `key_value_seq_lengths` (the
  form cuDNN accepts for padding); other padding patterns are made that
  form by moving the real keys first, so any padding is exact. Under
  `keras.distribution` DataParallel the operands are pinned to batch shards.
- `torch_sdpa`: `scaled_dot_product_attention` on (B, N, T, D) views with a
  boolean mask, and attention dropout applied by SDPA in training. In a
  training step whose padding trails each row's real tokens and whose
  losses read no padding output, on a GPU, from
  `torch_ops.SEGMENT_MIN_LENGTH` tokens: FlashAttention over
  variable-length segments (`torch_ops.segment_attention`,
  `torch_step.segments_apply`). `keras.ops.dot_product_attention` reaches
  the same kernel but first copies Q, K and V and turns the mask into a
  float bias.
- `flex_attention`: torch's FlexAttention (`torch_flex`): any mask
  description as a per-pair rule plus a block structure built from the
  description, the kernel compiled once on a GPU.

`fused_gelu(x, approximate)`: on JAX x (1 + erf(x / sqrt 2)) / 2 in float32,
as torch computes it (`jax.nn.gelu`'s erfc form expands to two rational
approximations per element), with a custom gradient recomputed from x:
autodiff kept three float32 copies of each block's (B, T, 4H) activation
for the backward pass, which the JAX loop programs (blocks in a
`lax.scan`) carry through stacked buffers (figures in
benchmarks/RESULTS.md); elsewhere `keras.activations.gelu`.

`fused_layer_norm(x, gamma, beta, epsilon)` normalises the last axis in
float32 and returns x's dtype. On JAX with a GPU or TPU a custom gradient: the forward pass
takes the mean and the mean of squares in one pass (variance clamped at 0);
the backward pass uses the closed form
dx = rstd (g' - mean(g') - x_hat mean(g' x_hat)), g' = g gamma. The one-pass
variance loses relative precision of about 1e-7 * mean^2 / variance per
row, negligible for LayerNorm inputs (the float32 parity tests against
transformers run through it). Elsewhere, JAX on a CPU included,
`keras.ops.layer_normalization`: XLA's CPU fusion recomputed the closed
form's chain of elementwise gradients through every later block inside
each block's (d_gamma, d_beta) reduction, a quarter of a MiniLM training
step on 2 cores.

`fused_embedding_sum(tokens, positions, segments, segment_ids)` is
tokens + segments[segment_ids] + positions[None]. On JAX both tables are
gathered, with a custom gradient (a product with ones for the positions, a
one-hot product for the segments): the broadcast's autodiff reduces over
the batch axis, for which XLA chose a (T, H, B) layout that spread large
transposes through the encoder. Elsewhere the broadcast and `take`.

`sublayer_call(layer, *args)` is `layer(*args)`; on torch with eager tensors
already in the layer's input dtype it calls `layer.call` under the autocast
scope `Layer.__call__` would set, skipping bookkeeping (~50 us of host time
per call) that is a no-op there: the torch GPU step is host-bound.

`fill_padding(x, padding_mask, value)`: padding positions set to a number
(on torch `masked_fill`: `full_like` there reads the number back from the
GPU, a synchronisation that breaks CUDA-graph capture).

`token_packing(inputs, padding_mask)`: the encoder block runs its dense
layers, LayerNorms and dropout on the real tokens only, an (n, H) matrix,
and scatters them back around attention and at its output. On torch for
eager CPU tensors whose batch is at least 1/8 padding (attention per group
of rows of similar length), on TensorFlow without XLA on a CPU
(`token_packing_path` says which path a batch takes); the padded path
elsewhere: a step compiled or captured per shape cannot take a
data-dependent token count. Outputs at real tokens are the padded path's;
at padding positions the block passes its inputs through.

`gather_positions(x, positions)`: the rows of x (B, T, H) at positions (B, P)
-> (B, P, H). On torch `torch.gather` on the positions expanded to
(B, P, H): `take_along_dim`'s broadcasting made `torch.export` fix the
batch and token sizes (ONNX export of `BertPreTrainer`). Elsewhere
`keras.ops.take_along_axis`. Positions are inside [0, T) (checked on the
host, `kbert.utils.checks`).

`reverse_table_padding(rows)`: JAX pads the MLM decoder's vocabulary table to
a multiple of 64 rows (tensor-core alignment; the logits are sliced back).

`int8_matmul(x, kernel)`: the exact int32 product of int8 x (..., I) and
int8 kernel (I, O), the product of Keras' int8 `Dense` (per-token int8
inputs, per-channel int8 kernel). Keras computes it with `ops.matmul`,
which on torch and TensorFlow widens both to int32 and runs a generic
integer product, slower on a CPU than the float32 product it replaces.
- torch: `torch._int_mm` (oneDNN's VNNI kernel on a CPU, cuBLASLt's on a
  GPU, which takes more than 16 rows and I, O multiples of 8: fewer rows
  are padded; other widths take the generic product).
- TensorFlow outside XLA: oneDNN's `QuantizedMatMulWithBias` with int32
  output, where the build has it (x + 128 as unsigned bytes; the kernel's
  column sums times 128 subtracted through the int32 bias, so the result
  is exact); small products over at most 1,024 terms the float32 product,
  which is exact there and skips oneDNN's fixed cost per call
  (`tf-float32-exact`); inside XLA on a CPU with bfloat16 dot
  instructions, bfloat16 XLA dots with float32 accumulation over pieces
  of at most 1,024 terms (`tf-xla-bf16-exact`, as JAX's below); inside
  XLA otherwise, or without the oneDNN kernel, `matmul` with int32
  output.
- JAX on a CPU with bfloat16 dot instructions (AVX512-BF16, AMX), for
  products of at least 256 rows: the int8 values as bfloat16 (exact) in a
  float32-accumulated product over pieces of at most 1,024 terms (exact
  there), summed in int32 (`jax-bf16-exact`): XLA's CPU int8 product ran
  at 1.3x its float32 rate, the bfloat16 one at 1.8x. Fewer rows keep the
  int8 product (converting the kernel costs more than they save).
  Elsewhere (a GPU's integer tensor cores) `dot_general` with int32
  accumulation, what Keras runs already.
- Inside `portable_graph()` (export): `keras.ops.matmul` everywhere.

`float8_matmul(x, kernel, state, dtype)`: Keras' float8 `Dense` product in
training (e4m3 inputs and kernel, e5m2 output gradients, delayed scaling
from abs-max histories; the scales and histories update through their
gradients, as Keras' do).
- JAX (`jax-float8-dot`): `dot_general` of the float8 tensors themselves,
  forward and in both backward products, with a bf16 result rescaled by
  the two scales; only the float8 tensors are kept for the backward pass.
  Keras multiplies quantized-then-dequantized bf16 copies and leaves XLA
  to find float8 GEMMs in that pattern; on an H100 with BERT-large 128 this
  runs at 1.10x Keras' speed with 24% less memory, still 0.81x bf16
  (`benchmarks/results/float8_h100.json`).
- elsewhere (`keras-qdq`), and outside training: Keras' own call.
"""

import contextlib
import threading

import keras
from keras import ops

from kbert import backend

if backend.is_jax():
    from kbert.backend import jax_ops
elif backend.is_torch():
    from kbert.backend import torch_ops
elif backend.is_tensorflow():
    from kbert.backend import tensorflow as tf_ops


def fill_padding(x, padding_mask, value):
    """x (B, T) with the positions where `padding_mask` is 0 set to the
    Python number `value`. On torch `masked_fill`, the number a kernel
    argument; `full_like` there makes a device tensor of it and reads it
    back, a synchronisation that also breaks CUDA-graph capture."""
    if backend.is_torch():
        return torch_ops.fill_padding(x, padding_mask, value)
    return ops.where(padding_mask > 0, x, ops.full_like(x, value))


def gather_positions(x, positions):
    """x (B, T, H), positions (B, P) integers in [0, T) -> (B, P, H)."""
    if backend.is_torch():
        return torch_ops.gather_positions(x, positions)
    return ops.take_along_axis(x, ops.expand_dims(ops.cast(positions, "int32"), -1), axis=1)


def packed_weight_cache():
    """A per-layer cache for `fused_dense` (torch CPU inference), or None."""
    return torch_ops.PackedWeightCache() if backend.is_torch() else None


def fused_dense_path(inputs=None):
    """Which implementation `fused_dense` uses on this backend (for `inputs`,
    under the current autograd mode, where that matters)."""
    if not backend.is_torch():
        return "keras-matmul-add"
    if inputs is not None and torch_ops.onednn_inference(ops.convert_to_tensor(inputs)):
        return "torch-onednn-packed"
    return "torch-linear"


def fused_dense(inputs, kernel, bias=None, cache=None):
    """inputs (..., I), kernel (I, O), bias (O,) or None -> (..., O).

    `cache`: the calling layer's `packed_weight_cache()`."""
    if backend.is_torch():
        return torch_ops.dense(inputs, kernel, bias, cache)
    x = ops.matmul(inputs, kernel)
    return x if bias is None else ops.add(x, bias)


def int8_matmul_path(inputs=None, kernel=None):
    """Which implementation `int8_matmul` uses on this backend (for these
    operands, where that matters)."""
    if getattr(_PORTABLE, "depth", 0):
        return "keras-matmul-int32"
    if backend.is_torch():
        if inputs is None or kernel is None:
            return "torch-int-mm"
        return torch_ops.int8_matmul_path(
            ops.convert_to_tensor(inputs), ops.convert_to_tensor(kernel)
        )
    if backend.is_tensorflow():
        if inputs is None or kernel is None:
            return tf_ops.int8_matmul_path()
        return tf_ops.int8_matmul_path(ops.convert_to_tensor(inputs), ops.convert_to_tensor(kernel))
    if backend.is_jax():
        return jax_ops.int8_matmul_path(None if inputs is None else ops.shape(inputs))
    return "keras-matmul-int32"


def int8_quantize(inputs, value_range=(-127, 127), epsilon=None):
    """Keras' per-row abs-max quantization of inputs (..., I) -> (int8
    values, (..., 1) scale), the quantizer of Keras' int8 `Dense`; on
    torch without making device tensors of its constants (CUDA-graph
    capture). TensorFlow runs Keras' graph operations: on a CPU one XLA
    launch per `Dense` for them costs more than the passes it saves."""
    epsilon = keras.config.epsilon() if epsilon is None else epsilon
    if backend.is_torch():
        return torch_ops.int8_quantize_rows(inputs, value_range, epsilon)
    return keras.quantizers.abs_max_quantize(
        inputs, axis=-1, value_range=value_range, epsilon=epsilon
    )


def int8_dequantize(product, kernel_scale, inputs_scale, bias=None, dtype="float32"):
    """Keras' int8 `Dense` rescaling of the int32 product (..., O):
    product / (kernel_scale * inputs_scale) + bias, in `dtype`, the same
    operations in the same order; on torch on a CPU without autograd the
    division and the bias add run as one pass in place."""
    if backend.is_torch() and not getattr(_PORTABLE, "depth", 0):
        dtype = keras.backend.standardize_dtype(dtype)
        out = torch_ops.int8_dequantize(
            product, kernel_scale, inputs_scale, bias, getattr(torch_ops.torch, dtype)
        )
        if out is not None:
            return out
    x = ops.divide(ops.cast(product, dtype), ops.multiply(kernel_scale, inputs_scale))
    return x if bias is None else ops.add(x, bias)


def int8_product(inputs, kernel, dtype):
    """The product `int8_dequantize(product, ..., dtype=dtype)` takes:
    `int8_matmul(inputs, kernel)`, or on JAX with `dtype` float32 that
    product already rounded to float32 (the same values after the
    dequantizer's cast; the bfloat16 path then skips an int32 pass)."""
    if (
        backend.is_jax()
        and keras.backend.standardize_dtype(dtype) == "float32"
        and not getattr(_PORTABLE, "depth", 0)
    ):
        return jax_ops.int8_matmul(inputs, kernel, "float32")
    return int8_matmul(inputs, kernel)


def int8_matmul(inputs, kernel):
    """inputs (..., I) int8, kernel (I, O) int8 -> (..., O) int32, exact."""
    if getattr(_PORTABLE, "depth", 0):
        return ops.matmul(inputs, kernel)  # Keras widens to int32 where it must
    if backend.is_torch():
        return torch_ops.int8_matmul(inputs, kernel)
    if backend.is_tensorflow():
        return tf_ops.int8_matmul(inputs, kernel)
    if backend.is_jax():
        return jax_ops.int8_matmul(inputs, kernel)
    return ops.matmul(inputs, kernel)


def float8_matmul_path():
    """Which implementation a float8 `Dense` trains with on this backend:
    "jax-float8-dot" (`float8_matmul`) or "keras-qdq" (Keras' own)."""
    return "jax-float8-dot" if backend.is_jax() else "keras-qdq"


def float8_matmul(inputs, kernel, state, compute_dtype):
    """Keras' float8 `Dense` product in training on JAX: inputs (..., I) @
    kernel (I, O) with e4m3 operands and e5m2 output gradients, `state` the
    layer's six scale and amax-history variables (Keras' order), whose
    gradients are their next values as in Keras. Keras multiplies
    quantized-then-dequantized bf16 tensors and leaves XLA to find the
    float8 GEMM in that pattern, keeping the dequantized copies for the
    backward pass; this multiplies the float8 tensors themselves, forward
    and backward, and keeps only them (1 byte a value)."""
    return jax_ops.float8_matmul(inputs, kernel, *state, compute_dtype)


def fused_dropout_path():
    """Which random bit generator `fused_dropout` uses on this backend."""
    return "jax-hash" if backend.is_jax() else f"keras-{backend.name()}"


def fused_dropout(inputs, rate, seed_generator):
    """Zeroes each element with probability `rate`, scales the rest by 1/(1-rate)."""
    if backend.is_jax():
        return jax_ops.dropout(inputs, rate, seed_generator)
    return keras.random.dropout(inputs, rate, seed=seed_generator)


def cudnn_attention_available(dtype):
    """Whether cuDNN's flash attention can run inputs of `dtype` here (JAX
    on a GPU, 16-bit inputs)."""
    return (
        backend.is_jax()
        and keras.backend.standardize_dtype(dtype) in ("float16", "bfloat16")
        and jax_ops.on_gpu()
    )


def blocks_in_loop(blocks, x, padding_mask, training=None):
    """`x` through `blocks` (same structure, own weights) as one loop over
    their stacked weights: JAX only (`jax_ops.blocks_in_loop`), for steps
    that compile while the first steps run (`kbert.backend.jax_compile`)."""
    if not backend.is_jax():
        raise ValueError("blocks_in_loop runs on JAX only")
    return jax_ops.blocks_in_loop(blocks, x, padding_mask, training)


def attention_keep(padding_mask):
    """A padding mask (B, S) -> the boolean mask (B, 1, 1, S) attention
    takes. A row of padding only sees every key instead: a softmax over
    nothing is NaN, and its outputs are padding, unused. Computed once per
    traced TensorFlow graph for all blocks, and on torch once per mask
    tensor within a `torch_ops.shared_masks` block."""

    def make():
        keep = ops.cast(padding_mask, "bool")
        empty = ops.logical_not(ops.any(keep, axis=-1, keepdims=True))
        return ops.logical_or(keep, empty)[:, None, None, :]

    if backend.is_tensorflow():
        from kbert.backend import tensorflow as tf_backend

        return tf_backend.per_graph("attention_keep", padding_mask, make)
    if backend.is_torch():
        return torch_ops.shared_mask("keep", padding_mask, make)
    return make()


def cudnn_attention(query, key, value, keep_keys, scale):
    """query/key/value (B, T, N, D), keep_keys (B, S) bool -> (B, T, N, D):
    cuDNN flash attention with padding as per-row key counts (any padding
    pattern: the real keys are moved first; `jax_ops.cudnn_attention`)."""
    return jax_ops.cudnn_attention(query, key, value, keep_keys, scale)


def torch_sdpa(query, key, value, keep, scale, dropout=0.0, padding_mask=None):
    """query/key/value (B, T, N, D), keep a bool mask broadcastable to
    (B, 1, T, S) -> (B, T, N, D) through torch's
    `scaled_dot_product_attention`, with attention dropout applied by the
    kernel. Given the (B, T) `padding_mask` of a self-attention, under
    `torch_ops.segment_attention`: FlashAttention over variable-length
    segments."""
    return torch_ops.sdpa(query, key, value, keep, scale, dropout, padding_mask=padding_mask)


def flex_attention(query, key, value, mask, scale, dropout=0.0):
    """query (B, T, N, D), key/value (B, S, N, D) -> (B, T, N, D): torch's
    FlexAttention over the keys the `AttentionMask` `mask` lets each query
    see, with attention dropout of probability `dropout`
    (`torch_flex.attention`; torch only)."""
    from kbert.backend import torch_flex

    return torch_flex.attention(query, key, value, mask, scale, dropout)


def flex_attention_preferred():
    """Whether FlexAttention is the fast way to compute a windowed mask
    here: torch with a GPU (compiled kernels; on a CPU torch runs its
    reference implementation)."""
    return backend.is_torch() and backend.on_accelerator()


def fused_embedding_sum(tokens, positions, segments, segment_ids):
    """tokens (B, T, H), positions (T, H), segments (S, H), segment_ids (B, T) -> (B, T, H)."""
    if backend.is_jax():
        return jax_ops.embedding_sum(tokens, positions, segments, segment_ids)
    return tokens + ops.take(segments, ops.cast(segment_ids, "int32"), axis=0) + positions[None]


def fused_gelu(x, approximate=False):
    """GELU of x; on JAX in the erf form, computed in float32."""
    if backend.is_jax():
        return jax_ops.gelu(x, approximate)
    return keras.activations.gelu(x, approximate=approximate)


def fused_layer_norm(x, gamma, beta, epsilon):
    """LayerNorm of x over its last axis with (H,) gamma and beta."""
    if backend.is_jax() and backend.jax_on_accelerator():
        return jax_ops.layer_norm(x, gamma, beta, epsilon)
    return ops.layer_normalization(x, gamma, beta, axis=-1, epsilon=epsilon)


# Nesting depth of `portable_graph()`, per thread.
_PORTABLE = threading.local()


@contextlib.contextmanager
def portable_graph():
    """Within the block (in this thread), encoder blocks run on the padded
    batch and the int8 product is a plain integer `matmul`: for graphs
    traced to be saved (SavedModel, ONNX), which must run anywhere, at any
    shape, on any device, and convert to ONNX."""
    _PORTABLE.depth = getattr(_PORTABLE, "depth", 0) + 1
    try:
        yield
    finally:
        _PORTABLE.depth -= 1


def token_packing(inputs, padding_mask):
    """An object with `gather` ((B, T, C) -> (n, C), the real tokens),
    `scatter` (back) and `attention_groups` for this block input, or None
    where the block runs on the padded batch."""
    if getattr(_PORTABLE, "depth", 0):
        return None
    if backend.is_torch():
        return torch_ops.token_packing(inputs, padding_mask)
    if backend.is_tensorflow():
        from kbert.backend import tensorflow as tf_backend

        return tf_backend.token_packing(inputs, padding_mask)
    return None


def token_packing_path(inputs, padding_mask):
    """'packed' or 'padded': how an encoder block runs on this batch."""
    return "padded" if token_packing(inputs, padding_mask) is None else "packed"


def sublayer_call(layer, *args, **kwargs):
    """layer(*args, **kwargs), without Keras' per-call bookkeeping on torch
    eager tensors."""
    if backend.is_torch() and layer.built:
        return torch_ops.sublayer_call(layer, *args, **kwargs)
    return layer(*args, **kwargs)


def reverse_table_padding(rows, multiple=64):
    """Zero rows to add to a (rows, H) table before the MLM decoder product:
    on JAX up to a multiple of `multiple` (0 or 1: none); elsewhere 0 (on
    eager torch the pad and slice would be real copies)."""
    if multiple <= 1 or not backend.is_jax():
        return 0
    return -rows % multiple


def rng_state():
    """Backend RNG state that lives outside Keras variables, as arrays (torch's
    global generators, from which its backend draws unseeded dropout)."""
    return torch_ops.rng_state() if backend.is_torch() else {}


def set_rng_state(arrays):
    """Restores what `rng_state` returned."""
    if backend.is_torch():
        torch_ops.set_rng_state(arrays)
