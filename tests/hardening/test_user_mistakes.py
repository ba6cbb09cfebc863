"""Common user mistakes get an error naming them, the same on every backend,
and common forms of input work as users write them."""

import hashlib
import json
import os
import warnings

import keras
import numpy as np
import pytest

import kbert
from kbert.presets import PresetError
from tests.harness import TINY

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + (
    "the a movie was good bad great awful not plot actors film , . ! who where is in rome".split()
)
TEXTS = ["the movie was good", "the film was awful", "great actors !", "not good , bad plot"]
LABELS = [1, 0, 1, 0]


@pytest.fixture
def preprocessor():
    return kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), sequence_length=12)


def _backbone():
    return kbert.BertBackbone(**{**TINY, "vocabulary_size": len(VOCAB)})


@pytest.fixture
def classifier(preprocessor):
    keras.utils.set_random_seed(0)
    model = kbert.BertClassifier(_backbone(), num_classes=3, preprocessor=preprocessor, dropout=0)
    model.compile(learning_rate=1e-3)
    return model


def test_jit_compile_true_evaluates_and_predicts(preprocessor, tmp_path):
    """`compile(jit_compile=True)`: torch.compile on torch (whose Inductor
    could not lower oneDNN's packed CPU product inside `predict`). A `.keras`
    saved on JAX records jit_compile=True, which loading replays."""
    keras.utils.set_random_seed(0)
    model = kbert.BertClassifier(_backbone(), num_classes=2, preprocessor=preprocessor, dropout=0)
    model.compile(jit_compile=False)
    expected = model.predict(TEXTS, batch_size=4, verbose=0)
    expected_loss = model.evaluate(TEXTS, LABELS, batch_size=4, verbose=0)[0]
    model.compile(jit_compile=True)
    np.testing.assert_allclose(model.predict(TEXTS, batch_size=4, verbose=0), expected, atol=1e-5)
    loss = model.evaluate(TEXTS, LABELS, batch_size=4, verbose=0)[0]
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    path = str(tmp_path / "model.keras")
    model.save(path)
    assert keras.saving.load_model(path).jit_compile == model.jit_compile


def test_fit_and_evaluate_before_compile(preprocessor):
    model = kbert.BertClassifier(_backbone(), num_classes=2, preprocessor=preprocessor)
    for method in (model.fit, model.evaluate):
        with pytest.raises(ValueError, match=r"call `compile\(\)` before"):
            method(TEXTS, LABELS, verbose=0)
    assert model.predict(TEXTS, verbose=0).shape == (4, 2)  # predict needs no compile


def test_fit_without_a_loss(preprocessor):
    """`BertTextEmbedder.compile()` sets no loss: JAX trained on a loss of 0,
    torch and TensorFlow raised Keras' error."""
    embedder = kbert.BertTextEmbedder(_backbone(), preprocessor=preprocessor)
    embedder.compile()
    for method in (embedder.fit, embedder.evaluate):
        with pytest.raises(ValueError, match="no loss to compute"):
            method(TEXTS, np.zeros((4, TINY["hidden_dim"]), "float32"), verbose=0)
    embedder.compile(loss="mse")
    assert np.isfinite(embedder.fit(TEXTS, np.zeros((4, 32)), verbose=0).history["loss"][0])


def test_labels_as_a_column_train_like_a_vector(classifier):
    vector = classifier.evaluate(TEXTS, np.array(LABELS), verbose=0)
    column = classifier.evaluate(TEXTS, np.array(LABELS)[:, None], verbose=0)
    np.testing.assert_allclose(column, vector, rtol=1e-6)
    history = classifier.fit(TEXTS, np.array(LABELS)[:, None], batch_size=2, verbose=0).history
    assert np.isfinite(history["loss"][0])


@pytest.mark.parametrize(
    "labels, message",
    [
        (np.eye(3)[[1, 0, 2, 0]], "look one-hot: pass np.argmax"),
        (["pos", "neg", "pos", "neg"], r"must be numbers .*got 'pos' \(str\).*map names to ids"),
        ([1, None, 0, 1], "must be numbers .*got None"),
        (np.zeros((4, 2, 2)), r"one per example \(class ids\), got shape \(4, 2, 2\)"),
    ],
)
def test_labels_in_other_forms_are_named(classifier, labels, message):
    with pytest.raises(ValueError, match=message):
        classifier.fit(TEXTS, labels, verbose=0)


def test_one_hot_and_multi_hot_targets_with_a_loss_that_takes_them(preprocessor):
    """The one-label-per-example rule is the default sparse loss's: with a
    loss of the user's that takes rows, the rows train as before."""
    keras.utils.set_random_seed(0)
    for loss in (
        keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1),
        keras.losses.BinaryCrossentropy(from_logits=True),
    ):
        model = kbert.BertClassifier(_backbone(), num_classes=3, preprocessor=preprocessor)
        model.compile(loss=loss, metrics=[])
        rows = np.eye(3, dtype="float32")[[1, 0, 2, 0]]
        if isinstance(loss, keras.losses.BinaryCrossentropy):
            rows[0, 2] = 1.0  # two labels on one example
        history = model.fit(TEXTS, rows, batch_size=2, verbose=0).history
        assert np.isfinite(history["loss"][0])


def test_a_subclass_with_its_own_loss_needs_none_in_compile(preprocessor):
    class Scored(kbert.BertClassifier):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            return keras.ops.mean(keras.ops.square(y_pred))

    model = Scored(_backbone(), num_classes=2, preprocessor=preprocessor)
    keras.Model.compile(model, optimizer="sgd")  # no loss
    assert np.isfinite(model.fit(TEXTS, LABELS, batch_size=2, verbose=0).history["loss"][0])


def test_regression_targets_that_are_not_numbers(preprocessor):
    model = kbert.BertClassifier(_backbone(), num_classes=1, preprocessor=preprocessor)
    model.compile()
    with pytest.raises(ValueError, match="regression targets must be numbers .*'high'"):
        model.fit(TEXTS, ["high", "low", "high", "low"], verbose=0)


def test_a_list_of_text_pairs_is_the_texts_and_pairs_tuple(classifier):
    pairs = [("the movie was good", "great actors !"), ("the film", "not good")]
    as_list = classifier.predict(pairs, verbose=0)
    as_tuple = classifier.predict(
        (["the movie was good", "the film"], ["great actors !", "not good"])
    )
    np.testing.assert_array_equal(as_list, as_tuple)
    losses = [
        classifier.evaluate(x, [1, 0], verbose=0)[0]
        for x in (pairs, ([p[0] for p in pairs], [p[1] for p in pairs]))
    ]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)


def test_a_tuple_of_two_pair_tuples_is_ambiguous(classifier):
    with pytest.raises(ValueError, match="reads both as \\(texts, pairs\\) and as two"):
        classifier.predict((("the movie", "was good"), ("the film", "was bad")), verbose=0)


def test_a_tuple_of_two_texts_with_two_labels(classifier):
    with pytest.raises(ValueError, match="a tuple of two strings is one \\(text, pair\\) example"):
        classifier.fit(("the movie was good", "the film was awful"), [1, 0], verbose=0)
    one = classifier.evaluate(("the movie", "was good"), [1], verbose=0)  # one pair example
    assert np.all(np.isfinite(one))


def test_token_labels_must_be_one_list_per_sentence(preprocessor):
    model = kbert.BertTokenClassifier(_backbone(), num_classes=3, preprocessor=preprocessor)
    model.compile()
    with pytest.raises(ValueError, match="labels of sentence 0 must be a list with one label"):
        model.fit([["the", "movie"]], [1], verbose=0)
    with pytest.raises(ValueError, match="got 1 sentences but 2 label lists"):
        model.fit([["the", "movie"]], [1, 0], verbose=0)
    with pytest.raises(ValueError, match="must be numbers .*'B-PER'"):
        model.fit([["the", "movie"]], [["B-PER", "O"]], verbose=0)


@pytest.mark.parametrize(
    "answer, message",
    [
        ("rome", r"answer 0 must be \{\"text\": \.\.\., \"answer_start\""),
        ({"text": "rome"}, "answer 0 \\('rome'\\) has no answer_start"),
    ],
)
def test_question_answers_in_other_forms_are_named(preprocessor, answer, message):
    model = kbert.BertQuestionAnswerer(_backbone(), preprocessor=preprocessor)
    model.compile()
    with pytest.raises(ValueError, match=message):
        model.fit((["who is in rome"], ["the movie is in rome"]), [answer], verbose=0)


def test_choices_given_as_a_string(preprocessor):
    model = kbert.BertMultipleChoice(_backbone(), num_choices=2, preprocessor=preprocessor)
    model.compile()
    with pytest.raises(ValueError, match="example 0: its choices must be a list of strings"):
        model.fit((["the movie"], ["was good"]), [0], verbose=0)
    with pytest.raises(ValueError, match="one per example .*look one-hot"):
        model.fit((["the movie"], [["was good", "was bad"]]), np.eye(2)[[0]], verbose=0)


def test_a_special_token_that_is_not_a_string():
    with pytest.raises(ValueError, match="special tokens must be non-empty strings.*None"):
        kbert.BertTokenizer(VOCAB, mask_token=None)


def test_a_keras_file_given_as_a_preset(classifier, tmp_path):
    path = str(tmp_path / "model.keras")
    classifier.save(path)
    with pytest.raises(PresetError, match=r"saved Keras model.*keras.saving.load_model"):
        kbert.BertClassifier.from_preset(path)


def _edit_json(directory, name, **changes):
    path = directory / name
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))
    metadata = json.loads((directory / "metadata.json").read_text())
    if name in metadata["files"]:
        metadata["files"][name] = hashlib.sha256(path.read_bytes()).hexdigest()
        (directory / "metadata.json").write_text(json.dumps(metadata))


def test_preset_settings_this_kbert_cannot_honour(classifier, tmp_path):
    classifier.save_to_preset(tmp_path / "a")
    _edit_json(tmp_path / "a", "preprocessor.json", truncate="nope")
    with pytest.raises(PresetError, match="truncate must be 'longest_first'.*'nope'"):
        kbert.BertClassifier.from_preset(tmp_path / "a")
    classifier.save_to_preset(tmp_path / "b")
    _edit_json(tmp_path / "b", "config.json", format_version=99)
    with pytest.raises(PresetError, match="format_version 99.*upgrade kbert"):
        kbert.BertClassifier.from_preset(tmp_path / "b")


def test_weights_files_are_as_readable_as_the_others(classifier, tmp_path):
    from kbert.convert.huggingface import export_to_huggingface

    mask = os.umask(0o022)  # group and others may read: owner-only files would differ
    try:
        classifier.save_to_preset(tmp_path / "preset")
        export_to_huggingface(classifier, tmp_path / "hf")
    finally:
        os.umask(mask)
    for directory, weights in (
        (tmp_path / "preset", "model.safetensors"),
        (tmp_path / "hf", "model.safetensors"),
    ):
        config_mode = os.stat(directory / "config.json").st_mode & 0o777
        assert os.stat(directory / weights).st_mode & 0o777 == config_mode
    assert os.stat(tmp_path / "preset" / "task.safetensors").st_mode & 0o777 == config_mode


def test_masked_lm_from_a_pre_trainer_preset_keeps_its_mlm_head(preprocessor, tmp_path, caplog):
    keras.utils.set_random_seed(0)
    pretrainer = kbert.BertPreTrainer(_backbone(), preprocessor=preprocessor)
    pretrainer.save_to_preset(tmp_path / "pretrained")
    with caplog.at_level("WARNING", logger="kbert"):
        masked_lm = kbert.BertMaskedLM.from_preset(tmp_path / "pretrained")
    assert "initialised fresh" not in caplog.text and "fresh" not in caplog.text
    saved = {w.path: np.asarray(w.numpy()) for w in pretrainer.weights}
    paths = masked_lm.head_weight_paths()
    assert paths and all(p.startswith("mlm_head/") for p in paths)
    for w in masked_lm.weights:
        np.testing.assert_array_equal(np.asarray(w.numpy()), saved[w.path])
    with pytest.raises(ValueError, match="trains on masked batches"):
        masked_lm.compile()
        masked_lm.fit(TEXTS, verbose=0)


def test_a_dataset_without_shuffle_gets_no_shuffle_warning(classifier):
    tf = pytest.importorskip("tensorflow")
    data = tf.data.Dataset.from_tensor_slices((TEXTS, LABELS)).batch(2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*shuffle=True.*")
        classifier.fit(data, verbose=0)
    with pytest.warns(UserWarning, match="shuffle=True"):  # asked for: Keras says it is ignored
        classifier.fit(data, shuffle=True, verbose=0)


def test_a_diverged_fit_raises_naming_the_epoch_and_the_preset_is_not_written(classifier, tmp_path):
    """A NaN training loss ends `fit` after its epoch with an error (the
    History on the error), and `save_to_preset` refuses the NaN weights
    that loading would refuse."""
    classifier.compile(learning_rate=1e8)
    with pytest.raises(kbert.training.NonFiniteLossError) as caught:
        classifier.fit(TEXTS * 2, LABELS * 2, batch_size=4, epochs=4, verbose=0)
    losses = caught.value.history.history["loss"]
    # it stopped after the first epoch whose loss was not finite, and says which
    assert not np.isfinite(losses[-1]) and np.all(np.isfinite(losses[:-1]))
    assert f"in epoch {len(losses)}, and training stopped" in str(caught.value)
    with pytest.raises(ValueError, match="holds NaN or inf"):
        classifier.save_to_preset(tmp_path / "preset")
    assert not (tmp_path / "preset" / "metadata.json").exists()


def test_a_diverged_fit_with_terminate_on_nan_is_the_callbacks_to_handle(classifier):
    classifier.compile(learning_rate=1e8)
    callback = keras.callbacks.TerminateOnNaN()
    history = classifier.fit(
        TEXTS * 2, LABELS * 2, batch_size=4, epochs=3, verbose=0, callbacks=[callback]
    )
    assert not np.isfinite(history.history["loss"][-1])


def test_a_frozen_backbone_stays_frozen_through_save_and_load(preprocessor, tmp_path):
    """freeze_backbone=True survives a .keras round trip, from_config and a
    preset (on TensorFlow the rebuilt backbone kept every weight trainable),
    and the loaded model's optimizer state loads with it."""
    model = kbert.BertClassifier(
        _backbone(), num_classes=3, preprocessor=preprocessor, freeze_backbone=True
    )
    head = len(model.trainable_weights)
    assert head == 2
    model.compile(learning_rate=1e-3)
    model.fit(TEXTS, LABELS, batch_size=2, epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    model.save_to_preset(tmp_path / "preset")
    with warnings.catch_warnings():
        # e.g. Keras' "Skipping variable loading for optimizer"
        warnings.simplefilter("error", UserWarning)
        loaded = keras.saving.load_model(tmp_path / "model.keras")
    rebuilt = kbert.BertClassifier.from_config(model.get_config())
    again = kbert.BertClassifier.from_preset(tmp_path / "preset", freeze_backbone=True)
    for other in (loaded, rebuilt, again):
        assert len(other.trainable_weights) == head
        assert not any(v.trainable for v in other.backbone.weights)
    before = [np.asarray(v.numpy()) for v in loaded.backbone.weights]
    loaded.fit(TEXTS, LABELS, batch_size=2, epochs=1, verbose=0)
    for value, variable in zip(before, loaded.backbone.weights):
        np.testing.assert_array_equal(value, np.asarray(variable.numpy()))
