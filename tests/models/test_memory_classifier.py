"""Recurrent memory over a long document's windows: the memory carried from
window to window as transformers' BERT computes it with `inputs_embeds`,
documents of different lengths, information passing from the first window
to the last, fit / predict / save / load, and bad arguments."""

import keras
import numpy as np
import pytest

import kbert
from kbert.data.long_documents import chunk_documents
from kbert.models.backbone import encoder_forward
from tests import harness
from tests.harness import TINY

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + "the a movie was good bad plot".split()
TOKENIZER = kbert.BertTokenizer(VOCAB)


def _backbone(**overrides):
    config = {**TINY, "vocabulary_size": len(VOCAB), "max_sequence_length": 12}
    return kbert.BertBackbone(**{**config, **overrides})


def test_one_window_reads_its_memory_and_tokens():
    """A document of one window: the head on the pooled [CLS] of
    `[CLS] memory tokens [SEP]`, the memory given as token vectors."""
    backbone = _backbone(dropout=0.0)
    model = kbert.BertMemoryClassifier(backbone, 2, max_chunks=2, memory_tokens=3)
    x = chunk_documents(TOKENIZER, ["the movie was good"], 8, 2)
    memory = np.random.default_rng(0).normal(size=(3, TINY["hidden_dim"])).astype("float32")
    model.get_layer("memory_tokens").set_weights([memory])
    ids = x["token_ids"][:, 0]
    window = np.concatenate([ids[:, :1], np.zeros((1, 3), "int32"), ids[:, 1:]], axis=1)
    mask = np.concatenate(
        [x["padding_mask"][:, 0, :1], np.ones((1, 3), "int32"), x["padding_mask"][:, 0, 1:]],
        axis=1,
    )
    table = keras.ops.convert_to_numpy(backbone.token_embedding.embeddings)
    vectors = table[window]
    vectors[:, 1:4] = memory
    out = encoder_forward(
        backbone.get_layer("embeddings"),
        backbone.transformer_layers,
        backbone.get_layer("pooler"),
        {
            "token_ids": window,
            "segment_ids": np.zeros_like(window),
            "padding_mask": mask,
            "token_vectors": vectors,
        },
    )
    kernel, bias = model.get_layer("logits").get_weights()
    expected = keras.ops.convert_to_numpy(out["pooled_output"]) @ kernel + bias
    np.testing.assert_allclose(harness.to_numpy(model(x)), expected, atol=1e-5)


def test_memory_carries_the_first_window_to_the_last():
    """The logits of a two-window document change with its first window's
    tokens only through the memory (the head reads the last window's [CLS],
    and the last windows are the same), and they do change."""
    # weights large enough for attention to tell tokens apart
    backbone = _backbone(initializer_range=1.0)
    model = kbert.BertMemoryClassifier(backbone, 2, max_chunks=2, memory_tokens=2)
    first = chunk_documents(TOKENIZER, ["the movie was good the plot was bad"], 6, 2)
    second = chunk_documents(TOKENIZER, ["the movie was bad the plot was bad"], 6, 2)
    np.testing.assert_array_equal(first["token_ids"][:, 1], second["token_ids"][:, 1])
    a, b = harness.to_numpy(model(first)), harness.to_numpy(model(second))
    assert np.max(np.abs(a - b)) > 1e-2


def test_documents_end_at_their_last_window():
    """A document shorter than C windows gets the same logits in a batch
    beside a longer one as alone, and as with C equal to its own windows."""
    backbone = _backbone()
    texts = ["the movie was good", "the plot was bad " * 4]
    three = kbert.BertMemoryClassifier(backbone, 2, max_chunks=3, memory_tokens=2)
    one = kbert.BertMemoryClassifier(backbone, 2, max_chunks=1, memory_tokens=2)
    one.set_weights(three.get_weights())
    both = harness.to_numpy(three(chunk_documents(TOKENIZER, texts, 8, 3)))
    alone = harness.to_numpy(three(chunk_documents(TOKENIZER, texts[:1], 8, 3)))
    short = harness.to_numpy(one(chunk_documents(TOKENIZER, texts[:1], 8, 1)))
    np.testing.assert_allclose(both[:1], alone, atol=1e-5)
    np.testing.assert_allclose(alone, short, atol=1e-5)
    assert np.all(np.isfinite(both))


transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def test_recurrence_matches_transformers_bert_with_inputs_embeds(tmp_path):
    """The whole recurrence against transformers' BertModel fed the memory
    through `inputs_embeds`, window by window, in float32."""
    config = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=16,
        num_labels=3,
    )
    torch.manual_seed(0)
    hf = transformers.BertForSequenceClassification(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    memory_tokens, chunks, length = 3, 3, 9
    model = kbert.BertMemoryClassifier.from_preset(
        tmp_path / "hf", num_classes=3, max_chunks=chunks, memory_tokens=memory_tokens
    )
    memory = np.random.default_rng(1).normal(size=(memory_tokens, 32)).astype("float32")
    model.get_layer("memory_tokens").set_weights([memory])
    model.get_layer("logits").set_weights(
        [hf.classifier.weight.detach().numpy().T, hf.classifier.bias.detach().numpy()]
    )
    texts = ["the movie was good " * 3, "bad", "the plot " * 9]
    x = chunk_documents(TOKENIZER, texts, length, chunks)
    got = harness.to_numpy(model(x))

    state = torch.tensor(memory)[None].repeat(len(texts), 1, 1)
    last = None
    with torch.no_grad():
        for c in range(chunks):
            ids = torch.tensor(x["token_ids"][:, c]).long()
            mask = torch.tensor(x["padding_mask"][:, c]).long()
            slots = torch.zeros(len(texts), memory_tokens, dtype=torch.long)
            ids = torch.cat([ids[:, :1], slots, ids[:, 1:]], 1)
            mask = torch.cat([mask[:, :1], slots + 1, mask[:, 1:]], 1)
            vectors = hf.bert.embeddings.word_embeddings(ids)
            vectors[:, 1 : 1 + memory_tokens] = state
            out = hf.bert(inputs_embeds=vectors, attention_mask=mask)
            real = torch.tensor(x["padding_mask"][:, c].any(-1))
            written = out.last_hidden_state[:, 1 : 1 + memory_tokens]
            state = torch.where(real[:, None, None], written, state)
            pooled = out.pooler_output
            last = pooled if last is None else torch.where(real[:, None], pooled, last)
        expected = hf.classifier(last).numpy()
    assert np.max(np.abs(got - expected)) <= 1e-5


@pytest.fixture
def classifier_preset(tmp_path):
    backbone = _backbone(num_layers=1)
    preprocessor = kbert.BertPreprocessor(TOKENIZER, sequence_length=12)
    model = kbert.BertClassifier(backbone, 2, preprocessor=preprocessor)
    model.save_to_preset(tmp_path / "classifier")
    return model, tmp_path / "classifier"


def test_memory_classifier_fits_and_round_trips(classifier_preset, tmp_path):
    classifier, directory = classifier_preset
    model = kbert.BertMemoryClassifier.from_preset(
        directory, num_classes=2, max_chunks=3, memory_tokens=4
    )
    np.testing.assert_array_equal(  # the classifier's head, a fresh memory
        model.get_layer("logits").get_weights()[0],
        classifier.get_layer("logits").get_weights()[0],
    )
    texts = ["the good plot " * 4, "the bad plot " * 4, "good movie", "bad movie"] * 2
    labels = np.array([1, 0, 1, 0] * 2)
    windows = model.preprocess_samples(texts[:1])["token_ids"]
    assert windows.shape == (1, 3, 8)  # 12 positions: 4 for the memory, 8 per window
    initial = [np.array(w) for w in model.get_weights()]
    model.compile(learning_rate=1e-2)
    history = model.fit(texts, labels, batch_size=4, epochs=2, verbose=0).history
    assert np.isfinite(history["loss"]).all()
    changed = [not np.allclose(a, b) for a, b in zip(initial, model.get_weights())]
    assert all(changed)  # every weight trains: memory, backbone, pooler, head
    before = model.predict(texts, verbose=0)
    model.save_to_preset(tmp_path / "memory")
    again = kbert.BertMemoryClassifier.from_preset(tmp_path / "memory")
    assert (again.max_chunks, again.memory_tokens) == (3, 4)
    np.testing.assert_array_equal(
        again.get_layer("memory_tokens").get_weights()[0],
        model.get_layer("memory_tokens").get_weights()[0],
    )
    # a chunk-and-pool preset gives its head too
    kbert.BertChunkClassifier.from_preset(directory, num_classes=2, max_chunks=2).save_to_preset(
        tmp_path / "c"
    )
    from_chunks = kbert.BertMemoryClassifier.from_preset(
        tmp_path / "c", num_classes=2, memory_tokens=4
    )
    np.testing.assert_array_equal(
        from_chunks.get_layer("logits").get_weights()[0],
        classifier.get_layer("logits").get_weights()[0],
    )
    np.testing.assert_allclose(again.predict(texts, verbose=0), before, atol=1e-6)
    model.save(tmp_path / "memory.keras")
    restored = keras.saving.load_model(tmp_path / "memory.keras")
    np.testing.assert_allclose(restored.predict(texts, verbose=0), before, atol=1e-6)


def test_bad_arguments_name_the_problem():
    backbone = _backbone()
    with pytest.raises(ValueError, match="memory_tokens"):
        kbert.BertMemoryClassifier(backbone, 2, memory_tokens=0)
    with pytest.raises(ValueError, match="memory_tokens"):
        kbert.BertMemoryClassifier(backbone, 2, memory_tokens=10)  # 12 positions
    with pytest.raises(ValueError, match="embedding_dim"):
        kbert.BertMemoryClassifier(_backbone(embedding_dim=8), 2, memory_tokens=2)
    with pytest.raises(ValueError, match="attention_window"):
        kbert.BertMemoryClassifier(_backbone(attention_window=4), 2, memory_tokens=2)
    model = kbert.BertMemoryClassifier(backbone, 2, max_chunks=2, memory_tokens=4)
    x = {k: np.ones((1, 2, 10), "int32") for k in ("token_ids", "segment_ids", "padding_mask")}
    with pytest.raises(ValueError, match="memory tokens exceed.*max_sequence_length=12"):
        model.predict(x, verbose=0)
    with pytest.raises(ValueError, match="single documents"):
        kbert.BertMemoryClassifier(
            backbone, 2, memory_tokens=2, preprocessor=kbert.BertPreprocessor(TOKENIZER, 12)
        ).predict((["a"], ["b"]), verbose=0)


def test_frozen_mixed_precision_backbone_trains_the_memory_and_head():
    backbone = _backbone(dtype="mixed_bfloat16")
    preprocessor = kbert.BertPreprocessor(TOKENIZER, sequence_length=12)
    model = kbert.BertMemoryClassifier(
        backbone, 2, preprocessor, max_chunks=2, memory_tokens=3, freeze_backbone=True
    )
    harness.check_config_round_trip(model)
    texts = ["the good plot " * 3, "the bad plot " * 3, "good", "bad"]
    x = model.preprocess_samples(texts)
    harness.check_eager_vs_compiled(model, x, atol=1e-2)  # bfloat16 compute
    frozen = [np.array(w) for w in backbone.get_weights()]
    memory = np.array(model.get_layer("memory_tokens").get_weights()[0])
    model.compile(learning_rate=1e-2)
    model.fit(texts, np.array([1, 0, 1, 0]), batch_size=2, epochs=1, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(frozen, backbone.get_weights()))
    assert not np.allclose(memory, model.get_layer("memory_tokens").get_weights()[0])
    logits = model.predict(texts, verbose=0)
    assert logits.dtype == np.float32 and np.all(np.isfinite(logits))


def test_batches_and_empty_inputs_keep_windows_within_the_positions():
    """Windows from raw strings fill the rows with the memory; per-batch
    calls pad them to a bucket no longer than the memory leaves."""
    preprocessor = kbert.BertPreprocessor(TOKENIZER, sequence_length=12)
    model = kbert.BertMemoryClassifier(_backbone(), 2, preprocessor, max_chunks=2, memory_tokens=5)
    assert model.input_limits()["max_sequence_length"] == 7
    texts = ["the movie was good", "the plot was bad " * 3]
    np.testing.assert_allclose(
        model.predict_on_batch(texts), model.predict(texts, verbose=0), atol=1e-5
    )
    assert model.predict([], verbose=0).shape == (0, 2)


def test_float8_is_refused_for_several_windows():
    model = kbert.BertMemoryClassifier(_backbone(), 2, max_chunks=2, memory_tokens=2)
    with pytest.raises(ValueError, match="float8.*once per window"):
        model.quantize("float8")
