"""BertMemoryClassifier: long documents read window by window by a BERT
that carries memory tokens from one window to the next (the Recurrent
Memory Transformer of Bulatov, Kuratov and Burtsev 2022, encoder form).

Shapes: B documents, C windows per document, T tokens per window (without
the memory), M memory tokens, H hidden, K classes.
"""

import keras
from keras import ops

from kbert.layers import BertEmbeddings, initializers
from kbert.models.backbone import TOKEN_VECTORS, encoder_forward
from kbert.models.chunk_classifier import BertChunkClassifier


@keras.saving.register_keras_serializable(package="kbert")
class MemoryTokens(keras.layers.Layer):
    """The memory a document starts from: M learned vectors of width H,
    (B, C, T) token ids -> (B, M, H).

    Args:
        memory_tokens: int. M.
        hidden_dim: int. H.
        initializer_range: float. stddev of the truncated-normal init.

    Example:
    >>> layer = MemoryTokens(3, 4)
    >>> tuple(layer(keras.ops.zeros((2, 5, 7), "int32")).shape)
    (2, 3, 4)
    """

    def __init__(self, memory_tokens, hidden_dim, initializer_range=0.02, **kwargs):
        super().__init__(**kwargs)
        self.memory_tokens = memory_tokens
        self.hidden_dim = hidden_dim
        self.initializer_range = initializer_range

    def build(self, token_ids_shape):
        # `<weight>_initializer`: where a checkpoint's load finds it (`initializers.draw_unset`)
        self.memory_initializer = initializers.truncated_normal(self.initializer_range)
        self.memory = self.add_weight(
            name="memory",
            shape=(self.memory_tokens, self.hidden_dim),
            initializer=self.memory_initializer,
        )
        self.built = True

    def call(self, token_ids):
        batch = ops.shape(token_ids)[0]
        memory = ops.cast(self.memory, self.compute_dtype)
        return ops.broadcast_to(memory[None], (batch, self.memory_tokens, self.hidden_dim))

    def compute_output_shape(self, token_ids_shape):
        return (token_ids_shape[0], self.memory_tokens, self.hidden_dim)

    def get_config(self):
        return {
            **super().get_config(),
            "memory_tokens": self.memory_tokens,
            "hidden_dim": self.hidden_dim,
            "initializer_range": self.initializer_range,
        }


@keras.saving.register_keras_serializable(package="kbert")
class MemoryWindow(keras.layers.Layer):
    """Window `chunk` of (B, C, T) model inputs with M memory slots after
    its [CLS]: token_ids, segment_ids and padding_mask (B, M + T). The slots
    hold id 0 and segment 0 (their vectors are replaced by the memory) and
    are always attended to, so that a window of padding only still has
    keys to attend to (its outputs are not used).

    Args:
        chunk: int. which window.
        memory_tokens: int. M.

    Example:
    >>> ids = keras.ops.convert_to_tensor([[[2, 7, 3], [0, 0, 0]]])
    >>> window = MemoryWindow(0, 2)(ids, keras.ops.zeros_like(ids), keras.ops.sign(ids))
    >>> keras.ops.convert_to_numpy(window["padding_mask"]).tolist()
    [[1, 1, 1, 1, 1]]
    """

    def __init__(self, chunk, memory_tokens, **kwargs):
        super().__init__(**kwargs)
        self.chunk = chunk
        self.memory_tokens = memory_tokens

    def call(self, token_ids, segment_ids, padding_mask):
        window = {}
        for name, x, slot in (
            ("token_ids", token_ids, 0),
            ("segment_ids", segment_ids, 0),
            ("padding_mask", padding_mask, 1),
        ):
            x = ops.cast(x[:, self.chunk, :], "int32")  # (B, T)
            slots = ops.full((ops.shape(x)[0], self.memory_tokens), slot, dtype="int32")
            window[name] = ops.concatenate([x[:, :1], slots, x[:, 1:]], axis=1)  # (B, M + T)
        return window

    def compute_output_spec(self, token_ids, segment_ids, padding_mask):
        length = token_ids.shape[2]
        shape = (token_ids.shape[0], None if length is None else length + self.memory_tokens)
        names = ("token_ids", "segment_ids", "padding_mask")
        return {name: keras.KerasTensor(shape, dtype="int32") for name in names}

    def get_config(self):
        return {**super().get_config(), "chunk": self.chunk, "memory_tokens": self.memory_tokens}


@keras.saving.register_keras_serializable(package="kbert")
class MemoryWrite(keras.layers.Layer):
    """Token vectors (B, M + T, H) with the memory (B, M, H) in the slots
    after [CLS].

    Args:
        memory_tokens: int. M.

    Example:
    >>> vectors = keras.ops.zeros((1, 5, 2))
    >>> out = MemoryWrite(2)(vectors, keras.ops.ones((1, 2, 2)))
    >>> keras.ops.convert_to_numpy(out)[0, :, 0].tolist()
    [0.0, 1.0, 1.0, 0.0, 0.0]
    """

    def __init__(self, memory_tokens, **kwargs):
        super().__init__(**kwargs)
        self.memory_tokens = memory_tokens

    def call(self, token_vectors, memory):
        memory = ops.cast(memory, token_vectors.dtype)
        return ops.concatenate(
            [token_vectors[:, :1], memory, token_vectors[:, 1 + self.memory_tokens :]], axis=1
        )

    def compute_output_shape(self, token_vectors_shape, memory_shape):
        return tuple(token_vectors_shape)

    def get_config(self):
        return {**super().get_config(), "memory_tokens": self.memory_tokens}


@keras.saving.register_keras_serializable(package="kbert")
class MemoryRead(keras.layers.Layer):
    """After window `chunk`: the memory slots' outputs become the memory
    and the window's pooled [CLS] the document's vector, for documents
    where the window holds tokens; the others keep both (a document ends
    with its last real window; one with no real window gets zeros).
    -> (memory (B, M, H), pooled (B, H)).

    Args:
        chunk: int. which window was read.
        memory_tokens: int. M.
    """

    def __init__(self, chunk, memory_tokens, **kwargs):
        super().__init__(**kwargs)
        self.chunk = chunk
        self.memory_tokens = memory_tokens

    def call(self, sequence_output, pooled_output, padding_mask, memory, last):
        real = ops.any(ops.cast(padding_mask[:, self.chunk, :], "bool"), axis=-1)  # (B,)
        written = sequence_output[:, 1 : 1 + self.memory_tokens, :]  # (B, M, H)
        memory = ops.where(real[:, None, None], written, ops.cast(memory, written.dtype))
        if last is None:  # the first window
            last = ops.zeros_like(pooled_output)
        return memory, ops.where(real[:, None], pooled_output, ops.cast(last, pooled_output.dtype))

    def compute_output_spec(self, sequence_output, pooled_output, padding_mask, memory, last):
        hidden = sequence_output.shape[-1]
        batch = sequence_output.shape[0]
        dtype = sequence_output.dtype
        return (
            keras.KerasTensor((batch, self.memory_tokens, hidden), dtype=dtype),
            keras.KerasTensor((batch, hidden), dtype=pooled_output.dtype),
        )

    def get_config(self):
        return {**super().get_config(), "chunk": self.chunk, "memory_tokens": self.memory_tokens}


@keras.saving.register_keras_serializable(package="kbert")
class BertMemoryClassifier(BertChunkClassifier):
    """Classifies a long document by reading its windows in order with M
    memory tokens carried from each window to the next (Recurrent Memory
    Transformer): window c is `[CLS] memory tokens ... [SEP]`, the memory
    tokens' vectors are the last layer's outputs at the memory positions of
    window c - 1 (learned vectors for the first window), given to the
    embeddings in place of token embeddings (segment and position
    embeddings are added as to tokens); the classifier reads the pooled
    [CLS] of the document's last window. Gradients flow through the memory
    across all windows (backpropagation through the whole document).

    Unlike chunk-and-pool (`BertChunkClassifier`), where each window is read
    alone, information can pass from early windows to late ones; the
    windows run one after the other instead of as one batch.

    `fit`, `evaluate` and `predict` take raw strings with a preprocessor
    attached, or model inputs of shape (B, C, T), windows cut as
    `kbert.data.long_documents.chunk_documents` cuts them, with T + M at
    most the backbone's `max_sequence_length`. From raw strings the windows
    hold `sequence_length - memory_tokens` tokens, so a window with its
    memory is as long as the preprocessor's rows. A `BertClassifier` or
    `BertChunkClassifier` preset loads with its classifier head (the memory
    starts fresh).

    Args:
        backbone: `kbert.BertBackbone` with full attention and embedding
            tables of width H (the memory is fed back as token vectors).
        num_classes: int. K; 1 for regression.
        preprocessor: `kbert.BertPreprocessor` or None.
        max_chunks: int. C, windows per document (longer documents keep
            their first C windows).
        memory_tokens: int. M, memory vectors carried between windows.
        dropout: float. dropout before the classifier.
        freeze_backbone: False, True or "adapters" (see `BertClassifier`).

    Example:
    >>> backbone = kbert.BertBackbone(100, 2, 2, 16, 32, max_sequence_length=16)
    >>> model = BertMemoryClassifier(backbone, num_classes=2, max_chunks=3, memory_tokens=4)
    >>> x = {k: keras.ops.ones((1, 3, 12), "int32") for k in ("token_ids", "padding_mask")}
    >>> x["segment_ids"] = keras.ops.zeros((1, 3, 12), "int32")
    >>> tuple(model(x).shape)
    (1, 2)
    """

    calls_backbone = False  # its forward runs the backbone's layers window by window
    head_weights_from = ("BertClassifier", "BertChunkClassifier")
    head_weights_fresh = ("memory_tokens",)
    config_names = ("num_classes", "max_chunks", "memory_tokens", "dropout", "freeze_backbone")

    def __init__(
        self,
        backbone,
        num_classes,
        preprocessor=None,
        max_chunks=8,
        memory_tokens=10,
        dropout=0.1,
        freeze_backbone=False,
        **kwargs,
    ):
        inputs = self.document_inputs(num_classes, max_chunks)
        if (
            not isinstance(memory_tokens, int)
            or isinstance(memory_tokens, bool)
            or not 1 <= memory_tokens <= backbone.max_sequence_length - 3
        ):
            raise ValueError(
                "memory_tokens must be an int from 1 to max_sequence_length - 3 "
                f"({backbone.max_sequence_length - 3}: a window keeps [CLS], one token and "
                f"[SEP]), got {memory_tokens!r}"
            )
        embeddings = backbone.get_layer("embeddings")
        if type(embeddings) is not BertEmbeddings or embeddings.embedding_dim is not None:
            raise ValueError(
                "BertMemoryClassifier feeds the memory back as token vectors, which needs "
                "BERT's embeddings with tables of the hidden width; this backbone has "
                f"{type(embeddings).__name__}"
                + (
                    f" with embedding_dim={embeddings.embedding_dim}"
                    if getattr(embeddings, "embedding_dim", None) is not None
                    else ""
                )
                + "; use a BERT backbone without embedding_dim (factorized embeddings)"
            )
        if getattr(backbone, "attention_window", None):
            raise ValueError(
                "BertMemoryClassifier reads windows with full attention; load the backbone "
                "without attention_window"
            )
        if preprocessor is not None and preprocessor.sequence_length - memory_tokens < 3:
            raise ValueError(
                f"the preprocessor's sequence_length={preprocessor.sequence_length} leaves "
                f"fewer than 3 tokens per window beside memory_tokens={memory_tokens}"
            )
        policy = embeddings.dtype_policy
        blocks = backbone.transformer_layers
        pooler = backbone.get_layer("pooler")
        memory = MemoryTokens(
            memory_tokens,
            backbone.hidden_dim,
            backbone.initializer_range,
            dtype=policy,
            name="memory_tokens",
        )(inputs["token_ids"])  # (B, M, H)
        write = MemoryWrite(memory_tokens, dtype=policy, name="memory_write")
        document = None
        for chunk in range(max_chunks):
            window = MemoryWindow(chunk, memory_tokens, name=f"memory_window_{chunk}")(
                inputs["token_ids"], inputs["segment_ids"], inputs["padding_mask"]
            )  # (B, M + T) each
            vectors = write(embeddings.token_embedding(window["token_ids"]), memory)
            outputs = encoder_forward(
                embeddings, blocks, pooler, {**window, TOKEN_VECTORS: vectors}
            )
            memory, document = MemoryRead(
                chunk, memory_tokens, dtype=policy, name=f"memory_read_{chunk}"
            )(
                outputs["sequence_output"],
                outputs["pooled_output"],
                inputs["padding_mask"],
                memory,
                document,
            )
        logits = self.logits_head(document, backbone, num_classes, dropout)
        config = dict(
            num_classes=num_classes,
            max_chunks=max_chunks,
            memory_tokens=memory_tokens,
            dropout=dropout,
            freeze_backbone=freeze_backbone,
        )
        self._init_task(inputs, logits, backbone, preprocessor, config, kwargs)

    def quantize(self, mode=None, *args, **kwargs):
        """Keras' `quantize`; "float8" is refused for more than one window:
        every backbone Dense runs once per window in a step, and float8's
        delayed scaling would add the scale updates of those runs together
        (as for `share_layers`)."""
        if mode == "float8" and self.max_chunks > 1:
            raise ValueError(
                f'quantize("float8") of a BertMemoryClassifier with max_chunks={self.max_chunks}: '
                "each backbone Dense runs once per window a step, and float8's delayed scaling "
                "would add their scale updates together; train it in bf16 (mixed_bfloat16), "
                'or quantize("int8") a trained model for inference'
            )
        return super().quantize(mode, *args, **kwargs)

    def input_limits(self):
        """The backbone's, with windows M tokens shorter (the memory's)."""
        limits = super().input_limits()
        limits["max_sequence_length"] -= self.memory_tokens
        return limits

    def window_length(self):
        """Tokens per window from raw strings (without the memory)."""
        return self.preprocessor.sequence_length - self.memory_tokens

    def preprocess_samples(self, x):
        """Raw strings -> (B, C, T) windows; model-input dicts pass through,
        T checked against the positions the memory leaves (`input_limits`)."""
        if isinstance(x, dict) and "token_ids" in x:
            ids = x["token_ids"]
            length = ids.shape[-1] if hasattr(ids, "shape") else len(ids[0][0])
            limit = self.backbone.max_sequence_length
            if isinstance(length, int) and length + self.memory_tokens > limit:
                raise ValueError(
                    f"windows of {length} tokens and {self.memory_tokens} memory tokens exceed "
                    f"the backbone's max_sequence_length={limit}; cut windows of at most "
                    f"{limit - self.memory_tokens} tokens"
                )
        if self.preprocessor is None or isinstance(x, dict):
            return x
        return self.chunk_texts(x, self.window_length())
