"""Multi-head self-attention with a fused QKV projection.

Shapes: B batch, T query tokens, S key tokens (= T), N heads, D head size,
H hidden (= N * D).

Two paths compute the same function:
- fused: `kbert.backend.ops` (cuDNN flash attention on JAX+GPU,
  PyTorch SDPA on torch, XLA elsewhere), used whenever no attention-probability dropout is
  active, i.e. at inference and when training with `attention_dropout=0`,
  and on torch also with it (SDPA drops attention probabilities itself);
- explicit: softmax(QK^T / sqrt(D)) with dropout on the probabilities, the
  paper's recipe, used when training with `attention_dropout > 0` on JAX
  and TensorFlow.
`attention_path(training)` says which one a call takes.
"""

import math

import keras
from keras import ops

from kbert.backend.ops import (
    attention_dropout_is_fused,
    attention_keep,
    fused_attention,
    sublayer_call,
)
from kbert.layers.dense import Dense
from kbert.layers.dropout import Dropout
from kbert.layers.initializers import truncated_normal


@keras.saving.register_keras_serializable(package="kbert")
class MultiHeadSelfAttention(keras.layers.Layer):
    """Bidirectional self-attention over the non-padding tokens.

    `padding_mask` is (B, S), or an attention mask (B, T, S) saying which
    keys each query sees (rows that hold several examples).

    Args:
        num_heads: int. number of heads N.
        hidden_dim: int. model width H, divisible by `num_heads`.
        attention_dropout: float. dropout on attention probabilities.
        initializer_range: float. stddev of the truncated-normal init.

    Example:
    >>> layer = MultiHeadSelfAttention(num_heads=2, hidden_dim=8)
    >>> x = keras.ops.ones((2, 5, 8))
    >>> tuple(layer(x, keras.ops.ones((2, 5), "int32")).shape)
    (2, 5, 8)
    """

    def __init__(
        self,
        num_heads,
        hidden_dim,
        attention_dropout=0.1,
        initializer_range=0.02,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if hidden_dim % num_heads:
            raise ValueError(f"hidden_dim={hidden_dim} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.head_dim = hidden_dim // num_heads
        self.attention_dropout = attention_dropout
        self.initializer_range = initializer_range
        init = truncated_normal(initializer_range)
        self.qkv = Dense(
            3 * hidden_dim, kernel_initializer=init, dtype=self.dtype_policy, name="qkv"
        )
        self.output_dense = Dense(
            hidden_dim, kernel_initializer=init, dtype=self.dtype_policy, name="output"
        )
        self.probs_dropout = Dropout(
            attention_dropout, dtype=self.dtype_policy, name="probs_dropout"
        )

    def build(self, inputs_shape, padding_mask_shape=None):
        self.qkv.build(inputs_shape)
        self.output_dense.build(tuple(inputs_shape[:-1]) + (self.hidden_dim,))
        self.built = True

    def attention_path(self, training=None):
        """'fused' or 'explicit': the attention path a call with `training` takes."""
        dropping = training and self.attention_dropout > 0
        return "explicit" if dropping and not attention_dropout_is_fused() else "fused"

    def call(self, inputs, padding_mask, training=None):
        qkv = sublayer_call(self.qkv, inputs, training=training)  # (B, T, 3H)
        context = self._attend(qkv, padding_mask, training)
        return sublayer_call(self.output_dense, context, training=training)

    def call_packed(self, tokens, packing, training=None):
        """`call` on the real tokens only: `tokens` (n, H) are the rows
        `packing.gather` took from a padded batch. The projections run on
        them; attention runs per group of rows of similar length
        (`packing.attention_groups()`), each padded to its own longest.
        Returns (n, H)."""
        qkv = sublayer_call(self.qkv, tokens, training=training)  # (n, 3H)
        groups = packing.attention_groups()
        parts = [
            group.gather(self._attend(group.scatter(qkv), group.padding_mask, training))
            for group in groups
        ]  # (n_g, H) each
        context = packing.merge(parts, groups)  # (n, H)
        return sublayer_call(self.output_dense, context, training=training)

    def _attend(self, qkv, padding_mask, training):
        """(B, T, 3H) projections -> (B, T, H) attention context."""
        batch, length = ops.shape(qkv)[0], ops.shape(qkv)[1]
        qkv = ops.reshape(qkv, (batch, length, 3, self.num_heads, self.head_dim))  # (B, T, 3, N, D)
        # unstack, not three slices: on torch each slice's gradient is a zero
        # (B, T, 3, N, D) tensor with its part copied in, and the three are
        # summed; unbind's gradient is one stack.
        query, key, value = ops.unstack(qkv, num=3, axis=2)  # (B, T, N, D) each

        scale = 1.0 / math.sqrt(self.head_dim)
        if self.attention_path(training) == "fused":
            dropout = self.attention_dropout if training else 0.0
            context = fused_attention(
                query, key, value, padding_mask, scale, dropout
            )  # (B, T, N, D)
        else:
            keep = attention_keep(padding_mask)  # (B, 1, 1, S) or (B, 1, T, S)
            context = self._explicit_attention(query, key, value, keep, scale, training)
        return ops.reshape(context, (batch, length, self.hidden_dim))  # (B, T, H)

    def _explicit_attention(self, query, key, value, keep, scale, training):
        scores = ops.einsum("btnd,bsnd->bnts", query, key)  # (B, N, T, S)
        scores = ops.cast(scores, "float32") * scale
        # Masked keys get -1e30 (exp underflows to exactly 0). An additive
        # bias rather than where(keep, scores, full_like(-1e30)): the filled
        # constant is a host-to-device copy per layer on torch, which
        # synchronises the stream.
        scores = scores + (ops.cast(keep, "float32") - 1.0) * 1e30
        probs = ops.cast(ops.softmax(scores, axis=-1), self.compute_dtype)
        probs = sublayer_call(self.probs_dropout, probs, training=training)
        return ops.einsum("bnts,bsnd->btnd", probs, value)  # (B, T, N, D)

    def compute_output_shape(self, inputs_shape, padding_mask_shape=None):
        return tuple(inputs_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            num_heads=self.num_heads,
            hidden_dim=self.hidden_dim,
            attention_dropout=self.attention_dropout,
            initializer_range=self.initializer_range,
        )
        return config
