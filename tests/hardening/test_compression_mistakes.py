"""Mistakes with the features that make BERT smaller (distillation,
quantization) and their artifacts: an error naming the problem on every
backend, before any backend computes."""

import numpy as np
import pytest

import kbert
from kbert.convert import huggingface
from kbert.models.distiller import student_from_teacher
from tests.harness import TINY


def _backbone(layers=2, **overrides):
    return kbert.BertBackbone(**{**TINY, "num_layers": layers, **overrides})


def _inputs(rows=4, length=6, segment=0):
    rng = np.random.default_rng(0)
    return {
        "token_ids": rng.integers(5, TINY["vocabulary_size"], (rows, length)).astype("int32"),
        "segment_ids": np.full((rows, length), segment, "int32"),
        "padding_mask": np.ones((rows, length), "int32"),
    }


def _classifier_distiller():
    teacher = kbert.BertClassifier(_backbone(), num_classes=2)
    student = kbert.BertClassifier(_backbone(1), num_classes=2)
    distiller = kbert.BertDistiller(teacher, student)
    distiller.compile(learning_rate=1e-3)
    return distiller


def test_inputs_are_checked_against_the_smaller_limits_of_teacher_and_student():
    """A segment id or a length only the student takes would break the
    teacher (NaN losses on JAX): refused on the host, naming the input."""
    distiller = kbert.BertDistiller(_backbone(type_vocab_size=2), _backbone(1, type_vocab_size=4))
    distiller.compile(learning_rate=1e-3)
    with pytest.raises(ValueError, match="segment_ids.*3"):
        distiller.fit(_inputs(segment=3), batch_size=2, verbose=0)
    history = distiller.fit(_inputs(segment=1), batch_size=2, verbose=0).history
    assert np.isfinite(history["loss"][0])
    short = TINY["max_sequence_length"] // 2
    distiller = kbert.BertDistiller(_backbone(max_sequence_length=short), _backbone(1))
    distiller.compile(learning_rate=1e-3)
    with pytest.raises(ValueError, match=f"max_sequence_length={short}"):
        distiller.fit(_inputs(length=short + 2), batch_size=2, verbose=0)


def test_masked_lm_targets_are_checked_where_weighted():
    """Padded prediction slots (weight 0) may hold any id, e.g. -100; a
    counted slot outside the vocabulary is refused."""
    teacher = kbert.BertMaskedLM(_backbone())
    distiller = kbert.BertDistiller(teacher, kbert.BertMaskedLM(_backbone(1)))
    distiller.compile(learning_rate=1e-3)
    x = {**_inputs(), "mask_positions": np.array([[1, 2]] * 4, "int32")}
    weights = np.array([[1, 0]] * 4, "float32")
    padded = {"mask_ids": np.array([[7, -100]] * 4, "int32"), "mask_weights": weights}
    history = distiller.fit(x, padded, batch_size=2, verbose=0).history
    assert np.isfinite(history["mlm_loss"][0])
    outside = {"mask_ids": np.array([[TINY["vocabulary_size"], 3]] * 4, "int32")}
    with pytest.raises(ValueError, match=f"label {TINY['vocabulary_size']} is outside"):
        distiller.fit(x, {**outside, "mask_weights": weights}, batch_size=2, verbose=0)


def test_the_same_model_as_teacher_and_student_is_refused():
    model = _backbone()
    with pytest.raises(ValueError, match="same model"):
        kbert.BertDistiller(model, model)
    classifier = kbert.BertClassifier(model, num_classes=2)
    with pytest.raises(ValueError, match="share a backbone"):
        kbert.BertDistiller(classifier, kbert.BertClassifier(model, num_classes=2))


@pytest.mark.parametrize(
    "labels, match",
    [
        (np.full(4, 5), "label 5 is outside \\[0, 2\\)"),
        (np.array(["pos", "neg", "pos", "neg"]), "must be numbers.*'pos'"),
        (np.eye(2)[[0, 1, 0, 1]], "look one-hot"),
    ],
    ids=["out-of-range", "names", "one-hot"],
)
def test_distiller_labels_get_the_task_checks(labels, match):
    distiller = _classifier_distiller()
    with pytest.raises(ValueError, match=match):
        distiller.fit(_inputs(), labels, batch_size=2, verbose=0)


def test_distiller_answer_positions_as_a_pair_and_out_of_range():
    teacher = kbert.BertQuestionAnswerer(_backbone())
    distiller = kbert.BertDistiller(teacher, kbert.BertQuestionAnswerer(_backbone(1)))
    distiller.compile(learning_rate=1e-3)
    start, end = np.array([1, 2, 1, 0]), np.array([2, 3, 4, 0])
    history = distiller.fit(_inputs(), (start, end), batch_size=2, verbose=0).history
    assert np.isfinite(history["task_loss"][0])
    too_far = TINY["max_sequence_length"] + 3
    with pytest.raises(ValueError, match=f"label {too_far} is outside"):
        distiller.fit(
            _inputs(),
            {"start_positions": start, "end_positions": np.full(4, too_far)},
            batch_size=2,
            verbose=0,
        )


def test_distiller_arguments_take_numpy_numbers_and_refuse_other_types():
    distiller = kbert.BertDistiller(_backbone(4), _backbone(2), alpha_cos=np.float32(0.5))
    assert distiller.get_config()["alpha_cos"] == 0.5
    assert isinstance(distiller.get_config()["alpha_cos"], float)
    with pytest.raises(ValueError, match="temperature must be a number > 0, got '2'"):
        kbert.BertDistiller(_backbone(4), _backbone(2), temperature="2")
    with pytest.raises(ValueError, match="layer_map must be a list of int"):
        kbert.BertDistiller(_backbone(4), _backbone(2), layer_map=[1.9, 3.7])
    for layer_map in (np.array([2, 4]), np.linspace(2, 4, 2)):
        distiller = kbert.BertDistiller(_backbone(4), _backbone(2), layer_map=layer_map)
        assert distiller.layer_map == [2, 4]
    distiller = kbert.BertDistiller(_backbone(4), _backbone(2), temperature=np.array(3.0))
    assert distiller.temperature == 3.0
    assert student_from_teacher(_backbone(4), np.arange(0, 4, 2)).num_layers == 2


def test_a_distiller_is_not_a_preset(tmp_path):
    distiller = kbert.BertDistiller(_backbone(), _backbone(1))
    with pytest.raises(ValueError, match="distiller.student.save_to_preset"):
        distiller.save_to_preset(tmp_path / "preset")


def test_a_preprocessor_longer_than_the_backbone_is_refused_when_attached():
    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]
    too_long = TINY["max_sequence_length"] + 1
    preprocessor = kbert.BertPreprocessor(kbert.BertTokenizer(vocabulary), too_long)
    with pytest.raises(ValueError, match=f"packs {too_long} tokens per row"):
        kbert.BertClassifier(_backbone(), num_classes=2, preprocessor=preprocessor)


def test_a_quantized_model_does_not_export_to_hugging_face(tmp_path):
    model = kbert.BertClassifier(_backbone(1), num_classes=2)
    model.quantize("int8")
    with pytest.raises(ValueError, match="quantized layers.*export the float model"):
        huggingface.export_to_huggingface(model, tmp_path / "hf")
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_an_int4_model_is_refused_as_a_preset_and_saves_as_keras(tmp_path):
    import keras

    model = kbert.BertClassifier(_backbone(1), num_classes=2)
    model.quantize("int4")
    with pytest.raises(ValueError, match="int4.*model.save"):
        model.save_to_preset(tmp_path / "preset")
    x = _inputs()
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    np.testing.assert_array_equal(
        np.asarray(loaded.predict(x, verbose=0)), np.asarray(model.predict(x, verbose=0))
    )


def test_a_student_from_a_quantized_teacher_names_the_order():
    teacher = _backbone(2)
    teacher.quantize("int8")
    with pytest.raises(ValueError, match="quantize the student after"):
        student_from_teacher(teacher, [0])


def test_masked_lm_loss_ignores_the_ids_of_padded_slots():
    from kbert.models.pretrainer import masked_lm_loss

    logits = np.random.default_rng(0).normal(size=(2, 3, 11)).astype("float32")
    weights = np.array([[1, 1, 0], [1, 0, 0]], "float32")
    ids = np.array([[4, 2, 7], [9, 3, 1]], "int32")
    padded = np.where(weights > 0, ids, -100).astype("int32")
    expected = float(np.asarray(masked_lm_loss(ids, logits, weights)))
    assert float(np.asarray(masked_lm_loss(padded, logits, weights))) == pytest.approx(expected)
    assert np.isfinite(expected) and expected > 0
