"""BertClassifier: [CLS] -> classifier, for single texts and text pairs.

Shapes: B batch, C classes.
"""

import keras
import numpy as np
from keras import ops

from kbert.models.task import Task
from kbert.models.text_embedder import TokenPooling
from kbert.training import batching
from kbert.utils import checks

POOLINGS = ("pooled", "cls", "mean", "max")


@keras.saving.register_keras_serializable(package="kbert")
class BertClassifier(Task):
    """Sequence classification (and regression) from the pooled [CLS] output
    (the paper's head), or from the mean or maximum of the token vectors.

    `fit`, `evaluate` and `predict` take raw strings, `(texts, pairs)` tuples
    or tf.data datasets of them when a preprocessor is attached (presets
    attach one). `num_classes=1` is regression (STS-B): mean squared error.

    Args:
        backbone: `kbert.BertBackbone`.
        num_classes: int. C; 1 for regression.
        preprocessor: `kbert.BertPreprocessor` or None.
        dropout: float. dropout before the classifier (0.1 in the paper).
        freeze_backbone: False, True (train the head only: feature-based
            use) or "adapters" (train adapters, LayerNorms and the head; the
            backbone needs `adapter_size`).
        pooling: str. what the classifier reads: "pooled" (the paper's:
            the backbone's pooler over [CLS]), "cls" (the [CLS] vector
            itself), "mean" or "max" over the real tokens' last-layer
            vectors (padding excluded). "mean" is how sentence-transformers
            checkpoints (e.g. all-MiniLM-L6-v2) were trained to be read;
            "max" lets a label decided by a few tokens anywhere in a long
            input reach the head directly. Hugging Face's
            `BertForSequenceClassification` has only "pooled".

    Example:
    >>> backbone = kbert.BertBackbone(100, 2, 2, 16, 32, max_sequence_length=16)
    >>> model = BertClassifier(backbone, num_classes=3)
    >>> model.compile()
    """

    def __init__(
        self,
        backbone,
        num_classes,
        preprocessor=None,
        dropout=0.1,
        freeze_backbone=False,
        pooling="pooled",
        **kwargs,
    ):
        if not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        inputs = self.backbone_inputs(backbone)
        outputs = backbone(inputs)
        if pooling == "pooled":
            features = outputs["pooled_output"]
        else:
            features = TokenPooling(pooling, name="token_pooling")(
                outputs["sequence_output"], inputs["padding_mask"]
            )
        logits = self.logits_head(features, backbone, num_classes, dropout)
        config = dict(
            num_classes=num_classes,
            dropout=dropout,
            freeze_backbone=freeze_backbone,
            pooling=pooling,
        )
        self._init_task(inputs, logits, backbone, preprocessor, config, kwargs)

    @property
    def packs_rows(self):
        """Whether `fit` may pack several examples per row (see `Task.fit`):
        with the pooled [CLS] head, which reads one [CLS] per example."""
        return getattr(self, "pooling", "pooled") == "pooled"

    def call(self, inputs, training=None, mask=None, **kwargs):
        if isinstance(inputs, dict) and batching.PACKED_KEY in inputs:
            # rows holding several examples (`fit` with `pack_rows`): one
            # [CLS] per example, then the head as in the functional graph.
            # `training` to every layer: JAX's step runs this `call` without
            # Keras' call context, and a float8 layer called without it
            # returns no new scales (its scales became 0, its outputs NaN).
            pooled = self.backbone(inputs, training=training)["pooled_output"]
            x = self.get_layer("classifier_dropout")(pooled, training=training)
            logits = self.get_layer("logits")(x, training=training)
            return self.get_layer("float32_logits")(logits)
        return super().call(inputs, training=training, mask=mask, **kwargs)

    config_names = ("num_classes", "dropout", "freeze_backbone", "pooling")

    def compile_defaults(self, given):
        if self.num_classes == 1:  # regression on scores
            return {"loss": "mse", "metrics": [keras.metrics.MeanAbsoluteError()]}
        return {
            "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "metrics": [keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        }

    def check_targets(self, y):
        if _is_tensor_like(y) is False:
            return None
        values = _host_values(y)
        if self.num_classes == 1:
            values = checks.check_numbers(values, "regression targets", "scores").astype("float32")
            if not np.all(np.isfinite(values)):
                bad = values[~np.isfinite(values)][0]
                raise ValueError(f"regression targets contain {bad}; remove or fix those examples")
            return values
        return checks.check_class_ids(
            values,
            self.num_classes,
            hint="; for scores use num_classes=1",
            per_example=self.takes_class_ids(),
        )

    def predict_classes(self, x, **kwargs):
        """Class ids (or scores for regression) for raw texts or inputs."""
        logits = self.predict(x, verbose=0, **kwargs)
        return logits[:, 0] if self.num_classes == 1 else np.argmax(logits, axis=-1)


def _host_values(y):
    """Targets as a NumPy array: a list of numbers directly (Keras' tree
    utilities visit each element of a long label list in Python), tensors
    through Keras."""
    if isinstance(y, np.ndarray):
        return y
    if isinstance(y, (list, tuple)):
        try:
            values = np.asarray(y)
        except (TypeError, ValueError, RuntimeError):  # e.g. tensors on a GPU
            values = None
        if values is not None and values.dtype.kind in "biufUSO":
            return values  # names and None are named by the checks
    return np.asarray(keras.ops.convert_to_numpy(y))


def _is_tensor_like(y):
    if isinstance(y, (list, tuple, np.ndarray)):
        return True
    try:
        return ops.is_tensor(y)
    except Exception:
        return False
