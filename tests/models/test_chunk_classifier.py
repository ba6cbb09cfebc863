"""Chunk-and-pool classification of long documents: the windows, the
pooling over them, one prediction per document, fit / predict / save / load."""

import keras
import numpy as np
import pytest

import kbert
from kbert.data.long_documents import chunk_documents
from kbert.models.chunk_classifier import ChunkPooling
from tests.harness import TINY

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + "the a movie was good bad plot".split()
TOKENIZER = kbert.BertTokenizer(VOCAB)


def test_chunk_documents_frames_cuts_and_pads():
    x = chunk_documents(TOKENIZER, ["the plot was good the movie", "", "bad " * 20], 5, 3)
    ids = x["token_ids"]
    assert ids.shape == (3, 3, 5) and x["segment_ids"].max() == 0
    the, plot, was, good, movie = (
        TOKENIZER.token_to_id(t) for t in "the plot was good movie".split()
    )
    assert ids[0].tolist() == [
        [2, the, plot, was, 3],
        [2, good, the, movie, 3],
        [0, 0, 0, 0, 0],
    ]
    assert x["padding_mask"][0].sum(-1).tolist() == [5, 5, 0]
    assert ids[1, 0].tolist() == [2, 3, 0, 0, 0]  # an empty text: one window [CLS] [SEP]
    assert x["padding_mask"][2].sum(-1).tolist() == [5, 5, 5]  # cut to max_chunks windows


@pytest.mark.parametrize("pooling", ["mean", "max"])
def test_chunk_pooling_leaves_out_empty_windows(pooling):
    x = np.array([[[1.0, -5.0], [3.0, -2.0], [9.0, 9.0]], [[4.0, 4.0], [7.0, 7.0], [1.0, 1.0]]])
    mask = np.array([[[1, 1], [1, 0], [0, 0]], [[0, 0]] * 3])
    got = keras.ops.convert_to_numpy(ChunkPooling(pooling)(x.astype("float32"), mask))
    want = [[2.0, -3.5], [0.0, 0.0]] if pooling == "mean" else [[3.0, -2.0], [0.0, 0.0]]
    np.testing.assert_allclose(got, want)


@pytest.fixture
def classifier_preset(tmp_path):
    backbone = kbert.BertBackbone(
        **{**TINY, "num_layers": 1, "vocabulary_size": len(VOCAB), "max_sequence_length": 8}
    )
    preprocessor = kbert.BertPreprocessor(TOKENIZER, sequence_length=8)
    model = kbert.BertClassifier(backbone, 2, preprocessor=preprocessor)
    model.save_to_preset(tmp_path / "classifier")
    return model, tmp_path / "classifier"


def test_one_prediction_per_document_from_its_windows(classifier_preset):
    """A BertClassifier preset loads with its head; a document's logits are
    the head on the mean of its windows' pooled [CLS] vectors."""
    classifier, directory = classifier_preset
    model = kbert.BertChunkClassifier.from_preset(directory, num_classes=2, max_chunks=3)
    texts = ["the movie was good", "the plot was bad " * 3]
    logits = model.predict(texts, verbose=0)
    assert logits.shape == (2, 2)
    # one window: the classifier's own output
    np.testing.assert_allclose(logits[0], classifier.predict(texts[:1], verbose=0)[0], atol=1e-5)
    # several: the head on the mean of the windows' pooled outputs
    windows = chunk_documents(TOKENIZER, texts[1:], 8, 3)
    real = windows["padding_mask"][0].any(-1)
    flat = {k: v[0][real] for k, v in windows.items()}
    pooled = classifier.backbone.predict(flat, verbose=0)["pooled_output"].mean(0)
    kernel, bias = classifier.get_layer("logits").get_weights()
    np.testing.assert_allclose(logits[1], pooled @ kernel + bias, atol=1e-5)


def test_chunk_classifier_fits_and_round_trips(classifier_preset, tmp_path):
    _, directory = classifier_preset
    model = kbert.BertChunkClassifier.from_preset(
        directory, num_classes=2, max_chunks=3, pooling="max"
    )
    texts = ["the good plot " * 4, "the bad plot " * 4, "good movie", "bad movie"] * 2
    labels = np.array([1, 0, 1, 0] * 2)
    initial = [np.array(w) for w in model.get_weights()]
    model.compile(learning_rate=1e-2)
    history = model.fit(texts, labels, batch_size=4, epochs=2, verbose=0).history
    assert np.isfinite(history["loss"]).all()
    changed = [not np.allclose(a, b) for a, b in zip(initial, model.get_weights())]
    assert all(changed)  # every weight trains: backbone, pooler, head
    before = model.predict(texts, verbose=0)
    model.save_to_preset(tmp_path / "chunks")
    again = kbert.BertChunkClassifier.from_preset(tmp_path / "chunks")
    assert (again.max_chunks, again.pooling) == (3, "max")
    np.testing.assert_allclose(again.predict(texts, verbose=0), before, atol=1e-6)
    model.save(tmp_path / "chunks.keras")
    restored = keras.saving.load_model(tmp_path / "chunks.keras")
    np.testing.assert_allclose(restored.predict(texts, verbose=0), before, atol=1e-6)
    with pytest.raises(ValueError, match="pooling"):
        kbert.BertChunkClassifier(model.backbone, 2, pooling="sum")


def test_a_dataset_of_raw_strings_is_refused_with_the_way_out(classifier_preset):
    tf = pytest.importorskip("tensorflow")
    _, directory = classifier_preset
    for cls, extra in (
        (kbert.BertChunkClassifier, {}),
        (kbert.BertMemoryClassifier, {"memory_tokens": 2}),
    ):
        model = cls.from_preset(directory, num_classes=2, max_chunks=2, **extra)
        data = tf.data.Dataset.from_tensor_slices((["the movie was good"] * 2, [1, 0])).batch(2)
        model.compile()
        with pytest.raises(ValueError, match="list or numpy array of strings"):
            model.fit(data, epochs=1, verbose=0)
        with pytest.raises(ValueError, match="cuts documents into windows"):
            model.predict(data.map(lambda x, y: x), verbose=0)
