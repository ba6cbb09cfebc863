"""keras-hub BERT preset directories -> kbert.

A keras-hub preset is `config.json` (a serialized `keras_hub>BertBackbone`),
`model.weights.h5`, `metadata.json`, and for the tokenizer `tokenizer.json`
plus `assets/tokenizer/vocabulary.txt`. We read config.json as plain JSON
(nothing is deserialized), read the weights from the HDF5 file by name with
h5py (no Keras loading code, no pickle), and map them onto kbert's names:
per-head query/key/value kernels (H, N, D) are fused into one (H, 3H) kernel.
keras-hub's BERT uses the tanh GELU, so the backbone gets
`activation="gelu_tanh"`.
"""

import json
import os

import numpy as np

from kbert.presets.io import PresetError, preset_file, read_json
from kbert.tokenizers import BertTokenizer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.weights.h5"
VOCABULARY_FILE = os.path.join("assets", "tokenizer", "vocabulary.txt")


def is_keras_hub_dir(directory):
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except ValueError:
        return False
    return isinstance(config, dict) and str(config.get("registered_name", "")).startswith(
        "keras_hub>"
    )


def backbone_config(directory):
    config = read_json(directory, CONFIG_FILE)
    if config.get("registered_name") != "keras_hub>BertBackbone":
        raise PresetError(
            f"{directory}/{CONFIG_FILE} is a keras-hub {config.get('registered_name')!r}, "
            "not a BERT backbone (keras_hub>BertBackbone)"
        )
    c = config.get("config", {})
    try:
        return {
            "vocabulary_size": int(c["vocabulary_size"]),
            "num_layers": int(c["num_layers"]),
            "num_heads": int(c["num_heads"]),
            "hidden_dim": int(c["hidden_dim"]),
            "intermediate_dim": int(c["intermediate_dim"]),
            "max_sequence_length": int(c.get("max_sequence_length", 512)),
            "type_vocab_size": int(c.get("num_segments", 2)),
            "dropout": float(c.get("dropout", 0.1)),
            "attention_dropout": float(c.get("dropout", 0.1)),
            "activation": "gelu_tanh",
            "layer_norm_epsilon": 1e-12,
        }
    except (KeyError, TypeError, ValueError) as e:
        raise PresetError(f"{directory}/{CONFIG_FILE} lacks a BERT setting: {e!r}") from e


def read_h5_weights(path):
    """{variable path: array} from a Keras 3 `.weights.h5` file, read with
    h5py. Keras stores each layer's variables under `<layer path>/vars/<i>`
    in creation order; we name them by the layer path and index."""
    import h5py

    out = {}
    try:
        with h5py.File(path, "r") as f:

            def visit(name, obj):
                if isinstance(obj, h5py.Dataset):
                    out[name] = np.asarray(obj[()])

            f.visititems(visit)
    except OSError as e:
        raise PresetError(f"{path} is not a readable HDF5 weights file: {e}") from e
    return out


def _layer_vars(raw, layer):
    """Arrays of one layer (by its path in the h5 file), in creation order."""
    prefix = f"layers/{layer}/vars/"
    found = {
        int(k[len(prefix) :]): v
        for k, v in raw.items()
        if k.startswith(prefix) and k[len(prefix) :].isdigit()
    }
    return [found[i] for i in sorted(found)]


def backbone_weights(raw, config, source):
    h = config["hidden_dim"]
    w = {}

    def get(layer, count):
        values = _layer_vars(raw, layer)
        if len(values) != count:
            raise PresetError(
                f"{source}: expected {count} variables under {layer!r}, found {len(values)}"
            )
        return values

    # Keras names the h5 groups after each layer's class, in model order:
    # the token embedding is the model's only ReversibleEmbedding, the
    # segment embedding its only Embedding, block i its i-th TransformerEncoder.
    w["embeddings/token_embedding/embeddings"] = get("reversible_embedding", 1)[0]
    w["embeddings/position_embeddings"] = get("position_embedding", 1)[0]
    w["embeddings/segment_embedding/embeddings"] = get("embedding", 1)[0]
    w["embeddings/layer_norm/gamma"], w["embeddings/layer_norm/beta"] = get(
        "layer_normalization", 2
    )
    for i in range(config["num_layers"]):
        src = "transformer_encoder" + (f"_{i}" if i else "") + "/"
        dst = f"transformer_layer_{i}/"
        kernels, biases = [], []
        for name in ("query", "key", "value"):
            kernel, bias = get(src + f"_self_attention_layer/{name}_dense", 2)
            kernels.append(kernel.reshape(h, h))
            biases.append(bias.reshape(h))
        w[dst + "self_attention/qkv/kernel"] = np.concatenate(kernels, axis=1)
        w[dst + "self_attention/qkv/bias"] = np.concatenate(biases)
        kernel, bias = get(src + "_self_attention_layer/output_dense", 2)
        w[dst + "self_attention/output/kernel"], w[dst + "self_attention/output/bias"] = (
            kernel.reshape(h, h),
            bias,
        )
        for theirs, mine, names in [
            ("_self_attention_layer_norm", "attention_layer_norm", ("gamma", "beta")),
            ("_feedforward_intermediate_dense", "intermediate_dense", ("kernel", "bias")),
            ("_feedforward_output_dense", "output_dense", ("kernel", "bias")),
            ("_feedforward_layer_norm", "output_layer_norm", ("gamma", "beta")),
        ]:
            for value, name in zip(get(src + theirs, 2), names):
                w[dst + f"{mine}/{name}"] = value
    w["pooler/dense/kernel"], w["pooler/dense/bias"] = get("dense", 2)
    return w


def read_backbone(directory, load_weights=True):
    """(kbert backbone config, {kbert path: array} or None) from a keras-hub
    BERT preset directory."""
    config = backbone_config(directory)
    if not load_weights:
        return config, None
    path = preset_file(directory, WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise PresetError(f"{directory} has no {WEIGHTS_FILE}")
    source = f"keras-hub weights in {path}"
    return config, backbone_weights(read_h5_weights(path), config, source)


def load_tokenizer(directory):
    """kbert BertTokenizer from a keras-hub preset's vocabulary and casing, or None."""
    vocab = os.path.join(directory, VOCABULARY_FILE)
    if not os.path.isfile(vocab):
        return None
    lowercase = False
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        lowercase = bool(
            read_json(directory, "tokenizer.json").get("config", {}).get("lowercase", False)
        )
    root = os.path.realpath(directory)
    if os.path.realpath(vocab) != os.path.join(
        root, VOCABULARY_FILE
    ):  # a symlink on the way leads out
        raise PresetError(f"{vocab} resolves outside {directory}; refusing to read it")
    return BertTokenizer(vocab, lowercase=lowercase)
