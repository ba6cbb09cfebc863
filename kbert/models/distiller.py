"""BertDistiller: a frozen teacher training a student (DistilBERT, TinyBERT,
task distillation), and `student_from_teacher`.

Shapes: B batch, T tokens, S tokens (keys, = T), N heads, D head size,
H hidden (teacher Ht, student Hs), P predictions, V vocabulary, C classes.

One compiled step runs both models: the teacher (inside `FrozenForward`,
whose call takes no `training` argument, so `fit` cannot switch its dropout
on) under `stop_gradient`, and the student (inside `StudentForward`, which
takes the distiller's `training`), so the student trains with dropout and
the teacher never updates.
Hidden states and attention scores come from the backbones' own layers (the
embeddings, each block, and each block's `qkv` projection for the scores),
so any backbone serves as it is.
"""

import math
import numbers

import keras
import numpy as np
from keras import ops

from kbert.layers import initializers
from kbert.models.backbone import BertBackbone, encoder_forward, is_packed
from kbert.models.classifier import BertClassifier
from kbert.models.pretrainer import _PreTrainingTask, masked_lm_loss
from kbert.models.question_answerer import BertQuestionAnswerer
from kbert.models.task import Task
from kbert.models.token_classifier import BertTokenClassifier
from kbert.training import distillation
from kbert.utils import checks

# model family -> what its head gives: "backbone" none, "mlm" MLM logits on
# mask_positions, "sequence" / "token" / "span" task logits.
_FAMILIES = (
    (BertBackbone, "backbone"),
    (_PreTrainingTask, "mlm"),
    (BertClassifier, "sequence"),
    (BertTokenClassifier, "token"),
    (BertQuestionAnswerer, "span"),
)


def _family(model, role):
    for cls, family in _FAMILIES:
        if isinstance(model, cls):
            return family
    raise ValueError(
        f"{role} is a {type(model).__name__}; BertDistiller takes a BertBackbone, "
        "BertPreTrainer, BertMaskedLM, BertClassifier, BertTokenClassifier or "
        "BertQuestionAnswerer"
    )


def _backbone_of(model):
    return model if isinstance(model, BertBackbone) else model.backbone


def _on_host(value):
    """Targets given as NumPy arrays, lists or numbers, which are checked
    here; tensors and dataset elements are left to the loss."""
    return isinstance(value, (np.ndarray, list, tuple, numbers.Number))


def _is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _scalar(value):
    """A 0-d array as its Python number; anything else as it is."""
    return value.item() if isinstance(value, np.ndarray) and value.ndim == 0 else value


def _answer_targets(y):
    """A `(start, end)` pair as the answer-position dict."""
    if isinstance(y, (tuple, list)) and len(y) == 2:
        return {"start_positions": y[0], "end_positions": y[1]}
    return y


def _tokenizer_differences(teacher, student):
    """The tokenizer settings in which two preprocessors differ (names)."""
    a, b = teacher.get_config()["tokenizer"], student.get_config()["tokenizer"]
    return [key for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]


def _shared_preprocessor(teacher, student):
    """(the preprocessor raw text goes through, or None; why there is none
    although a model carries one, or None). The student's, else the
    teacher's: the inputs feed both models, so both must tokenize alike."""
    t_pre = getattr(teacher, "preprocessor", None)
    s_pre = getattr(student, "preprocessor", None)
    if t_pre is not None and s_pre is not None:
        differ = _tokenizer_differences(t_pre, s_pre)
        if differ:
            return None, (
                "BertDistiller got raw text, but its teacher and student tokenize differently "
                f"(their tokenizers differ in {', '.join(differ)}), so one text would give "
                "each model other tokens; give both models one tokenizer (build the "
                "student from the teacher's preset or preprocessor), or pass model inputs "
                "(a dict with token_ids, segment_ids, padding_mask)"
            )
    return (s_pre if s_pre is not None else t_pre), None


def student_from_teacher(teacher_backbone, layers=(0, 2, 4), name=None):
    """A smaller `BertBackbone` initialised from chosen teacher blocks
    (DistilBERT: every other layer).

    Same config as the teacher except `num_layers = len(layers)`; the
    embeddings, the pooler and block `layers[i]` of the teacher are copied
    into block i.

    Args:
        teacher_backbone: `BertBackbone` (or a task model: its backbone).
        layers: sequence of int. 0-based teacher blocks, in student order.
        name: str or None. the student's name.

    Example:
    >>> teacher = kbert.BertBackbone(100, 4, 2, 16, 32, max_sequence_length=16)
    >>> student_from_teacher(teacher, layers=[0, 2]).num_layers
    2
    """
    teacher = _backbone_of(teacher_backbone) if isinstance(teacher_backbone, Task) else None
    teacher = teacher or teacher_backbone
    if not isinstance(teacher, BertBackbone):
        raise ValueError(
            f"student_from_teacher needs a BertBackbone (or a task model), got "
            f"{type(teacher_backbone).__name__}"
        )
    return BertBackbone.from_teacher(teacher, layers, name=name)


def _attention_scores(block, hidden, training):
    """Block `block`'s pre-softmax attention scores QK^T / sqrt(D) on its
    input `hidden`, from the block's own qkv projection (B, N, T, S),
    float32, no mask added."""
    if hasattr(block, "attention_scores"):  # a block whose attention inputs are its own
        return block.attention_scores(hidden, **training)
    attention = block.self_attention
    batch, length = ops.shape(hidden)[0], ops.shape(hidden)[1]
    qkv = attention.qkv(hidden, **training)
    qkv = ops.reshape(qkv, (batch, length, 3, attention.num_heads, attention.head_dim))
    query, key, _ = ops.unstack(qkv, num=3, axis=2)  # (B, T, N, D); see MultiHeadSelfAttention
    scores = ops.einsum("btnd,bsnd->bnts", query, key)  # (B, N, T, S)
    return ops.cast(scores, "float32") * (1.0 / math.sqrt(attention.head_dim))


def forward(model, inputs, hidden_layers=(), score_layers=(), training=None):
    """The outputs distillation reads, from `model`'s own layers.

    Returns a dict: `logits` (the head's float32 logits, for task and MLM
    models; for span models (B, 2, T)), `hidden_{i}` for i in
    `hidden_layers` (0 the embedding output, i the output of block i,
    1-based) and `scores_{i}` for i in `score_layers` (block i's attention
    scores). `training`: passed explicitly to every layer when not None.
    Packed rows (`inputs` of `BertBackbone`'s packed forward, a classifier's
    `fit`): hidden states per row, logits per example; no scores.
    """
    kw = {} if training is None else {"training": training}
    family = _family(model, "model")
    backbone = _backbone_of(model)
    mask = inputs["padding_mask"]
    out = {}
    wanted = set(hidden_layers)
    pooled = None
    if is_packed(inputs):
        if score_layers or family != "sequence":
            raise ValueError(
                "packed rows give a classifier's logits and hidden states, not attention "
                "scores or per-token outputs (fit with pack_rows=False)"
            )
        features = encoder_forward(
            backbone.get_layer("embeddings"),
            backbone.transformer_layers,
            backbone.get_layer("pooler"),
            inputs,
            training=training,
            hidden_states=bool(wanted),
        )
        out.update({f"hidden_{i}": features["hidden_states"][:, i] for i in sorted(wanted)})
        x, pooled = features["sequence_output"], features["pooled_output"]
    else:
        x = backbone.get_layer("embeddings")(inputs["token_ids"], inputs["segment_ids"], **kw)
        if 0 in wanted:
            out["hidden_0"] = x
        for i, block in enumerate(backbone.transformer_layers, start=1):
            if i in score_layers:
                out[f"scores_{i}"] = _attention_scores(block, x, kw)
            if i > max([*wanted, *score_layers, 0]) and family == "backbone":
                break  # nothing later is read
            x = block(x, mask, **kw)
            if i in wanted:
                out[f"hidden_{i}"] = x
    if family == "mlm":
        out["logits"] = model.get_layer("mlm_head")(x, inputs["mask_positions"], **kw)
    elif family != "backbone":
        features = x
        if family == "sequence":
            features = backbone.get_layer("pooler")(x, **kw) if pooled is None else pooled
        logits = model.get_layer("classifier_dropout")(features, **kw)
        # `training` to every layer: JAX's step gives no Keras call context
        # (a float8 layer needs it to update its scales)
        logits = model.get_layer("logits")(logits, **kw)
        logits = model.get_layer("float32_logits")(logits)
        if family == "span":  # (B, T, 2) -> start, end over T, padding masked
            start = model.get_layer("start_logits")(logits[:, :, 0], mask)
            end = model.get_layer("end_logits")(logits[:, :, 1], mask)
            logits = ops.stack([start, end], axis=1)  # (B, 2, T)
        out["logits"] = logits
    return out


class _Forward(keras.layers.Layer):
    """`forward(model, ...)` as one layer of a distiller's graph (the
    model's own layers would clash by name: every block has a `qkv`)."""

    def __init__(self, model, hidden_layers=(), score_layers=(), **kwargs):
        super().__init__(**kwargs)
        self.model = model
        self.hidden_layers = [int(i) for i in hidden_layers]
        self.score_layers = [int(i) for i in score_layers]
        self.built = True

    def run(self, inputs, training):
        return forward(self.model, inputs, self.hidden_layers, self.score_layers, training)

    def compute_output_spec(self, inputs, training=None):
        # From shapes: tracing `forward` on placeholder tensors would exceed
        # the backbone's max_sequence_length on some backends.
        model = self.model
        backbone = _backbone_of(model)
        batch, length = inputs["token_ids"].shape
        dtype = backbone.get_layer("embeddings").compute_dtype
        spec = {
            f"hidden_{i}": keras.KerasTensor((batch, length, backbone.hidden_dim), dtype=dtype)
            for i in self.hidden_layers
        }
        for i in self.score_layers:
            shape = (batch, backbone.num_heads, length, length)
            spec[f"scores_{i}"] = keras.KerasTensor(shape, dtype="float32")
        family = _family(model, "model")
        shapes = {
            "mlm": (batch, inputs.get("mask_positions", inputs["token_ids"]).shape[1]),
            "sequence": (batch,),
            "token": (batch, length),
            "span": (batch, 2, length),
        }
        if family in shapes:
            classes = {"mlm": backbone.vocabulary_size, "span": None}
            last = classes.get(family, getattr(model, "num_classes", None))
            shape = shapes[family] + ((last,) if last else ())
            spec["logits"] = keras.KerasTensor(shape, dtype="float32")
        return spec

    def get_config(self):
        config = super().get_config()
        config.update(
            model=keras.saving.serialize_keras_object(self.model),
            hidden_layers=self.hidden_layers,
            score_layers=self.score_layers,
        )
        return config

    @classmethod
    @initializers.placeholders_when_loading
    def from_config(cls, config):
        config = dict(config)
        config["model"] = keras.saving.deserialize_keras_object(config["model"])
        return cls(**config)


@keras.saving.register_keras_serializable(package="kbert")
class FrozenForward(_Forward):
    """The teacher's `forward` at inference (no dropout), frozen and under
    stop_gradient.

    Its `call` takes no `training` argument, so a model that holds it can
    train without switching the teacher to training mode.

    Args:
        model: the teacher (a `BertBackbone` or a kbert task model).
        hidden_layers: list of int. hidden states to return (see `forward`).
        score_layers: list of int. blocks whose attention scores to return.
    """

    def __init__(self, model, hidden_layers=(), score_layers=(), **kwargs):
        super().__init__(model, hidden_layers, score_layers, **kwargs)
        self.model.trainable = False
        # A model rebuilt from its config can keep sublayer variables marked
        # trainable (seen on TensorFlow), and a parent model collects
        # trainable weights by that mark.
        for variable in self.model.weights:
            variable.trainable = False

    def call(self, inputs):
        return {k: ops.stop_gradient(v) for k, v in self.run(inputs, False).items()}


@keras.saving.register_keras_serializable(package="kbert")
class StudentForward(_Forward):
    """The student's `forward`, in training mode when the distiller trains.

    Args: as `FrozenForward`.
    """

    def call(self, inputs, training=None):
        return self.run(inputs, training)


_LOSSES = ("ce", "mlm", "task", "cos", "hidden", "attention")


def _paired_outputs(t_out, s_out, pairs, score_pairs, projection):
    """The distiller's outputs from the teacher's and student's `forward`:
    the paired hidden states (the student's projected to the teacher's
    width), attention scores and logits."""
    outputs = {}
    for s, t in pairs:
        hidden = s_out[f"hidden_{s}"]
        outputs[f"student_hidden_{s}"] = projection(hidden) if projection else hidden
        outputs[f"teacher_hidden_{t}"] = t_out[f"hidden_{t}"]
    for s, t in score_pairs:
        outputs[f"student_scores_{s}"] = s_out[f"scores_{s}"]
        outputs[f"teacher_scores_{t}"] = t_out[f"scores_{t}"]
    if "logits" in s_out:
        outputs["student_logits"] = s_out["logits"]
        outputs["teacher_logits"] = t_out["logits"]
    return outputs


def _weighted_mean(losses, sample_weight):
    """Mean of `losses` over their weights (the plain mean without weights)."""
    if sample_weight is None:
        return ops.mean(losses)
    weights = ops.cast(ops.reshape(sample_weight, ops.shape(losses)), "float32")
    return ops.sum(losses * weights) / (ops.sum(weights) + 1e-5)


@keras.saving.register_keras_serializable(package="kbert")
class BertDistiller(Task):
    """A frozen teacher training a student in `fit`, on every backend.

    Teacher and student are of one kind, and the kind decides the losses
    that apply (each weighted by its `alpha_*`; 0 leaves it out):

    - `BertBackbone`s: representation losses only (`alpha_cos`,
      `alpha_hidden`, `alpha_attention`); `fit(x)` on model inputs.
    - `BertPreTrainer` / `BertMaskedLM` (DistilBERT): soft targets on the MLM
      logits (`alpha_ce`, temperature T), the hard MLM loss on `mask_ids`
      (`alpha_mlm`), and the representation losses; `fit(x, y)` on
      `kbert.data` pre-training batches (NSP is not distilled).
    - `BertClassifier`, `BertTokenClassifier`, `BertQuestionAnswerer`
      (task distillation): soft labels (`alpha_ce`; for a regression
      classifier the squared difference of the predictions) and the task's
      label loss (`alpha_task`) on the task's targets, and the
      representation losses. The label loss is the mean over
      `sample_weight` where `fit` gets one: examples of weight 0 (text
      without labels, a transfer set as in TinyBERT's augmentation) learn
      from the teacher's soft labels only.

    Losses (see `kbert.training.distillation`): `ce` KL divergence at
    temperature T, times T^2; `cos` 1 - cosine of the last hidden states per
    real token; `hidden` mean squared error of the embedding output and each
    student block's output against teacher block `layer_map[m - 1]`;
    `attention` mean squared error of pre-softmax attention scores of those
    block pairs over real query-key pairs (same head count needed). When
    the widths differ, a learned dense `hidden_projection` (student width
    -> teacher width) maps the student's hidden states for `cos` and
    `hidden` (TinyBERT). Defaults are DistilBERT's: T = 2, alpha_ce 5,
    alpha_mlm 2, alpha_cos 1.

    Hard losses need targets: with `alpha_mlm` or `alpha_task` above 0,
    `fit` without them is an error. `fit` reports every active loss
    (`ce_loss`, `mlm_loss`, ...). Only the student (and the projection)
    train; `distiller.student` is the model to keep.

    `fit` takes raw text where the student carries a preprocessor (a
    `from_preset` model does), or else the teacher: the text goes through
    that one preprocessor to both models. Where both carry one and their
    tokenizers differ (vocabulary, lowercasing, rules, ...), raw text is
    refused, naming the difference; model inputs still train.

    Building the distiller freezes the teacher (`teacher.trainable` and
    each of its weights become False); to fine-tune the teacher itself
    again, set `teacher.trainable = True` (a task model built with
    `freeze_backbone` then needs `teacher.set_backbone_training(...)`
    again).

    Args:
        teacher: a `BertBackbone` or kbert task model (frozen here).
        student: a model of the teacher's kind, same vocabulary.
        temperature: float. T of the soft targets.
        alpha_ce: float. soft-target weight.
        alpha_mlm: float. hard masked-LM weight (MLM models).
        alpha_task: float. task label-loss weight (task models).
        alpha_cos: float. cosine loss on the last hidden states.
        alpha_hidden: float. hidden-state (and embedding) MSE.
        alpha_attention: float. attention-score MSE.
        layer_map: list of int or None. the 1-based teacher block each
            student block learns from; None: TinyBERT's g(m) = m * Lt / Ls
            (rounded up for a student deeper than its teacher).

    Example:
    >>> teacher = kbert.BertBackbone(100, 4, 2, 16, 32, max_sequence_length=16)
    >>> student = student_from_teacher(teacher, layers=[0, 2])
    >>> distiller = BertDistiller(teacher, student, alpha_hidden=1.0)
    >>> distiller.compile()
    """

    targets_required = False  # soft targets come from the teacher

    # its step runs the backbones' layers itself, not their `call`
    calls_backbone = False

    def __init__(
        self,
        teacher,
        student,
        temperature=2.0,
        alpha_ce=5.0,
        alpha_mlm=2.0,
        alpha_task=1.0,
        alpha_cos=1.0,
        alpha_hidden=0.0,
        alpha_attention=0.0,
        layer_map=None,
        **kwargs,
    ):
        family = _family(teacher, "teacher")
        if _family(student, "student") != family:
            raise ValueError(
                f"teacher is a {type(teacher).__name__} and student a {type(student).__name__}; "
                "distil between models of one kind (build the student with the teacher's class)"
            )
        temperature = _scalar(temperature)
        if not _is_number(temperature) or not temperature > 0:
            raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
        alphas = dict(
            ce=alpha_ce,
            mlm=alpha_mlm,
            task=alpha_task,
            cos=alpha_cos,
            hidden=alpha_hidden,
            attention=alpha_attention,
        )
        alphas = {loss: _scalar(value) for loss, value in alphas.items()}
        for loss, value in alphas.items():
            if not _is_number(value) or value < 0:
                raise ValueError(f"alpha_{loss} must be a number >= 0, got {value!r}")
        alphas = {loss: float(value) for loss, value in alphas.items()}
        t_backbone, s_backbone = _backbone_of(teacher), _backbone_of(student)
        if t_backbone is s_backbone:
            raise ValueError(
                "teacher and student are the same model (or share a backbone); the student "
                "needs its own weights: build it with student_from_teacher or from a preset"
            )
        if t_backbone.vocabulary_size != s_backbone.vocabulary_size:
            raise ValueError(
                f"teacher vocabulary ({t_backbone.vocabulary_size}) and student vocabulary "
                f"({s_backbone.vocabulary_size}) differ; the student needs the teacher's "
                "vocabulary (student_from_teacher keeps it)"
            )
        if family in ("sequence", "token") and teacher.num_classes != student.num_classes:
            raise ValueError(
                f"teacher has {teacher.num_classes} classes and student {student.num_classes}; "
                "build the student with the teacher's num_classes"
            )
        t_layers, s_layers = t_backbone.num_layers, s_backbone.num_layers
        if layer_map is None:
            layer_map = distillation.default_layer_map(t_layers, s_layers)
        layer_map = list(layer_map)
        if not all(_is_number(i) and float(i).is_integer() for i in layer_map):
            raise ValueError(f"layer_map must be a list of int block numbers, got {layer_map!r}")
        layer_map = [int(i) for i in layer_map]
        if len(layer_map) != s_layers or not all(1 <= i <= t_layers for i in layer_map):
            raise ValueError(
                f"layer_map must give one teacher block (1..{t_layers}) per student block "
                f"({s_layers}), got {layer_map}"
            )
        if alpha_attention and t_backbone.num_heads != s_backbone.num_heads:
            raise ValueError(
                f"attention distillation compares heads one to one: the teacher has "
                f"{t_backbone.num_heads} heads, the student {s_backbone.num_heads}; use the "
                "teacher's head count or alpha_attention=0"
            )
        # the losses that apply to this kind of model
        active = {k: v for k, v in alphas.items() if v}
        if family == "backbone":
            active.pop("ce", None)
        if family != "mlm":
            active.pop("mlm", None)
        if family in ("backbone", "mlm"):
            active.pop("task", None)
        if not active:
            raise ValueError(
                f"no loss applies to a {type(teacher).__name__} with these weights; "
                "set alpha_cos, alpha_hidden or alpha_attention (or alpha_ce for heads)"
            )

        # (student hidden index, teacher hidden index) pairs read by the losses
        pairs = []
        if "hidden" in active:
            pairs += [(0, 0)] + [(m, layer_map[m - 1]) for m in range(1, s_layers + 1)]
        if "cos" in active:
            pairs.append((s_layers, t_layers))
        pairs = sorted(set(pairs))
        score_pairs = (
            [(m, layer_map[m - 1]) for m in range(1, s_layers + 1)] if "attention" in active else []
        )

        # === Graph ===
        inputs = self.backbone_inputs(s_backbone)
        if family == "mlm":
            inputs["mask_positions"] = keras.Input(
                shape=(None,), dtype="int32", name="mask_positions"
            )
        frozen = FrozenForward(
            teacher,
            hidden_layers=sorted({t for _, t in pairs}),
            score_layers=sorted({t for _, t in score_pairs}),
            name="teacher_forward",
        )
        t_out = frozen(inputs)
        s_out = StudentForward(
            student,
            hidden_layers=sorted({s for s, _ in pairs}),
            score_layers=sorted({s for s, _ in score_pairs}),
            name="student_forward",
        )(inputs)
        projection = None
        if pairs and t_backbone.hidden_dim != s_backbone.hidden_dim:
            projection = keras.layers.Dense(
                t_backbone.hidden_dim,
                kernel_initializer=initializers.truncated_normal(s_backbone.initializer_range),
                dtype=s_backbone.get_layer("embeddings").dtype_policy,
                name="hidden_projection",
            )
        outputs = _paired_outputs(t_out, s_out, pairs, score_pairs, projection)
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)

        # === Config ===
        # Raw text: through the student's preprocessor (else the teacher's),
        # where the two tokenize alike.
        preprocessor, self.preprocessor_conflict = _shared_preprocessor(teacher, student)
        self._set_backbone(s_backbone, preprocessor)
        self.teacher = teacher
        self.student = student
        self.family = family
        self.temperature = float(temperature)
        self.alphas = alphas
        self.active = active
        self.layer_map = layer_map
        self.pairs = pairs
        self.score_pairs = score_pairs
        self.loss_trackers = {k: keras.metrics.Mean(name=f"{k}_loss") for k in active}
        # Classifiers: `fit` may pack several examples per row, as the
        # student's own `fit` does (all but attention scores are per token
        # of a row or per example).
        self.packs_rows = family == "sequence" and not score_pairs

    def call(self, inputs, training=None, mask=None, **kwargs):
        if is_packed(inputs):  # not in the functional graph, as `BertClassifier.call`
            t_out = self.get_layer("teacher_forward")(inputs)
            s_out = self.get_layer("student_forward")(inputs, training=training)
            projection = None
            if any(layer.name == "hidden_projection" for layer in self.layers):
                projection = self.get_layer("hidden_projection")
            return _paired_outputs(t_out, s_out, self.pairs, self.score_pairs, projection)
        return super().call(inputs, training=training, mask=mask, **kwargs)

    def check_targets(self, y):
        """The label checks of the student's task (class ids, one per
        example; regression scores), masked-LM ids against the vocabulary
        where `mask_weights` counts them, and answer positions against
        `max_sequence_length` (a `(start, end)` pair is taken as the two
        positions). Host values only: tensors are left to the loss."""
        if self.family == "sequence" and self.student.num_classes == 1:
            return self.student.check_targets(y)
        if self.family == "sequence":
            if not _on_host(y):
                return None
            return checks.check_class_ids(np.asarray(y), self.student.num_classes, per_example=True)
        if self.family == "span":
            y = _answer_targets(y)
            if not isinstance(y, dict):
                return None
            length = self.backbone.max_sequence_length
            return {
                key: checks.check_class_ids(value, length, kind="answer", meaning="token positions")
                if key in ("start_positions", "end_positions") and _on_host(value)
                else value
                for key, value in y.items()
            }
        if self.family == "mlm" and isinstance(y, dict) and _on_host(y.get("mask_ids")):
            ids = np.asarray(y["mask_ids"])
            weights = y.get("mask_weights")
            if _on_host(weights) and np.shape(weights) == ids.shape:
                ids = ids[np.asarray(weights) > 0]  # padded slots may hold anything
            checks.check_class_ids(
                ids, self.backbone.vocabulary_size, kind="masked-LM", meaning="token ids"
            )
        return None

    def input_limits(self):
        """Inputs go to both models: the smaller of their limits."""
        teacher, student = _backbone_of(self.teacher), _backbone_of(self.student)
        return {
            name: min(getattr(teacher, name), getattr(student, name))
            for name in ("vocabulary_size", "type_vocab_size", "max_sequence_length")
        }

    def save_to_preset(self, preset_dir, preprocessor=None):
        raise ValueError(
            "a BertDistiller holds two models and is not a preset; save the model to keep: "
            "`distiller.student.save_to_preset(directory)` (or the whole distiller with "
            "`distiller.save('distiller.keras')`)"
        )

    @property
    def token_targets(self):
        """A tagger's labels and weights are per token: length buckets cut
        them with the inputs."""
        return getattr(self, "family", None) == "token"

    def task_config(self):
        return {
            "temperature": self.temperature,
            **{f"alpha_{k}": v for k, v in self.alphas.items()},
            "layer_map": self.layer_map,
        }

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "teacher": keras.saving.serialize_keras_object(self.teacher),
            "student": keras.saving.serialize_keras_object(self.student),
            **self.task_config(),
        }

    @classmethod
    @initializers.placeholders_when_loading
    def from_config(cls, config):
        config = dict(config)
        for role in ("teacher", "student"):
            config[role] = keras.saving.deserialize_keras_object(config[role])
        return cls(**config)

    @property
    def metrics(self):
        # the teacher's and student's own trackers (a task's `mlm_loss`, ...)
        # are not updated here: left out, so that names stay unambiguous
        inner = {id(m) for model in (self.teacher, self.student) for m in model.metrics}
        listed = [m for m in super().metrics if id(m) not in inner]
        own = list(self.loss_trackers.values())
        return listed + [m for m in own if not any(m is other for other in listed)]

    # --- losses -----------------------------------------------------------

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        terms = self.distillation_losses(x, y, y_pred, sample_weight)
        total = 0.0
        for name, value in terms.items():
            self.loss_trackers[name].update_state(value, sample_weight=ops.ones_like(value))
            total = total + self.active[name] * value
        for extra in self.losses:
            total = total + ops.cast(extra, "float32")
        return total

    def distillation_losses(self, x, y, y_pred, sample_weight=None):
        """Each active loss, unweighted: a dict name -> float32 scalar."""
        mask = x["padding_mask"]
        terms = {}
        if "cos" in self.active:
            s_layers, t_layers = self.backbone_layers("student"), self.backbone_layers("teacher")
            terms["cos"] = distillation.cosine_loss(
                y_pred[f"teacher_hidden_{t_layers}"], y_pred[f"student_hidden_{s_layers}"], mask
            )
        if "hidden" in self.active:
            values = [
                distillation.hidden_state_mse(
                    y_pred[f"teacher_hidden_{t}"], y_pred[f"student_hidden_{s}"], mask
                )
                for s, t in [(0, 0)] + [(m, self.layer_map[m - 1]) for m in self._student_blocks()]
            ]
            terms["hidden"] = sum(values[1:], values[0])
        if "attention" in self.active:
            values = [
                distillation.attention_score_mse(
                    y_pred[f"teacher_scores_{t}"], y_pred[f"student_scores_{s}"], mask
                )
                for s, t in self.score_pairs
            ]
            terms["attention"] = sum(values[1:], values[0])
        if self.family != "backbone":
            terms.update(self._head_losses(x, y, y_pred, sample_weight))
        return terms

    def backbone_layers(self, role):
        return _backbone_of(getattr(self, role)).num_layers

    def _student_blocks(self):
        return range(1, self.backbone_layers("student") + 1)

    def _head_losses(self, x, y, y_pred, sample_weight):
        teacher, student = y_pred["teacher_logits"], y_pred["student_logits"]
        hard = "mlm" if self.family == "mlm" else "task"
        if hard in self.active and y is None:
            raise ValueError(
                f"alpha_{hard}={self.alphas[hard]} needs targets; pass y to fit "
                f"(or alpha_{hard}=0 to distil on soft targets only)"
            )
        terms = {}
        if self.family == "mlm":
            weights = y["mask_weights"] if y is not None else None
            if "ce" in self.active:
                terms["ce"] = distillation.soft_target_loss(
                    teacher, student, self.temperature, weights
                )
            if "mlm" in self.active:
                terms["mlm"] = masked_lm_loss(y["mask_ids"], student, y["mask_weights"])
            return terms
        if self.family == "sequence" and self.student.num_classes == 1:  # regression
            if "ce" in self.active:
                terms["ce"] = ops.mean(ops.square(teacher - student))
            if "task" in self.active:
                target = ops.reshape(ops.cast(y, "float32"), (-1,))
                terms["task"] = _weighted_mean(ops.square(student[:, 0] - target), sample_weight)
            return terms
        weights = x["padding_mask"] if self.family == "token" else None
        if "ce" in self.active:
            terms["ce"] = distillation.soft_target_loss(teacher, student, self.temperature, weights)
        if "task" in self.active:
            terms["task"] = self._label_loss(y, student, sample_weight)
        return terms

    def _label_loss(self, y, logits, sample_weight):
        def cross_entropy(labels, logits):
            return keras.losses.sparse_categorical_crossentropy(
                ops.cast(labels, "int32"), logits, from_logits=True
            )

        if self.family == "span":
            y = _answer_targets(y)
            start = _weighted_mean(cross_entropy(y["start_positions"], logits[:, 0]), sample_weight)
            end = _weighted_mean(cross_entropy(y["end_positions"], logits[:, 1]), sample_weight)
            return (start + end) / 2.0
        # token family as BertTokenClassifier: only the weighted pieces count;
        # sequence family: an example of weight 0 is taught by soft targets only
        return _weighted_mean(cross_entropy(y, logits), sample_weight)

    def compile(
        self,
        optimizer="adamw",
        learning_rate=5e-4,
        num_train_steps=None,
        num_warmup_steps=None,
        **kwargs,
    ):
        """AdamW at `learning_rate` (DistilBERT's 5e-4), 10% warm-up and
        linear decay when `num_train_steps` is given; see `Task.compile`."""
        super().compile(optimizer, learning_rate, num_train_steps, num_warmup_steps, **kwargs)
