"""Smoke subset: the paths a user hits first, fast enough to run on every
supported Keras version (`.ci/run` runs it on the oldest one, per backend).

Run: `KERAS_BACKEND=torch python -m pytest -q -m smoke`.
"""

import keras
import numpy as np
import pytest

import kbert
from tests.harness import TINY, backbone_inputs, max_abs_diff

pytestmark = pytest.mark.smoke

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + (
    "the a movie was good bad great awful not plot actors film , . !".split()
)
TEXTS = ["the movie was good", "the film was awful", "great actors !", "not good , bad plot"] * 2
LABELS = np.array([1, 0, 1, 0] * 2)
# One encoder block: the smoke subset checks the API paths, and on JAX each
# block adds XLA compile time to every step function.
SMALL = {**TINY, "num_layers": 1, "vocabulary_size": len(VOCAB)}


def classifier():
    backbone = kbert.BertBackbone(**SMALL)
    preprocessor = kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), sequence_length=12)
    return kbert.BertClassifier(backbone, num_classes=2, preprocessor=preprocessor)


def test_classifier_fit_and_predict_on_raw_strings():
    model = classifier()
    model.compile(learning_rate=1e-3)  # kbert's AdamW
    history = model.fit(TEXTS, LABELS, batch_size=4, epochs=2, verbose=0).history
    assert np.all(np.isfinite(history["loss"])) and "accuracy" in history
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 4
    out = model.predict(TEXTS[:3], verbose=0)
    assert out.shape == (3, 2) and out.dtype == np.float32 and np.all(np.isfinite(out))


def test_keras_file_round_trip_with_default_optimizer(tmp_path):
    model = classifier()
    model.compile()  # kbert's AdamW with the warm-up/decay schedule
    model.optimizer.build(model.trainable_variables)
    x = model.preprocessor(TEXTS[:4])
    path = str(tmp_path / "classifier.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    assert type(restored) is kbert.BertClassifier
    assert type(restored.optimizer) is type(model.optimizer)
    assert max_abs_diff(model(x), restored(x)) <= 1e-6
    assert len(restored.optimizer.variables) == len(model.optimizer.variables)


def test_preset_round_trip(tmp_path):
    model = classifier()
    x = model.preprocessor(TEXTS[:4])
    model.save_to_preset(tmp_path / "preset")
    restored = kbert.BertClassifier.from_preset(tmp_path / "preset")
    assert restored.num_classes == 2 and restored.preprocessor.sequence_length == 12
    assert max_abs_diff(model(x), restored(x)) == 0.0
    backbone = kbert.BertBackbone.from_preset(tmp_path / "preset")
    assert max_abs_diff(backbone(x), model.backbone(x)) == 0.0


def pretraining_batch(batch_size=4, length=12, predictions=3, seed=0):
    rng = np.random.default_rng(seed)
    x = backbone_inputs(batch_size, length, len(VOCAB), seed)
    x["mask_positions"] = rng.integers(1, 4, (batch_size, predictions)).astype("int32")
    weights = np.ones((batch_size, predictions), "float32")
    weights[1, 2:] = 0  # padded prediction slots
    y = {
        "mask_ids": rng.integers(1, len(VOCAB), (batch_size, predictions)).astype("int32"),
        "mask_weights": weights,
        "next_sentence_labels": rng.integers(0, 2, (batch_size,)).astype("int32"),
    }
    return x, y


def test_pretrainer_one_step():
    model = kbert.BertPreTrainer(kbert.BertBackbone(**SMALL))
    model.compile(num_warmup_steps=0)  # kbert's AdamW; warm-up 0 so step 1 moves the weights
    x, y = pretraining_batch()
    before = keras.ops.convert_to_numpy(model.backbone.token_embedding.embeddings).copy()
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0).history
    for key in ("loss", "mlm_loss", "mlm_accuracy", "nsp_loss", "nsp_accuracy"):
        assert key in history and np.isfinite(history[key][0])
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 1
    after = keras.ops.convert_to_numpy(model.backbone.token_embedding.embeddings)
    assert not np.allclose(before, after)
