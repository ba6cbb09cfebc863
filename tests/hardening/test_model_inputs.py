"""Bad model inputs: a ValueError naming the input, the value, its position
and the allowed range, before any backend gathers, through every entry
point of the backbone and the task models."""

import keras
import numpy as np
import pytest

import kbert
from tests.harness import TINY

V, T = 50, 8


@pytest.fixture(scope="module")
def models():
    backbone = kbert.BertBackbone(**{**TINY, "vocabulary_size": V, "max_sequence_length": 16})
    classifier = kbert.BertClassifier(backbone, 2)
    classifier.compile(optimizer="sgd")
    tagger = kbert.BertTokenClassifier(backbone, 3)
    tagger.compile(optimizer="sgd")
    pretrainer = kbert.BertPreTrainer(backbone)
    pretrainer.compile(optimizer="sgd")
    return {"backbone": backbone, "classifier": classifier, "tagger": tagger, "pre": pretrainer}


def good(batch=4, length=T):
    rng = np.random.default_rng(0)
    return {
        "token_ids": rng.integers(5, V, (batch, length)).astype("int32"),
        "segment_ids": np.zeros((batch, length), "int32"),
        "padding_mask": np.ones((batch, length), "int32"),
    }


BAD = {
    "id_at_vocabulary_size": ("token_ids", (1, 2), V, r"token_ids holds 50 at position \[1, 2\]"),
    "negative_id": ("token_ids", (0, 0), -1, r"token_ids holds -1 at position \[0, 0\]"),
    "segment_past_type_vocab": ("segment_ids", (3, 1), 2, r"segment_ids holds 2 .*\[0, 2\)"),
    "mask_value_two": ("padding_mask", (2, 5), 2, r"padding_mask holds 2"),
}


def bad(kind):
    name, where, value, _ = BAD[kind]
    x = good()
    x[name] = x[name].copy()
    x[name][where] = value
    return x


ENTRY_POINTS = {
    "backbone.predict": lambda m, x: m["backbone"].predict(x, verbose=0),
    "backbone.predict_on_batch": lambda m, x: m["backbone"].predict_on_batch(x),
    "backbone.__call__": lambda m, x: m["backbone"](x),
    "classifier.fit": lambda m, x: m["classifier"].fit(x, np.zeros(4), verbose=0),
    "classifier.evaluate": lambda m, x: m["classifier"].evaluate(x, np.zeros(4), verbose=0),
    "classifier.predict": lambda m, x: m["classifier"].predict(x, verbose=0),
    "classifier.predict_on_batch": lambda m, x: m["classifier"].predict_on_batch(x),
    "classifier.train_on_batch": lambda m, x: m["classifier"].train_on_batch(x, np.zeros(4)),
    "classifier.test_on_batch": lambda m, x: m["classifier"].test_on_batch(x, np.zeros(4)),
    "classifier.__call__": lambda m, x: m["classifier"](x),
    "tagger.fit": lambda m, x: m["tagger"].fit(x, np.zeros((4, T)), verbose=0),
    "tagger.predict": lambda m, x: m["tagger"].predict(x, verbose=0),
}


@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_bad_ids_fail_before_the_backend(models, entry, kind):
    with pytest.raises(ValueError, match=BAD[kind][3]):
        ENTRY_POINTS[entry](models, bad(kind))


def test_longer_than_the_model(models):
    for entry in ("classifier.predict", "classifier.fit", "backbone.predict_on_batch"):
        with pytest.raises(ValueError, match="max_sequence_length=16"):
            ENTRY_POINTS[entry](models, good(length=17))


def test_mask_positions_past_the_tokens(models):
    x = {**good(), "mask_positions": np.array([[1, 2]] * 3 + [[1, T]], "int32")}
    y = {"mlm_logits": np.zeros((4, 2), "int32"), "nsp_logits": np.zeros(4, "int32")}
    with pytest.raises(ValueError, match=r"mask_positions holds 8 at position \[3, 1\]"):
        models["pre"].fit(x, y, verbose=0)


def test_tf_data_inputs_are_checked_in_the_pipeline(models):
    tf = pytest.importorskip("tensorflow")
    x = bad("id_at_vocabulary_size")
    data = tf.data.Dataset.from_tensor_slices((x, np.zeros(4))).batch(2)
    classifier = models["classifier"]
    before = [keras.ops.convert_to_numpy(v) for v in classifier.weights]
    with pytest.raises(ValueError, match="token_ids holds"):
        classifier.fit(data, verbose=0)
    # the failed fit keeps the weights (JAX's loop had emptied its variables)
    for value, variable in zip(before, classifier.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), value)
    with pytest.raises(ValueError, match="token_ids holds"):
        models["classifier"].predict(data.map(lambda x, y: x), verbose=0)


def test_raw_text_without_a_preprocessor_names_the_fix(models):
    with pytest.raises(ValueError, match="no preprocessor.*BertPreprocessor"):
        models["classifier"].fit(["some text"], np.zeros(1), verbose=0)


def test_good_inputs_still_run(models):
    out = models["classifier"].predict(good(), verbose=0)
    assert out.shape == (4, 2) and np.isfinite(out).all()
    direct = keras.ops.convert_to_numpy(models["classifier"](good()))
    np.testing.assert_allclose(direct, out, atol=1e-5)


def test_no_device_read_while_a_cuda_graph_is_captured(models, monkeypatch):
    """Eager inference range-checks token ids in the embeddings layer (the
    last check before the gather); while torch captures a CUDA graph that
    device read is skipped (it would invalidate the capture: the graphed
    predict's inputs were checked on the host)."""
    from kbert.utils import checks

    reads = []
    original = checks.check_token_ids

    def counting(*args, **kwargs):
        reads.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(checks, "check_token_ids", counting)
    x = good()
    bad = x["token_ids"].copy()
    bad[0, 0] = V
    embeddings = models["backbone"].get_layer("embeddings")
    ids = keras.ops.convert_to_tensor(bad)
    segments = keras.ops.convert_to_tensor(x["segment_ids"])
    eager = keras.backend.backend() == "torch"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        embeddings(ids, segments)
    assert reads
    if eager:
        reads.clear()
        monkeypatch.setattr(checks, "cuda_graph_capturing", lambda x: True)
        assert not checks.is_concrete(ids)
        embeddings(keras.ops.convert_to_tensor(x["token_ids"]), segments)
        assert reads == []
