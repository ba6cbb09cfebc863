"""Heads on top of the encoder: pooler, masked-LM head, next-sentence head.

Shapes: B batch, T tokens, P predictions per sequence, H hidden, V vocabulary,
E embedding width (factorized embeddings; E = H otherwise).
Logits are float32 under mixed precision, so losses are computed in float32.
"""

import keras
from keras import ops

from kbert.backend.ops import gather_positions
from kbert.layers.activations import canonical_activation, get_activation
from kbert.layers.config import ArgumentsConfig
from kbert.layers.dense import Dense
from kbert.layers.initializers import truncated_normal
from kbert.layers.layer_norm import LayerNorm


def _initializer(stddev):
    return truncated_normal(stddev)


@keras.saving.register_keras_serializable(package="kbert")
class Pooler(ArgumentsConfig, keras.layers.Layer):
    """tanh(Dense(h_[CLS])): the pooled output used by NSP and classifiers.

    Args:
        hidden_dim: int. width H.
        initializer_range: float. stddev of the truncated-normal init.

    Example:
    >>> tuple(Pooler(8)(keras.ops.ones((2, 5, 8))).shape)
    (2, 8)
    """

    def __init__(self, hidden_dim, initializer_range=0.02, **kwargs):
        super().__init__(**kwargs)
        self.store_arguments(locals())
        self.dense = Dense(
            hidden_dim,
            activation="tanh",
            kernel_initializer=_initializer(initializer_range),
            dtype=self.dtype_policy,
            name="dense",
        )

    def build(self, sequence_shape):
        self.dense.build((sequence_shape[0], sequence_shape[-1]))
        self.built = True

    def call(self, sequence_output):
        return self.dense(sequence_output[:, 0, :])  # (B, H) from [CLS]

    def compute_output_shape(self, sequence_shape):
        return (sequence_shape[0], self.hidden_dim)


@keras.saving.register_keras_serializable(package="kbert")
class MaskedLMHead(ArgumentsConfig, keras.layers.Layer):
    """Predicts the original token at each masked position.

    Gathers `mask_positions` first, so the vocabulary projection (the largest
    matrix product of pre-training) runs on P positions, not T. Then
    Dense -> activation -> LayerNorm -> decoder tied to the token embedding
    (transposed) -> per-token output bias, as in the original BERT. With
    `embedding_dim` (ALBERT) the Dense maps H -> E and the LayerNorm and the
    tied decoder work at E, the width of the factorized token embedding.

    Args:
        vocabulary_size: int. V.
        hidden_dim: int. H.
        activation: str. transform activation (as the encoder's).
        layer_norm_epsilon: float. LayerNorm epsilon.
        initializer_range: float. stddev of the truncated-normal init.
        token_embedding: `kbert.layers.TokenEmbedding` or None. The embedding
            to tie the decoder to (not serialized: the task model that owns
            both passes it again when rebuilt). None gives an untied decoder.
        embedding_dim: int or None. E, the decoder's width; None: H.

    Example:
    >>> head = MaskedLMHead(vocabulary_size=20, hidden_dim=8)
    >>> x = keras.ops.ones((2, 5, 8))
    >>> tuple(head(x, keras.ops.zeros((2, 3), "int32")).shape)
    (2, 3, 20)
    """

    config_excluded = ("token_embedding",)  # see Args
    config_omitted = {"embedding_dim": None}

    def __init__(
        self,
        vocabulary_size,
        hidden_dim,
        activation="gelu",
        layer_norm_epsilon=1e-12,
        initializer_range=0.02,
        token_embedding=None,
        embedding_dim=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        activation = canonical_activation(activation)
        self.store_arguments(locals())
        width = self.decoder_dim
        if token_embedding is not None and (
            token_embedding.input_dim != vocabulary_size or token_embedding.output_dim != width
        ):
            name = "hidden_dim" if embedding_dim is None else "embedding_dim"
            raise ValueError(
                "token_embedding shape "
                f"({token_embedding.input_dim}, {token_embedding.output_dim}) does not "
                f"match vocabulary_size={vocabulary_size}, {name}={width}"
            )
        self.transform = Dense(
            width,
            activation=get_activation(self.activation),
            kernel_initializer=_initializer(initializer_range),
            dtype=self.dtype_policy,
            name="transform",
        )
        self.layer_norm = LayerNorm(
            epsilon=layer_norm_epsilon, dtype=self.dtype_policy, name="layer_norm"
        )

    @property
    def decoder_dim(self):
        """Width the decoder works at: E with factorized embeddings, else H."""
        return self.hidden_dim if self.embedding_dim is None else self.embedding_dim

    def build(self, sequence_output_shape, mask_positions_shape=None):
        self.transform.build((None, None, self.hidden_dim))
        self.layer_norm.build((None, None, self.decoder_dim))
        if self.token_embedding is None:
            self.decoder_kernel_initializer = _initializer(self.initializer_range)
            self.decoder_kernel = self.add_weight(
                name="decoder_kernel",
                shape=(self.decoder_dim, self.vocabulary_size),
                initializer=self.decoder_kernel_initializer,
            )
        self.output_bias = self.add_weight(
            name="output_bias", shape=(self.vocabulary_size,), initializer="zeros"
        )
        self.built = True

    def call(self, sequence_output, mask_positions):
        x = gather_positions(sequence_output, mask_positions)  # (B, P, H)
        x = self.layer_norm(self.transform(x))  # (B, P, E)
        if self.token_embedding is not None:
            logits = self.token_embedding(x, reverse=True)  # (B, P, V)
        else:
            logits = ops.matmul(x, ops.cast(self.decoder_kernel, self.compute_dtype))
        logits = ops.cast(logits, "float32")
        return logits + ops.cast(self.output_bias, "float32")

    def compute_output_shape(self, sequence_output_shape, mask_positions_shape=None):
        return (sequence_output_shape[0], mask_positions_shape[1], self.vocabulary_size)

    def compute_output_spec(self, sequence_output, mask_positions):
        shape = (sequence_output.shape[0], mask_positions.shape[1], self.vocabulary_size)
        return keras.KerasTensor(shape, dtype="float32")


@keras.saving.register_keras_serializable(package="kbert")
class NextSentenceHead(ArgumentsConfig, keras.layers.Layer):
    """Two logits from the pooled output: 0 = B follows A, 1 = B is random
    (next sentence prediction), or 0 = A then B in document order, 1 =
    swapped (ALBERT's sentence-order prediction): the same layer.

    Args:
        initializer_range: float. stddev of the truncated-normal init.

    Example:
    >>> tuple(NextSentenceHead()(keras.ops.ones((2, 8))).shape)
    (2, 2)
    """

    def __init__(self, initializer_range=0.02, **kwargs):
        super().__init__(**kwargs)
        self.store_arguments(locals())
        self.dense = Dense(
            2,
            kernel_initializer=_initializer(initializer_range),
            dtype=self.dtype_policy,
            name="dense",
        )

    def build(self, pooled_shape):
        self.dense.build(pooled_shape)
        self.built = True

    def call(self, pooled_output):
        return ops.cast(self.dense(pooled_output), "float32")

    def compute_output_shape(self, pooled_shape):
        return (pooled_shape[0], 2)

    def compute_output_spec(self, pooled_output):
        return keras.KerasTensor((pooled_output.shape[0], 2), dtype="float32")
