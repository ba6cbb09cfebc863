import math

import keras
import numpy as np
import pytest

import kbert
from kbert.models.distiller import student_from_teacher
from kbert.training import distillation
from tests import harness

SMALL = dict(
    vocabulary_size=50,
    num_layers=2,
    num_heads=2,
    hidden_dim=16,
    intermediate_dim=24,
    max_sequence_length=16,
)


def value(tensor):
    return float(keras.ops.convert_to_numpy(tensor))


def np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


# --- the losses, against hand-computed values ------------------------------


def test_soft_target_loss_hand_computed():
    teacher = np.array([[0.0, math.log(3.0)], [1.0, 1.0]], "float32")
    student = np.array([[0.0, 0.0], [5.0, -5.0]], "float32")
    # row 0 at T = 1: p = (1/4, 3/4), q = (1/2, 1/2);
    # KL = 1/4 log(1/2) + 3/4 log(3/2); row 1 has weight 0
    expected = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    got = distillation.soft_target_loss(teacher, student, 1.0, np.array([1.0, 0.0]))
    assert abs(value(got) - expected / (1 + 1e-5)) < 1e-6
    # T = 2 divides the logits and scales by T^2 = 4
    p = np.exp(np_log_softmax(teacher / 2))
    kl = (p * (np_log_softmax(teacher / 2) - np_log_softmax(student / 2))).sum(-1)
    got = distillation.soft_target_loss(teacher, student, 2.0)
    assert abs(value(got) - 4 * kl.sum() / (2 + 1e-5)) < 1e-5
    assert abs(value(distillation.soft_target_loss(teacher, teacher, 3.0))) < 1e-6


def test_cosine_and_hidden_losses_hand_computed():
    teacher = np.array([[[1.0, 0.0], [0.0, 2.0], [5.0, 5.0]]], "float32")
    student = np.array([[[3.0, 0.0], [1.0, 0.0], [0.0, 0.0]]], "float32")
    mask = np.array([[1, 1, 0]], "int32")  # the last token is padding
    # cos = 1 and 0 on the real tokens
    assert abs(value(distillation.cosine_loss(teacher, student, mask)) - 1 / (2 + 1e-5)) < 1e-6
    # squared differences: (4 + 0) / 2 and (1 + 4) / 2 per token
    expected = (2.0 + 2.5) / (2 + 1e-5)
    assert abs(value(distillation.hidden_state_mse(teacher, student, mask)) - expected) < 1e-6


def test_cosine_loss_gradient_is_finite_at_zero_vectors():
    """Hidden states may be zero vectors (positions filled with zeros): the
    masked-out tokens must not turn the gradient into NaN."""
    teacher = np.array([[[1.0, 2.0], [0.0, 0.0]]], "float32")
    student = np.array([[[2.0, 1.0], [0.0, 0.0]]], "float32")
    mask = np.array([[1, 0]], "int32")
    student_var = keras.Variable(student)
    if keras.backend.backend() == "jax":
        import jax

        grad = jax.grad(lambda s: distillation.cosine_loss(teacher, s, mask))(student)
    elif keras.backend.backend() == "torch":
        loss = distillation.cosine_loss(teacher, student_var.value, mask)
        loss.backward()
        grad = student_var.value.grad
    else:
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = distillation.cosine_loss(teacher, student_var.value, mask)
        grad = tape.gradient(loss, student_var.value)
    grad = keras.ops.convert_to_numpy(grad)
    assert np.all(np.isfinite(grad))
    assert np.all(grad[0, 1] == 0) and np.any(grad[0, 0] != 0)


def test_attention_score_mse_hand_computed():
    teacher = np.zeros((1, 1, 2, 2), "float32")
    student = np.array([[[[1.0, 2.0], [3.0, 4.0]]]], "float32")
    # only the (0, 0) pair has two real tokens
    got = distillation.attention_score_mse(teacher, student, np.array([[1, 0]]))
    assert abs(value(got) - 1 / (1 + 1e-5)) < 1e-6
    got = distillation.attention_score_mse(teacher, student, np.array([[1, 1]]))
    assert abs(value(got) - 30 / (4 + 1e-5)) < 1e-5


def test_default_layer_map():
    assert distillation.default_layer_map(6, 3) == [2, 4, 6]
    assert distillation.default_layer_map(4, 3) == [1, 2, 4]
    # a student deeper than its teacher: every block learns a teacher block
    assert distillation.default_layer_map(6, 11) == [1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    assert distillation.default_layer_map(3, 3) == [1, 2, 3]


def test_student_deeper_than_the_teacher_distils_with_the_default_map():
    """MobileBERT students have more (thinner) blocks than their teacher."""
    teacher = kbert.BertClassifier(kbert.BertBackbone(**{**SMALL, "num_layers": 1}), num_classes=2)
    student = kbert.BertClassifier(kbert.BertBackbone(**{**SMALL, "num_layers": 3}), num_classes=2)
    distiller = kbert.BertDistiller(teacher, student, alpha_ce=1.0, alpha_task=1.0, alpha_cos=0.0)
    assert distiller.layer_map == [1, 1, 1]
    hidden = kbert.BertDistiller(teacher.backbone, student.backbone, alpha_hidden=1.0)
    assert hidden.layer_map == [1, 1, 1]
    x = harness.backbone_inputs(4, 8, SMALL["vocabulary_size"])
    distiller.compile()
    history = distiller.fit(x, np.array([0, 1, 1, 0]), batch_size=4, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


# --- the student from the teacher ------------------------------------------


def test_student_from_teacher_copies_the_chosen_blocks():
    teacher = kbert.BertBackbone(**{**SMALL, "num_layers": 3})
    student = student_from_teacher(teacher, layers=[0, 2])
    assert student.num_layers == 2 and student.hidden_dim == teacher.hidden_dim
    pairs = [("embeddings", "embeddings"), ("pooler", "pooler")]
    pairs += [("transformer_layer_0", "transformer_layer_0")]
    pairs += [("transformer_layer_1", "transformer_layer_2")]
    for s, t in pairs:
        for a, b in zip(student.get_layer(s).get_weights(), teacher.get_layer(t).get_weights()):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="blocks 0..2"):
        student_from_teacher(teacher, layers=[0, 3])
    with pytest.raises(ValueError, match="non-empty"):
        student_from_teacher(teacher, layers=[])
    # the same through the backbone's own constructor
    again = kbert.BertBackbone.from_teacher(teacher, layers=[0, 2])
    for a, b in zip(again.get_weights(), student.get_weights()):
        np.testing.assert_array_equal(a, b)
    shared = kbert.BertBackbone(**{**SMALL, "num_layers": 3, "share_layers": True})
    with pytest.raises(ValueError, match="shares one block"):
        kbert.BertBackbone.from_teacher(shared, layers=[0, 2])


# --- the distiller -------------------------------------------------------


def weights_of(model):
    return [np.array(keras.ops.convert_to_numpy(w)) for w in model.weights]


def test_pretraining_distillation_fit_trains_the_student_only(tmp_path):
    teacher = kbert.BertMaskedLM(kbert.BertBackbone(**SMALL))
    student = kbert.BertMaskedLM(student_from_teacher(teacher.backbone, layers=[1]))
    distiller = kbert.BertDistiller(teacher, student, alpha_hidden=1.0, alpha_attention=1.0)
    x = harness.backbone_inputs(4, 8, SMALL["vocabulary_size"])
    x["mask_positions"] = np.array([[1, 2]] * 4, "int32")
    y = {
        "mask_ids": np.array([[3, 4]] * 4, "int32"),
        "mask_weights": np.array([[1, 1], [1, 0], [1, 1], [1, 0]], "float32"),
    }
    teacher_before, student_before = weights_of(teacher), weights_of(student)
    distiller.compile(learning_rate=1e-2)
    history = distiller.fit(x, y, batch_size=2, epochs=1, verbose=0).history
    for name in ("ce_loss", "mlm_loss", "cos_loss", "hidden_loss", "attention_loss", "loss"):
        assert np.isfinite(history[name][0]), name
    assert all(np.array_equal(a, b) for a, b in zip(teacher_before, weights_of(teacher)))
    changed = [not np.array_equal(a, b) for a, b in zip(student_before, weights_of(student))]
    assert sum(changed) >= len(changed) // 2

    # .keras round trip: the same outputs, and still only the student trains
    distiller.save(tmp_path / "distiller.keras")
    loaded = keras.saving.load_model(tmp_path / "distiller.keras")
    assert [w.path for w in loaded.weights] == [w.path for w in distiller.weights]
    assert harness.max_abs_diff(loaded.weights, distiller.weights) == 0.0
    inferred = loaded(x, training=False)
    assert len(loaded.trainable_weights) == len(distiller.trainable_weights)
    assert len(loaded.optimizer.variables) == len(distiller.optimizer.variables)

    # the teacher runs without dropout even when the distiller trains
    trained = distiller(x, training=True)
    assert harness.max_abs_diff(trained["teacher_logits"], inferred["teacher_logits"]) <= 1e-6
    assert harness.max_abs_diff(trained["student_logits"], inferred["student_logits"]) > 1e-3


def test_task_distillation_losses_match_numpy():
    """Every reported loss against NumPy on the distiller's own outputs, with
    a narrower student (a learned projection) and a hard label loss."""
    teacher = kbert.BertClassifier(kbert.BertBackbone(**SMALL), num_classes=3)
    student = kbert.BertClassifier(
        kbert.BertBackbone(**{**SMALL, "num_layers": 1, "hidden_dim": 8, "intermediate_dim": 8}),
        num_classes=3,
    )
    distiller = kbert.BertDistiller(
        teacher,
        student,
        temperature=3.0,
        alpha_ce=0.5,
        alpha_task=0.5,
        alpha_cos=0.25,
        alpha_hidden=2.0,
    )
    assert distiller.layer_map == [2]
    x = harness.backbone_inputs(4, 8, SMALL["vocabulary_size"])
    labels = np.array([0, 2, 1, 1])
    distiller.compile()
    outputs = distiller(x, training=False)
    total = value(distiller.compute_loss(x, labels, outputs))
    logs = {m.name: value(m.result()) for m in distiller.metrics if m.name.endswith("_loss")}
    logs["loss"] = total

    out = harness.to_numpy(outputs)
    assert out["student_hidden_1"].shape == (4, 8, 16)  # projected to the teacher's width
    mask = x["padding_mask"].astype("float64")
    t, s = out["teacher_logits"] / 3.0, out["student_logits"] / 3.0
    ce = (np.exp(np_log_softmax(t)) * (np_log_softmax(t) - np_log_softmax(s))).sum(-1)
    expected = {"ce_loss": 9.0 * ce.sum() / (4 + 1e-5)}
    expected["task_loss"] = -np_log_softmax(out["student_logits"])[np.arange(4), labels].mean()

    def cos(a, b):
        norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
        return (a * b).sum(-1) / np.maximum(norms, 1e-8)

    real = mask.sum() + 1e-5
    last_t, last_s = out["teacher_hidden_2"], out["student_hidden_1"]
    expected["cos_loss"] = ((1 - cos(last_t, last_s)) * mask).sum() / real
    expected["hidden_loss"] = sum(
        (((out[f"teacher_hidden_{t}"] - out[f"student_hidden_{s}"]) ** 2).mean(-1) * mask).sum()
        / real
        for s, t in [(0, 0), (1, 2)]
    )
    expected["loss"] = sum(
        w * expected[f"{k}_loss"]
        for k, w in [("ce", 0.5), ("task", 0.5), ("cos", 0.25), ("hidden", 2.0)]
    )
    for name, number in expected.items():
        assert abs(logs[name] - number) <= 1e-4 * max(1.0, abs(number)), name


def test_task_label_loss_follows_sample_weight():
    """Weight 0 marks an unlabeled example (a transfer set): the label loss is
    the mean over the weighted examples, the soft-target loss covers all."""
    teacher = kbert.BertClassifier(kbert.BertBackbone(**SMALL), num_classes=3)
    student = kbert.BertClassifier(kbert.BertBackbone(**{**SMALL, "num_layers": 1}), num_classes=3)
    distiller = kbert.BertDistiller(teacher, student, alpha_ce=1.0, alpha_task=1.0, alpha_cos=0.0)
    x = harness.backbone_inputs(4, 8, SMALL["vocabulary_size"])
    labels = np.array([0, 2, 1, 1])
    weights = np.array([1.0, 0.0, 3.0, 0.0], "float32")
    distiller.compile()
    outputs = distiller(x, training=False)
    terms = distiller.distillation_losses(x, labels, outputs, weights)
    ce = -np_log_softmax(harness.to_numpy(outputs)["student_logits"])[np.arange(4), labels]
    assert abs(value(terms["task"]) - (ce[0] + 3 * ce[2]) / 4) <= 1e-4
    unweighted = distiller.distillation_losses(x, labels, outputs)
    assert abs(value(unweighted["task"]) - ce.mean()) <= 1e-4
    assert abs(value(terms["ce"]) - value(unweighted["ce"])) <= 1e-6
    history = distiller.fit(x, labels, sample_weight=weights, batch_size=4, epochs=1, verbose=0)
    assert np.isfinite(history.history["task_loss"][0])


def test_token_and_span_distillation_losses():
    x = harness.backbone_inputs(4, 8, SMALL["vocabulary_size"])
    for cls, kwargs, y in [
        (kbert.BertTokenClassifier, {"num_classes": 3}, np.arange(32).reshape(4, 8) % 3),
        (
            kbert.BertQuestionAnswerer,
            {},
            {"start_positions": np.array([1, 0, 2, 0]), "end_positions": np.array([2, 1, 3, 0])},
        ),
    ]:
        teacher = cls(kbert.BertBackbone(**SMALL), **kwargs)
        student = cls(student_from_teacher(teacher.backbone, layers=[1]), **kwargs)
        distiller = kbert.BertDistiller(teacher, student, alpha_cos=0.0)
        out = distiller(x, training=False)
        terms = harness.to_numpy(distiller.distillation_losses(x, y, out))
        logits = harness.to_numpy(out)
        t, s = logits["teacher_logits"] / 2.0, logits["student_logits"] / 2.0
        kl = (np.exp(np_log_softmax(t)) * (np_log_softmax(t) - np_log_softmax(s))).sum(-1)
        if cls is kbert.BertTokenClassifier:
            mask = x["padding_mask"]
            expected_ce = 4.0 * (kl * mask).sum() / (mask.sum() + 1e-5)
        else:
            assert logits["student_logits"].shape == (4, 2, 8)  # start, end over tokens
            expected_ce = 4.0 * kl.sum() / (kl.size + 1e-5)
        assert abs(float(terms["ce"]) - expected_ce) < 1e-4, cls.__name__
        assert np.isfinite(float(terms["task"]))
        if cls is kbert.BertQuestionAnswerer:  # weight 0: soft labels only
            weights = np.array([1.0, 0.0, 1.0, 1.0], "float32")
            weighted = harness.to_numpy(distiller.distillation_losses(x, y, out, weights))
            s_log = np_log_softmax(logits["student_logits"])  # (4, 2, 8)
            ce = [-s_log[np.arange(4), i, y[k]] for i, k in enumerate(y)]
            expected = sum((c * weights).sum() / weights.sum() for c in ce) / 2
            assert abs(float(weighted["task"]) - expected) <= 1e-5 * max(1.0, abs(expected))
        # fit cuts per-token labels with the inputs (length buckets of 8 here)
        padded = {k: np.pad(v, ((0, 0), (0, 8))) for k, v in x.items()}
        targets = y if isinstance(y, dict) else np.pad(y, ((0, 0), (0, 8)))
        distiller.compile()
        history = distiller.fit(padded, targets, batch_size=4, bucket_lengths=8, verbose=0)
        assert np.isfinite(history.history["loss"][0]), cls.__name__


def test_bad_arguments_are_named():
    backbone = kbert.BertBackbone(**SMALL)
    classifier = kbert.BertClassifier(kbert.BertBackbone(**SMALL), num_classes=2)
    with pytest.raises(ValueError, match="one kind"):
        kbert.BertDistiller(classifier, backbone)
    with pytest.raises(ValueError, match="vocabulary"):
        kbert.BertDistiller(backbone, kbert.BertBackbone(**{**SMALL, "vocabulary_size": 40}))
    with pytest.raises(ValueError, match="num_classes"):
        kbert.BertDistiller(classifier, kbert.BertClassifier(backbone, num_classes=3))
    with pytest.raises(ValueError, match="layer_map"):
        kbert.BertDistiller(backbone, student_from_teacher(backbone, [0]), layer_map=[3])
    with pytest.raises(ValueError, match="heads"):
        kbert.BertDistiller(
            backbone, kbert.BertBackbone(**{**SMALL, "num_heads": 4}), alpha_attention=1.0
        )
    with pytest.raises(ValueError, match="no loss applies"):
        kbert.BertDistiller(backbone, student_from_teacher(backbone, [0]), alpha_cos=0.0)
    distiller = kbert.BertDistiller(
        classifier, kbert.BertClassifier(student_from_teacher(backbone, [0]), num_classes=2)
    )
    x = harness.backbone_inputs(4, 8, SMALL["vocabulary_size"])
    with pytest.raises(ValueError, match="alpha_task=0"):
        distiller.distillation_losses(x, None, distiller(x))


def test_config_round_trip():
    teacher = kbert.BertBackbone(**SMALL)
    distiller = kbert.BertDistiller(
        teacher, student_from_teacher(teacher, [1]), alpha_hidden=1.0, layer_map=[1]
    )
    clone = harness.check_config_round_trip(distiller)
    assert clone.layer_map == [1] and clone.active == {"cos": 1.0, "hidden": 1.0}


WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad", "film", "not", "a", "plot"]
TEXTS = ["good film", "bad plot", "not a good film", "a bad film", "good plot", "not bad"]
LABELS = np.array([1, 0, 0, 0, 1, 1])


def text_classifier(num_layers, lowercase=True, preprocessor=True):
    backbone = kbert.BertBackbone(
        **{**SMALL, "vocabulary_size": len(WORDS), "num_layers": num_layers}
    )
    tokenizer = kbert.BertTokenizer(WORDS, lowercase=lowercase)
    pre = kbert.BertPreprocessor(tokenizer, sequence_length=16) if preprocessor else None
    return kbert.BertClassifier(backbone, num_classes=2, preprocessor=pre)


def test_distiller_fits_raw_text_through_the_students_preprocessor(tmp_path):
    # Both models from presets, each carrying its preprocessor.
    text_classifier(2).save_to_preset(tmp_path / "teacher")
    text_classifier(1).save_to_preset(tmp_path / "student")
    teacher = kbert.BertClassifier.from_preset(tmp_path / "teacher")
    student = kbert.BertClassifier.from_preset(tmp_path / "student")
    distiller = kbert.BertDistiller(teacher, student)
    assert distiller.preprocessor is student.preprocessor
    distiller.compile(learning_rate=1e-3)
    history = distiller.fit(TEXTS, LABELS, batch_size=3, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    # a student without one: the teacher's (same tokens for both)
    bare = text_classifier(1, preprocessor=False)
    assert kbert.BertDistiller(teacher, bare).preprocessor is teacher.preprocessor


def test_distiller_refuses_raw_text_when_the_models_tokenize_differently():
    teacher, student = text_classifier(2), text_classifier(1, lowercase=False)
    distiller = kbert.BertDistiller(teacher, student)
    distiller.compile()
    with pytest.raises(ValueError, match="tokenize differently.*lowercase"):
        distiller.fit(TEXTS, LABELS, verbose=0)
    # model inputs still train
    x = {k: np.asarray(v) for k, v in student.preprocessor(TEXTS).items()}
    distiller.fit(x, LABELS, batch_size=3, epochs=1, verbose=0)


def test_classifier_distillation_packs_rows_as_the_classifier_does():
    # Packed rows (the default of `fit` on JAX on a CPU, where they save most
    # of the work on short texts): the same losses as one example per row.
    weights = np.array([1, 1, 0, 1, 0, 1], "float32")  # two of a transfer set
    losses = {}
    for pack in (True, False):
        keras.utils.set_random_seed(0)
        teacher = text_classifier(2)
        student = kbert.BertClassifier(
            kbert.BertBackbone(
                **{**SMALL, "vocabulary_size": len(WORDS), "num_layers": 1, "dropout": 0.0}
            ),
            num_classes=2,
            dropout=0.0,
        )
        distiller = kbert.BertDistiller(teacher, student, alpha_hidden=1.0)
        distiller.compile(learning_rate=1e-3)
        history = distiller.fit(
            teacher.preprocessor(TEXTS),
            LABELS,
            sample_weight=weights,
            batch_size=3,
            epochs=2,
            shuffle=False,
            pack_rows=pack,
            verbose=0,
        )
        losses[pack] = {k: v for k, v in history.history.items() if k.endswith("loss")}
    assert set(losses[True]) == {"loss", "ce_loss", "task_loss", "cos_loss", "hidden_loss"}
    for name, values in losses[False].items():
        np.testing.assert_allclose(losses[True][name], values, rtol=1e-3, atol=1e-6, err_msg=name)
