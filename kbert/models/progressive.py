"""Progressive knowledge transfer (MobileBERT, Sun et al. 2020): a student
trained block by block to reproduce a frozen teacher's feature maps and
attention maps, the blocks below frozen.

Shapes: B batch, T tokens, S tokens (keys, = T), N heads (teacher Nt,
student Ns), H hidden (teacher Ht, student Hs).

Stage m trains student block m (with the embeddings at stage 1) against
teacher block `layer_map[m - 1]`: the mean squared error of the block
outputs (`kbert.training.distillation.hidden_state_mse`; the student's
projected to the teacher's width by a learned `hidden_projection` where
they differ, shared by every stage) plus the KL divergence of the attention
distributions (`attention_kl`; heads averaged where the counts differ). A
MobileBERT student whose `hidden_dim` is the teacher's width needs no
projection: its bottleneck keeps it narrow inside each block. After the
stages come pre-training distillation (`BertDistiller` of masked-LM models)
and task fine-tuning, as in the paper; docs/mobilebert.md shows the three.
"""

import keras

from kbert.backend import keras_internals
from kbert.layers import initializers
from kbert.models.backbone import BertBackbone
from kbert.models.distiller import FrozenForward, StudentForward, _shared_preprocessor
from kbert.models.task import Task
from kbert.training import distillation


def _backbone_of(model, role):
    backbone = model if isinstance(model, BertBackbone) else getattr(model, "backbone", None)
    if not isinstance(backbone, BertBackbone):
        raise ValueError(
            f"the {role} is a {type(model).__name__}; progressive transfer takes BertBackbones "
            "(MobileBertBackbone included) or task models on them"
        )
    return backbone


def _projection(teacher, student):
    return keras.layers.Dense(
        teacher.hidden_dim,
        kernel_initializer=initializers.truncated_normal(student.initializer_range),
        dtype=student.get_layer("embeddings").dtype_policy,
        name="hidden_projection",
    )


@keras.saving.register_keras_serializable(package="kbert")
class LayerTransfer(Task):
    """One stage of progressive knowledge transfer: student block `block`
    learns teacher block `teacher_block`'s output (MSE) and attention
    distributions (KL); every other student weight is frozen (the
    embeddings train with block 1 unless `train_embeddings` says otherwise).

    `fit(x)` takes model inputs or raw text (through the student's or else
    the teacher's preprocessor), no targets, and reports `feature_loss` and
    `attention_loss`. Building it freezes the teacher and the student's
    other weights: `progressive_transfer` unfreezes the student after its
    last stage.

    Args:
        teacher: `BertBackbone` (or a task model: its backbone), frozen.
        student: `BertBackbone` (e.g. a `MobileBertBackbone`) of the
            teacher's vocabulary.
        block: int. the student block trained, 1-based.
        teacher_block: int. the teacher block it learns from, 1-based.
        alpha_feature: float. weight of the feature-map MSE.
        alpha_attention: float. weight of the attention KL (0: left out).
        train_embeddings: bool or None. also train the student's
            embeddings; None: at block 1 only.
        projection: `keras.layers.Dense` or None. maps the student's width
            to the teacher's; None: a new one where the widths differ.

    Example:
    >>> teacher = kbert.BertBackbone(100, 2, 2, 16, 32, max_sequence_length=16)
    >>> student = kbert.MobileBertBackbone(100, 2, 2, 16, 16, max_sequence_length=16,
    ...                                    embedding_dim=8, bottleneck_dim=8)
    >>> stage = LayerTransfer(teacher, student, block=1, teacher_block=1)
    >>> stage.compile()
    """

    targets_required = False  # the teacher gives the targets
    calls_backbone = False  # its step runs the backbones' layers itself
    # `compile`'s Adam epsilon. The losses are means over every element of
    # the feature and attention maps, so per-weight gradients are small:
    # against the original BERT's 1e-6, a MobileBERT block learning from
    # all-MiniLM-L6-v2 moves 3-30x less per step in most of its kernels.
    adam_epsilon = 1e-8

    def __init__(
        self,
        teacher,
        student,
        block,
        teacher_block,
        alpha_feature=1.0,
        alpha_attention=1.0,
        train_embeddings=None,
        projection=None,
        **kwargs,
    ):
        t_backbone = _backbone_of(teacher, "teacher")
        s_backbone = _backbone_of(student, "student")
        if t_backbone is s_backbone:
            raise ValueError("teacher and student are the same backbone; the student needs its own")
        if t_backbone.vocabulary_size != s_backbone.vocabulary_size:
            raise ValueError(
                f"teacher vocabulary ({t_backbone.vocabulary_size}) and student vocabulary "
                f"({s_backbone.vocabulary_size}) differ; build the student with the teacher's"
            )
        for name, value, limit in [
            ("block", block, s_backbone.num_layers),
            ("teacher_block", teacher_block, t_backbone.num_layers),
        ]:
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
                raise ValueError(f"{name} must be a block number in 1..{limit}, got {value!r}")
        for name, value in [("alpha_feature", alpha_feature), ("alpha_attention", alpha_attention)]:
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if not alpha_feature and not alpha_attention:
            raise ValueError("alpha_feature and alpha_attention are both 0: nothing to learn")
        if train_embeddings is None:
            train_embeddings = block == 1
        scores = bool(alpha_attention)

        # === Graph ===
        inputs = self.backbone_inputs(s_backbone)
        t_out = FrozenForward(
            t_backbone,
            hidden_layers=[teacher_block],
            score_layers=[teacher_block] if scores else [],
            name="teacher_forward",
        )(inputs)
        s_out = StudentForward(
            s_backbone,
            hidden_layers=[block],
            score_layers=[block] if scores else [],
            name="student_forward",
        )(inputs)
        if projection is None and t_backbone.hidden_dim != s_backbone.hidden_dim:
            projection = _projection(t_backbone, s_backbone)
        features = s_out[f"hidden_{block}"]
        outputs = {
            "teacher_features": t_out[f"hidden_{teacher_block}"],
            "student_features": projection(features) if projection is not None else features,
        }
        if scores:
            outputs["teacher_scores"] = t_out[f"scores_{teacher_block}"]
            outputs["student_scores"] = s_out[f"scores_{block}"]
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)

        # Only this stage's block (and the embeddings, the projection) train.
        keras_internals.set_trainable(s_backbone, False)
        keras_internals.set_trainable(s_backbone.transformer_layers[block - 1], True)
        if train_embeddings:
            keras_internals.set_trainable(s_backbone.get_layer("embeddings"), True)

        # === Config ===
        preprocessor, self.preprocessor_conflict = _shared_preprocessor(teacher, student)
        self._set_backbone(s_backbone, preprocessor)
        self.teacher = teacher
        self.student = student
        self.block = block
        self.teacher_block = teacher_block
        self.alpha_feature = float(alpha_feature)
        self.alpha_attention = float(alpha_attention)
        self.train_embeddings = bool(train_embeddings)
        self.projection = projection
        self.feature_tracker = keras.metrics.Mean(name="feature_loss")
        self.attention_tracker = keras.metrics.Mean(name="attention_loss") if scores else None

    @property
    def metrics(self):
        inner = {id(m) for model in (self.teacher, self.student) for m in model.metrics}
        listed = [m for m in super().metrics if id(m) not in inner]
        own = [m for m in (self.feature_tracker, self.attention_tracker) if m is not None]
        return listed + [m for m in own if not any(m is other for other in listed)]

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        mask = x["padding_mask"]
        feature = distillation.hidden_state_mse(
            y_pred["teacher_features"], y_pred["student_features"], mask
        )
        self.feature_tracker.update_state(feature, sample_weight=keras.ops.ones_like(feature))
        total = self.alpha_feature * feature
        if self.attention_tracker is not None:
            attention = distillation.attention_kl(
                y_pred["teacher_scores"], y_pred["student_scores"], mask
            )
            self.attention_tracker.update_state(
                attention, sample_weight=keras.ops.ones_like(attention)
            )
            total = total + self.alpha_attention * attention
        return total

    def save_to_preset(self, preset_dir, preprocessor=None):
        raise ValueError(
            "a LayerTransfer holds two models and is not a preset; save the student: "
            "`stage.student.save_to_preset(directory)`"
        )

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "teacher": keras.saving.serialize_keras_object(self.teacher),
            "student": keras.saving.serialize_keras_object(self.student),
            "block": self.block,
            "teacher_block": self.teacher_block,
            "alpha_feature": self.alpha_feature,
            "alpha_attention": self.alpha_attention,
            "train_embeddings": self.train_embeddings,
            "projection": keras.saving.serialize_keras_object(self.projection)
            if self.projection is not None
            else None,
        }

    @classmethod
    @initializers.placeholders_when_loading
    def from_config(cls, config):
        config = dict(config)
        for key in ("teacher", "student", "projection"):
            if config.get(key) is not None:
                config[key] = keras.saving.deserialize_keras_object(config[key])
        return cls(**config)

    def compile(self, optimizer="adamw", learning_rate=1e-3, **kwargs):
        """AdamW at `learning_rate`; see `Task.compile`."""
        super().compile(optimizer, learning_rate, **kwargs)


def progressive_transfer(
    teacher,
    student,
    x,
    layer_map=None,
    epochs_per_block=1,
    batch_size=32,
    learning_rate=1e-3,
    alpha_feature=1.0,
    alpha_attention=1.0,
    verbose=0,
    **fit_kwargs,
):
    """Trains `student` block by block on the teacher's feature and
    attention maps (one `LayerTransfer` per student block, bottom up, lower
    blocks frozen), then leaves every student weight trainable again.

    Args:
        teacher: `BertBackbone` or task model (its backbone), frozen.
        student: `BertBackbone` (e.g. `MobileBertBackbone`), trained in place.
        x: model inputs or raw text, as `fit` takes them.
        layer_map: list of int or None. the teacher block (1-based) of each
            student block; None: g(m) = ceil(m * Lt / Ls) (a student deeper
            than its teacher learns each teacher block in turn).
        epochs_per_block: int. epochs of each stage.
        batch_size: int. batch size of each stage.
        learning_rate: float. AdamW's rate in each stage.
        alpha_feature: float. weight of the feature-map MSE.
        alpha_attention: float. weight of the attention KL.
        verbose: int. `fit`'s verbosity.
        **fit_kwargs: more `fit` arguments (callbacks, ...).

    Returns a list of each stage's `History.history` (`feature_loss`,
    `attention_loss`, `loss` per epoch).

    Example:
    >>> teacher = kbert.BertBackbone(100, 2, 2, 16, 32, max_sequence_length=16)
    >>> student = kbert.MobileBertBackbone(100, 2, 2, 16, 16, max_sequence_length=16,
    ...                                    embedding_dim=8, bottleneck_dim=8)
    >>> x = {"token_ids": np.ones((4, 8), "int32"), "segment_ids": np.zeros((4, 8), "int32"),
    ...      "padding_mask": np.ones((4, 8), "int32")}
    >>> len(progressive_transfer(teacher, student, x, batch_size=4))
    2
    """
    t_backbone = _backbone_of(teacher, "teacher")
    s_backbone = _backbone_of(student, "student")
    if layer_map is None:  # g(m) = ceil(m * Lt / Ls): a deeper student repeats teacher blocks
        t_layers, s_layers = t_backbone.num_layers, s_backbone.num_layers
        layer_map = [-(-m * t_layers // s_layers) for m in range(1, s_layers + 1)]
    layer_map = [int(i) for i in layer_map]
    if len(layer_map) != s_backbone.num_layers:
        raise ValueError(
            f"layer_map must give one teacher block per student block ({s_backbone.num_layers}), "
            f"got {layer_map}"
        )
    projection = None
    if t_backbone.hidden_dim != s_backbone.hidden_dim:
        projection = _projection(t_backbone, s_backbone)
    histories = []
    try:
        for block, teacher_block in enumerate(layer_map, start=1):
            stage = LayerTransfer(
                teacher,
                student,
                block,
                teacher_block,
                alpha_feature=alpha_feature,
                alpha_attention=alpha_attention,
                projection=projection,
                name=f"layer_transfer_{block}",
            )
            stage.compile(learning_rate=learning_rate)
            history = stage.fit(
                x, batch_size=batch_size, epochs=epochs_per_block, verbose=verbose, **fit_kwargs
            )
            histories.append(history.history)
    finally:
        keras_internals.set_trainable(s_backbone, True)
    return histories
