"""The one place with backend-specific code: dense, dropout, attention, GELU,
LayerNorm and the position + segment embedding sum.

`fused_dense(x, kernel, bias)` computes x @ kernel + bias.
- torch: one `torch.nn.functional.linear` call, i.e. a GEMM with the bias
  added in its epilogue (`addmm`), as transformers' `nn.Linear` does. The
  generic `matmul` then `add` costs a second pass over the output, and
  Keras' eager torch backend cannot fuse it.
- torch, float32 on CPU without autograd (inference): oneDNN's matrix
  product on a weight reordered once into its blocked layout
  (`torch.ops.mkldnn._linear_pointwise`, what torch.compile's CPU freezing
  uses), 2.3x faster than MKL's `addmm` for a (1536, 384) x (384, 1536)
  product on the 2-core dev machine. The reordered weight is cached per
  layer and rebuilt when the kernel tensor changes (new tensor or in-place
  update, seen by `Tensor._version`).
- everything else: `keras.ops.matmul` + `keras.ops.add`; XLA fuses the add.
`fused_dense_path(...)` says which one is used.

`fused_dropout(x, rate, seed_generator)` is inverted dropout.
- JAX: the keep mask compares `dropout_bits` with (1 - rate) * 2^32: a
  keyed hash of each element's index (two rounds of the lowbias32 mixer,
  keys from the layer's Keras seed), computed inside the fusion that applies
  the mask. A generator (threefry, or XLA's Philox RngBitGenerator through
  a `rbg` key) writes its bits to memory and reads them back: on an H100 a
  BERT-base step ran at 4,774 sequences/s with Philox and 5,023 with the
  hash (same machine; `python benchmarks/layout_probe.py --variants base
  philox` reruns the comparison). The hash is not a cryptographic or BigCrush-certified
  generator; tests check what dropout needs: the keep rate, no correlation
  between neighbouring elements, rows, or successive masks; and the
  pre-training example reaches the same held-out accuracy with it as with
  Philox over three seeds (benchmarks/results/dropout_rng_cpu.json). Kept values
  are scaled in float32 and rounded once (1 / 0.9 rounded to bfloat16 is
  1.109: every kept value 0.16% low); the gradient is one select with the
  same mask.
- everything else: `keras.random.dropout`.
`fused_dropout_path()` says which one is used.

`fused_attention` computes softmax(QK^T * scale) V over the non-padding keys.
- JAX on GPU: cuDNN flash attention through `jax.nn.dot_product_attention`
  with `key_value_seq_lengths` (the form cuDNN accepts for padding: a mask
  tensor is what made keras-hub's cuDNN call fail). Key counts mean right
  padding (1s then 0s); other masks are made that form by moving the real
  keys first (see `_jax_cudnn`), so any mask is exact. Under
  `keras.distribution.DataParallel` the operands are pinned to batch
  shards; under other distributions the XLA path is used, and so it is
  for float32 (cuDNN flash attention takes only 16-bit and fp8 inputs).
- torch: `torch.nn.functional.scaled_dot_product_attention` on (B, N, T, D)
  views with a boolean mask. `keras.ops.dot_product_attention` reaches the
  same kernel but first copies Q, K and V to contiguous tensors and turns
  the mask into a float bias: three copies per layer for nothing.
- everything else: `keras.ops.dot_product_attention` with a boolean mask
  (XLA or the TensorFlow kernel).
`fused_attention_path()` says which one is used.

`fused_gelu(x, approximate)` is GELU (exact erf form or tanh approximation).
- JAX: x (1 + erf(x / sqrt 2)) / 2 in float32, as torch and transformers
  compute it. `jax.nn.gelu` writes it with `erfc(-x / sqrt 2)`, whose XLA
  expansion evaluates two rational approximations, an exp and divisions per
  element and selects between them: on an H100, a BERT-base step went from
  4,428 to 4,653 sequences/s with the erf form (`benchmarks/layout_probe.py`,
  variants autogelu and erfauto). A custom gradient that kept only x for
  the backward pass measured the same (4,653 vs 4,659), so autodiff stays.
  The tanh form is also computed in float32.
- everything else: `keras.activations.gelu`.

`fused_layer_norm(x, gamma, beta, epsilon)` normalises the last axis, in
float32, and returns x's dtype.
- JAX: a custom gradient. The forward pass takes the mean and the mean of
  squares in one pass over x (variance = E[x^2] - E[x]^2, in float32,
  clamped at 0); the backward pass recomputes x_hat from x and the saved
  row statistics and uses the closed form
  dx = rstd (g' - mean(g') - x_hat mean(g' x_hat)), g' = g gamma.
  Autodiff of Keras' two-pass form (jnp.var) read the activation more times.
  The one-pass variance loses relative precision of about 1e-7 * mean^2 /
  variance per row: negligible for LayerNorm inputs, whose row means are
  small against their spread; the parity tests against transformers (1e-5,
  float32) run through it.
- everything else: `keras.ops.layer_normalization`.

`fused_embedding_sum(tokens, positions, segments, segment_ids)` is
tokens + segments[segment_ids] + positions[None]: (B, T, H) token vectors,
(T, H) and (S, H) tables.
- JAX: both tables are gathered to (B, T, H), with a custom gradient: a
  product with a ones vector (the batch sum) for the positions, a one-hot
  product for the segments, accumulated in float32. Written as a broadcast
  (`positions[None]`), the gradient is `sum(grad, axis=0)`, a reduction over
  the major axis, and for it XLA's layout assignment made the batch the
  fastest-varying axis. That layout, (T, H, B) in memory, spread to every
  residual add and LayerNorm of the encoder: 148 large transposes per
  BERT-base training step (6.9 GB moved), since every matrix product needs
  (B*T, H) rows. With this form: 0 (`benchmarks/layout_probe.py`). Autodiff
  of a plain gather would scatter-add 256-fold duplicates into each
  position row (16,384-fold into each segment row) with atomics: half the
  throughput in the same probe.
- everything else: the broadcast and `take`, as autodiff sees them.

`sublayer_call(layer, *args, **kwargs)` is `layer(*args, **kwargs)` for the
built sublayers of an encoder block.
- torch, eager tensors already in the layer's input dtype: `layer.call`
  under the autocast scope Keras' `__call__` would set. `__call__`'s other
  work (input conversion, signature binding, call context, masks, build
  check, name scope) is a no-op there, and it costs ~50 us of host time per
  call, which the torch backend's GPU step waits for: it is host-bound.
  On the dev CPU a 12-layer thin model's training step went from 32.4 to
  26.3 ms.
- everything else (symbolic or meta tensors, another dtype, other
  backends): `layer(*args, **kwargs)`.
"""

import keras
import numpy as np
from keras import ops


def fused_dense_path(inputs=None):
    """Which implementation `fused_dense` uses on this backend (for `inputs`,
    under the current autograd mode, where that matters)."""
    backend = keras.backend.backend()
    if backend != "torch":
        return "keras-matmul-add"
    if inputs is not None and _onednn_inference(ops.convert_to_tensor(inputs)):
        return "torch-onednn-packed"
    return "torch-linear"


class PackedWeightCache:
    """One oneDNN-reordered weight, valid for one kernel tensor at one version."""

    def __init__(self):
        self.kernel = self.version = self.packed = None

    def get(self, kernel):
        import torch

        if self.kernel is not kernel or self.version != kernel._version:
            # Holding `kernel` keeps its storage alive, so identity cannot be
            # fooled by a new tensor at a recycled address.
            self.kernel, self.version = kernel, kernel._version
            self.packed = torch.ops.mkldnn._reorder_linear_weight(kernel.t().contiguous(), None)
        return self.packed


def _onednn_inference(x):
    import torch

    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and not torch.is_grad_enabled()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def fused_dense(inputs, kernel, bias=None, cache=None):
    """inputs (..., I), kernel (I, O), bias (O,) or None -> (..., O).

    `cache`: a `PackedWeightCache` owned by the calling layer (torch CPU
    inference reuses the reordered weight through it).
    """
    if keras.backend.backend() == "torch":
        import torch

        inputs = ops.convert_to_tensor(inputs)
        kernel = ops.convert_to_tensor(kernel)
        bias = None if bias is None else ops.convert_to_tensor(bias)
        if cache is not None and kernel.dtype == torch.float32 and _onednn_inference(inputs):
            return torch.ops.mkldnn._linear_pointwise(
                inputs, cache.get(kernel), bias, "none", [], ""
            )
        # linear(x, W, b) = x @ W^T + b; W^T of a transposed view is a
        # stride change, not a copy.
        return torch.nn.functional.linear(inputs, kernel.t(), bias)
    x = ops.matmul(inputs, kernel)
    return x if bias is None else ops.add(x, bias)


def fused_dropout_path():
    """Which random bit generator `fused_dropout` uses on this backend."""
    return "jax-hash" if keras.backend.backend() == "jax" else f"keras-{keras.backend.backend()}"


def _mix32(x):
    """lowbias32 (C. Wellons' hash-prospector): a bijective 32-bit mixer
    with near-ideal avalanche (every input bit flips each output bit with
    probability ~1/2)."""
    import jax.numpy as jnp

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
    import jax
    import jax.numpy as jnp

    seed = jnp.asarray(seed, jnp.uint32)
    k0 = _mix32(seed[0] ^ jnp.uint32(0x9E3779B9))
    k1 = _mix32(seed[1] + jnp.uint32(0x85EBCA6B))
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):  # row-major flat index (mod 2^32)
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(
            stride % 2**32
        )
        stride *= shape[axis]
    return _mix32(_mix32(index ^ k0) + k1)


def fused_dropout(inputs, rate, seed_generator):
    """Zeroes each element with probability `rate`, scales the rest by 1/(1-rate)."""
    if keras.backend.backend() != "jax":
        return keras.random.dropout(inputs, rate, seed=seed_generator)
    import jax
    import jax.numpy as jnp

    if rate >= 1.0:  # 1/(1-rate) would put inf (and NaN gradients) in the dropped branch
        return jnp.zeros_like(inputs)
    scale = np.float32(1.0 / (1.0 - rate))
    bits = dropout_bits(inputs.shape, seed_generator.next())  # next() advances the generator
    # keep iff bits < (1 - rate) * 2^32, exact to 2^-32.
    keep = bits < jnp.uint32(min(int(round((1.0 - rate) * 2**32)), 2**32 - 1))

    def masked(x):  # the product in float32: 1 / 0.9 in bfloat16 is 1.109, a 0.16% bias
        return jnp.where(keep, (x.astype(jnp.float32) * scale).astype(x.dtype), jnp.zeros_like(x))

    @jax.custom_vjp
    def apply(x):
        return masked(x)

    def forward(x):
        return apply(x), None

    def backward(_, grad):  # one fused select; autodiff left the scaling as a separate pass
        return (masked(grad),)

    apply.defvjp(forward, backward)
    return apply(inputs)


def _jax_gpu():
    distribution = keras.distribution.distribution()
    if keras.backend.backend() != "jax" or not (
        distribution is None or isinstance(distribution, keras.distribution.DataParallel)
    ):
        # Under model parallelism XLA may shard the sliced Q/K/V apart
        # (heads, features), which jax's cuDNN partitioner rejects; the XLA
        # path shards freely. Data parallelism pins them to batch shards.
        return False
    import jax

    return jax.devices()[0].platform == "gpu"


def fused_attention_path(dtype="bfloat16"):
    """Which kernel `fused_attention` uses for inputs of `dtype`."""
    cudnn = _jax_gpu() and keras.backend.standardize_dtype(dtype) in ("float16", "bfloat16")
    if cudnn:
        return "jax-cudnn-flash"
    return (
        "torch-sdpa" if keras.backend.backend() == "torch" else f"keras-{keras.backend.backend()}"
    )


def fused_attention(query, key, value, padding_mask, scale, dropout=0.0):
    """query/key/value (B, T, N, D); padding_mask (B, S) -> (B, T, N, D).
    `dropout` (torch only): inverted dropout on the attention probabilities,
    applied by SDPA."""
    if dropout and keras.backend.backend() != "torch":
        raise ValueError("fused_attention applies attention dropout on torch only")
    keep = ops.cast(padding_mask, "bool")
    if _jax_gpu() and keras.backend.standardize_dtype(query.dtype) in ("float16", "bfloat16"):
        return _jax_cudnn(query, key, value, keep, scale)
    # A row with no real token would softmax over nothing (NaN); let it
    # attend everywhere instead. Its outputs are padding and unused.
    empty = ops.logical_not(ops.any(keep, axis=1, keepdims=True))
    keep = ops.logical_or(keep, empty)[:, None, None, :]  # (B, 1, 1, S)
    if keras.backend.backend() == "torch":
        return _torch_sdpa(query, key, value, keep, scale, dropout)
    return ops.dot_product_attention(query, key, value, mask=keep, scale=scale)


def _torch_sdpa(query, key, value, keep, scale, dropout=0.0):
    import torch

    q, k, v = (
        ops.convert_to_tensor(t).transpose(1, 2) for t in (query, key, value)
    )  # (B, N, T, D)
    context = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=keep, scale=scale, dropout_p=float(dropout)
    )
    return context.transpose(1, 2)  # (B, T, N, D)


def _jax_cudnn(query, key, value, keep, scale, implementation="cudnn"):
    import jax
    import jax.numpy as jnp

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


def _permute_keys(x, order, inverse):
    """x (B, S, N, D) reordered along S; its gradient is the inverse gather
    (autodiff of a gather would scatter-add)."""
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def permute(x):
        return jnp.take_along_axis(x, order[:, :, None, None], axis=1)

    def forward(x):
        return permute(x), None

    def backward(_, grad):
        return (jnp.take_along_axis(grad, inverse[:, :, None, None], axis=1),)

    permute.defvjp(forward, backward)
    return permute(x)


def fused_embedding_sum(tokens, positions, segments, segment_ids):
    """tokens (B, T, H), positions (T, H), segments (S, H), segment_ids (B, T) -> (B, T, H)."""
    if keras.backend.backend() != "jax":
        return tokens + ops.take(segments, ops.cast(segment_ids, "int32"), axis=0) + positions[None]
    import jax
    import jax.numpy as jnp

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
        # reduction over the major axis made XLA choose the (T, H, B) layout
        # described above, just as the broadcast's autodiff did.
        ones = jnp.ones((batch,), grad.dtype)
        d_positions = jnp.einsum("b,bth->th", ones, grad, preferred_element_type=jnp.float32)
        one_hot = jax.nn.one_hot(
            segment_ids, num_segments, dtype=grad.dtype
        )  # out-of-range ids: zero rows
        d_segments = jnp.einsum("bts,bth->sh", one_hot, grad, preferred_element_type=jnp.float32)
        return d_positions.astype(positions.dtype), d_segments.astype(segments.dtype)

    embed.defvjp(forward, backward)
    return tokens + embed(positions, segments)


def fused_gelu(x, approximate=False):
    """GELU of x; on JAX in the erf form, computed in float32."""
    if keras.backend.backend() != "jax":
        return keras.activations.gelu(x, approximate=approximate)
    import jax
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    if approximate:  # x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2
        inner = np.float32(np.sqrt(2.0 / np.pi)) * (x32 + 0.044715 * x32 * x32 * x32)
        return (0.5 * x32 * (1.0 + jnp.tanh(inner))).astype(x.dtype)
    return (0.5 * x32 * (1.0 + jax.lax.erf(x32 * np.float32(1 / np.sqrt(2.0))))).astype(x.dtype)


def fused_layer_norm(x, gamma, beta, epsilon):
    """LayerNorm of x over its last axis with (H,) gamma and beta."""
    if keras.backend.backend() != "jax":
        return ops.layer_normalization(x, gamma, beta, axis=-1, epsilon=epsilon)
    import jax
    import jax.numpy as jnp

    x, gamma, beta = (
        ops.convert_to_tensor(v) for v in (x, gamma, beta)
    )  # Keras variables -> arrays
    out_dtype = x.dtype
    reduce_axes = tuple(range(x.ndim - 1))

    def statistics(x32):
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        variance = jnp.maximum(jnp.mean(x32 * x32, axis=-1, keepdims=True) - mean * mean, 0.0)
        return mean, jax.lax.rsqrt(variance + np.float32(epsilon))

    @jax.custom_vjp
    def layer_norm(x, gamma, beta):
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

    layer_norm.defvjp(forward, backward)
    return layer_norm(x, gamma, beta)


def sublayer_call(layer, *args, **kwargs):
    """layer(*args, **kwargs), without Keras' per-call bookkeeping on torch
    eager tensors (see the module docstring)."""
    if keras.backend.backend() != "torch" or not layer.built:
        return layer(*args, **kwargs)
    import torch
    from keras.src.backend import AutocastScope, get_autocast_scope

    x = args[0]
    if (
        not isinstance(x, torch.Tensor)
        or x.device.type == "meta"
        or keras.backend.standardize_dtype(x.dtype) != layer.input_dtype
    ):
        return layer(*args, **kwargs)
    # The scope Layer.__call__ would enter (keras/src/layers/layer.py, step 7).
    scope = get_autocast_scope()
    autocasts = layer.autocast and keras.backend.is_float_dtype(layer.compute_dtype)
    mixed = scope is not None or layer.compute_dtype != layer.variable_dtype
    wanted = layer.compute_dtype if autocasts and mixed else None
    if (scope.dtype if scope is not None else None) == wanted:
        return layer.call(*args, **kwargs)
    with AutocastScope(wanted):
        return layer.call(*args, **kwargs)
