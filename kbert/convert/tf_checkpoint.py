"""Original Google BERT TensorFlow checkpoints (`bert_config.json`,
`bert_model.ckpt.*`, `vocab.txt`) -> kbert, MLM and NSP heads included.

The checkpoint is read with `tf.train.load_checkpoint` (TensorFlow is
imported here only). Names are mapped to the Hugging Face layout and then go
through the same checked mapping as Hugging Face directories.
"""

import glob
import json
import os
import re

import numpy as np


def is_tf_checkpoint_dir(directory):
    return os.path.isfile(os.path.join(directory, "bert_config.json")) and bool(
        glob.glob(os.path.join(directory, "*.ckpt*.index"))
    )


def checkpoint_prefix(directory):
    indexes = sorted(glob.glob(os.path.join(directory, "*.ckpt*.index")))
    if not indexes:
        raise ValueError(f"{directory} has no *.ckpt.index file")
    return indexes[-1][: -len(".index")]


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
    import tensorflow as tf

    reader = tf.train.load_checkpoint(checkpoint_prefix(directory))
    state = {}
    for name in reader.get_variable_to_shape_map():
        if not (name.startswith("bert/") or name.startswith("cls/")) or "adam" in name.lower():
            continue  # optimizer slots, global_step
        hf, transpose = tf_name_to_hf(name)
        value = np.asarray(reader.get_tensor(name), dtype=np.float32)
        state[hf] = value.T if transpose else value
    return state


def read_config(directory):
    with open(os.path.join(directory, "bert_config.json")) as f:
        config = json.load(f)
    return {"model_type": "bert", "layer_norm_eps": 1e-12, **config}
