"""Encoder blocks, registered by name: the post-LayerNorm Transformer block
of BERT is "bert".

Shapes: B batch, T tokens, H hidden, I intermediate (feed-forward) width.

A backbone builds its blocks from `BLOCKS[block_type]` (`BertBackbone`'s
`block_type` and `block_options`). A block class takes the backbone's
common arguments (num_heads, hidden_dim, intermediate_dim, dropout,
attention_dropout, activation, layer_norm_epsilon, initializer_range,
adapter_size, attention_implementation, plus Keras' dtype and name) and
the backbone's `block_options`, is called as `block(x, attention_mask,
training=...)` and keeps x's shape. A new kind of block (a bottleneck
block, a decoder block) is one class and one `register_block` call.
"""

import keras

from kbert.backend.ops import sublayer_call, token_packing
from kbert.layers.activations import canonical_activation, get_activation
from kbert.layers.adapters import BottleneckAdapter
from kbert.layers.attention import MultiHeadSelfAttention
from kbert.layers.config import ArgumentsConfig
from kbert.layers.dense import Dense
from kbert.layers.dropout import Dropout
from kbert.layers.initializers import truncated_normal
from kbert.layers.layer_norm import LayerNorm
from kbert.layers.masks import AttentionMask


@keras.saving.register_keras_serializable(package="kbert")
class TransformerEncoderBlock(ArgumentsConfig, keras.layers.Layer):
    """x -> LN(x + Attn(x)) -> LN(. + FFN(.)), dropout before each residual add.

    Args:
        num_heads: int. attention heads.
        hidden_dim: int. model width H.
        intermediate_dim: int. feed-forward width I.
        dropout: float. dropout on each sub-layer's output.
        attention_dropout: float. dropout on attention probabilities.
        activation: str. feed-forward activation ("gelu" is exact erf GELU,
            "gelu_tanh" the tanh approximation; see `kbert.layers.activations`).
        layer_norm_epsilon: float. LayerNorm epsilon.
        initializer_range: float. stddev of the truncated-normal init.
        adapter_size: int or None. width of the bottleneck adapters inserted
            after the attention and feed-forward outputs (Houlsby et al.).
        attention_implementation: str. see `kbert.layers.attention`.
        global_projections: bool. separate projections for global tokens
            (Longformer's; see `kbert.layers.attention.MultiHeadSelfAttention`).

    `attention_mask` is a (B, T) padding mask, or an `AttentionMask` or a
    dict of its parts given as a keyword argument.

    Example:
    >>> block = TransformerEncoderBlock(2, 8, 16)
    >>> tuple(block(keras.ops.ones((1, 3, 8)), keras.ops.ones((1, 3))).shape)
    (1, 3, 8)
    """

    config_omitted = {"attention_implementation": "auto", "global_projections": False}

    def __init__(
        self,
        num_heads,
        hidden_dim,
        intermediate_dim,
        dropout=0.1,
        attention_dropout=0.1,
        activation="gelu",
        layer_norm_epsilon=1e-12,
        initializer_range=0.02,
        adapter_size=None,
        attention_implementation="auto",
        global_projections=False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        activation = canonical_activation(activation)
        self.store_arguments(locals())
        init = truncated_normal(initializer_range)
        policy = self.dtype_policy
        self.self_attention = MultiHeadSelfAttention(
            num_heads,
            hidden_dim,
            attention_dropout=attention_dropout,
            initializer_range=initializer_range,
            attention_implementation=attention_implementation,
            global_projections=global_projections,
            dtype=policy,
            name="self_attention",
        )
        self.attention_dropout_layer = Dropout(
            dropout, dtype=policy, name="attention_output_dropout"
        )
        self.attention_layer_norm = LayerNorm(
            epsilon=layer_norm_epsilon, dtype=policy, name="attention_layer_norm"
        )
        self.intermediate_dense = Dense(
            intermediate_dim,
            activation=get_activation(self.activation),
            kernel_initializer=init,
            dtype=policy,
            name="intermediate_dense",
        )
        self.output_dense = Dense(
            hidden_dim, kernel_initializer=init, dtype=policy, name="output_dense"
        )
        self.output_dropout = Dropout(dropout, dtype=policy, name="output_dropout")
        self.output_layer_norm = LayerNorm(
            epsilon=layer_norm_epsilon, dtype=policy, name="output_layer_norm"
        )
        self.attention_adapter = self.output_adapter = None
        if adapter_size:
            self.attention_adapter = BottleneckAdapter(
                adapter_size,
                self.activation,
                initializer_range,
                dtype=policy,
                name="attention_adapter",
            )
            self.output_adapter = BottleneckAdapter(
                adapter_size,
                self.activation,
                initializer_range,
                dtype=policy,
                name="output_adapter",
            )

    def build(self, inputs_shape, attention_mask_shape=None):
        self.self_attention.build(inputs_shape)
        self.attention_layer_norm.build(inputs_shape)
        self.intermediate_dense.build(inputs_shape)
        self.output_dense.build(tuple(inputs_shape[:-1]) + (self.intermediate_dim,))
        self.output_layer_norm.build(inputs_shape)
        if self.adapter_size:
            self.attention_adapter.build(inputs_shape)
            self.output_adapter.build(inputs_shape)
        self.built = True

    def call(self, inputs, attention_mask, training=None):
        run = sublayer_call  # layer(...), minus Keras' per-call overhead on torch
        mask = AttentionMask.of(attention_mask)
        packing = token_packing(inputs, mask.padding) if mask.kind == "padding" else None
        if packing is None:
            # the description as a keyword: Keras takes only tensors positionally
            attended = run(self.self_attention, inputs, attention_mask=mask, training=training)
            return self._residual_layers(inputs, attended, training)
        # The real tokens only, as (n, H) rows: see `kbert.backend.ops`.
        # Padding positions keep their inputs: zeros there would reach a
        # head's LayerNorm as constant vectors, whose gradient overflows
        # float16 (1 / sqrt(epsilon)).
        tokens = packing.gather(inputs)
        attended = self.self_attention.call_packed(tokens, packing, training)
        return packing.scatter(self._residual_layers(tokens, attended, training), base=inputs)

    def _residual_layers(self, inputs, attended, training):
        """Everything after attention; acts on each token alone, so the
        rows may be a (B, T, H) batch or (n, H) real tokens."""
        run = sublayer_call
        attended = run(self.attention_dropout_layer, attended, training=training)
        if self.attention_adapter is not None:
            attended = self.attention_adapter(attended)
        x = run(self.attention_layer_norm, inputs + attended)
        return self._feed_forward(x, training)

    def _feed_forward(self, x, training):
        """LN(x + FFN(x)), the block's second half."""
        run = sublayer_call
        # `training` reaches the Dense layers for float8 quantization, whose
        # delayed scaling updates its scales only in training calls.
        y = run(self.intermediate_dense, x, training=training)
        y = run(self.output_dense, y, training=training)
        y = run(self.output_dropout, y, training=training)
        if self.output_adapter is not None:
            y = self.output_adapter(y)
        return run(self.output_layer_norm, x + y)

    def compute_output_shape(self, inputs_shape, attention_mask_shape=None):
        return tuple(inputs_shape)


BLOCKS = {}


def register_block(name, cls):
    """Makes `cls` the block of backbones built with `block_type=name`."""
    BLOCKS[name] = cls
    return cls


def block_class(name):
    """The block class registered as `name`; a ValueError naming the known
    ones otherwise."""
    if name not in BLOCKS:
        raise ValueError(f"unknown block_type {name!r}; registered: {sorted(BLOCKS)}")
    return BLOCKS[name]


register_block("bert", TransformerEncoderBlock)
