"""Original Google BERT TensorFlow checkpoints (`bert_config.json`,
`bert_model.ckpt.*`, `vocab.txt`) -> kbert, MLM and NSP heads included.

The checkpoint is read with `tf.train.load_checkpoint` (TensorFlow is
imported here only). Names are mapped to the Hugging Face layout and then go
through the same checked mapping as Hugging Face directories.
"""

import glob
import os
import re

import numpy as np

from kbert.convert.huggingface import HuggingFaceLoader
from kbert.presets.io import PresetError, preset_file, read_json
from kbert.presets.loader import register_format

CONFIG_FILE = "bert_config.json"


def is_tf_checkpoint_dir(directory):
    return os.path.lexists(os.path.join(directory, CONFIG_FILE)) and bool(
        glob.glob(os.path.join(glob.escape(os.fspath(directory)), "*.ckpt*.index"))
    )


def checkpoint_prefix(directory):
    """The checkpoint's path prefix, after checking that its index and data
    files are regular files inside `directory`."""
    indexes = sorted(glob.glob(os.path.join(glob.escape(os.fspath(directory)), "*.ckpt*.index")))
    if not indexes:
        raise PresetError(f"{directory} has no *.ckpt.index file")
    prefix = indexes[-1][: -len(".index")]
    for path in [indexes[-1]] + glob.glob(glob.escape(prefix) + ".data-*"):
        preset_file(directory, os.path.basename(path))
    return prefix


def _reader(directory):
    import tensorflow as tf

    try:
        return tf.train.load_checkpoint(checkpoint_prefix(directory))
    except (tf.errors.OpError, ValueError) as e:
        raise PresetError(f"the TF checkpoint in {directory} cannot be read: {e}") from e


def _bert_variables(names):
    # optimizer slots and global_step are not part of the model
    return [
        n
        for n in names
        if (n.startswith("bert/") or n.startswith("cls/")) and "adam" not in n.lower()
    ]


def read_shapes(directory):
    """{Hugging Face name: shape (torch layout)} from the checkpoint's index,
    reading no tensor data."""
    shapes = _reader(directory).get_variable_to_shape_map()
    out = {}
    for name in _bert_variables(shapes):
        hf, transpose = tf_name_to_hf(name)
        out[hf] = tuple(shapes[name])[::-1] if transpose else tuple(shapes[name])
    return out


def tf_name_to_hf(name):
    """'bert/encoder/layer_3/attention/self/query/kernel' -> HF name (+ transpose flag)."""
    transpose = name.endswith("/kernel")
    hf = re.sub(r"layer_(\d+)", r"layer.\1", name)
    hf = hf.replace("/kernel", "/weight").replace("/gamma", "/weight").replace("/beta", "/bias")
    if hf.startswith("bert/embeddings/") and hf.count("/") == 2:  # word/position/token_type tables
        hf += "/weight"
    hf = hf.replace("cls/predictions/output_bias", "cls/predictions/bias")
    hf = hf.replace("cls/seq_relationship/output_weights", "cls/seq_relationship/weight")
    hf = hf.replace("cls/seq_relationship/output_bias", "cls/seq_relationship/bias")
    return hf.replace("/", "."), transpose


def read_state(directory):
    """{Hugging Face name: array (torch layout)} from an original checkpoint."""
    reader = _reader(directory)
    state = {}
    for name in _bert_variables(reader.get_variable_to_shape_map()):
        hf, transpose = tf_name_to_hf(name)
        value = np.asarray(reader.get_tensor(name), dtype=np.float32)
        state[hf] = value.T if transpose else value
    return state


def read_config(directory):
    """The checkpoint's bert_config.json in Hugging Face form."""
    return {"model_type": "bert", "layer_norm_eps": 1e-12, **read_json(directory, CONFIG_FILE)}


class TFCheckpointLoader(HuggingFaceLoader):
    """An original checkpoint directory, read into Hugging Face names and
    then mapped as a Hugging Face BERT is; it holds a BertPreTrainer."""

    format = "tf_checkpoint"
    priority = 20  # before Hugging Face: a directory with both is read as the checkpoint
    config_file = CONFIG_FILE

    @classmethod
    def detect(cls, directory):
        return is_tf_checkpoint_dir(directory)

    def _read_config(self):
        return read_config(self.directory)

    def _read_shapes(self):
        return read_shapes(self.directory)

    def _read_state(self):
        return read_state(self.directory)

    def held_model(self):
        return "BertPreTrainer", {}  # the MLM and NSP heads


register_format(TFCheckpointLoader)
