"""BertTextEmbedder: one vector per text ([CLS], mean or max pooling)."""

import keras
from keras import ops

from kbert.models.task import Task

POOLINGS = ("cls", "mean", "max", "pooled")


@keras.saving.register_keras_serializable(package="kbert")
class TokenPooling(keras.layers.Layer):
    """Pools (B, T, H) token vectors over the non-padding tokens -> (B, H).

    Args:
        pooling: str. "cls" (first token), "mean" or "max" over real tokens.
        normalize: bool. L2-normalise the result (sentence-transformers style).
    """

    def __init__(self, pooling="mean", normalize=False, **kwargs):
        super().__init__(**kwargs)
        self.pooling = pooling
        self.normalize = normalize

    def call(self, sequence_output, padding_mask):
        x = ops.cast(sequence_output, "float32")
        mask = ops.cast(padding_mask, "float32")[:, :, None]  # (B, T, 1)
        if self.pooling == "cls":
            pooled = x[:, 0]
        elif self.pooling == "mean":
            pooled = ops.sum(x * mask, axis=1) / ops.maximum(ops.sum(mask, axis=1), 1e-9)
        else:
            pooled = ops.max(ops.where(mask > 0, x, ops.full_like(x, -1e9)), axis=1)
        if self.normalize:
            pooled = pooled / ops.maximum(ops.norm(pooled, axis=-1, keepdims=True), 1e-12)
        return pooled

    def compute_output_spec(self, sequence_output, padding_mask):
        return keras.KerasTensor((sequence_output.shape[0], sequence_output.shape[-1]), dtype="float32")

    def get_config(self):
        config = super().get_config()
        config.update(pooling=self.pooling, normalize=self.normalize)
        return config


@keras.saving.register_keras_serializable(package="kbert")
class BertTextEmbedder(Task):
    """Sentence embeddings from a BERT backbone.

    Args:
        backbone: `kbert.BertBackbone`.
        pooling: str. "mean" (sentence-transformers), "cls", "max", or
            "pooled" (the tanh pooler).
        normalize: bool. L2-normalise (all-MiniLM-L6-v2 does).
        preprocessor: `kbert.BertPreprocessor` or None.

    Example:
    >>> embedder = BertTextEmbedder(kbert.BertBackbone(100, 2, 2, 16, 32, max_sequence_length=16))
    """

    def __init__(self, backbone, pooling="mean", normalize=True, preprocessor=None, **kwargs):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        inputs = self.backbone_inputs(backbone)
        features = backbone(inputs)
        if pooling == "pooled":
            embedding = TokenPooling("cls", normalize, name="pooling")(
                ops.expand_dims(features["pooled_output"], 1), inputs["padding_mask"][:, :1]
            )
        else:
            embedding = TokenPooling(pooling, normalize, name="pooling")(features["sequence_output"], inputs["padding_mask"])
        super().__init__(inputs=inputs, outputs=embedding, **kwargs)
        self._set_backbone(backbone, preprocessor)
        self.pooling = pooling
        self.normalize = normalize

    def task_config(self):
        return {"pooling": self.pooling, "normalize": self.normalize}

    def embed(self, texts, batch_size=32):
        """Raw texts -> numpy (N, H) embeddings."""
        return self.predict(texts, batch_size=batch_size, verbose=0)
