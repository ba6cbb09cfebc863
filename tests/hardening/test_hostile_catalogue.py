"""The catalogue of hostile artifacts (README: "N of N refused").

Each fixture builds one hostile artifact in its own directory and the
matching loader must raise a clear error; nothing may run (a marker file a
payload would write stays absent) and nothing may be written outside the
artifact's directory.
"""

import hashlib
import json
import os
import pickle
import zipfile

import keras
import numpy as np
import pytest

import kbert
from kbert.presets import PresetError
from tests.harness import TINY

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]
MARKER = "pwned"


def _preset(d):
    kbert.BertBackbone(**TINY).save_to_preset(d / "p")
    return d / "p"


def _set_checksums(directory, files=None):
    metadata = json.loads((directory / "metadata.json").read_text())
    if files is None:
        files = {
            name: hashlib.sha256((directory / name).read_bytes()).hexdigest()
            for name in metadata["files"]
        }
    metadata["files"] = files
    (directory / "metadata.json").write_text(json.dumps(metadata))


def _rezip(path, edit):
    with zipfile.ZipFile(path) as z:
        files = {n: z.read(n) for n in z.namelist()}
    config = json.loads(files["config.json"])
    edit(config)
    files["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)


def keras_lambda(d):
    inputs = keras.Input((2,))
    marker = str(d / MARKER)
    outputs = keras.layers.Lambda(lambda x: (open(marker, "w"), x)[1])(inputs)
    keras.Model(inputs, outputs).save(d / "m.keras")
    os.remove(marker)  # building the model traced the lambda once; loading must not run it
    return lambda: keras.saving.load_model(d / "m.keras"), "(?i)lambda|unsafe|safe_mode"


def keras_unregistered_class(d):
    kbert.BertBackbone(**TINY).save(d / "m.keras")
    _rezip(
        d / "m.keras",
        lambda c: c.update(class_name="system", module="os", registered_name="system"),
    )
    return lambda: keras.saving.load_model(
        d / "m.keras"
    ), "(?i)could not|unknown|not.*found|locate|interpret"


def keras_vocabulary_is_a_path(d):
    pre = kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), 8)
    kbert.BertClassifier(
        kbert.BertBackbone(**{**TINY, "vocabulary_size": 7}), 2, preprocessor=pre
    ).save(d / "m.keras")
    (d.parent / "secret_vocab.txt").write_text("\n".join(VOCAB))

    def edit(config):
        config["config"]["preprocessor"]["config"]["tokenizer"]["vocabulary"] = str(
            d.parent / "secret_vocab.txt"
        )

    _rezip(d / "m.keras", edit)
    return lambda: keras.saving.load_model(d / "m.keras"), "embed its vocabulary"


def _metadata_naming(name):
    def build(d):
        p = _preset(d)
        metadata = json.loads((p / "metadata.json").read_text())
        _set_checksums(p, {**metadata["files"], name: "0" * 64})
        return lambda: kbert.BertBackbone.from_preset(p), "unsafe file"

    build.__name__ = f"preset_metadata_names_{name!r}"
    return build


def preset_symlink_leaving(d):
    p = _preset(d)
    outside = d.parent / "elsewhere.safetensors"
    os.replace(p / "model.safetensors", outside)
    os.symlink(outside, p / "model.safetensors")
    return lambda: kbert.BertBackbone.from_preset(p), "link"


def preset_checksum_mismatch(d):
    p = _preset(d)
    data = bytearray((p / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # one flipped byte, metadata untouched
    (p / "model.safetensors").write_bytes(bytes(data))
    return lambda: kbert.BertBackbone.from_preset(p), "(?i)checksum|sha256"


def preset_truncated_weights(d):
    p = _preset(d)
    (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:1000])
    _set_checksums(p)
    return lambda: kbert.BertBackbone.from_preset(p), "corrupt or truncated"


def preset_garbage_weights(d):
    p = _preset(d)
    (p / "model.safetensors").write_bytes(os.urandom(4096))
    _set_checksums(p)
    return lambda: kbert.BertBackbone.from_preset(p), "corrupt or truncated|model.safetensors"


def preset_nan_weights(d):
    from safetensors.numpy import load_file, save_file

    p = _preset(d)
    weights = load_file(str(p / "model.safetensors"))
    weights["pooler/dense/bias"] = np.full_like(weights["pooler/dense/bias"], np.inf)
    save_file(weights, str(p / "model.safetensors"))
    _set_checksums(p)
    return lambda: kbert.BertBackbone.from_preset(p), "NaN or inf"


def preset_wrong_class(d):
    p = _preset(d)
    config = json.loads((p / "config.json").read_text())
    config["class_name"] = "os.system"
    (p / "config.json").write_text(json.dumps(config))
    _set_checksums(p)
    return lambda: kbert.BertBackbone.from_preset(p), "not a kbert BertBackbone"


class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def huggingface_pickle_without_opt_in(d):
    h = d / "hf"
    h.mkdir()
    (h / "config.json").write_text(
        json.dumps(
            {
                "model_type": "bert",
                "vocab_size": 97,
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "intermediate_size": 37,
            }
        )
    )
    with open(h / "pytorch_model.bin", "wb") as f:
        pickle.dump(_Payload(str(d / MARKER)), f)
    return lambda: kbert.BertBackbone.from_preset(h), "allow_pickle=True"


def huggingface_other_model_type(d):
    h = d / "hf"
    h.mkdir()
    (h / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    return lambda: kbert.BertBackbone.from_preset(h), "(?i)gpt2|not.*bert"


def keras_hub_vocabulary_symlink(d):
    keras_hub = pytest.importorskip("keras_hub")
    k = d / "kh"
    keras_hub.models.BertBackbone(
        vocabulary_size=7,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=8,
    ).save_to_preset(str(k))
    (k / "assets" / "tokenizer").mkdir(parents=True)
    (d.parent / "outside_vocab.txt").write_text("\n".join(VOCAB))
    os.symlink(d.parent / "outside_vocab.txt", k / "assets" / "tokenizer" / "vocabulary.txt")
    return lambda: kbert.BertClassifier.from_preset(k, num_classes=2), "outside"


def keras_hub_truncated_weights(d):
    keras_hub = pytest.importorskip("keras_hub")
    k = d / "kh"
    keras_hub.models.BertBackbone(
        vocabulary_size=7,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=8,
    ).save_to_preset(str(k))
    (k / "model.weights.h5").write_bytes((k / "model.weights.h5").read_bytes()[:500])
    return lambda: kbert.BertBackbone.from_preset(k), "model.weights.h5"


def preset_config_beyond_its_weights(d):
    p = _preset(d)
    config = json.loads((p / "config.json").read_text())
    config["config"].update(num_layers=200, hidden_dim=8192, num_heads=64)
    (p / "config.json").write_text(json.dumps(config))
    _set_checksums(p)
    return lambda: kbert.BertBackbone.from_preset(p), "the weights hold"


def _huggingface_dir(d):
    from kbert.convert.huggingface import export_to_huggingface

    h = d / "hf"
    export_to_huggingface(kbert.BertBackbone(**{**TINY, "vocabulary_size": len(VOCAB)}), h)
    (h / "vocab.txt").write_text("\n".join(VOCAB))
    return h


def huggingface_config_nested_too_deep(d):
    h = _huggingface_dir(d)
    (h / "config.json").write_text('{"model_type": "bert", "x": ' + "[" * 100_000)
    return lambda: kbert.BertBackbone.from_preset(h), "config.json is not valid JSON"


def huggingface_vocabulary_is_a_fifo(d):
    h = _huggingface_dir(d)
    os.remove(h / "vocab.txt")
    os.mkfifo(h / "vocab.txt")  # reading it would block forever
    return lambda: kbert.BertClassifier.from_preset(h, num_classes=2), "not a regular file"


def huggingface_vocabulary_past_the_embeddings(d):
    h = _huggingface_dir(d)
    (h / "vocab.txt").write_text("\n".join(VOCAB + ["c", "d"]))
    return lambda: kbert.BertClassifier.from_preset(h, num_classes=2), "9 tokens but.* 7 rows"


HOSTILE = [
    keras_lambda,
    keras_unregistered_class,
    keras_vocabulary_is_a_path,
    _metadata_naming("../outside.json"),
    _metadata_naming("/etc/passwd"),
    _metadata_naming("sub/dir.json"),
    preset_symlink_leaving,
    preset_checksum_mismatch,
    preset_truncated_weights,
    preset_garbage_weights,
    preset_nan_weights,
    preset_wrong_class,
    huggingface_pickle_without_opt_in,
    huggingface_other_model_type,
    keras_hub_vocabulary_symlink,
    keras_hub_truncated_weights,
    preset_config_beyond_its_weights,
    huggingface_config_nested_too_deep,
    huggingface_vocabulary_is_a_fifo,
    huggingface_vocabulary_past_the_embeddings,
]


@pytest.mark.parametrize("build", HOSTILE, ids=lambda b: b.__name__)
def test_hostile_artifact_is_refused(build, tmp_path):
    d = tmp_path / "artifact"
    d.mkdir()
    load, message = build(d)
    before = set(os.listdir(tmp_path))
    with pytest.raises((PresetError, ValueError, TypeError)) as error:
        load()
    assert error.match(message), str(error.value)
    assert not (d / MARKER).exists()  # no payload ran
    assert set(os.listdir(tmp_path)) == before  # nothing written beside the artifact
