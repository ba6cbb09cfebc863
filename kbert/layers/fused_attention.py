"""The one place with backend-specific attention code.

`fused_attention` computes softmax(QK^T * scale) V over the non-padding keys.
- JAX on GPU: cuDNN flash attention through `jax.nn.dot_product_attention`
  with `key_value_seq_lengths` (the form cuDNN accepts for padding: a mask
  tensor is what made keras-hub's cuDNN call fail). That needs right padding
  (1s then 0s), which every kbert pipeline produces; a batch whose mask is
  not of that form is sent, inside the same compiled step, to the XLA path.
  Under a `keras.distribution` (data parallel) the XLA path is used; so it
  is for float32 (cuDNN flash attention takes only 16-bit and fp8 inputs).
- everything else: `keras.ops.dot_product_attention` with a boolean mask
  (PyTorch SDPA on torch; XLA or the TensorFlow kernel elsewhere).
`fused_attention_path()` says which one is used.
"""

import keras
from keras import ops


def _jax_gpu():
    if keras.backend.backend() != "jax" or keras.distribution.distribution() is not None:
        # Under a Keras distribution, XLA may shard the sliced Q/K/V apart,
        # which jax's cuDNN partitioner rejects; the XLA path shards freely.
        return False
    import jax

    return jax.devices()[0].platform == "gpu"


def fused_attention_path(dtype="bfloat16"):
    """Which kernel `fused_attention` uses for inputs of `dtype`."""
    cudnn = _jax_gpu() and keras.backend.standardize_dtype(dtype) in ("float16", "bfloat16")
    return "jax-cudnn-flash" if cudnn else f"keras-{keras.backend.backend()}"


def fused_attention(query, key, value, padding_mask, scale):
    """query/key/value (B, T, N, D); padding_mask (B, S) -> (B, T, N, D)."""
    keep = ops.cast(padding_mask, "bool")
    if _jax_gpu() and keras.backend.standardize_dtype(query.dtype) in ("float16", "bfloat16"):
        return _jax_cudnn(query, key, value, keep, scale)
    # A row with no real token would softmax over nothing (NaN); let it
    # attend everywhere instead. Its outputs are padding and unused.
    empty = ops.logical_not(ops.any(keep, axis=1, keepdims=True))
    keep = ops.logical_or(keep, empty)[:, None, None, :]  # (B, 1, 1, S)
    return ops.dot_product_attention(query, key, value, mask=keep, scale=scale)


def _jax_cudnn(query, key, value, keep, scale):
    import jax
    import jax.numpy as jnp

    length = keep.shape[1]
    lengths = jnp.sum(keep, axis=1, dtype=jnp.int32)  # (B,)
    right_padded = jnp.all(keep == (jnp.arange(length)[None, :] < lengths[:, None]))
    lengths = jnp.where(lengths == 0, length, lengths)  # all-padding rows: finite

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, key_value_seq_lengths=lengths, implementation="cudnn"
        )

    def xla(q, k, v):
        mask = jnp.logical_or(keep, ~jnp.any(keep, axis=1, keepdims=True))[:, None, None, :]
        return jax.nn.dot_product_attention(q, k, v, scale=scale, mask=mask, implementation="xla")

    return jax.lax.cond(right_padded, cudnn, xla, query, key, value)
