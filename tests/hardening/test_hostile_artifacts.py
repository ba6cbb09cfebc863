"""Hostile artifacts are refused with a clear error and nothing runs."""

import hashlib
import json
import os
import re
import shutil
import stat
import zipfile

import keras
import numpy as np
import pytest

import kbert
from kbert.presets import PresetError
from tests.harness import TINY


@pytest.fixture
def preset(tmp_path):
    directory = tmp_path / "preset"
    kbert.BertBackbone(**TINY).save_to_preset(directory)
    return directory


def _rewrite_metadata(directory, files):
    metadata = json.loads((directory / "metadata.json").read_text())
    metadata["files"] = files
    (directory / "metadata.json").write_text(json.dumps(metadata))


def test_lambda_layer_in_keras_file_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    inputs = keras.Input((2,))
    outputs = keras.layers.Lambda(lambda x: x * 2)(inputs)
    path = str(tmp_path / "lambda.keras")
    keras.Model(inputs, outputs).save(path)
    with pytest.raises(ValueError, match="(?i)lambda|unsafe|safe_mode"):
        keras.saving.load_model(path)
    assert not marker.exists()


def test_unregistered_class_in_keras_file_is_refused(tmp_path):
    path = tmp_path / "model.keras"
    kbert.BertBackbone(**TINY).save(path)
    with zipfile.ZipFile(path) as z:
        files = {n: z.read(n) for n in z.namelist()}
    config = json.loads(files["config.json"])
    config.update(class_name="system", module="os", registered_name="system")
    files["config.json"] = json.dumps(config).encode()
    bad = tmp_path / "bad.keras"
    with zipfile.ZipFile(bad, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    with pytest.raises((TypeError, ValueError)):
        keras.saving.load_model(bad)


@pytest.mark.parametrize("name", ["../outside.json", "/etc/passwd", "sub/dir.json", ".."])
def test_metadata_naming_paths_outside_is_refused(preset, name):
    metadata = json.loads((preset / "metadata.json").read_text())
    _rewrite_metadata(preset, {**metadata["files"], name: "0" * 64})
    with pytest.raises(PresetError, match="unsafe file"):
        kbert.BertBackbone.from_preset(preset)


def test_symlinked_weights_are_refused(preset, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(preset / "model.safetensors", outside)
    os.symlink(outside, preset / "model.safetensors")
    with pytest.raises(PresetError, match="link"):
        kbert.BertBackbone.from_preset(preset)


def test_truncated_weights_with_matching_checksum_are_refused(preset):
    data = (preset / "model.safetensors").read_bytes()[:1000]
    (preset / "model.safetensors").write_bytes(data)
    metadata = json.loads((preset / "metadata.json").read_text())
    _rewrite_metadata(
        preset, {**metadata["files"], "model.safetensors": hashlib.sha256(data).hexdigest()}
    )
    with pytest.raises(PresetError, match="corrupt or truncated"):
        kbert.BertBackbone.from_preset(preset)


def test_nan_weights_are_refused(preset):
    from safetensors.numpy import load_file, save_file

    weights = load_file(str(preset / "model.safetensors"))
    weights["pooler/dense/bias"] = np.full_like(weights["pooler/dense/bias"], np.nan)
    save_file(weights, str(preset / "model.safetensors"))
    metadata = json.loads((preset / "metadata.json").read_text())
    digest = hashlib.sha256((preset / "model.safetensors").read_bytes()).hexdigest()
    _rewrite_metadata(preset, {**metadata["files"], "model.safetensors": digest})
    with pytest.raises(ValueError, match="NaN or inf"):
        kbert.BertBackbone.from_preset(preset)


# --- malformed JSON and files that are not regular files ---------------------

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]

MALFORMED_JSON = {
    "deep_nesting": b"[" * 200_000,
    "deep_nesting_in_object": b'{"model_type": "bert", "x": ' + b"[" * 200_000,
    "huge_integer": b'{"model_type": "bert", "vocab_size": ' + b"9" * 5000 + b"}",
    "float_overflow": b'{"model_type": "bert", "vocab_size": 1e999}',
    "nan": b'{"model_type": "bert", "vocab_size": NaN}',
    "top_level_list": b'[{"model_type": "bert"}]',
    "not_utf8": b'{"model_type": "\xff\xfe"}',
    "truncated": b'{"model_type": "bert", "vocab_',
    "oversized": b"{" + b" " * (17 << 20) + b"}",
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from kbert.convert.huggingface import export_to_huggingface

    directory = tmp_path_factory.mktemp("hf") / "hf"
    export_to_huggingface(kbert.BertBackbone(**{**TINY, "vocabulary_size": len(VOCAB)}), directory)
    (directory / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return directory


def _tf_checkpoint_dir(directory):
    directory.mkdir()
    (directory / "bert_model.ckpt.index").write_bytes(b"")
    return directory


# (file, how to make a directory holding it, how to load it)
JSON_FILES = {
    "hf_config": ("config.json", None),
    "kbert_metadata": ("metadata.json", None),
    "tf_bert_config": ("bert_config.json", _tf_checkpoint_dir),
    "sharded_index": ("model.safetensors.index.json", None),
}


@pytest.mark.parametrize("contents", MALFORMED_JSON.values(), ids=MALFORMED_JSON.keys())
@pytest.mark.parametrize("target", JSON_FILES, ids=JSON_FILES.keys())
def test_malformed_json_is_a_preset_error_naming_the_file(
    preset, hf_dir, tmp_path, target, contents
):
    name, make = JSON_FILES[target]
    if target == "kbert_metadata":
        directory = preset
    elif make is not None:
        directory = make(tmp_path / "artifact")
    else:
        directory = tmp_path / "artifact"
        shutil.copytree(hf_dir, directory)
        if name == "model.safetensors.index.json":
            os.remove(directory / "model.safetensors")
    (directory / name).write_bytes(contents)
    with pytest.raises(PresetError, match=re.escape(name)):
        kbert.BertBackbone.from_preset(directory)


TOKENIZER_SETTINGS = {
    "tokenizer_config.json": [b"[" * 200_000, b'{"do_lower_case": "yes"}', b"[]"],
    "preprocessor.json": [b'{"sequence_length": 1e999}', b'{"sequence_length": 10000}'],
}


@pytest.mark.parametrize(
    "name, contents",
    [(n, c) for n, cs in TOKENIZER_SETTINGS.items() for c in cs],
    ids=lambda v: v if isinstance(v, str) else v[:24].decode(),
)
def test_malformed_tokenizer_settings_are_refused(hf_dir, tmp_path, name, contents):
    directory = tmp_path / "hf"
    shutil.copytree(hf_dir, directory)
    (directory / name).write_bytes(contents)
    with pytest.raises(PresetError, match=re.escape(name)):
        kbert.BertClassifier.from_preset(directory, num_classes=2)


def _not_regular(kind, path):
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # like /dev/zero
        except (PermissionError, OSError):
            pytest.skip("cannot create a device node here")
    else:  # a link leaving the directory
        outside = path.parent.parent / f"outside_{path.name}"
        outside.write_text("\n".join(VOCAB))
        os.symlink(outside, path)


@pytest.mark.parametrize("kind", ["directory", "fifo", "device", "link"])
@pytest.mark.parametrize("name", ["vocab.txt", "config.json", "model.safetensors"])
def test_files_that_are_not_regular_files_are_refused(hf_dir, tmp_path, name, kind):
    directory = tmp_path / "hf"
    shutil.copytree(hf_dir, directory)
    os.remove(directory / name)
    _not_regular(kind, directory / name)
    with pytest.raises(PresetError, match="not a regular file|link") as error:
        kbert.BertClassifier.from_preset(directory, num_classes=2)
    assert name in str(error.value)


def test_metadata_listing_a_fifo_is_refused(preset):
    os.remove(preset / "model.safetensors")
    os.mkfifo(preset / "model.safetensors")
    with pytest.raises(PresetError, match="not a regular file"):
        kbert.BertBackbone.from_preset(preset)
