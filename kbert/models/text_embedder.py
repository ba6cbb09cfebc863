"""BertTextEmbedder: one vector per text ([CLS], mean or max pooling)."""

import keras
from keras import ops

from kbert.layers.config import ArgumentsConfig
from kbert.models.task import Task

POOLINGS = ("cls", "mean", "max", "pooled")


@keras.saving.register_keras_serializable(package="kbert")
class TokenPooling(ArgumentsConfig, keras.layers.Layer):
    """Pools (B, T, H) token vectors over the non-padding tokens -> (B, H).

    Args:
        pooling: str. "cls" (first token), "mean" or "max" over real tokens.
        normalize: bool. L2-normalise the result (sentence-transformers style).
    """

    def __init__(self, pooling="mean", normalize=False, **kwargs):
        super().__init__(**kwargs)
        self.store_arguments(locals())

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
        return keras.KerasTensor(
            (sequence_output.shape[0], sequence_output.shape[-1]), dtype="float32"
        )


@keras.saving.register_keras_serializable(package="kbert")
class LayerMix(keras.layers.Layer):
    """A learned weighted sum of the backbone's hidden states (ELMo's scalar
    mix): gamma * sum_l softmax(w)_l h_l, with w = 0 (a plain average) and
    gamma = 1 at the start.

    Input (B, L + 1, T, H) -> (B, T, H).
    """

    def build(self, hidden_states_shape):
        self.layer_weights = self.add_weight(
            shape=(hidden_states_shape[1],), initializer="zeros", name="layer_weights"
        )
        self.gamma = self.add_weight(shape=(), initializer="ones", name="gamma")
        self.built = True

    def call(self, hidden_states):
        weights = ops.softmax(ops.cast(self.layer_weights, "float32"))
        mixed = ops.einsum("l,bltd->btd", weights, ops.cast(hidden_states, "float32"))
        return ops.cast(self.gamma, "float32") * mixed

    def compute_output_shape(self, hidden_states_shape):
        return (hidden_states_shape[0],) + tuple(hidden_states_shape[2:])


@keras.saving.register_keras_serializable(package="kbert")
class BertTextEmbedder(Task):
    """Sentence embeddings from a BERT backbone.

    Args:
        backbone: `kbert.BertBackbone`.
        pooling: str. "mean" (sentence-transformers), "cls", "max", or
            "pooled" (the tanh pooler).
        normalize: bool. L2-normalise (all-MiniLM-L6-v2 does).
        preprocessor: `kbert.BertPreprocessor` or None.
        layer_mix: bool. pool a learned weighted sum of all hidden states
            (embedding output and every layer) instead of the last layer;
            needs a backbone built with `output_hidden_states=True`.

    Example:
    >>> embedder = BertTextEmbedder(kbert.BertBackbone(100, 2, 2, 16, 32, max_sequence_length=16))
    """

    def __init__(
        self, backbone, pooling="mean", normalize=True, preprocessor=None, layer_mix=False, **kwargs
    ):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if layer_mix and (pooling == "pooled" or not backbone.output_hidden_states):
            raise ValueError(
                "layer_mix needs token pooling (cls/mean/max) and a backbone with "
                "output_hidden_states=True (e.g. BertTextEmbedder.from_preset(preset, "
                "layer_mix=True, output_hidden_states=True))"
            )
        inputs = self.backbone_inputs(backbone)
        features = backbone(inputs)
        if layer_mix:
            features = dict(
                features, sequence_output=LayerMix(name="layer_mix")(features["hidden_states"])
            )
        if pooling == "pooled":
            embedding = TokenPooling("cls", normalize, name="pooling")(
                ops.expand_dims(features["pooled_output"], 1), inputs["padding_mask"][:, :1]
            )
        else:
            embedding = TokenPooling(pooling, normalize, name="pooling")(
                features["sequence_output"], inputs["padding_mask"]
            )
        super().__init__(inputs=inputs, outputs=embedding, **kwargs)
        self._set_backbone(backbone, preprocessor)
        self.pooling = pooling
        self.normalize = normalize
        self.layer_mix = layer_mix

    def task_config(self):
        return {"pooling": self.pooling, "normalize": self.normalize, "layer_mix": self.layer_mix}

    def embed(self, texts, batch_size=32):
        """Raw texts -> numpy (N, H) embeddings."""
        return self.predict(texts, batch_size=batch_size, verbose=0)
