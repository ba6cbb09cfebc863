"""Artifacts saved by kbert 0.1.0 (tests/fixtures/saved_0_1_0) load with
the current code on every backend and give the outputs they gave."""

import os

import keras
import numpy as np
import pytest

import kbert

HERE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "saved_0_1_0")
TEXTS = ["a gentle lord", "the kings, a villain", "sweet traitor king"]


@pytest.fixture(scope="module")
def saved():
    return dict(np.load(os.path.join(HERE, "outputs.npz")))


@pytest.mark.parametrize("name", ["classifier", "albert_adapters", "token_classifier"])
def test_keras_files_load_and_predict_as_saved(saved, name):
    model = keras.saving.load_model(os.path.join(HERE, f"{name}.keras"))
    got, want = model.predict(TEXTS, verbose=0), saved[name]
    if name == "token_classifier":  # outputs at padding positions are unspecified
        real = np.asarray(model.preprocessor(TEXTS)["padding_mask"]) > 0
        got, want = got[real], want[real]
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_classifier_preset_loads_and_predicts_as_saved(saved):
    model = kbert.BertClassifier.from_preset(os.path.join(HERE, "classifier_preset"))
    np.testing.assert_allclose(model.predict(TEXTS, verbose=0), saved["classifier"], atol=1e-5)


def test_pretrainer_preset_loads_and_predicts_as_saved(saved):
    model = kbert.BertPreTrainer.from_preset(os.path.join(HERE, "pretrainer_preset"))
    x = {k: np.asarray(v) for k, v in model.preprocessor(TEXTS).items()}
    x["mask_positions"] = saved["pretrainer_inputs_mask_positions"]
    out = model.predict(x, verbose=0)
    np.testing.assert_allclose(out["mlm_logits"], saved["pretrainer_mlm"], atol=1e-5)
    np.testing.assert_allclose(out["nsp_logits"], saved["pretrainer_nsp"], atol=1e-5)
