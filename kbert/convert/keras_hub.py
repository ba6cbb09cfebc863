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

import functools
import os
import re

import numpy as np

from kbert.presets.io import PresetError, preset_file, read_json
from kbert.presets.loader import PresetLoader, register_format
from kbert.tokenizers import BertTokenizer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.weights.h5"
VOCABULARY_FILE = "assets/tokenizer/vocabulary.txt"


def is_keras_hub_dir(directory):
    if not os.path.lexists(os.path.join(directory, CONFIG_FILE)):
        return False
    config = read_json(directory, CONFIG_FILE)
    return str(config.get("registered_name", "")).startswith("keras_hub>")


def backbone_config(directory):
    config = read_json(directory, CONFIG_FILE)
    if config.get("registered_name") != "keras_hub>BertBackbone":
        raise PresetError(
            f"{directory}/{CONFIG_FILE} is a keras-hub {config.get('registered_name')!r}, "
            "not a BERT backbone (keras_hub>BertBackbone)"
        )
    c = config.get("config")
    if not isinstance(c, dict):
        raise PresetError(f"{directory}/{CONFIG_FILE} has no 'config' object")
    absent = [
        k
        for k in ("vocabulary_size", "num_layers", "num_heads", "hidden_dim", "intermediate_dim")
        if k not in c
    ]
    if absent:
        raise PresetError(f"{directory}/{CONFIG_FILE} lacks the BERT setting(s) {absent}")
    # Values are kept as read: check_backbone_config refuses wrong types.
    return {
        "vocabulary_size": c["vocabulary_size"],
        "num_layers": c["num_layers"],
        "num_heads": c["num_heads"],
        "hidden_dim": c["hidden_dim"],
        "intermediate_dim": c["intermediate_dim"],
        "max_sequence_length": c.get("max_sequence_length", 512),
        "type_vocab_size": c.get("num_segments", 2),
        "dropout": c.get("dropout", 0.1),
        "attention_dropout": c.get("dropout", 0.1),
        "activation": "gelu_tanh",
        "layer_norm_epsilon": 1e-12,
    }


def _h5_datasets(path, read):
    """{dataset name: shape, or array when `read`} of an HDF5 file. Datasets
    whose data live in other files (external storage, virtual datasets) are
    refused: a weights file names no other file."""
    import h5py

    out = {}
    try:
        with h5py.File(path, "r") as f:

            def visit(name, obj):
                if not isinstance(obj, h5py.Dataset):
                    return
                if obj.external or obj.is_virtual:
                    raise PresetError(
                        f"{path}: dataset {name!r} keeps its data in other files; "
                        "refusing to read them"
                    )
                out[name] = np.asarray(obj[()]) if read else tuple(obj.shape)

            f.visititems(visit)
    except OSError as e:
        raise PresetError(f"{path} is not a readable HDF5 weights file: {e}") from e
    return out


def read_h5_weights(path):
    """{variable path: array} from a Keras 3 `.weights.h5` file, read with
    h5py. Keras stores each layer's variables under `<layer path>/vars/<i>`
    in creation order; we name them by the layer path and index."""
    return _h5_datasets(path, read=True)


_ENCODER = re.compile(r"layers/transformer_encoder(?:_(\d+))?/")


def backbone_shapes(h5_shapes):
    """{kbert path: shape} for the embedding tables and blocks of a keras-hub
    BERT weights file's {dataset name: shape}: what `held_sizes` needs."""
    tables = {
        "layers/reversible_embedding/vars/0": "embeddings/token_embedding/embeddings",
        "layers/position_embedding/vars/0": "embeddings/position_embeddings",
        "layers/embedding/vars/0": "embeddings/segment_embedding/embeddings",
    }
    out = {ours: h5_shapes[theirs] for theirs, ours in tables.items() if theirs in h5_shapes}
    for name, shape in h5_shapes.items():
        m = _ENCODER.match(name)
        if m is None:
            continue
        block = f"transformer_layer_{int(m.group(1) or 0)}/"
        if name[m.end() :] == "_feedforward_intermediate_dense/vars/0":
            out[block + "intermediate_dense/kernel"] = shape
        else:
            out[block + name[m.end() :]] = shape
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


def load_tokenizer(directory):
    """kbert BertTokenizer from a keras-hub preset's vocabulary and casing, or None."""
    vocab = preset_file(directory, VOCABULARY_FILE, subfolders=True)
    if not os.path.lexists(vocab):
        return None
    return BertTokenizer(vocab, lowercase=tokenizer_lowercase(directory))


def tokenizer_lowercase(directory):
    """The casing keras-hub's tokenizer.json records (False when absent)."""
    if not os.path.lexists(os.path.join(directory, "tokenizer.json")):
        return False
    config = read_json(directory, "tokenizer.json").get("config", {})
    lowercase = config.get("lowercase", False) if isinstance(config, dict) else None
    if not isinstance(lowercase, bool):
        raise PresetError(
            f"{directory}/tokenizer.json: config.lowercase must be true or false, "
            f"got {lowercase!r:.60}"
        )
    return lowercase


class KerasHubLoader(PresetLoader):
    """A keras-hub BERT preset directory (config.json naming a `keras_hub>` class)."""

    format = "keras_hub"
    priority = 10  # before kbert presets: keras-hub presets have a metadata.json too
    config_file = CONFIG_FILE
    vocabulary_file = VOCABULARY_FILE

    @classmethod
    def detect(cls, directory):
        return is_keras_hub_dir(directory)

    @property
    def weights_source(self):
        return f"keras-hub weights in {self.directory}"

    def backbone_config(self):
        return backbone_config(self.directory)

    @functools.cached_property
    def _weights_path(self):
        path = preset_file(self.directory, WEIGHTS_FILE)
        if not os.path.lexists(path):
            raise PresetError(f"{self.directory} has no {WEIGHTS_FILE}")
        return path

    @functools.cached_property
    def _h5_shapes(self):
        return _h5_datasets(self._weights_path, False)

    def held_shapes(self):
        return backbone_shapes(self._h5_shapes)

    def check_held(self, config, held):
        # keras-hub keeps heads apart, (H, N, D): a wrong num_heads would load silently
        query = self._h5_shapes.get(
            "layers/transformer_encoder/_self_attention_layer/query_dense/vars/0"
        )
        if query is not None and len(query) == 3 and query[1] != config["num_heads"]:
            raise PresetError(
                f"{self.config_source}: num_heads={config['num_heads']} but the weights hold "
                f"{query[1]} heads; the config does not describe these weights"
            )

    def backbone_weights(self, config):
        path = self._weights_path
        return backbone_weights(read_h5_weights(path), config, f"keras-hub weights in {path}")

    def tokenizer(self, rules=None):
        if os.path.isfile(os.path.join(self.directory, "vocab.txt")):
            return super().tokenizer(rules)
        return load_tokenizer(self.directory)


register_format(KerasHubLoader)
