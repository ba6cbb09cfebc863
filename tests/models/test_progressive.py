"""Progressive knowledge transfer into a MobileBERT student from a teacher of
another width and head count, then pre-training distillation: each stage
runs and lowers its loss (fine-tuning a MobileBERT classifier:
tests/convert/test_mobilebert.py)."""

import keras
import numpy as np
import pytest

import kbert
from kbert.models.progressive import progressive_transfer
from kbert.training import distillation
from tests import harness

V, T = 97, 12


def _teacher():
    keras.utils.set_random_seed(0)
    # wider than the student (24 vs 16) and with more heads (4 vs 2)
    # (a wide init: peaked attention maps to learn)
    return kbert.BertBackbone(V, 2, 4, 24, 32, max_sequence_length=16, dropout=0.0,
                              attention_dropout=0.0, initializer_range=0.5)  # fmt: skip


def _student():
    keras.utils.set_random_seed(1)
    return kbert.MobileBertBackbone(
        V, 2, 2, 16, 16, max_sequence_length=16, embedding_dim=8, bottleneck_dim=8,
        num_feedforward_networks=2, attention_dropout=0.0, initializer_range=0.2,
    )  # fmt: skip


def _inputs(n=16, seed=0):
    x = harness.backbone_inputs(batch=n, length=T, vocabulary_size=V, seed=seed)
    x["padding_mask"][:, :4] = 1  # every row has a few real tokens
    return x


def test_attention_kl_is_zero_for_equal_maps_and_ignores_padding():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(2, 3, 5, 5)).astype("float32")
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], "int32")
    assert float(distillation.attention_kl(scores, scores, mask)) == pytest.approx(0.0, abs=1e-6)
    other = scores.copy()
    other[0, :, :, 3:] += 5.0  # padded keys of row 0
    other[0, :, 3:, :] += 5.0  # padded queries of row 0
    assert float(distillation.attention_kl(scores, other, mask)) == pytest.approx(0.0, abs=1e-6)
    other[1] += rng.normal(size=(3, 5, 5)).astype("float32")
    assert float(distillation.attention_kl(scores, other, mask)) > 1e-3
    # other head counts: compared as head-averaged distributions
    assert float(distillation.attention_kl(scores, scores[:, :1], mask)) > 0.0


class _FrozenCheck(keras.callbacks.Callback):
    """Records, for each stage, whether the weights below its block (and the
    embeddings after stage 1) stayed as they were and its block changed."""

    def __init__(self):
        super().__init__()
        self.kept, self.changed = [], []

    def _frozen(self):
        student = self.model.student
        layers = student.transformer_layers[: self.model.block - 1]
        if self.model.block > 1:
            layers = [student.get_layer("embeddings"), *layers]
        return [harness.to_numpy(w) for layer in layers for w in layer.weights]

    def _own(self):
        return harness.to_numpy(
            self.model.student.transformer_layers[self.model.block - 1].weights[0]
        )

    def on_train_begin(self, logs=None):
        self.before, self.own = self._frozen(), self._own()

    def on_train_end(self, logs=None):
        self.kept.append(all(np.array_equal(a, b) for a, b in zip(self.before, self._frozen())))
        self.changed.append(not np.array_equal(self.own, self._own()))


def test_progressive_transfer_then_pretraining_distillation():
    teacher, student = _teacher(), _student()
    x = _inputs()
    # 1. block by block: each stage lowers its feature and attention losses
    # and trains its own block only
    check = _FrozenCheck()
    histories = progressive_transfer(
        teacher, student, x, epochs_per_block=3, batch_size=16, learning_rate=1e-2,
        callbacks=[check],
    )  # fmt: skip
    assert len(histories) == 2
    assert check.kept == [True, True] and check.changed == [True, True]
    assert all(not w.trainable for w in teacher.weights)
    for history in histories:
        assert history["feature_loss"][-1] < history["feature_loss"][0]
        assert history["attention_loss"][-1] < history["attention_loss"][0]
    assert all(w.trainable for w in student.weights)  # unfrozen after the last stage

    # 2. pre-training distillation: masked-LM teacher and student, all layers
    keras.utils.set_random_seed(2)
    teacher_mlm = kbert.BertMaskedLM(teacher)
    student_mlm = kbert.BertMaskedLM(student)
    positions = np.tile(np.array([[1, 2, 3]], "int32"), (16, 1))
    batch = {**x, "mask_positions": positions}
    targets = {
        "mask_ids": np.take_along_axis(x["token_ids"], positions, axis=1),
        "mask_weights": np.ones((16, 3), "float32"),
    }
    distiller = kbert.BertDistiller(teacher_mlm, student_mlm, alpha_cos=0.0, alpha_hidden=1.0)
    distiller.compile(learning_rate=1e-2)
    history = distiller.fit(batch, targets, batch_size=16, epochs=3, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]
