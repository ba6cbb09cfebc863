"""No examples, no inputs, missing inputs or missing targets: a defined
result or a ValueError naming the problem, on every task model and backend."""

import numpy as np
import pytest

import kbert
from tests.harness import TINY

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + "the a movie was good bad".split()
TEXTS = ["the movie was good", "the movie was bad"] * 2


@pytest.fixture
def preprocessor():
    return kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), sequence_length=12)


@pytest.fixture
def backbone():
    return kbert.BertBackbone(**{**TINY, "vocabulary_size": len(VOCAB)})


def test_no_examples_give_empty_predictions_and_a_clear_error_in_fit(backbone, preprocessor):
    """An empty list of texts (or word lists, or QA pairs), or model inputs
    with no rows: `predict` returns each output with no rows (per-token
    axes at the inputs' length), `fit` and `evaluate` name the problem."""
    classifier = kbert.BertClassifier(backbone, num_classes=2, preprocessor=preprocessor)
    tagger = kbert.BertTokenClassifier(backbone, num_classes=3, preprocessor=preprocessor)
    reader = kbert.BertQuestionAnswerer(backbone, preprocessor=preprocessor)
    chooser = kbert.BertMultipleChoice(backbone, num_choices=2, preprocessor=preprocessor)
    inputs = {k: np.zeros((0, 7), "int32") for k in ("token_ids", "segment_ids", "padding_mask")}
    assert classifier.predict([], verbose=0).shape == (0, 2)
    assert classifier.predict(([], []), verbose=0).shape == (0, 2)  # (texts, pairs)
    assert classifier.predict(inputs, verbose=0).shape == (0, 2)
    assert classifier.predict_on_batch(inputs).shape == (0, 2)
    assert classifier.predict_classes([]).shape == (0,)
    assert tagger.predict([], verbose=0).shape == (0, 12, 3)  # the preprocessor's length
    assert tagger.predict(inputs, verbose=0).shape == (0, 7, 3)  # the inputs' length
    assert tagger.predict_words([]) == []
    assert reader.predict_answers([], []) == []
    assert chooser.predict(([], []), verbose=0).shape == (0, 2)
    masked = {**inputs, "mask_positions": np.zeros((0, 3), "int32")}
    mlm = kbert.BertPreTrainer(backbone).predict(masked, verbose=0)
    assert mlm["mlm_logits"].shape == (0, 3, len(VOCAB)) and mlm["nsp_logits"].shape == (0, 2)
    with pytest.raises(ValueError, match="lack padding_mask"):  # checked, even with no rows
        classifier.predict({"token_ids": inputs["token_ids"]}, verbose=0)
    assert classifier.predict(TEXTS[:1], verbose=0).shape == (1, 2)
    for model, y in ((classifier, []), (tagger, []), (reader, [])):
        model.compile()
        x = ([], []) if model is reader else []
        with pytest.raises(ValueError, match="fit got no examples"):
            model.fit(x, y, verbose=0)
        with pytest.raises(ValueError, match="evaluate got no examples"):
            model.evaluate(x, y, verbose=0)


def test_missing_inputs_or_targets_are_named(backbone, preprocessor):
    """No inputs, a model-input dict without some inputs, or host inputs
    without targets: a ValueError naming the problem, not a backend's."""
    model = kbert.BertClassifier(backbone, num_classes=2, preprocessor=preprocessor)
    model.compile()
    with pytest.raises(ValueError, match="predict needs inputs"):
        model.predict(None, verbose=0)
    with pytest.raises(ValueError, match="lack padding_mask, segment_ids"):
        model.predict({"token_ids": np.ones((2, 4), "int32")}, verbose=0)
    with pytest.raises(ValueError, match="fit needs targets"):
        model.fit(TEXTS[:4], verbose=0)
    with pytest.raises(ValueError, match="evaluate needs targets"):
        model.evaluate(preprocessor(TEXTS[:4]), verbose=0)
    tagger = kbert.BertTokenClassifier(backbone, num_classes=3, preprocessor=preprocessor)
    tagger.compile()
    with pytest.raises(ValueError, match="fit needs targets"):
        tagger.fit([["the", "movie"]], verbose=0)
