"""BertMultipleChoice: one score per (context, choice) pair, softmax over choices (SWAG).

Shapes: B questions, N choices, T tokens.
"""

import keras
from keras import ops

from kbert.models.task import Task
from kbert.utils import checks


@keras.saving.register_keras_serializable(package="kbert")
class ChoiceReshape(keras.layers.Layer):
    """(B, N, ...) <-> (B * N, ...): folds the choices into the batch and back."""

    def __init__(self, num_choices, fold=True, **kwargs):
        super().__init__(**kwargs)
        self.num_choices = num_choices
        self.fold = fold

    def call(self, x):
        shape = ops.shape(x)
        if self.fold:
            return ops.reshape(x, (-1,) + tuple(shape[2:]))
        return ops.reshape(x, (-1, self.num_choices) + tuple(shape[1:]))

    def compute_output_spec(self, x):
        if self.fold:
            batch = None if x.shape[0] is None else x.shape[0] * x.shape[1]
            return keras.KerasTensor((batch,) + tuple(x.shape[2:]), dtype=x.dtype)
        batch = None if x.shape[0] is None else x.shape[0] // self.num_choices
        return keras.KerasTensor((batch, self.num_choices) + tuple(x.shape[1:]), dtype=x.dtype)

    def get_config(self):
        config = super().get_config()
        config.update(num_choices=self.num_choices, fold=self.fold)
        return config


@keras.saving.register_keras_serializable(package="kbert")
class BertMultipleChoice(Task):
    """Multiple choice: each `[CLS] context [SEP] choice [SEP]` gets a score
    from its pooled [CLS] vector; a softmax over the N scores picks the choice
    (the paper's SWAG set-up; `transformers`' `BertForMultipleChoice`).

    Inputs are the usual dict with (B, N, T) arrays. With a preprocessor,
    `fit` / `evaluate` / `predict` take `(contexts, choices)`: B context
    strings and B lists of N choice strings; labels are choice indices.

    Args:
        backbone: `kbert.BertBackbone`.
        num_choices: int. N.
        preprocessor: `kbert.BertPreprocessor` or None.
        dropout: float. dropout before the scoring layer.
        freeze_backbone: False, True or "adapters" (see `BertClassifier`).

    Example:
    >>> backbone = kbert.BertBackbone(100, 2, 2, 16, 32, max_sequence_length=16)
    >>> mc = BertMultipleChoice(backbone, num_choices=4)
    """

    def __init__(
        self, backbone, num_choices, preprocessor=None, dropout=0.1, freeze_backbone=False, **kwargs
    ):
        if not isinstance(num_choices, int) or num_choices < 2:
            raise ValueError(f"num_choices must be an int ≥ 2, got {num_choices!r}")
        inputs = {
            name: keras.Input(shape=(num_choices, None), dtype="int32", name=name)
            for name in ("token_ids", "segment_ids", "padding_mask")
        }
        folded = {
            name: ChoiceReshape(num_choices, True, name=f"fold_{name}")(t)
            for name, t in inputs.items()
        }
        pooled = backbone(folded)["pooled_output"]
        scores = self.logits_head(pooled, backbone, 1, dropout)  # (B * N, 1)
        logits = ChoiceReshape(num_choices, False, dtype="float32", name="choice_logits")(
            scores[:, 0]
        )
        config = dict(num_choices=num_choices, dropout=dropout, freeze_backbone=freeze_backbone)
        self._init_task(inputs, logits, backbone, preprocessor, config, kwargs)

    config_names = ("num_choices", "dropout", "freeze_backbone")

    def compile_defaults(self, given):
        return {
            "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "metrics": [keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        }

    def preprocess_samples(self, x):
        if (
            self.preprocessor is None
            or not (isinstance(x, tuple) and len(x) == 2)
            or isinstance(x, dict)
        ):
            return x
        contexts, choices = x
        contexts = [contexts] if isinstance(contexts, str) else list(contexts)
        choices = [choices] if isinstance(choices, str) else list(choices)
        for row, options in enumerate(choices):
            if isinstance(options, str):
                raise ValueError(
                    f"example {row}: its choices must be a list of strings, got the string "
                    f"{options!r:.60}"
                )
        choices = [list(c) for c in choices]
        if len(contexts) != len(choices):
            raise ValueError(f"got {len(contexts)} contexts but {len(choices)} choice lists")
        for row, options in enumerate(choices):
            if len(options) != self.num_choices:
                raise ValueError(
                    f"example {row} has {len(options)} choices; the model takes {self.num_choices}"
                )
        flat_contexts = [c for c in contexts for _ in range(self.num_choices)]
        flat_choices = [o for options in choices for o in options]
        packed = self.preprocessor(flat_contexts, flat_choices)
        return {k: v.reshape(len(contexts), self.num_choices, -1) for k, v in packed.items()}

    def check_targets(self, y):
        return checks.check_class_ids(
            y,
            self.num_choices,
            kind="multiple-choice",
            meaning="choice indices",
            per_example=self.takes_class_ids(),
        )
