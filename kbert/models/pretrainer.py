"""BertPreTrainer (masked LM + next sentence or sentence order prediction)
and BertMaskedLM.

Shapes: B batch, T tokens, P predictions per sequence, V vocabulary.
Inputs: token_ids, segment_ids, padding_mask (B, T), mask_positions (B, P).
Targets: mask_ids, mask_weights (B, P), next_sentence_labels (B,): the
sentence task's label, NSP (0 = B follows A, 1 = random B) or SOP (0 = A
then B in document order, 1 = swapped).
"""

import keras
from keras import ops

from kbert.backend.trainer import replica_sum
from kbert.layers import MaskedLMHead, NextSentenceHead
from kbert.models.task import Task


def masked_lm_loss(mask_ids, logits, mask_weights):
    """Mean cross-entropy over real predictions (weight 1), float32.

    Padded prediction slots have weight 0; a batch without any real
    prediction gives loss 0, not NaN (the original adds 1e-5 the same way).
    """
    total, weight = _masked_lm_sums(mask_ids, logits, mask_weights)
    return total / (weight + 1e-5)


def _masked_lm_sums(mask_ids, logits, mask_weights):
    # Rows of (B * P, V): Keras' torch loss moves the class axis to dim 1,
    # and for (B, P, V) logits that makes the softmax stride over P (a
    # strided kernel, slow on a GPU at long sequences).
    vocabulary = ops.shape(logits)[-1]
    weights = ops.reshape(ops.cast(mask_weights, "float32"), (-1,))
    # padded slots (weight 0) may hold any id, e.g. -100: read as 0, which
    # every backend's cross-entropy takes (no Python constant: on torch each
    # is a host-to-device copy)
    ids = ops.reshape(ops.cast(mask_ids, "int32"), (-1,))
    ids = ops.where(ops.cast(weights, "bool"), ids, ops.zeros_like(ids))
    losses = keras.losses.sparse_categorical_crossentropy(
        ids,
        ops.reshape(ops.cast(logits, "float32"), (-1, vocabulary)),
        from_logits=True,
    )  # (B * P,)
    return ops.sum(losses * weights), ops.sum(weights)


def next_sentence_loss(labels, logits):
    losses = keras.losses.sparse_categorical_crossentropy(
        ops.cast(labels, "int32"), ops.cast(logits, "float32"), from_logits=True
    )
    return ops.mean(losses)


SENTENCE_TASKS = ("nsp", "sop")


class _PreTrainingTask(Task):
    """Shared graph and loss of BertPreTrainer and BertMaskedLM."""

    with_nsp = True
    targets_hint = (
        "it trains on masked batches, inputs with their targets, such as those of "
        "kbert.data.dynamic_pretraining_dataset (docs/pretraining.md)"
    )
    # Pre-training datasets are packed to full length, and a TPU needs the
    # static shapes they have: tf.data batches are not cut to buckets.
    bucket_datasets = False

    def __init__(self, backbone, preprocessor=None, sentence_task="nsp", **kwargs):
        if sentence_task not in SENTENCE_TASKS:
            raise ValueError(
                f"sentence_task must be 'nsp' (next sentence prediction) or 'sop' "
                f"(sentence order prediction), got {sentence_task!r}"
            )
        if not self.with_nsp and sentence_task != "nsp":
            raise ValueError(
                f"{type(self).__name__} trains no sentence task; use "
                f"BertPreTrainer(backbone, sentence_task={sentence_task!r})"
            )
        task = sentence_task  # the prefix of the head, output and metric names
        policy = backbone.get_layer("embeddings").dtype_policy
        inputs = self.backbone_inputs(backbone)
        inputs["mask_positions"] = keras.Input(shape=(None,), dtype="int32", name="mask_positions")
        features = backbone(inputs)  # mask_positions is ignored by the backbone
        mlm_head = getattr(backbone, "masked_lm_head_class", MaskedLMHead)(
            backbone.vocabulary_size,
            backbone.hidden_dim,
            activation=backbone.activation,
            layer_norm_epsilon=backbone.layer_norm_epsilon,
            initializer_range=backbone.initializer_range,
            token_embedding=backbone.token_embedding,
            embedding_dim=backbone.embedding_dim,
            dtype=policy,
            name="mlm_head",
        )
        outputs = {"mlm_logits": mlm_head(features["sequence_output"], inputs["mask_positions"])}
        if self.with_nsp:
            head = NextSentenceHead(backbone.initializer_range, dtype=policy, name=f"{task}_head")
            outputs[f"{task}_logits"] = head(features["pooled_output"])
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        self._set_backbone(backbone, preprocessor)
        self.sentence_task = sentence_task
        self.mlm_loss_tracker = keras.metrics.Mean(name="mlm_loss")
        self.mlm_accuracy = keras.metrics.Mean(name="mlm_accuracy")
        if self.with_nsp:
            self.nsp_loss_tracker = keras.metrics.Mean(name=f"{task}_loss")
            self.nsp_accuracy = keras.metrics.SparseCategoricalAccuracy(name=f"{task}_accuracy")

    def task_config(self):
        return {"sentence_task": self.sentence_task} if self.sentence_task != "nsp" else {}

    @property
    def metrics(self):
        own = [self.mlm_loss_tracker, self.mlm_accuracy]
        if self.with_nsp:
            own += [self.nsp_loss_tracker, self.nsp_accuracy]
        # Keras already lists metrics set as attributes once built; listed
        # twice, their variables are twice in the JAX train state, and a
        # jitted step that donates the state gets one buffer twice.
        listed = super().metrics
        return listed + [m for m in own if not any(m is other for other in listed)]

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        missing = [k for k in self._target_names() if k not in (y or {})]
        if missing:
            raise ValueError(
                f"{type(self).__name__} needs targets {list(self._target_names())}; "
                f"missing {missing}"
            )
        weights = ops.cast(y["mask_weights"], "float32")
        # Normalised by global totals, so that replicas' gradients sum to the
        # single-device gradient of the same global batch.
        local_total, local_weight = _masked_lm_sums(y["mask_ids"], y_pred["mlm_logits"], weights)
        global_weight, replicas = replica_sum(local_weight)
        mlm = local_total / (global_weight + 1e-5)
        global_mlm = replica_sum(mlm)[0] if replicas > 1 else mlm
        correct = ops.cast(
            ops.equal(ops.argmax(y_pred["mlm_logits"], axis=-1), ops.cast(y["mask_ids"], "int32")),
            "float32",
        )
        # Metric weights are passed as device tensors: Keras turns a missing
        # weight into a Python count, whose host-to-device copy synchronises
        # the torch backend's stream (the step then waits for the GPU).
        self.mlm_loss_tracker.update_state(global_mlm, sample_weight=ops.ones_like(global_mlm))
        self.mlm_accuracy.update_state(correct, sample_weight=weights)
        total = mlm
        if self.with_nsp:
            logits = y_pred[f"{self.sentence_task}_logits"]
            nsp = next_sentence_loss(y["next_sentence_labels"], logits) / replicas
            nsp_total = replica_sum(nsp)[0] if replicas > 1 else nsp
            self.nsp_loss_tracker.update_state(nsp_total, sample_weight=ops.ones_like(nsp_total))
            labels = y["next_sentence_labels"]
            self.nsp_accuracy.update_state(
                labels, logits, sample_weight=ops.ones_like(labels, "float32")
            )
            total = total + nsp
        for extra in self.losses:
            total = total + ops.cast(extra, "float32")
        return total

    def _target_names(self):
        names = ("mask_ids", "mask_weights")
        return names + ("next_sentence_labels",) if self.with_nsp else names

    def compile(
        self,
        optimizer="adamw",
        learning_rate=1e-4,
        num_train_steps=10_000,
        num_warmup_steps=100,
        **kwargs,
    ):
        """Pre-training defaults: AdamW 1e-4, 100 warm-up steps, linear decay
        over `num_train_steps`; see `Task.compile`."""
        super().compile(optimizer, learning_rate, num_train_steps, num_warmup_steps, **kwargs)


@keras.saving.register_keras_serializable(package="kbert")
class BertPreTrainer(_PreTrainingTask):
    """BERT pre-training: masked LM on `mask_positions` + a sentence task.

    Outputs `mlm_logits` (B, P, V) and `nsp_logits` (B, 2), both float32.
    `fit` takes `(x, y)` batches from `kbert.data` and reports `mlm_loss`,
    `mlm_accuracy`, `nsp_loss`, `nsp_accuracy`. With `sentence_task="sop"`
    (ALBERT's sentence order prediction; data from
    `MaskingConfig(sentence_task="sop")`) the head is `sop_head`, the output
    `sop_logits` and the metrics `sop_loss`, `sop_accuracy`; the target is
    still `next_sentence_labels`, carrying the SOP label (1 = swapped).

    Args:
        backbone: `kbert.BertBackbone`.
        preprocessor: `kbert.BertPreprocessor` or None.
        sentence_task: str. "nsp" (next sentence prediction, BERT) or "sop"
            (sentence order prediction, ALBERT).

    Example:
    >>> backbone = kbert.BertBackbone(100, 2, 2, 16, 32, max_sequence_length=16)
    >>> model = BertPreTrainer(backbone)
    >>> model.compile()
    """


@keras.saving.register_keras_serializable(package="kbert")
class BertMaskedLM(_PreTrainingTask):
    """Masked-LM pre-training only (no NSP), e.g. RoBERTa-style training.

    Example:
    >>> model = BertMaskedLM(kbert.BertBackbone(100, 2, 2, 16, 32, max_sequence_length=16))
    """

    with_nsp = False
    head_weights_from = ("BertPreTrainer",)  # its MLM head, without the NSP head
