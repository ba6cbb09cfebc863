"""BertChunkClassifier: long documents classified from their windows
(chunk-and-pool), the baseline for long inputs on a 512-position BERT.

Shapes: B documents, C windows (chunks) per document, T tokens per window,
H hidden, K classes.
"""

import keras
from keras import ops

from kbert.data.long_documents import chunk_documents
from kbert.models.classifier import BertClassifier
from kbert.models.multiple_choice import ChoiceReshape

POOLINGS = ("mean", "max")


@keras.saving.register_keras_serializable(package="kbert")
class ChunkPooling(keras.layers.Layer):
    """(B, C, H) per-window vectors and the (B, C, T) padding mask -> (B, H):
    the mean or the maximum over each document's windows that hold tokens
    (windows of padding only are left out; a document without any gives 0).

    Args:
        pooling: str. "mean" or "max".

    Example:
    >>> layer = ChunkPooling("max")
    >>> x = keras.ops.convert_to_tensor([[[1.0, 5.0], [3.0, 2.0], [9.0, 9.0]]])
    >>> mask = keras.ops.convert_to_tensor([[[1, 1], [1, 0], [0, 0]]])
    >>> keras.ops.convert_to_numpy(layer(x, mask)).tolist()
    [[3.0, 5.0]]
    """

    def __init__(self, pooling="mean", **kwargs):
        super().__init__(**kwargs)
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.pooling = pooling

    def call(self, chunks, padding_mask):
        real = ops.any(ops.cast(padding_mask, "bool"), axis=-1)  # (B, C)
        weights = ops.cast(real, chunks.dtype)[:, :, None]  # (B, C, 1)
        if self.pooling == "mean":
            count = ops.maximum(ops.sum(weights, axis=1), 1.0)  # (B, 1)
            return ops.sum(chunks * weights, axis=1) / count
        # empty windows take the smallest value a real one can beat; no real window: 0
        lowest = ops.min(chunks, axis=1, keepdims=True)  # (B, 1, H)
        pooled = ops.max(ops.where(real[:, :, None], chunks, lowest), axis=1)
        return pooled * ops.max(weights, axis=1)

    def compute_output_shape(self, chunks_shape, padding_mask_shape=None):
        return (chunks_shape[0], chunks_shape[2])

    def get_config(self):
        return {**super().get_config(), "pooling": self.pooling}


@keras.saving.register_keras_serializable(package="kbert")
class BertChunkClassifier(BertClassifier):
    """Classifies a long document from its windows: the text's WordPiece ids
    cut into up to `max_chunks` consecutive windows of the preprocessor's
    `sequence_length` (each `[CLS] ... [SEP]`), every window through the
    backbone, the windows' pooled [CLS] vectors pooled (mean or max) into
    one vector per document, then dropout and the classifier, once per
    document.

    `fit`, `evaluate` and `predict` take raw strings with a preprocessor
    attached, or model inputs of shape (B, C, T) (see
    `kbert.data.long_documents.chunk_documents`). The head has
    `BertClassifier`'s layers: a `BertClassifier` preset loads with its head.

    Args:
        backbone: `kbert.BertBackbone`.
        num_classes: int. K; 1 for regression.
        preprocessor: `kbert.BertPreprocessor` or None. its tokenizer cuts
            the windows, its `sequence_length` is their length T.
        max_chunks: int. C, windows per document (longer documents keep
            their first C windows).
        pooling: str. "mean" or "max" over a document's windows.
        dropout: float. dropout before the classifier.
        freeze_backbone: False, True or "adapters" (see `BertClassifier`).

    Example:
    >>> backbone = kbert.BertBackbone(100, 2, 2, 16, 32, max_sequence_length=16)
    >>> model = BertChunkClassifier(backbone, num_classes=2, max_chunks=4)
    >>> model.compile()
    """

    packs_rows = False  # a row is a window of a document, not an example

    @property
    def text_dataset_refusal(self):
        """Why a tf.data dataset of raw strings is refused: the windows are
        cut on the host (`chunk_documents`), not by the in-graph preprocessor."""
        return (
            f"{type(self).__name__} cuts documents into windows on the host; pass the texts "
            "as a list or numpy array of strings, or a tf.data dataset of model inputs (B, C, "
            "T) made by kbert.data.long_documents.chunk_documents"
        )

    head_weights_from = ("BertClassifier",)
    config_names = ("num_classes", "max_chunks", "pooling", "dropout", "freeze_backbone")

    def __init__(
        self,
        backbone,
        num_classes,
        preprocessor=None,
        max_chunks=8,
        pooling="mean",
        dropout=0.1,
        freeze_backbone=False,
        **kwargs,
    ):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        inputs = self.document_inputs(num_classes, max_chunks)
        folded = {
            name: ChoiceReshape(max_chunks, True, name=f"fold_{name}")(t)
            for name, t in inputs.items()
        }  # (B * C, T) each
        pooled = backbone(folded)["pooled_output"]  # (B * C, H)
        chunks = ChoiceReshape(max_chunks, False, name="unfold_chunks")(pooled)  # (B, C, H)
        policy = backbone.get_layer("embeddings").dtype_policy
        document = ChunkPooling(pooling, dtype=policy, name="chunk_pooling")(
            chunks, inputs["padding_mask"]
        )  # (B, H)
        logits = self.logits_head(document, backbone, num_classes, dropout)
        config = dict(
            num_classes=num_classes,
            max_chunks=max_chunks,
            pooling=pooling,
            dropout=dropout,
            freeze_backbone=freeze_backbone,
        )
        self._init_task(inputs, logits, backbone, preprocessor, config, kwargs)

    @staticmethod
    def document_inputs(num_classes, max_chunks):
        """The arguments checked; the symbolic (B, C, T) inputs."""
        if not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
        if not isinstance(max_chunks, int) or isinstance(max_chunks, bool) or max_chunks < 1:
            raise ValueError(f"max_chunks must be a positive int, got {max_chunks!r}")
        return {
            name: keras.Input(shape=(max_chunks, None), dtype="int32", name=name)
            for name in ("token_ids", "segment_ids", "padding_mask")
        }

    def call(self, inputs, training=None, mask=None, **kwargs):
        return super(BertClassifier, self).call(inputs, training=training, mask=mask, **kwargs)

    def preprocess_samples(self, x):
        """Raw strings -> (B, C, T) windows; model-input dicts pass through."""
        if self.preprocessor is None or isinstance(x, dict):
            return x
        return self.chunk_texts(x, self.preprocessor.sequence_length)

    def chunk_texts(self, x, length):
        """Raw strings -> (B, C, `length`) windows of the preprocessor's tokens."""
        if isinstance(x, tuple):
            raise ValueError(
                f"{type(self).__name__} classifies single documents; got a (texts, pairs) tuple"
            )
        texts = [x] if isinstance(x, str) else self.preprocessor._texts(x, "documents")
        return chunk_documents(self.preprocessor.tokenizer, texts, length, self.max_chunks)
