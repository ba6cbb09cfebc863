"""transformers MobileBERT directories load into `MobileBertBackbone` and the
task models with transformers' outputs (fp32, 1e-5), and export back."""

import json

import keras
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import kbert
from kbert.convert.huggingface import export_to_huggingface
from tests import harness

# google/mobilebert-uncased's structure at a tiny size: E < A < H, a shared
# query/key bottleneck, stacked feed-forward networks, NoNorm, ReLU.
TINY = dict(
    vocab_size=97,
    embedding_size=8,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=24,
    intra_bottleneck_size=16,
    num_feedforward_networks=3,
    max_position_embeddings=24,
    initializer_range=0.2,  # larger than the default: differences show
)
WORDS = "the a cat dog sat ran on mat fast slow good bad very not movie film".split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS


def _mobilebert(directory, cls, **kwargs):
    """A random transformers model saved to `directory`; its norms' scales
    and offsets are moved off ones and zeros so that they matter."""
    config = transformers.MobileBertConfig(**{**TINY, **kwargs})
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(directory)
    (directory / "vocab.txt").write_text("\n".join(VOCAB + [f"w{i}" for i in range(97 - 21)]))
    return model


def _torch_inputs(x):
    return dict(
        input_ids=torch.tensor(x["token_ids"]).long(),
        token_type_ids=torch.tensor(x["segment_ids"]).long(),
        attention_mask=torch.tensor(x["padding_mask"]).long(),
    )


def _masked(a, x):
    return a * x["padding_mask"][..., None]


POSITIONS = np.array([[1, 2], [1, 3], [2, 0]], "int32")


@pytest.fixture(scope="module")
def pretraining(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mobilebert") / "pt"
    return _mobilebert(directory, transformers.MobileBertForPreTraining), directory


def test_backbone_and_pretraining_heads_parity(pretraining):
    hf, directory = pretraining
    backbone = kbert.BertBackbone.from_preset(directory)
    assert type(backbone) is kbert.MobileBertBackbone
    assert (backbone.embedding_dim, backbone.bottleneck_dim, backbone.hidden_dim) == (8, 16, 32)
    assert backbone.normalization == "no_norm" and backbone.activation == "relu"
    x = harness.backbone_inputs()
    with torch.no_grad():
        ref = hf(**_torch_inputs(x), output_hidden_states=True)
        base = hf.mobilebert(**_torch_inputs(x))
    y = harness.to_numpy(backbone(x))
    assert np.max(np.abs(_masked(y["sequence_output"] - base.last_hidden_state.numpy(), x))) <= 1e-5
    assert np.max(np.abs(y["pooled_output"] - base.pooler_output.numpy())) <= 1e-5

    model = kbert.BertPreTrainer.from_preset(directory)
    y = harness.to_numpy(model({**x, "mask_positions": POSITIONS}))
    expected = np.take_along_axis(ref.prediction_logits.numpy(), POSITIONS[..., None], axis=1)
    assert np.max(np.abs(y["mlm_logits"] - expected)) <= 1e-5
    assert np.max(np.abs(y["nsp_logits"] - ref.seq_relationship_logits.numpy())) <= 1e-5
    # the MLM head's decoder is the (V, E) table and the (H - E, V) matrix
    head = model.get_layer("mlm_head")
    assert tuple(head.extra_decoder_kernel.shape) == (32 - 8, 97)


# The other options transformers exposes, two tiny models for all of them.
VARIANTS = {
    "layer_norm_no_trigram_no_pooler_activation": dict(
        normalization_type="layer_norm",
        trigram_input=False,
        classifier_activation=False,
        use_bottleneck_attention=True,
        num_feedforward_networks=1,
    ),
    "no_bottleneck_layer_norm": dict(
        use_bottleneck=False,
        embedding_size=32,
        normalization_type="layer_norm",
        hidden_dropout_prob=0.1,
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_options_parity(variant, tmp_path):
    hf = _mobilebert(tmp_path, transformers.MobileBertModel, **VARIANTS[variant])
    backbone = kbert.MobileBertBackbone.from_preset(tmp_path)
    x = harness.backbone_inputs()
    with torch.no_grad():
        ref = hf(**_torch_inputs(x))
    y = harness.to_numpy(backbone(x))
    assert np.max(np.abs(_masked(y["sequence_output"] - ref.last_hidden_state.numpy(), x))) <= 1e-5
    assert np.max(np.abs(y["pooled_output"] - ref.pooler_output.numpy())) <= 1e-5


HEADS = {
    "classifier": (transformers.MobileBertForSequenceClassification, kbert.BertClassifier),
    "token": (transformers.MobileBertForTokenClassification, kbert.BertTokenClassifier),
    "span": (transformers.MobileBertForQuestionAnswering, kbert.BertQuestionAnswerer),
    "choice": (transformers.MobileBertForMultipleChoice, kbert.BertMultipleChoice),
    "masked_lm": (transformers.MobileBertForMaskedLM, kbert.BertMaskedLM),
}


@pytest.mark.parametrize("head", sorted(HEADS))
def test_task_heads_parity_and_export(head, tmp_path):
    hf_cls, cls = HEADS[head]
    hf = _mobilebert(tmp_path / "in", hf_cls, num_labels=2 if head == "span" else 3)
    kwargs = {"num_classes": 3} if head in ("classifier", "token") else {}
    if head == "choice":
        kwargs = {"num_choices": 2}
    model = cls.from_preset(tmp_path / "in", **kwargs)
    x = harness.backbone_inputs(batch=4 if head == "choice" else 3)
    torch_x = _torch_inputs(x)
    if head == "choice":  # (B, N, T): two choices per question
        x = {k: v.reshape(2, 2, -1) for k, v in x.items()}
        torch_x = {k: v.reshape(2, 2, -1) for k, v in torch_x.items()}
    if head == "masked_lm":
        x = {**x, "mask_positions": POSITIONS}

    def compare(reference):
        with torch.no_grad():
            ref = reference(**torch_x)
        y = harness.to_numpy(model(x))
        if head == "span":
            real = x["padding_mask"] == 1
            for name in ("start_logits", "end_logits"):
                assert np.max(np.abs((y[name] - getattr(ref, name).numpy())[real])) <= 1e-5
        elif head == "masked_lm":
            expected = np.take_along_axis(ref.logits.numpy(), POSITIONS[..., None], axis=1)
            assert np.max(np.abs(y["mlm_logits"] - expected)) <= 1e-5
        elif head == "token":
            assert np.max(np.abs(_masked(y - ref.logits.numpy(), x))) <= 1e-5
        else:
            assert np.max(np.abs(y - ref.logits.numpy())) <= 1e-5

    compare(hf)
    export_to_huggingface(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [hf_cls.__name__]
    compare(hf_cls.from_pretrained(tmp_path / "out").eval())
    again = cls.from_preset(tmp_path / "out", **kwargs)
    # transformers builds these without a pooler: kbert's is drawn afresh
    fresh = "pooler/" if head in ("masked_lm", "token", "span") else None
    for a, b in zip(model.weights, again.weights):
        assert a.path == b.path
        if fresh and a.path.startswith(fresh):
            continue
        np.testing.assert_array_equal(harness.to_numpy(a), harness.to_numpy(b))


def test_backbone_export_loads_in_transformers(pretraining, tmp_path):
    hf, directory = pretraining
    backbone = kbert.MobileBertBackbone.from_preset(directory)
    export_to_huggingface(backbone, tmp_path / "out")
    exported = transformers.MobileBertModel.from_pretrained(tmp_path / "out").eval()
    x = harness.backbone_inputs()
    with torch.no_grad():
        ref = hf.mobilebert(**_torch_inputs(x))
        again = exported(**_torch_inputs(x))
    np.testing.assert_array_equal(again.last_hidden_state.numpy(), ref.last_hidden_state.numpy())
    np.testing.assert_array_equal(again.pooler_output.numpy(), ref.pooler_output.numpy())


def test_preset_and_keras_round_trips(pretraining, tmp_path):
    _, directory = pretraining
    model = kbert.BertPreTrainer.from_preset(directory)
    x = {**harness.backbone_inputs(), "mask_positions": POSITIONS}
    preset = harness.check_preset_round_trip(model, x, tmp_path)
    assert type(kbert.BertBackbone.from_preset(preset)) is kbert.MobileBertBackbone
    harness.check_keras_round_trip(model, x, tmp_path)
    harness.check_config_round_trip(model.backbone)


def test_classifier_fits_raw_text_from_a_transformers_directory(pretraining):
    _, directory = pretraining
    model = kbert.BertClassifier.from_preset(directory, num_classes=2)
    assert model.preprocessor is not None
    texts = ["the cat sat on the mat", "a very bad movie", "good film", "the dog ran fast"] * 2
    labels = np.array([1, 0, 1, 1, 0, 0, 1, 0])
    model.compile(learning_rate=1e-3)
    losses = model.fit(texts, labels, batch_size=8, epochs=3, verbose=0).history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_packed_rows_keep_each_window_inside_its_example():
    """fit packs a classifier's rows (JAX on a CPU by default): each example's
    3-token windows and attention stay its own."""
    from kbert.training import batching

    keras.utils.set_random_seed(0)
    backbone = kbert.MobileBertBackbone(
        97,
        2,
        2,
        32,
        24,
        max_sequence_length=16,
        embedding_dim=8,
        bottleneck_dim=16,
        num_feedforward_networks=2,
        initializer_range=0.2,
    )
    table = harness.to_numpy(backbone.token_embedding.embeddings)
    table[0] = 0.0  # [PAD], as transformers keeps it
    backbone.token_embedding.embeddings.assign(table)
    model = kbert.BertClassifier(backbone, 3, dropout=0.0)
    rng = np.random.default_rng(0)
    lengths = np.array([16, 5, 3, 7, 4, 9, 2, 6])
    mask = (np.arange(16) < lengths[:, None]).astype("int32")
    x = {
        "token_ids": (rng.integers(5, 97, (8, 16)) * mask).astype("int32"),
        "segment_ids": np.zeros((8, 16), "int32"),
        "padding_mask": mask,
    }
    alone = keras.ops.convert_to_numpy(model(x, training=False))  # one example per row
    data = batching.PackedBatches(x, np.zeros(8, "int32"), batch_size=8, row_length=16)
    batch, _ = data[0]
    assert batch["token_ids"].shape[0] < 8  # examples side by side
    packed = keras.ops.convert_to_numpy(model(batch, training=False))
    np.testing.assert_allclose(packed, alone[data.batches[0]], atol=1e-5)


@pytest.mark.parametrize("trigram", [True, False])
def test_table_as_wide_as_the_hidden_states(trigram, tmp_path):
    """embedding_size == hidden_size: transformers keeps an
    `embedding_transformation` it does not apply without the trigram input,
    and an empty (0, V) extra decoder matrix; both directions load and
    export with transformers' outputs."""
    hf = _mobilebert(
        tmp_path / "in",
        transformers.MobileBertForMaskedLM,
        embedding_size=32,
        trigram_input=trigram,
    )
    model = kbert.BertMaskedLM.from_preset(tmp_path / "in")
    assert (model.backbone.embedding_dim is None) == (not trigram)
    x = {**harness.backbone_inputs(), "mask_positions": POSITIONS}

    def compare(reference):
        with torch.no_grad():
            ref = reference(**_torch_inputs(x)).logits.numpy()
        expected = np.take_along_axis(ref, POSITIONS[..., None], axis=1)
        got = harness.to_numpy(model(x))["mlm_logits"]
        assert np.max(np.abs(got - expected)) <= 1e-5

    compare(hf)
    export_to_huggingface(model, tmp_path / "out")
    compare(transformers.MobileBertForMaskedLM.from_pretrained(tmp_path / "out").eval())
    again = kbert.BertMaskedLM.from_preset(tmp_path / "out")
    for a, b in zip(model.weights, again.weights):
        if not a.path.startswith("pooler/"):  # transformers' masked LM has none
            np.testing.assert_array_equal(harness.to_numpy(a), harness.to_numpy(b))


def test_a_non_zero_pad_embedding_is_named(tmp_path, caplog):
    """With the 3-token window, a non-zero [PAD] row makes outputs depend on
    how far a row is padded (transformers' too): loading says so."""
    hf = _mobilebert(tmp_path, transformers.MobileBertModel)
    with caplog.at_level("WARNING", logger="kbert"):
        kbert.MobileBertBackbone.from_preset(tmp_path)
    assert "[PAD] embedding" not in caplog.text  # transformers keeps it at zero
    with torch.no_grad():
        hf.embeddings.word_embeddings.weight[0] = 0.5
    hf.save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="kbert"):
        kbert.MobileBertBackbone.from_preset(tmp_path)
    assert "[PAD] embedding (row 0) is not zero" in caplog.text


def test_next_sentence_directory_loads_as_a_pair_classifier(tmp_path):
    """A `MobileBertForNextSentencePrediction` directory loads as a 2-class
    `BertClassifier` (`num_classes` read from its head, no dropout before
    it) with transformers' logits on sentence pairs, and exports as a
    `MobileBertForSequenceClassification` with the same logits."""
    hf = _mobilebert(tmp_path / "in", transformers.MobileBertForNextSentencePrediction)
    model = kbert.BertClassifier.from_preset(tmp_path / "in")
    assert model.num_classes == 2
    assert model.get_layer("classifier_dropout").rate == 0.0
    x = harness.backbone_inputs()
    with torch.no_grad():
        ref = hf(**_torch_inputs(x)).logits.numpy()
    assert np.max(np.abs(harness.to_numpy(model(x)) - ref)) <= 1e-5
    export_to_huggingface(model, tmp_path / "out")
    exported = transformers.MobileBertForSequenceClassification.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        again = exported.eval()(**_torch_inputs(x)).logits.numpy()
    assert np.max(np.abs(again - ref)) <= 1e-5
