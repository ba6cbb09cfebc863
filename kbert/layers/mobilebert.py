"""MobileBERT's parts (Sun et al., 2020): NoNorm, the 3-token-window
embeddings, the bottleneck block (registered as "mobilebert"), the
first-token pooler and the masked-LM head whose decoder is the embedding
table extended by a dense matrix.

Shapes: B batch, T tokens, H hidden (between blocks), A the block's inner
width (the bottleneck; H without one), I feed-forward width, E embedding
table width, V vocabulary, P predictions per sequence.

Every layer follows transformers' `MobileBertModel` to the operation, so its
checkpoints load exactly (`kbert.convert.mobilebert`). Attention is the
shared layer (`kbert.layers.attention`): its implementations and mask
descriptions apply unchanged.
"""

import math

import keras
from keras import ops

from kbert.backend.ops import gather_positions, sublayer_call, token_packing
from kbert.layers.activations import canonical_activation, get_activation
from kbert.layers.attention import MultiHeadSelfAttention, check_implementation_name
from kbert.layers.config import ArgumentsConfig
from kbert.layers.dense import Dense
from kbert.layers.dropout import Dropout
from kbert.layers.embeddings import TokenEmbedding
from kbert.layers.encoder import register_block
from kbert.layers.initializers import truncated_normal
from kbert.layers.layer_norm import LayerNorm
from kbert.layers.masks import AttentionMask
from kbert.utils import checks

NORMALIZATIONS = ("no_norm", "layer_norm")
# transformers builds these two LayerNorms without its config's epsilon
# (torch's default): the embeddings' and each block's output norm.
DEFAULT_EPSILON = 1e-5


def check_normalization(normalization):
    """Raises a ValueError naming the choices unless `normalization` is one."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(
            f"normalization must be one of {list(NORMALIZATIONS)}, got {normalization!r}"
        )


@keras.saving.register_keras_serializable(package="kbert")
class NoNorm(keras.layers.Layer):
    """x * gamma + beta, elementwise over the last axis: MobileBERT's
    replacement for LayerNorm (no statistics computed).

    Example:
    >>> tuple(NoNorm()(keras.ops.ones((2, 3, 8))).shape)
    (2, 3, 8)
    """

    def build(self, inputs_shape):
        width = inputs_shape[-1]
        self.gamma = self.add_weight(name="gamma", shape=(width,), initializer="ones")
        self.beta = self.add_weight(name="beta", shape=(width,), initializer="zeros")
        self.built = True

    def call(self, inputs):
        gamma = ops.cast(self.gamma, self.compute_dtype)
        return inputs * gamma + ops.cast(self.beta, self.compute_dtype)


def normalization_layer(normalization, epsilon, dtype, name):
    """NoNorm ("no_norm") or LayerNorm ("layer_norm", with `epsilon`)."""
    if normalization == "no_norm":
        return NoNorm(dtype=dtype, name=name)
    return LayerNorm(epsilon=epsilon, dtype=dtype, name=name)


@keras.saving.register_keras_serializable(package="kbert")
class MobileBertEmbeddings(ArgumentsConfig, keras.layers.Layer):
    """Token embeddings of width E, each concatenated with its neighbours'
    (next, itself, previous: a 3-token window, zeros past the ends) and
    projected to H; plus learned positions and segments of width H; then
    NoNorm or LayerNorm, and dropout.

    Args:
        vocabulary_size: int. number of token ids V.
        hidden_dim: int. output width H.
        embedding_dim: int or None. token table width E; None: H.
        max_sequence_length: int. number of learned positions.
        type_vocab_size: int. number of segment ids.
        dropout: float. dropout after the normalization.
        trigram_input: bool. the 3-token window; False: each token alone
            (projected only when E differs from H).
        normalization: str. "no_norm" or "layer_norm".
        initializer_range: float. stddev of the truncated-normal init.

    Rows holding several examples (`position_ids` given, each example
    counting from 0) keep each window inside its example: an example's
    last token sees zeros next, as in a padded row whose padding token has
    a zero embedding (transformers keeps it at zero: `padding_idx`).

    Example:
    >>> layer = MobileBertEmbeddings(100, 16, embedding_dim=8, max_sequence_length=16)
    >>> ids = keras.ops.ones((2, 5), "int32")
    >>> tuple(layer(ids, keras.ops.zeros((2, 5), "int32")).shape)
    (2, 5, 16)
    """

    def __init__(
        self,
        vocabulary_size,
        hidden_dim,
        embedding_dim=None,
        max_sequence_length=512,
        type_vocab_size=2,
        dropout=0.0,
        trigram_input=True,
        normalization="no_norm",
        initializer_range=0.02,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_normalization(normalization)
        self.store_arguments(locals())
        init = truncated_normal(initializer_range)
        policy = self.dtype_policy
        self.token_embedding = TokenEmbedding(
            vocabulary_size,
            self.table_dim,
            embeddings_initializer=init,
            dtype=policy,
            name="token_embedding",
        )
        self.segment_embedding = keras.layers.Embedding(
            type_vocab_size,
            hidden_dim,
            embeddings_initializer=init,
            dtype=policy,
            name="segment_embedding",
        )
        self.projection = None
        if trigram_input or self.table_dim != hidden_dim:
            self.projection = Dense(
                hidden_dim, kernel_initializer=init, dtype=policy, name="projection"
            )
        self.layer_norm = normalization_layer(normalization, DEFAULT_EPSILON, policy, "layer_norm")
        self.dropout_layer = Dropout(dropout, dtype=policy, name="dropout")

    @property
    def table_dim(self):
        """Width E of the token table (H when `embedding_dim` is None)."""
        return self.hidden_dim if self.embedding_dim is None else self.embedding_dim

    def build(self, token_ids_shape, segment_ids_shape=None):
        self.token_embedding.build(token_ids_shape)
        self.segment_embedding.build(token_ids_shape)
        # `<name>_initializer`: where `kbert.layers.initializers` finds it
        self.position_embeddings_initializer = truncated_normal(self.initializer_range)
        self.position_embeddings = self.add_weight(
            name="position_embeddings",
            shape=(self.max_sequence_length, self.hidden_dim),
            initializer=self.position_embeddings_initializer,
        )
        window = 3 * self.table_dim if self.trigram_input else self.table_dim
        if self.projection is not None:
            self.projection.build(tuple(token_ids_shape) + (window,))
        self.layer_norm.build(tuple(token_ids_shape) + (self.hidden_dim,))
        self.built = True

    def call(self, token_ids, segment_ids, training=None, position_ids=None):
        if position_ids is None:
            length = ops.shape(token_ids)[1]
            checks.check_sequence_length(length, self.max_sequence_length)
            if not training and checks.is_concrete(token_ids):
                checks.check_token_ids(token_ids, self.vocabulary_size)
                checks.check_token_ids(segment_ids, self.type_vocab_size, "segment_ids")
        x = self.token_embedding(token_ids)  # (B, T, E)
        if self.trigram_input:
            following = ops.pad(x[:, 1:], ((0, 0), (0, 1), (0, 0)))
            preceding = ops.pad(x[:, :-1], ((0, 0), (1, 0), (0, 0)))
            if position_ids is not None:
                # an example's first token (position 0) starts a new window
                starts = ops.cast(ops.equal(position_ids, 0), x.dtype)  # (B, T)
                next_starts = ops.pad(starts[:, 1:], ((0, 0), (0, 1)))
                following = following * (1 - next_starts)[..., None]
                preceding = preceding * (1 - starts)[..., None]
            x = ops.concatenate([following, x, preceding], axis=-1)  # (B, T, 3E)
        if self.projection is not None:
            x = self.projection(x)  # (B, T, H)
        table = ops.cast(self.position_embeddings, self.compute_dtype)
        if position_ids is None:
            positions = table[None, : ops.shape(token_ids)[1]]  # (1, T, H)
        else:
            positions = ops.take(table, ops.cast(position_ids, "int32"), axis=0)  # (B, T, H)
        segments = self.segment_embedding(segment_ids)  # (B, T, H)
        x = self.layer_norm(x + positions + segments)
        return self.dropout_layer(x, training=training)

    def compute_output_shape(self, token_ids_shape, segment_ids_shape=None):
        return tuple(token_ids_shape) + (self.hidden_dim,)


@keras.saving.register_keras_serializable(package="kbert")
class SharedBottleneckAttention(MultiHeadSelfAttention):
    """Self-attention whose queries and keys come from one input and values
    from another (MobileBERT's shared query/key bottleneck): the projections
    `query_key` (fused) and `value`, then the attention of
    `MultiHeadSelfAttention` (same implementations, dropout and output
    projection).

    Args:
        num_heads: int. heads N.
        hidden_dim: int. attention width A, divisible by `num_heads`.
        attention_dropout: float. dropout on attention probabilities.
        initializer_range: float. stddev of the truncated-normal init.
        attention_implementation: str. see `kbert.layers.attention`.

    Called as `layer(query_key_input, value_input, attention_mask=...)`.

    Example:
    >>> layer = SharedBottleneckAttention(num_heads=2, hidden_dim=8)
    >>> q, v = keras.ops.ones((2, 5, 8)), keras.ops.ones((2, 5, 16))
    >>> tuple(layer(q, v, attention_mask=keras.ops.ones((2, 5), "int32")).shape)
    (2, 5, 8)
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
        # The parent's constructor would add its one-input `qkv`; this layer
        # has two projections instead, and takes the rest of the parent as is.
        keras.layers.Layer.__init__(self, **kwargs)
        if hidden_dim % num_heads:
            raise ValueError(f"hidden_dim={hidden_dim} is not divisible by num_heads={num_heads}")
        check_implementation_name(attention_implementation)
        self.store_arguments(locals())
        self.head_dim = hidden_dim // num_heads
        init = truncated_normal(initializer_range)
        policy = self.dtype_policy
        self.query_key = Dense(
            2 * hidden_dim, kernel_initializer=init, dtype=policy, name="query_key"
        )
        self.value = Dense(hidden_dim, kernel_initializer=init, dtype=policy, name="value")
        self.output_dense = Dense(hidden_dim, kernel_initializer=init, dtype=policy, name="output")
        self.probs_dropout = Dropout(attention_dropout, dtype=policy, name="probs_dropout")

    def build(self, query_key_input_shape, value_input_shape=None, attention_mask_shape=None):
        self.query_key.build(query_key_input_shape)
        self.value.build(value_input_shape or query_key_input_shape)
        self.output_dense.build(tuple(query_key_input_shape[:-1]) + (self.hidden_dim,))
        self.built = True

    def call(self, query_key_input, value_input, attention_mask=None, training=None):
        mask = AttentionMask.of(attention_mask)
        query_key = sublayer_call(self.query_key, query_key_input, training=training)  # (B, T, 2A)
        value = sublayer_call(self.value, value_input, training=training)  # (B, T, A)
        qkv = ops.concatenate([query_key, value], axis=-1)  # (B, T, 3A)
        context = self._attend(qkv, mask, training)
        return sublayer_call(self.output_dense, context, training=training)

    def compute_output_shape(
        self, query_key_input_shape, value_input_shape=None, attention_mask_shape=None
    ):
        return tuple(query_key_input_shape[:-1]) + (self.hidden_dim,)


@keras.saving.register_keras_serializable(package="kbert")
class MobileBertBlock(ArgumentsConfig, keras.layers.Layer):
    """MobileBERT's block: H -> bottleneck A -> attention -> stacked
    feed-forward networks at A -> back to H, each sub-layer closed by a
    residual add and NoNorm (or LayerNorm).

    x (B, T, H) -> inner = norm(Dense_A(x)); attention on queries/keys from
    a second bottleneck of x (`key_query_shared_bottleneck`), from `inner`
    (`use_bottleneck_attention`) or from x, values from `inner` or x;
    a = norm(Attn + inner); `num_feedforward_networks` times
    a = norm(a + FFN(a)) (the last one's names are BERT's
    `intermediate_dense` / `output_dense`); out = norm(x + Dense_H(a)).
    Without `use_bottleneck` it is a post-norm BERT block with stacked FFNs.

    Args:
        num_heads: int. attention heads.
        hidden_dim: int. width H between blocks.
        intermediate_dim: int. feed-forward width I.
        dropout: float. hidden dropout (transformers' places).
        attention_dropout: float. dropout on attention probabilities.
        activation: str. feed-forward activation ("relu" in MobileBERT).
        layer_norm_epsilon: float. LayerNorm epsilon.
        initializer_range: float. stddev of the truncated-normal init.
        adapter_size: None. adapters are not offered in this block.
        attention_implementation: str. see `kbert.layers.attention`.
        bottleneck_dim: int. the inner width A (transformers'
            `intra_bottleneck_size`).
        use_bottleneck: bool. False: the block works at H throughout.
        use_bottleneck_attention: bool. queries, keys and values from the
            block's bottleneck.
        key_query_shared_bottleneck: bool. queries and keys from a second,
            shared bottleneck; values from the block's input.
        num_feedforward_networks: int. feed-forward networks per block.
        normalization: str. "no_norm" (x * gamma + beta) or "layer_norm".

    Example:
    >>> block = MobileBertBlock(2, 16, 32, bottleneck_dim=8)
    >>> tuple(block(keras.ops.ones((1, 3, 16)), keras.ops.ones((1, 3))).shape)
    (1, 3, 16)
    """

    def __init__(
        self,
        num_heads,
        hidden_dim,
        intermediate_dim,
        dropout=0.0,
        attention_dropout=0.1,
        activation="relu",
        layer_norm_epsilon=1e-12,
        initializer_range=0.02,
        adapter_size=None,
        attention_implementation="auto",
        bottleneck_dim=128,
        use_bottleneck=True,
        use_bottleneck_attention=False,
        key_query_shared_bottleneck=True,
        num_feedforward_networks=4,
        normalization="no_norm",
        **kwargs,
    ):
        super().__init__(**kwargs)
        if adapter_size:
            raise ValueError(
                "MobileBertBlock has no adapters (adapter_size must be None); its "
                "bottleneck already narrows each block"
            )
        check_normalization(normalization)
        if not isinstance(num_feedforward_networks, int) or num_feedforward_networks < 1:
            raise ValueError(
                f"num_feedforward_networks must be a positive int, got {num_feedforward_networks!r}"
            )
        activation = canonical_activation(activation)
        self.store_arguments(locals())
        inner = self.inner_dim
        if inner % num_heads:
            raise ValueError(
                f"the attention width {inner} (bottleneck_dim, or hidden_dim without a "
                f"bottleneck) is not divisible by num_heads={num_heads}"
            )
        init = truncated_normal(initializer_range)
        policy = self.dtype_policy

        def dense(units, name, act=None):
            return Dense(units, activation=act, kernel_initializer=init, dtype=policy, name=name)

        def norm(name, epsilon=layer_norm_epsilon):
            return normalization_layer(normalization, epsilon, policy, name)

        self.input_bottleneck = self.attention_bottleneck = None
        if use_bottleneck:
            self.input_bottleneck = dense(inner, "input_bottleneck")
            self.input_bottleneck_norm = norm("input_bottleneck_norm")
            if self.shared_query_key:
                self.attention_bottleneck = dense(inner, "attention_bottleneck")
                self.attention_bottleneck_norm = norm("attention_bottleneck_norm")
        attention_cls = (
            SharedBottleneckAttention if self.shared_query_key else MultiHeadSelfAttention
        )
        self.self_attention = attention_cls(
            num_heads,
            inner,
            attention_dropout=attention_dropout,
            initializer_range=initializer_range,
            attention_implementation=attention_implementation,
            dtype=policy,
            name="self_attention",
        )
        self.attention_norm = norm("attention_norm")
        # the stacked feed-forward networks before the last (Keras tracks
        # lists of layers, not tuples)
        stacked = range(num_feedforward_networks - 1)
        self.ffn_intermediate = [
            dense(intermediate_dim, f"ffn_{i}_intermediate", self._act()) for i in stacked
        ]
        self.ffn_output = [dense(inner, f"ffn_{i}_output") for i in stacked]
        self.ffn_norm = [norm(f"ffn_{i}_norm") for i in stacked]
        self.intermediate_dense = dense(intermediate_dim, "intermediate_dense", self._act())
        self.output_dense = dense(inner, "output_dense")
        self.output_norm = norm("output_norm", DEFAULT_EPSILON)
        if use_bottleneck:
            self.output_bottleneck = dense(hidden_dim, "output_bottleneck")
            self.output_bottleneck_norm = norm("output_bottleneck_norm")
        self.dropout_layer = Dropout(dropout, dtype=policy, name="dropout")

    def _stacked_ffns(self):
        return zip(self.ffn_intermediate, self.ffn_output, self.ffn_norm)

    def _act(self):
        return get_activation(self.activation)

    @property
    def inner_dim(self):
        """The width A the block attends and feeds forward at."""
        return self.bottleneck_dim if self.use_bottleneck else self.hidden_dim

    @property
    def shared_query_key(self):
        """Whether queries and keys come from their own shared bottleneck."""
        return (
            self.use_bottleneck
            and self.key_query_shared_bottleneck
            and not self.use_bottleneck_attention
        )

    def build(self, inputs_shape, attention_mask_shape=None):
        inputs_shape = tuple(inputs_shape)
        inner_shape = inputs_shape[:-1] + (self.inner_dim,)
        if self.use_bottleneck:
            for layer in (self.input_bottleneck, self.attention_bottleneck):
                if layer is not None:
                    layer.build(inputs_shape)
            self.input_bottleneck_norm.build(inner_shape)
            if self.attention_bottleneck is not None:
                self.attention_bottleneck_norm.build(inner_shape)
        if self.shared_query_key:
            self.self_attention.build(inner_shape, inputs_shape)
        else:
            attended = inner_shape if self.use_bottleneck_attention else inputs_shape
            self.self_attention.build(attended)
        self.attention_norm.build(inner_shape)
        wide = inputs_shape[:-1] + (self.intermediate_dim,)
        for intermediate, output, norm in self._stacked_ffns():
            intermediate.build(inner_shape)
            output.build(wide)
            norm.build(inner_shape)
        self.intermediate_dense.build(inner_shape)
        self.output_dense.build(wide)
        self.output_norm.build(inner_shape)
        if self.use_bottleneck:
            self.output_bottleneck.build(inner_shape)
            self.output_bottleneck_norm.build(inputs_shape)
        self.built = True

    def call(self, inputs, attention_mask, training=None):
        mask = AttentionMask.of(attention_mask)
        packing = token_packing(inputs, mask.padding) if mask.kind == "padding" else None
        if packing is None:
            return self._block(inputs, mask, training)
        # The real tokens only, as (n, H) rows (see `kbert.backend.ops`):
        # every bottleneck and feed-forward network runs on them; attention
        # on the padded batch. Padding positions keep their inputs.
        tokens = packing.gather(inputs)
        return packing.scatter(self._block(tokens, mask, training, packing), base=inputs)

    def _attend(self, sources, mask, training, packing):
        """Self-attention on `sources` (rows of the padded batch, or real
        tokens brought back to it), its output in the same rows."""
        if packing is not None:
            sources = [packing.scatter(s) for s in sources]
        # the description as a keyword: Keras takes only tensors positionally
        out = sublayer_call(self.self_attention, *sources, attention_mask=mask, training=training)
        return out if packing is None else packing.gather(out)

    def _block(self, x, mask, training, packing=None):
        """The block on rows x: (B, T, H), or (n, H) real tokens with
        `packing`."""
        run = sublayer_call  # layer(...), minus Keras' per-call overhead on torch
        if self.use_bottleneck:
            inner = run(
                self.input_bottleneck_norm, run(self.input_bottleneck, x, training=training)
            )
        else:
            inner = x
        if self.shared_query_key:
            shared = run(
                self.attention_bottleneck_norm, run(self.attention_bottleneck, x, training=training)
            )  # (..., A)
            attended = self._attend([shared, x], mask, training, packing)
        else:
            source = inner if self.use_bottleneck_attention else x
            attended = self._attend([source], mask, training, packing)
        if not self.use_bottleneck:
            attended = run(self.dropout_layer, attended, training=training)
        a = run(self.attention_norm, attended + inner)  # (..., A)
        for intermediate, output, norm in self._stacked_ffns():
            y = run(output, run(intermediate, a, training=training), training=training)
            a = run(norm, y + a)
        y = run(self.intermediate_dense, a, training=training)  # (..., I)
        y = run(self.output_dense, y, training=training)  # (..., A)
        if not self.use_bottleneck:
            y = run(self.dropout_layer, y, training=training)
            return run(self.output_norm, y + a)
        a = run(self.output_norm, y + a)
        y = run(self.output_bottleneck, a, training=training)  # (..., H)
        y = run(self.dropout_layer, y, training=training)
        return run(self.output_bottleneck_norm, y + x)

    def attention_scores(self, inputs, training=None):
        """The block's pre-softmax attention scores Q K^T / sqrt(D) on its
        input (B, T, H), from its own bottlenecks and projections:
        (B, N, T, S) float32, no mask added (for attention transfer)."""
        kw = {} if training is None else {"training": training}
        attention = self.self_attention
        if self.shared_query_key:
            source = self.attention_bottleneck_norm(self.attention_bottleneck(inputs, **kw))
            projected = attention.query_key(source, **kw)  # (B, T, 2A)
        else:
            source = inputs
            if self.use_bottleneck_attention:
                source = self.input_bottleneck_norm(self.input_bottleneck(inputs, **kw))
            projected = attention.qkv(source, **kw)[..., : 2 * attention.hidden_dim]  # (B, T, 2A)
        batch, length = ops.shape(inputs)[0], ops.shape(inputs)[1]
        heads, size = attention.num_heads, attention.head_dim
        query, key = ops.unstack(
            ops.reshape(projected, (batch, length, 2, heads, size)), num=2, axis=2
        )  # (B, T, N, D) each
        scores = ops.einsum("btnd,bsnd->bnts", query, key)  # (B, N, T, S)
        return ops.cast(scores, "float32") * (1.0 / math.sqrt(size))

    def compute_output_shape(self, inputs_shape, attention_mask_shape=None):
        return tuple(inputs_shape)


register_block("mobilebert", MobileBertBlock)


@keras.saving.register_keras_serializable(package="kbert")
class FirstTokenPooler(ArgumentsConfig, keras.layers.Layer):
    """The first token's hidden state as the pooled output, unchanged
    (MobileBERT without `classifier_activation`).

    Args:
        hidden_dim: int. width H.

    Example:
    >>> tuple(FirstTokenPooler(8)(keras.ops.ones((2, 5, 8))).shape)
    (2, 8)
    """

    def __init__(self, hidden_dim, **kwargs):
        super().__init__(**kwargs)
        self.store_arguments(locals())

    def call(self, sequence_output):
        return sequence_output[:, 0, :]  # (B, H)

    def compute_output_shape(self, sequence_shape):
        return (sequence_shape[0], self.hidden_dim)


@keras.saving.register_keras_serializable(package="kbert")
class MobileBertMaskedLMHead(ArgumentsConfig, keras.layers.Layer):
    """MobileBERT's masked-LM head: Dense H -> H, activation, LayerNorm,
    then a decoder of width H made of the token table (E of the H
    columns, tied) and `extra_decoder_kernel` (the other H - E), plus a
    per-token bias. Takes `MaskedLMHead`'s arguments.

    Args:
        vocabulary_size: int. V.
        hidden_dim: int. H.
        activation: str. transform activation.
        layer_norm_epsilon: float. LayerNorm epsilon.
        initializer_range: float. stddev of the truncated-normal init.
        token_embedding: `kbert.layers.TokenEmbedding`. the (V, E) table
            the decoder's first E columns are tied to (not serialized: the
            task model passes it again when rebuilt).
        embedding_dim: int or None. E; None: H (no extra matrix).

    Example:
    >>> table = TokenEmbedding(20, 4)
    >>> table.build((None,))
    >>> head = MobileBertMaskedLMHead(20, 8, token_embedding=table, embedding_dim=4)
    >>> tuple(head(keras.ops.ones((2, 5, 8)), keras.ops.zeros((2, 3), "int32")).shape)
    (2, 3, 20)
    """

    config_excluded = ("token_embedding",)

    def __init__(
        self,
        vocabulary_size,
        hidden_dim,
        activation="relu",
        layer_norm_epsilon=1e-12,
        initializer_range=0.02,
        token_embedding=None,
        embedding_dim=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        activation = canonical_activation(activation)
        self.store_arguments(locals())
        width = self.table_dim
        if token_embedding is None:
            raise ValueError(
                "MobileBertMaskedLMHead ties its decoder to the token table: pass "
                "token_embedding (the backbone's `token_embedding`)"
            )
        if token_embedding.input_dim != vocabulary_size or token_embedding.output_dim != width:
            raise ValueError(
                f"token_embedding shape ({token_embedding.input_dim}, "
                f"{token_embedding.output_dim}) does not match vocabulary_size="
                f"{vocabulary_size}, embedding_dim={width}"
            )
        if width > hidden_dim:
            raise ValueError(f"embedding_dim={width} is wider than hidden_dim={hidden_dim}")
        self.transform = Dense(
            hidden_dim,
            activation=get_activation(self.activation),
            kernel_initializer=truncated_normal(initializer_range),
            dtype=self.dtype_policy,
            name="transform",
        )
        self.layer_norm = LayerNorm(
            epsilon=layer_norm_epsilon, dtype=self.dtype_policy, name="layer_norm"
        )

    @property
    def table_dim(self):
        """Width E of the tied table (H when `embedding_dim` is None)."""
        return self.hidden_dim if self.embedding_dim is None else self.embedding_dim

    def build(self, sequence_output_shape, mask_positions_shape=None):
        self.transform.build((None, None, self.hidden_dim))
        self.layer_norm.build((None, None, self.hidden_dim))
        self.extra_decoder_kernel = None
        if self.hidden_dim > self.table_dim:
            self.extra_decoder_kernel_initializer = truncated_normal(self.initializer_range)
            self.extra_decoder_kernel = self.add_weight(
                name="extra_decoder_kernel",
                shape=(self.hidden_dim - self.table_dim, self.vocabulary_size),
                initializer=self.extra_decoder_kernel_initializer,
            )
        self.output_bias = self.add_weight(
            name="output_bias", shape=(self.vocabulary_size,), initializer="zeros"
        )
        self.built = True

    def call(self, sequence_output, mask_positions):
        x = gather_positions(sequence_output, mask_positions)  # (B, P, H)
        x = self.layer_norm(self.transform(x))  # (B, P, H)
        e = self.table_dim
        # x @ [table^T; extra] as two products: no (H, V) concatenation per call
        logits = self.token_embedding(x[..., :e], reverse=True)  # (B, P, V)
        if self.extra_decoder_kernel is not None:
            extra = ops.cast(self.extra_decoder_kernel, self.compute_dtype)
            logits = logits + ops.matmul(x[..., e:], extra)
        logits = ops.cast(logits, "float32")
        return logits + ops.cast(self.output_bias, "float32")

    def compute_output_shape(self, sequence_output_shape, mask_positions_shape=None):
        return (sequence_output_shape[0], mask_positions_shape[1], self.vocabulary_size)

    def compute_output_spec(self, sequence_output, mask_positions):
        shape = (sequence_output.shape[0], mask_positions.shape[1], self.vocabulary_size)
        return keras.KerasTensor(shape, dtype="float32")
