"""BERT input embeddings: token + segment + learned position, LayerNorm, dropout.

Shapes: B batch, T tokens, H hidden, E embedding width (ALBERT's factorized
embeddings; E = H otherwise), V vocabulary.
"""

import keras
from keras import ops

from kbert.backend import keras_internals
from kbert.backend.ops import fused_embedding_sum, reverse_table_padding
from kbert.layers.config import ArgumentsConfig
from kbert.layers.dense import Dense
from kbert.layers.dropout import Dropout
from kbert.layers.initializers import truncated_normal
from kbert.layers.layer_norm import LayerNorm
from kbert.utils import checks


@keras.saving.register_keras_serializable(package="kbert")
class TokenEmbedding(keras.layers.Embedding):
    """A token embedding that can also project hidden states back to logits.

    `call(ids)` looks ids up; `call(hidden, reverse=True)` multiplies by the
    transposed table, which is how the masked-LM decoder ties its weights to
    the input embedding as in the original BERT.

    Args:
        input_dim: int. vocabulary size V.
        output_dim: int. hidden size H.

    Example:
    >>> layer = TokenEmbedding(10, 4)
    >>> logits = layer(layer(keras.ops.ones((2, 3), "int32")), reverse=True)
    >>> tuple(logits.shape)
    (2, 3, 10)
    """

    # JAX: the reverse product runs on a table padded to a multiple of this
    # many rows (0 or 1: no padding).
    REVERSE_PAD = 64

    def call(self, inputs, reverse=False):
        if not reverse:
            return super().call(inputs)
        table = ops.cast(self.embeddings, self.compute_dtype)
        pad = reverse_table_padding(self.input_dim, self.REVERSE_PAD)
        if pad:
            # A product whose output rows are not a multiple of 8 elements
            # (V = 30522) leaves every operand of the forward and both
            # backward products misaligned for the GPU's tensor-core
            # kernels; zero rows pad V, the slice drops their columns. XLA
            # fuses the pad into the cast above and the slice into the
            # consumers, so no copy is added.
            table = ops.pad(table, ((0, pad), (0, 0)))
            return ops.matmul(inputs, ops.transpose(table))[..., : self.input_dim]
        return ops.matmul(inputs, ops.transpose(table))  # (B, ..., V)

    def compute_output_shape(self, input_shape, reverse=False):
        if reverse:
            return tuple(input_shape[:-1]) + (self.input_dim,)
        return super().compute_output_shape(input_shape)


@keras.saving.register_keras_serializable(package="kbert")
class BertEmbeddings(ArgumentsConfig, keras.layers.Layer):
    """Sum of token, segment and learned absolute position embeddings.

    With `embedding_dim` (ALBERT's factorized embeddings, Lan et al. 2020)
    the three tables and the LayerNorm have width E and a Dense layer
    `projection` maps the result to H: V E + E H weights instead of V H.

    Args:
        vocabulary_size: int. number of token ids V.
        hidden_dim: int. output width H.
        max_sequence_length: int. number of learned positions.
        type_vocab_size: int. number of segment ids (2 for sentence pairs).
        dropout: float. dropout after the LayerNorm.
        layer_norm_epsilon: float. LayerNorm epsilon.
        initializer_range: float. stddev of the truncated-normal init.
        embedding_dim: int or None. table width E, projected to H; None:
            tables of width H and no projection.

    `call(token_ids, segment_ids, token_vectors=v)` takes (B, T, E) vectors
    in place of the token table's lookup (the ids then give only the
    shape), to which the segment and position embeddings are added as to
    looked-up ones: e.g. memory states fed back as tokens
    (`kbert.BertMemoryClassifier`).

    Example:
    >>> layer = BertEmbeddings(100, 8, max_sequence_length=16, embedding_dim=4)
    >>> ids = keras.ops.ones((2, 5), "int32")
    >>> tuple(layer(ids, keras.ops.zeros((2, 5), "int32")).shape)
    (2, 5, 8)
    """

    config_omitted = {"embedding_dim": None}

    def __init__(
        self,
        vocabulary_size,
        hidden_dim,
        max_sequence_length=512,
        type_vocab_size=2,
        dropout=0.1,
        layer_norm_epsilon=1e-12,
        initializer_range=0.02,
        embedding_dim=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.store_arguments(locals())
        width = self.table_dim
        self.token_embedding = TokenEmbedding(
            vocabulary_size,
            width,
            embeddings_initializer=truncated_normal(initializer_range),
            dtype=self.dtype_policy,
            name="token_embedding",
        )
        self.segment_embedding = keras.layers.Embedding(
            type_vocab_size,
            width,
            embeddings_initializer=truncated_normal(initializer_range),
            dtype=self.dtype_policy,
            name="segment_embedding",
        )
        self.layer_norm = LayerNorm(
            epsilon=layer_norm_epsilon, dtype=self.dtype_policy, name="layer_norm"
        )
        self.dropout_layer = Dropout(dropout, dtype=self.dtype_policy, name="dropout")
        self.projection = None
        if embedding_dim is not None:
            self.projection = Dense(
                hidden_dim,
                kernel_initializer=truncated_normal(initializer_range),
                dtype=self.dtype_policy,
                name="projection",
            )

    @property
    def table_dim(self):
        """Width of the embedding tables: E when factorized, else H."""
        return self.hidden_dim if self.embedding_dim is None else self.embedding_dim

    def build(self, token_ids_shape, segment_ids_shape=None):
        self.token_embedding.build(token_ids_shape)
        self.segment_embedding.build(token_ids_shape)
        self.position_embeddings_initializer = truncated_normal(self.initializer_range)
        self.position_embeddings = self.add_weight(
            name="position_embeddings",
            shape=(self.max_sequence_length, self.table_dim),
            initializer=self.position_embeddings_initializer,
        )
        self.layer_norm.build(tuple(token_ids_shape) + (self.table_dim,))
        if self.projection is not None:
            self.projection.build(tuple(token_ids_shape) + (self.table_dim,))
        self.built = True

    def call(self, token_ids, segment_ids, training=None, position_ids=None, token_vectors=None):
        if keras_internals.in_symbolic_scope():
            # Keras infers shapes on torch by running the model on tensors of
            # ones where a meta kernel is missing: an id of 1 is outside a
            # table of one token type (RoBERTa, Longformer), and the values
            # do not matter there
            segment_ids = ops.zeros_like(segment_ids)
        if position_ids is not None:
            if token_vectors is not None:
                raise ValueError("token_vectors are taken without position_ids (packed rows)")
            return self._embed_at(token_ids, segment_ids, position_ids, training)
        length = ops.shape(token_ids)[1]
        checks.check_sequence_length(length, self.max_sequence_length)
        # eager inference on concrete values (not while a CUDA graph is
        # captured: `is_concrete` is False there, a device read would break it)
        if not training and checks.is_concrete(token_ids):
            checks.check_token_ids(token_ids, self.vocabulary_size)
            checks.check_token_ids(segment_ids, self.type_vocab_size, "segment_ids")
        table = ops.cast(self.position_embeddings, self.compute_dtype)
        if isinstance(length, int) or ops.is_tensor(length):
            positions = ops.slice(table, (0, 0), (length, self.table_dim))  # (T, E)
        else:
            # A symbolic or unknown length (shape-polymorphic export) cannot
            # be proven <= max_sequence_length, which a slice requires; a
            # gather of the first T rows has no such bound.
            position_ids = ops.cumsum(ops.ones_like(token_ids[0]), axis=0) - 1  # (T,)
            positions = ops.take(table, position_ids, axis=0)  # (T, E)
        if self.segment_embedding.quantization_mode is None:
            segments = ops.cast(self.segment_embedding.embeddings, self.compute_dtype)
        else:  # the stored table is int8; Keras' quantized lookup rescales it
            segments = self.segment_embedding(ops.arange(self.type_vocab_size))  # (S, E)
            # ... by its float32 scale, which promotes a 16-bit lookup to float32
            segments = ops.cast(segments, self.compute_dtype)
        if token_vectors is None:
            token_vectors = self.token_embedding(token_ids)
        else:
            token_vectors = ops.cast(token_vectors, self.compute_dtype)
        x = fused_embedding_sum(token_vectors, positions, segments, segment_ids)  # (B, T, E)
        x = self.dropout_layer(self.layer_norm(x), training=training)
        if self.projection is not None:
            x = self.projection(x)  # (B, T, H)
        return x

    def _embed_at(self, token_ids, segment_ids, position_ids, training):
        """`call` with each token's position given (B, T): rows that hold
        several examples, each counting from 0."""
        # Gathered from the variables, then cast: their gradients (a sum
        # over every token into a few rows) accumulate in the variables'
        # dtype, as the padded path's do.
        positions = ops.take(self.position_embeddings, ops.cast(position_ids, "int32"), axis=0)
        if self.segment_embedding.quantization_mode is None:
            segments = ops.take(
                self.segment_embedding.embeddings, ops.cast(segment_ids, "int32"), axis=0
            )
        else:  # the stored table is int8; Keras' quantized lookup rescales it
            segments = self.segment_embedding(segment_ids)
        x = (
            self.token_embedding(token_ids)
            + ops.cast(segments, self.compute_dtype)
            + ops.cast(positions, self.compute_dtype)
        )  # (B, T, E)
        x = self.dropout_layer(self.layer_norm(x), training=training)
        if self.projection is not None:
            x = self.projection(x)  # (B, T, H)
        return x

    def compute_output_shape(self, token_ids_shape, segment_ids_shape=None):
        return tuple(token_ids_shape) + (self.hidden_dim,)
