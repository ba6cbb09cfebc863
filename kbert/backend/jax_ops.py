"""JAX implementations of the fused operations in `kbert.backend.ops`.

Why each exists (the generic form and what it cost) is documented in
`kbert.backend.ops`; the measurements are in `benchmarks/RESULTS.md`.
"""

import functools
import math

import jax
import jax.numpy as jnp
import keras
import numpy as np
from keras import ops

from kbert import backend


def on_gpu():
    """Whether JAX runs on a GPU under no distribution or data parallelism.

    Under model parallelism XLA may shard the sliced Q/K/V apart (heads,
    features), which jax's cuDNN partitioner rejects; the XLA path shards
    freely. Data parallelism pins them to batch shards."""
    distribution = keras.distribution.distribution()
    if not (distribution is None or isinstance(distribution, keras.distribution.DataParallel)):
        return False
    return jax.devices()[0].platform == "gpu"


def _mix32(x):
    """lowbias32 (C. Wellons' hash-prospector): a bijective 32-bit mixer
    with near-ideal avalanche (every input bit flips each output bit with
    probability ~1/2)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def dropout_bits(shape, seed):
    """(shape) uint32 bits for the (2,) uint32 `seed`: a keyed hash of each
    element's flat index, mix(mix(index ^ k0) + k1), k0 and k1 mixed from
    the seed words. Pure element-wise arithmetic, so XLA computes it inside
    the fusion that uses the mask: no generator pass, no bits in memory."""
    seed = jnp.asarray(seed, jnp.uint32)
    k0 = _mix32(seed[0] ^ jnp.uint32(0x9E3779B9))
    k1 = _mix32(seed[1] + jnp.uint32(0x85EBCA6B))
    return _mix32(_mix32(_flat_index(shape) ^ k0) + k1)


def _flat_index(shape, iota_limit=2**32):
    """Each element's row-major flat index, as uint32 (mod 2^32): one iota
    reshaped (a BERT-base training step compiles faster on a GPU than with
    an iota per axis, for the same bits)."""
    size = int(np.prod(shape, dtype=np.int64))
    if size < iota_limit:
        return jax.lax.iota(jnp.uint32, size).reshape(shape)
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(
            stride % 2**32
        )
        stride *= shape[axis]
    return index


def dropout(inputs, rate, seed_generator):
    """Inverted dropout with the hashed keep mask (see `dropout_bits`)."""
    if rate >= 1.0:  # 1/(1-rate) would put inf (and NaN gradients) in the dropped branch
        return jnp.zeros_like(inputs)
    scale = np.float32(1.0 / (1.0 - rate))
    bits = dropout_bits(inputs.shape, seed_generator.next())  # next() advances the generator
    # keep iff bits < (1 - rate) * 2^32, exact to 2^-32.
    keep = bits < jnp.uint32(min(int(round((1.0 - rate) * 2**32)), 2**32 - 1))

    def masked(x, keep):  # the product in float32: 1 / 0.9 in bfloat16 is 1.109, a 0.16% bias
        return jnp.where(keep, (x.astype(jnp.float32) * scale).astype(x.dtype), jnp.zeros_like(x))

    # The mask is an argument, not a closure: a custom_vjp closing over a
    # traced value fails where the function is traced anew, as in the body
    # of a lax.scan over layers.
    @jax.custom_vjp
    def apply(x, keep):
        return masked(x, keep)

    def forward(x, keep):
        return apply(x, keep), keep

    def backward(keep, grad):  # one fused select; autodiff left the scaling as a separate pass
        return masked(grad, keep), None

    apply.defvjp(forward, backward)
    return apply(inputs, keep)


def cudnn_attention(query, key, value, keep, scale, implementation="cudnn"):
    """cuDNN flash attention with padding given as per-row key counts.

    query/key/value (B, T, N, D), keep (B, S) bool -> (B, T, N, D)."""
    length = keep.shape[1]
    lengths = jnp.sum(keep, axis=1, dtype=jnp.int32)  # (B,)
    lengths = jnp.where(lengths == 0, length, lengths)  # all-padding rows: attend everywhere
    # cuDNN takes padding as per-row key counts: the first `lengths` keys are
    # real. Attention is invariant to the order of the keys, so moving the
    # real keys (and their values) to the front makes any mask that form;
    # for right-padded rows the order is the identity. A lax.cond between
    # this and a masked XLA path cost more: autodiff makes each branch
    # return the other's residuals, so every layer materialised zero
    # (B, N, T, S) tensors, and the cond boundary forced layout copies.
    distribution = keras.distribution.distribution()
    if distribution is not None:
        # Data parallel: every operand sharded on the batch axis only, the
        # layout jax's cuDNN partitioner accepts (XLA could otherwise pick
        # another sharding for the sliced Q/K/V).
        def pin(x):
            return keras.distribution.distribute_tensor(x, distribution.get_data_layout(x.shape))

        query, key, value, keep, lengths = (pin(x) for x in (query, key, value, keep, lengths))
    order = jnp.argsort(~keep, axis=1, stable=True).astype(jnp.int32)  # (B, S), real keys first
    inverse = jnp.argsort(order, axis=1).astype(jnp.int32)
    key, value = _permute_keys(key, order, inverse), _permute_keys(value, order, inverse)
    return jax.nn.dot_product_attention(
        query, key, value, scale=scale, key_value_seq_lengths=lengths, implementation=implementation
    )


def blocks_in_loop(blocks, x, padding_mask, training):
    """`x` through `blocks` (layers of one structure, each with its own
    weights) as one `lax.scan` over their stacked weights: XLA compiles
    one block instead of L (see `kbert.backend.jax_compile`). Each block's
    non-trainable state (its dropout generators) is used and advanced as
    when the blocks run one after the other: the same step, to float
    rounding. The blocks must be alike (`BertBackbone.loops_layers`): the
    first block's code runs on each block's weights."""
    from kbert.backend import keras_internals

    first = blocks[0]
    trainable, rest = first.trainable_variables, first.non_trainable_variables
    own = trainable + rest
    per_block = [
        keras_internals.current_values(b.trainable_variables + b.non_trainable_variables)
        for b in blocks
    ]
    stacked = [jnp.stack(values) for values in zip(*per_block)]

    def body(h, weights):
        with keras_internals.variables_bound(own, weights) as value_of:
            y = first(h, padding_mask, training=training)
            advanced = [value_of(v) for v in rest]
        return y, [w if a is None else a for w, a in zip(weights[len(trainable) :], advanced)]

    x, states = jax.lax.scan(body, x, stacked)
    for i, block in enumerate(blocks):
        for variable, state in zip(block.non_trainable_variables, states):
            variable.assign(state[i])
    return x


def _permute_keys(x, order, inverse):
    """x (B, S, N, D) reordered along S; its gradient is the inverse gather
    (autodiff of a gather would scatter-add)."""

    @jax.custom_vjp
    def permute(x, order, inverse):  # the orders as arguments: see `dropout`
        return jnp.take_along_axis(x, order[:, :, None, None], axis=1)

    def forward(x, order, inverse):
        return permute(x, order, inverse), inverse

    def backward(inverse, grad):
        return jnp.take_along_axis(grad, inverse[:, :, None, None], axis=1), None, None

    permute.defvjp(forward, backward)
    return permute(x, order, inverse)


def embedding_sum(tokens, positions, segments, segment_ids):
    """tokens (B, T, H) + positions (T, H) + segments[segment_ids] with a
    custom gradient that keeps XLA's row-major layout (see `kbert.backend.ops`)."""
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    batch, length = segment_ids.shape
    num_segments = segments.shape[0]

    @jax.custom_vjp
    def embed(positions, segments):
        position_ids = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (batch, length))
        return jnp.take(positions, position_ids, axis=0) + jnp.take(segments, segment_ids, axis=0)

    def forward(positions, segments):
        return embed(positions, segments), None

    def backward(_, grad):
        # The batch sum as a product with ones: written as `sum(grad, 0)`, the
        # reduction over the major axis made XLA choose the (T, H, B) layout,
        # just as the broadcast's autodiff did.
        ones = jnp.ones((batch,), grad.dtype)
        d_positions = jnp.einsum("b,bth->th", ones, grad, preferred_element_type=jnp.float32)
        one_hot = jax.nn.one_hot(
            segment_ids, num_segments, dtype=grad.dtype
        )  # out-of-range ids: zero rows
        d_segments = jnp.einsum("bts,bth->sh", one_hot, grad, preferred_element_type=jnp.float32)
        return d_positions.astype(positions.dtype), d_segments.astype(segments.dtype)

    embed.defvjp(forward, backward)
    return tokens + embed(positions, segments)


def _tanh_inner(x32):  # GELU's tanh form: sqrt(2/pi) (x + 0.044715 x^3)
    return np.float32(np.sqrt(2.0 / np.pi)) * (x32 + 0.044715 * x32 * x32 * x32)


def _erf_term(x32):  # GELU's erf form: 1 + erf(x / sqrt 2)
    return 1.0 + jax.lax.erf(x32 * np.float32(1 / np.sqrt(2.0)))


def _gelu32(x32, approximate):
    if approximate:  # x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2
        return 0.5 * x32 * (1.0 + jnp.tanh(_tanh_inner(x32)))
    return 0.5 * x32 * _erf_term(x32)


def _gelu32_derivative(x32, approximate):
    if approximate:
        t = jnp.tanh(_tanh_inner(x32))
        c = np.float32(np.sqrt(2.0 / np.pi))
        return 0.5 * (1.0 + t) + 0.5 * x32 * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * x32 * x32)
    density = jnp.exp(-0.5 * x32 * x32) * np.float32(1 / np.sqrt(2.0 * np.pi))
    return 0.5 * _erf_term(x32) + x32 * density


def gelu(x, approximate=False):
    """GELU in the erf form (or the tanh approximation), computed in float32.

    Its gradient is recomputed from x, the only value kept for the
    backward pass, in its own dtype: autodiff of the float32 expression
    keeps three float32 copies of the (B, T, 4H) activation per block (x,
    1 + erf and the exponential), which a training step writes and reads
    back. (Reverse mode only, as every custom gradient here.)"""
    return _gelu(x, bool(approximate))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gelu(x, approximate):
    return _gelu32(x.astype(jnp.float32), approximate).astype(x.dtype)


def _gelu_forward(x, approximate):
    return _gelu(x, approximate), x


def _gelu_backward(approximate, x, grad):
    derivative = _gelu32_derivative(x.astype(jnp.float32), approximate)
    return ((grad.astype(jnp.float32) * derivative).astype(x.dtype),)


_gelu.defvjp(_gelu_forward, _gelu_backward)


def layer_norm(x, gamma, beta, epsilon):
    """LayerNorm over the last axis with a one-pass forward and a closed-form
    backward (see `kbert.backend.ops`)."""
    x, gamma, beta = (ops.convert_to_tensor(v) for v in (x, gamma, beta))  # variables -> arrays
    out_dtype = x.dtype
    reduce_axes = tuple(range(x.ndim - 1))

    def statistics(x32):
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        variance = jnp.maximum(jnp.mean(x32 * x32, axis=-1, keepdims=True) - mean * mean, 0.0)
        return mean, jax.lax.rsqrt(variance + np.float32(epsilon))

    @jax.custom_vjp
    def apply(x, gamma, beta):
        return forward(x, gamma, beta)[0]

    def forward(x, gamma, beta):
        x32 = x.astype(jnp.float32)
        mean, rstd = statistics(x32)
        y = (x32 - mean) * rstd * gamma.astype(jnp.float32) + beta.astype(jnp.float32)
        return y.astype(out_dtype), (x, mean, rstd, gamma, beta)

    def backward(residuals, grad):
        x, mean, rstd, gamma, beta = residuals
        x_hat = (x.astype(jnp.float32) - mean) * rstd
        g = grad.astype(jnp.float32)
        g_scaled = g * gamma.astype(jnp.float32)
        a = jnp.mean(g_scaled, axis=-1, keepdims=True)
        b = jnp.mean(g_scaled * x_hat, axis=-1, keepdims=True)
        dx = rstd * (g_scaled - a - x_hat * b)
        zero = np.float32(0)
        d_gamma, d_beta = jax.lax.reduce(  # one pass over (g, x) for both
            (g * x_hat, g), (zero, zero), lambda u, v: (u[0] + v[0], u[1] + v[1]), reduce_axes
        )
        return dx.astype(x.dtype), d_gamma.astype(gamma.dtype), d_beta.astype(beta.dtype)

    apply.defvjp(forward, backward)
    return apply(x, gamma, beta)


# bfloat16 holds every integer in [-256, 256] exactly, so int8 values cast to
# it lose nothing, and a float32 accumulator holds every integer up to 2**24:
# a product over at most 1,024 terms of |x|, |k| <= 128 (2**24 at most) is
# exact. Wider products are split into such pieces, summed in int32.
_EXACT_DEPTH = 1024
# The bfloat16 product converts the kernel on every call, a pass over it
# that a product of few rows does not repay: on a 2-core AVX512-BF16 CPU
# XLA's int8 dot was faster up to about 128 rows (768 x 3,072: 0.30 against
# 0.53 ms at 32 rows, 3.4 against 2.5 ms at 512), so batch-1 sentences keep it.
_BF16_MIN_ROWS = 256


def int8_matmul_path(shape=None):
    """Names the path for inputs of `shape` (None: many rows):
    "jax-bf16-exact" on a CPU with bfloat16 dot instructions from
    `_BF16_MIN_ROWS` rows on, else "keras-matmul-int32" (XLA's int8 product
    with int32 accumulation, which runs on a GPU's integer tensor cores).
    Symbolic sizes (shape-polymorphic export) take the int32 product."""
    if shape is None:
        many = True
    else:
        lead = tuple(shape)[:-1]
        many = all(isinstance(d, int) for d in lead) and math.prod(lead) >= _BF16_MIN_ROWS
    if jax.default_backend() == "cpu" and backend.cpu_has_bf16_dot() and many:
        return "jax-bf16-exact"
    return "keras-matmul-int32"


def int8_matmul(inputs, kernel, dtype="int32"):
    """inputs (..., I) int8, kernel (I, O) int8 -> (..., O): the exact int32
    product (`dtype="int32"`), or that product rounded to float32
    (`dtype="float32"`; the bfloat16 path then skips an int32 pass)."""
    if dtype not in ("int32", "float32"):
        raise ValueError(f"int8_matmul returns int32 or float32, not {dtype}")
    if int8_matmul_path(inputs.shape) == "jax-bf16-exact":
        return bf16_exact_product(inputs, kernel, dtype)
    product = ops.matmul(inputs, kernel)  # Keras' JAX matmul accumulates int8 in int32
    return product if dtype == "int32" else product.astype(dtype)


def bf16_exact_product(inputs, kernel, dtype="int32"):
    """`int8_matmul` through bfloat16 x bfloat16 -> float32 products over
    pieces of at most `_EXACT_DEPTH` terms (each exact in float32).

    Two exact float32 pieces sum to the correctly rounded float32 of the
    exact product, the value `dtype="float32"` asks for; more pieces, or
    `dtype="int32"`, are summed in int32."""
    x = jnp.asarray(inputs).astype(jnp.bfloat16)
    k = jnp.asarray(kernel).astype(jnp.bfloat16)
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    parts = [
        jax.lax.dot_general(
            x[..., start : start + _EXACT_DEPTH],
            k[start : start + _EXACT_DEPTH],
            dims,
            preferred_element_type=jnp.float32,
        )
        for start in range(0, k.shape[0], _EXACT_DEPTH)
    ]
    if dtype == "float32" and len(parts) <= 2:
        return functools.reduce(jnp.add, parts)
    product = functools.reduce(jnp.add, [p.astype(jnp.int32) for p in parts])
    return product if dtype == "int32" else product.astype(dtype)


# float8 training (Keras' float8 `Dense`: e4m3 inputs and kernel, e5m2
# output gradients, per-tensor scales from an abs-max history).
_FLOAT8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def _float8_quantize(x, scale, dtype, compute_dtype):
    """Keras' `quantize_and_dequantize` up to the cast to float8 (the same
    operations in the same types): x / scale, clipped to the format's
    range, as `dtype`."""
    limit = _FLOAT8_MAX[dtype]
    x = x / scale.astype(compute_dtype)
    return jnp.clip(x, -limit, limit).astype(dtype)


def _float8_scale(amax_history, scale, dtype):
    """Keras' `compute_float8_scale(max(amax_history), scale, max)`."""
    amax = jnp.max(amax_history, axis=0)
    sf = jnp.where(amax > 0.0, _FLOAT8_MAX[dtype] / amax, 1.0 / scale)
    return 1.0 / jnp.where(jnp.isfinite(amax), sf, 1.0 / scale)


def _float8_history(x, amax_history):
    """Keras' `compute_float8_amax_history`: roll left, newest abs-max first."""
    amax = jnp.max(jnp.abs(x)).astype(amax_history.dtype)
    return jnp.roll(amax_history, -1).at[0].set(amax)


def _float8_product(a, b, scale_a, scale_b, dims, compute_dtype):
    """The product of two float8 tensors, rescaled by their scales, in
    `compute_dtype`: one float8 GEMM (float32 accumulation) on GPUs that
    have one; XLA's CPU backend widens the operands."""
    product = jax.lax.dot_general(a, b, dims, preferred_element_type=compute_dtype)
    return product * (scale_a * scale_b).astype(compute_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def float8_matmul(inputs, kernel, sx, hx, sk, hk, sg, hg, compute_dtype):
    """inputs (..., I) @ kernel (I, O) with float8 operands, as Keras'
    float8 `Dense` computes it in training, differentiated the way Keras'
    is: `state` = (inputs_scale, inputs_amax_history, kernel_scale,
    kernel_amax_history, outputs_grad_scale, outputs_grad_amax_history),
    whose cotangents are their next values (overwrite with gradient);
    `compute_dtype` last. See `kbert.backend.ops.float8_matmul`."""
    return _float8_forward(inputs, kernel, sx, hx, sk, hk, sg, hg, compute_dtype)[0]


def _float8_forward(inputs, kernel, sx, hx, sk, hk, sg, hg, compute_dtype):
    xq = _float8_quantize(inputs, sx, "float8_e4m3fn", compute_dtype)
    kq = _float8_quantize(kernel, sk, "float8_e4m3fn", compute_dtype)
    dims = (((inputs.ndim - 1,), (0,)), ((), ()))
    y = _float8_product(xq, kq, sx, sk, dims, compute_dtype)
    # Keras computes the next input and kernel scales in the forward pass,
    # from the histories before this call's abs-max joins them.
    updates = (
        _float8_scale(hx, sx, "float8_e4m3fn"),
        _float8_history(inputs, hx),
        _float8_scale(hk, sk, "float8_e4m3fn"),
        _float8_history(kernel, hk),
    )
    # Empty arrays carry the primal dtypes (residuals must be arrays).
    dtypes = (jnp.zeros((0,), inputs.dtype), jnp.zeros((0,), kernel.dtype))
    return y, (xq, kq, sx, sk, sg, hg, updates, dtypes)


def _float8_backward(compute_dtype, residuals, grad):
    xq, kq, sx, sk, sg, hg, updates, (inputs_dtype, kernel_dtype) = residuals
    gq = _float8_quantize(grad, sg, "float8_e5m2", compute_dtype)
    lead = tuple(range(grad.ndim - 1))
    dx = _float8_product(gq, kq, sg, sk, (((grad.ndim - 1,), (1,)), ((), ())), compute_dtype)
    dk = _float8_product(xq, gq, sx, sg, ((lead, lead), ((), ())), compute_dtype)
    new_sg = _float8_scale(hg, sg, "float8_e5m2")
    new_hg = _float8_history(grad, hg)
    dx, dk = dx.astype(inputs_dtype.dtype), dk.astype(kernel_dtype.dtype)
    return (dx, dk, *updates, new_sg, new_hg)


float8_matmul.defvjp(_float8_forward, _float8_backward)
