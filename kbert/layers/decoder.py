"""The decoder block: causal self-attention, cross-attention to an encoder's
output, feed-forward (BERT2BERT's decoder, transformers' `BertLayer` with
`add_cross_attention`). Registered as the block type "bert_decoder".

Shapes: B batch, T query tokens, S key tokens (the encoder's, or a cache's),
N heads, D head size, H hidden (= N * D).

Cached decoding runs a block on the newest tokens only: `call_cached`
writes their keys and values into fixed-size (B, S, N, D) caches at a
position and attends to every cached key a padding mask marks as written,
so a decode loop keeps one shape from the first token to the last (one
compiled program). The cross-attention keys and values of the encoder
output are computed once (`cross_key_values`) and passed to every step.
"""

import math

import keras
from keras import ops

from kbert.backend.decoding import cache_write
from kbert.backend.ops import sublayer_call
from kbert.layers.attention import (
    AttentionDropout,
    check_implementation_name,
    select_implementation,
)
from kbert.layers.config import ArgumentsConfig
from kbert.layers.dense import Dense
from kbert.layers.dropout import Dropout
from kbert.layers.encoder import TransformerEncoderBlock, register_block
from kbert.layers.initializers import truncated_normal
from kbert.layers.layer_norm import LayerNorm
from kbert.layers.masks import AttentionMask


def _heads(x, parts, num_heads, head_dim):
    """(B, T, parts * H) projections -> `parts` tensors (B, T, N, D)."""
    batch, length = ops.shape(x)[0], ops.shape(x)[1]
    x = ops.reshape(x, (batch, length, parts, num_heads, head_dim))  # (B, T, parts, N, D)
    return ops.unstack(x, num=parts, axis=2)


def attend(layer, query, key, value, mask, training):
    """softmax(Q K^T / sqrt(D)) V with `layer`'s implementation and
    probability dropout; query (B, T, N, D), key and value (B, S, N, D),
    `mask` an `AttentionMask`. Returns (B, T, H)."""
    rate = layer.attention_dropout if training else 0.0
    implementation = select_implementation(layer.attention_implementation, mask, query.dtype, rate)
    dropout = AttentionDropout(
        rate, lambda probs: sublayer_call(layer.probs_dropout, probs, training=training)
    )
    scale = 1.0 / math.sqrt(layer.head_dim)
    context = implementation.attend(query, key, value, mask, scale, dropout)  # (B, T, N, D)
    batch, length = ops.shape(query)[0], ops.shape(query)[1]
    return ops.reshape(context, (batch, length, layer.hidden_dim))  # (B, T, H)


def cached_self_attention(layer, inputs, key_cache, value_cache, index, key_mask):
    """A `MultiHeadSelfAttention` call on the newest tokens: their keys and
    values are written into the caches at positions [index, index + T) and
    the queries attend to the cached keys `key_mask` (B, S) marks as seen
    (on torch with a tensor `index`, the caches are written in place:
    `kbert.backend.decoding.cache_write`). Returns (output (B, T, H),
    key_cache, value_cache)."""
    qkv = sublayer_call(layer.qkv, inputs)  # (B, T, 3H)
    query, key, value = _heads(qkv, 3, layer.num_heads, layer.head_dim)  # (B, T, N, D) each
    key_cache = cache_write(key_cache, index, ops.cast(key, key_cache.dtype))
    value_cache = cache_write(value_cache, index, ops.cast(value, value_cache.dtype))
    mask = AttentionMask(padding=key_mask)
    context = attend(layer, query, key_cache, value_cache, mask, training=False)
    return sublayer_call(layer.output_dense, context), key_cache, value_cache


@keras.saving.register_keras_serializable(package="kbert")
class MultiHeadCrossAttention(ArgumentsConfig, keras.layers.Layer):
    """Multi-head attention from one sequence (queries) to another (keys and
    values, fused into one projection), e.g. a decoder to its encoder.

    Args:
        num_heads: int. number of heads N.
        hidden_dim: int. model width H, divisible by `num_heads`.
        attention_dropout: float. dropout on attention probabilities.
        initializer_range: float. stddev of the truncated-normal init.
        attention_implementation: str. a name in
            `kbert.layers.attention.ATTENTION_IMPLEMENTATIONS`, or "auto".

    Example:
    >>> layer = MultiHeadCrossAttention(num_heads=2, hidden_dim=8)
    >>> x, context = keras.ops.ones((2, 3, 8)), keras.ops.ones((2, 5, 8))
    >>> tuple(layer(x, context, keras.ops.ones((2, 5), "int32")).shape)
    (2, 3, 8)
    """

    def __init__(
        self,
        num_heads,
        hidden_dim,
        attention_dropout=0.1,
        initializer_range=0.02,
        attention_implementation="auto",
        **kwargs,
    ):
        super().__init__(**kwargs)
        if hidden_dim % num_heads:
            raise ValueError(f"hidden_dim={hidden_dim} is not divisible by num_heads={num_heads}")
        check_implementation_name(attention_implementation)
        self.store_arguments(locals())
        self.head_dim = hidden_dim // num_heads
        init = truncated_normal(initializer_range)
        policy = self.dtype_policy
        self.query = Dense(hidden_dim, kernel_initializer=init, dtype=policy, name="query")
        self.key_value = Dense(
            2 * hidden_dim, kernel_initializer=init, dtype=policy, name="key_value"
        )
        self.output_dense = Dense(hidden_dim, kernel_initializer=init, dtype=policy, name="output")
        self.probs_dropout = Dropout(attention_dropout, dtype=policy, name="probs_dropout")

    def build(self, inputs_shape, context_shape=None, context_padding_mask_shape=None):
        self.query.build(inputs_shape)
        self.key_value.build(context_shape or inputs_shape)
        self.output_dense.build(tuple(inputs_shape[:-1]) + (self.hidden_dim,))
        self.built = True

    def key_values(self, context):
        """The keys and values of `context` (B, S, H), (B, S, N, D) each."""
        kv = sublayer_call(self.key_value, context)  # (B, S, 2H)
        key, value = _heads(kv, 2, self.num_heads, self.head_dim)
        return key, value

    def attend_to(self, inputs, key, value, context_padding_mask, training=None):
        """Attention of `inputs` (B, T, H) to precomputed keys and values."""
        query = sublayer_call(self.query, inputs, training=training)  # (B, T, H)
        (query,) = _heads(query, 1, self.num_heads, self.head_dim)  # (B, T, N, D)
        context = attend(
            self, query, key, value, AttentionMask(padding=context_padding_mask), training
        )
        return sublayer_call(self.output_dense, context, training=training)

    def call(self, inputs, context, context_padding_mask, training=None):
        key, value = self.key_values(context)
        return self.attend_to(inputs, key, value, context_padding_mask, training)

    def compute_output_shape(self, inputs_shape, *args, **kwargs):
        return tuple(inputs_shape)


@keras.saving.register_keras_serializable(package="kbert")
class TransformerDecoderBlock(TransformerEncoderBlock):
    """x -> LN(x + SelfAttn(x)) -> LN(. + CrossAttn(., encoder)) -> LN(. + FFN(.)).

    With `encoder_output`, the self-attention is causal: `attention_mask`
    is the decoder's padding mask (B, T) (or an `AttentionMask`, made
    causal). Without `encoder_output` the block skips the
    cross-attention and is the encoder block: a model whose encoder and
    decoder share their weights (BERTShare) calls the same blocks for both.

    Args: those of `kbert.layers.TransformerEncoderBlock`.

    Example:
    >>> block = TransformerDecoderBlock(2, 8, 16)
    >>> x, encoded = keras.ops.ones((1, 3, 8)), keras.ops.ones((1, 5, 8))
    >>> y = block(x, keras.ops.ones((1, 3)), encoder_output=encoded,
    ...           encoder_padding_mask=keras.ops.ones((1, 5)))
    >>> tuple(y.shape)
    (1, 3, 8)
    """

    def __init__(self, num_heads, hidden_dim, intermediate_dim, **kwargs):
        super().__init__(num_heads, hidden_dim, intermediate_dim, **kwargs)
        policy = self.dtype_policy
        self.cross_attention = MultiHeadCrossAttention(
            num_heads,
            hidden_dim,
            attention_dropout=self.attention_dropout,
            initializer_range=self.initializer_range,
            attention_implementation=self.attention_implementation,
            dtype=policy,
            name="cross_attention",
        )
        self.cross_attention_dropout = Dropout(
            self.dropout, dtype=policy, name="cross_attention_output_dropout"
        )
        self.cross_attention_layer_norm = LayerNorm(
            epsilon=self.layer_norm_epsilon, dtype=policy, name="cross_attention_layer_norm"
        )

    def build(self, inputs_shape, attention_mask_shape=None, **kwargs):
        super().build(inputs_shape)
        self.cross_attention.build(inputs_shape, inputs_shape)
        self.cross_attention_layer_norm.build(inputs_shape)
        self.built = True

    def call(
        self,
        inputs,
        attention_mask,
        encoder_output=None,
        encoder_padding_mask=None,
        training=None,
    ):
        if encoder_output is None:
            return super().call(inputs, attention_mask, training=training)
        mask = AttentionMask.of(attention_mask)
        if not mask.causal:  # a decoder's tokens never see later ones
            mask = AttentionMask(padding=mask.padding, segments=mask.segments, causal=True)
        attended = sublayer_call(
            self.self_attention, inputs, attention_mask=mask, training=training
        )
        x = self._attention_residual(inputs, attended, training)
        key, value = self.cross_attention.key_values(encoder_output)
        return self._cross_and_feed_forward(x, (key, value, encoder_padding_mask), training)

    def _attention_residual(self, inputs, attended, training):
        attended = sublayer_call(self.attention_dropout_layer, attended, training=training)
        if self.attention_adapter is not None:
            attended = self.attention_adapter(attended)
        return sublayer_call(self.attention_layer_norm, inputs + attended)

    def _cross_and_feed_forward(self, x, cross, training):
        key, value, encoder_padding_mask = cross
        attended = self.cross_attention.attend_to(x, key, value, encoder_padding_mask, training)
        attended = sublayer_call(self.cross_attention_dropout, attended, training=training)
        x = sublayer_call(self.cross_attention_layer_norm, x + attended)
        return self._feed_forward(x, training)

    def cross_key_values(self, encoder_output):
        """The cross-attention keys and values of `encoder_output`, computed
        once per generated sequence: (B, S, N, D) each."""
        return self.cross_attention.key_values(encoder_output)


def block_call_cached(block, inputs, key_cache, value_cache, index, key_mask, cross=None):
    """A block (`TransformerEncoderBlock` or `TransformerDecoderBlock`) on
    the newest tokens `inputs` (B, T, H) at positions [index, index + T):
    self-attention over the caches (see `cached_self_attention`), then,
    for a decoder block given `cross` = (key, value, encoder_padding_mask),
    cross-attention (`cross` may hold one row per group of consecutive
    rows of `inputs`, e.g. a source's beams), then the feed-forward part.
    Inference only. Returns
    (output, key_cache, value_cache)."""
    attended, key_cache, value_cache = cached_self_attention(
        block.self_attention, inputs, key_cache, value_cache, index, key_mask
    )
    attended = sublayer_call(block.attention_dropout_layer, attended, training=False)
    if block.attention_adapter is not None:
        attended = block.attention_adapter(attended)
    x = sublayer_call(block.attention_layer_norm, inputs + attended)
    if cross is None:
        return block._feed_forward(x, False), key_cache, value_cache
    rows, sources = ops.shape(x)[0], ops.shape(cross[0])[0]
    if rows != sources:  # beams: a source's rows are one row of queries to its keys
        shape = ops.shape(x)
        x = ops.reshape(x, (sources, (rows // sources) * shape[1], shape[2]))
        x = block._cross_and_feed_forward(x, cross, False)
        return ops.reshape(x, shape), key_cache, value_cache
    return block._cross_and_feed_forward(x, cross, False), key_cache, value_cache


register_block("bert_decoder", TransformerDecoderBlock)
