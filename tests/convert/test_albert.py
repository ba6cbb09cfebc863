"""Hugging Face ALBERT checkpoints load into ALBERT-style kbert backbones
(factorized embeddings, one shared block) with transformers' outputs."""

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import kbert
from kbert.presets import PresetError
from tests import harness


def _albert(tmp_path, cls, name, **kwargs):
    # The sizes of tests/models/test_albert.py (JAX reuses its compiled ops).
    config = transformers.AlbertConfig(
        vocab_size=97,
        embedding_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=24,
        initializer_range=0.2,  # larger than the default: differences show
        **kwargs,
    )
    torch.manual_seed(0)
    model = cls(config).eval()
    directory = tmp_path / name
    model.save_pretrained(directory)
    return model, directory


def _torch_inputs(x):
    return dict(
        input_ids=torch.tensor(x["token_ids"]).long(),
        token_type_ids=torch.tensor(x["segment_ids"]).long(),
        attention_mask=torch.tensor(x["padding_mask"]).long(),
    )


@pytest.fixture(scope="module")
def pretraining(tmp_path_factory):
    return _albert(tmp_path_factory.mktemp("albert"), transformers.AlbertForPreTraining, "pt")


def test_backbone_parity_and_export(pretraining, tmp_path):
    hf, directory = pretraining
    backbone = kbert.BertBackbone.from_preset(directory)
    assert backbone.embedding_dim == 8 and backbone.share_layers
    assert backbone.activation == "gelu_tanh"  # ALBERT's default gelu_new
    assert backbone.dropout == 0.0 and backbone.num_layers == 2
    x = harness.backbone_inputs()
    y = harness.to_numpy(backbone(x))
    with torch.no_grad():
        ref = hf.albert(**_torch_inputs(x))
    mask = x["padding_mask"][..., None]
    assert np.max(np.abs((y["sequence_output"] - ref.last_hidden_state.numpy()) * mask)) <= 1e-5
    assert np.max(np.abs(y["pooled_output"] - ref.pooler_output.numpy())) <= 1e-5

    kbert.convert.huggingface.export_to_huggingface(backbone, tmp_path / "out")
    exported = transformers.AlbertModel.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        again = exported(**_torch_inputs(x))
    assert np.max(np.abs(again.last_hidden_state.numpy() - ref.last_hidden_state.numpy())) == 0
    assert np.max(np.abs(again.pooler_output.numpy() - ref.pooler_output.numpy())) == 0


def test_pretraining_heads_parity_and_export(pretraining, tmp_path):
    """The MLM head (H -> E, LayerNorm at E, decoder tied to the E-wide
    table) and the SOP head; the SOP head is chosen from the checkpoint."""
    hf, directory = pretraining
    model = kbert.BertPreTrainer.from_preset(directory)
    assert model.sentence_task == "sop"
    x = harness.backbone_inputs()
    positions = np.array([[1, 2], [1, 3], [2, 0]], "int32")
    y = harness.to_numpy(model({**x, "mask_positions": positions}))
    with torch.no_grad():
        ref = hf(**_torch_inputs(x))
    expected = np.take_along_axis(ref.prediction_logits.numpy(), positions[..., None], axis=1)
    assert np.max(np.abs(y["mlm_logits"] - expected)) <= 1e-5
    assert np.max(np.abs(y["sop_logits"] - ref.sop_logits.numpy())) <= 1e-5

    kbert.convert.huggingface.export_to_huggingface(model, tmp_path / "out")
    exported = transformers.AlbertForPreTraining.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        again = exported(**_torch_inputs(x))
    assert np.array_equal(again.prediction_logits.numpy(), ref.prediction_logits.numpy())
    assert np.array_equal(again.sop_logits.numpy(), ref.sop_logits.numpy())


def test_layer_groups_are_refused(tmp_path):
    _, directory = _albert(tmp_path, transformers.AlbertModel, "groups", num_hidden_groups=2)
    with pytest.raises(PresetError, match="num_hidden_groups=2"):
        kbert.BertBackbone.from_preset(directory)
    # Weights with a second group under a config that claims one group
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "num_hidden_groups": 1}))
    with pytest.raises(PresetError, match="several ALBERT layer groups"):
        kbert.BertBackbone.from_preset(directory)


def test_masked_lm_and_classifier_heads(tmp_path):
    x = harness.backbone_inputs()
    hf, directory = _albert(tmp_path, transformers.AlbertForMaskedLM, "mlm")
    positions = np.array([[1, 2], [1, 3], [2, 0]], "int32")
    y = harness.to_numpy(
        kbert.BertMaskedLM.from_preset(directory)({**x, "mask_positions": positions})
    )
    with torch.no_grad():
        ref = hf(**_torch_inputs(x)).logits.numpy()
    expected = np.take_along_axis(ref, positions[..., None], axis=1)
    assert np.max(np.abs(y["mlm_logits"] - expected)) <= 1e-5

    cls = transformers.AlbertForSequenceClassification
    hf, directory = _albert(tmp_path, cls, "classifier", num_labels=3)
    y = harness.to_numpy(kbert.BertClassifier.from_preset(directory, num_classes=3)(x))
    with torch.no_grad():
        ref = hf(**_torch_inputs(x)).logits.numpy()
    assert np.max(np.abs(y - ref)) <= 1e-5
