"""Hugging Face MobileBERT directories <-> kbert's `MobileBertBackbone`.

Reads a transformers MobileBERT directory (config.json with model_type
"mobilebert", model.safetensors, vocab.txt): `MobileBertModel`,
`MobileBertForPreTraining`, `MobileBertForMaskedLM` and the task heads;
`export_to_huggingface` (`kbert.convert.huggingface`) writes them back.

One set of tables serves both directions: `CONFIG` (transformers' name,
kbert's, transformers' default) for the config, `EMBEDDINGS`, `block_table`
and `POOLER` for the backbone's weights, `HEADS` for the heads; the task
classes are `kbert.convert.huggingface.TASKS` with "MobileBert" for "Bert"
in their architectures.
"""

import re

import numpy as np

from kbert.convert import huggingface as hf
from kbert.layers.activations import canonical_activation
from kbert.presets.io import PresetError
from kbert.presets.loader import TaskHead, register_format

MODEL_TYPE = "mobilebert"
BACKBONE_TYPE = "mobilebert"  # kbert.models.mobilebert.BACKBONE_TYPE

# (transformers' name, kbert's, transformers' MobileBertConfig default):
# save_pretrained writes only the values that differ from these.
CONFIG = [
    ("vocab_size", "vocabulary_size", 30522),
    ("num_hidden_layers", "num_layers", 24),
    ("num_attention_heads", "num_heads", 4),
    ("hidden_size", "hidden_dim", 512),
    ("intermediate_size", "intermediate_dim", 512),
    ("max_position_embeddings", "max_sequence_length", 512),
    ("type_vocab_size", "type_vocab_size", 2),
    ("hidden_dropout_prob", "dropout", 0.0),
    ("attention_probs_dropout_prob", "attention_dropout", 0.1),
    ("hidden_act", "activation", "relu"),
    ("layer_norm_eps", "layer_norm_epsilon", 1e-12),
    ("initializer_range", "initializer_range", 0.02),
    ("embedding_size", "embedding_dim", 128),
    ("intra_bottleneck_size", "bottleneck_dim", 128),
    ("use_bottleneck", "use_bottleneck", True),
    ("use_bottleneck_attention", "use_bottleneck_attention", False),
    ("key_query_shared_bottleneck", "key_query_shared_bottleneck", True),
    ("num_feedforward_networks", "num_feedforward_networks", 4),
    ("normalization_type", "normalization", "no_norm"),
    ("trigram_input", "trigram_input", True),
    ("classifier_activation", "pooler_activation", True),
]


def backbone_config_from_hf(hf_config, source="config.json"):
    """The `MobileBertBackbone` config of a transformers MobileBERT config."""
    if hf_config.get("model_type") != MODEL_TYPE:
        raise PresetError(f"{source} is not a MobileBERT config (model_type 'mobilebert')")
    config = {ours: hf_config.get(theirs, default) for theirs, ours, default in CONFIG}
    if not isinstance(config["activation"], str):
        raise PresetError(f"{source}: hidden_act must be a name, got {config['activation']!r:.60}")
    try:
        config["activation"] = canonical_activation(config["activation"])
    except ValueError as e:
        raise PresetError(f"{source}: {e}") from e
    if config["embedding_dim"] == config["hidden_dim"] and not config["trigram_input"]:
        config["embedding_dim"] = None  # no projection: the table is H wide
    config["backbone_type"] = BACKBONE_TYPE
    return config


def _has_projection(config):
    return config["embedding_dim"] is not None


def embeddings_table(config):
    """The embeddings' names (the projection only where the model uses one)."""
    table = [
        ("embeddings.word_embeddings.weight", "embeddings/token_embedding/embeddings", "tensor"),
        (
            "embeddings.token_type_embeddings.weight",
            "embeddings/segment_embedding/embeddings",
            "tensor",
        ),
        ("embeddings.position_embeddings.weight", "embeddings/position_embeddings", "tensor"),
        ("embeddings.LayerNorm", "embeddings/layer_norm", "norm"),
    ]
    if _has_projection(config):
        table.append(("embeddings.embedding_transformation", "embeddings/projection", "linear"))
    return table


def _shared_query_key(config):
    return (
        config["use_bottleneck"]
        and config["key_query_shared_bottleneck"]
        and not config["use_bottleneck_attention"]
    )


def block_table(config):
    """{"fused": [(kbert projection, [transformers Linear names])],
    "names": name table} of one block, relative to the block: query and key
    (and value, where all three see one input) fuse into one kbert Dense."""
    shared = _shared_query_key(config)
    names = [
        ("attention.output.dense", "self_attention/output", "linear"),
        ("attention.output.LayerNorm", "attention_norm", "norm"),
        ("intermediate.dense", "intermediate_dense", "linear"),
        ("output.dense", "output_dense", "linear"),
        ("output.LayerNorm", "output_norm", "norm"),
    ]
    for i in range(config["num_feedforward_networks"] - 1):
        names += [
            (f"ffn.{i}.intermediate.dense", f"ffn_{i}_intermediate", "linear"),
            (f"ffn.{i}.output.dense", f"ffn_{i}_output", "linear"),
            (f"ffn.{i}.output.LayerNorm", f"ffn_{i}_norm", "norm"),
        ]
    if config["use_bottleneck"]:
        names += [
            ("bottleneck.input.dense", "input_bottleneck", "linear"),
            ("bottleneck.input.LayerNorm", "input_bottleneck_norm", "norm"),
            ("output.bottleneck.dense", "output_bottleneck", "linear"),
            ("output.bottleneck.LayerNorm", "output_bottleneck_norm", "norm"),
        ]
    if shared:
        names += [
            ("bottleneck.attention.dense", "attention_bottleneck", "linear"),
            ("bottleneck.attention.LayerNorm", "attention_bottleneck_norm", "norm"),
        ]
        fused = [
            ("self_attention/query_key", ["attention.self.query", "attention.self.key"]),
            ("self_attention/value", ["attention.self.value"]),
        ]
    else:
        fused = [
            (
                "self_attention/qkv",
                ["attention.self.query", "attention.self.key", "attention.self.value"],
            )
        ]
    return {"fused": fused, "names": names}


def _blocks(config):
    return [(f"encoder.layer.{i}.", f"transformer_layer_{i}/") for i in range(config["num_layers"])]


POOLER = [("pooler.dense", "pooler/dense", "linear")]

# The heads, at the checkpoint's top level: BERT's, but for the masked-LM
# head's dense matrix that extends the tied decoder from E to H.
HEADS = {
    **hf.HEADS["bert"],
    "mlm": hf.HEADS["bert"]["mlm"]
    + [("cls.predictions.dense.weight", "mlm_head/extra_decoder_kernel", "tensor")],
}
# transformers ties cls.predictions.decoder.bias to cls.predictions.bias
WRITTEN_TWICE = hf.WRITTEN_TWICE


def architecture(task):
    """The transformers class of an `HFTask` for a MobileBERT backbone."""
    return task.architecture.replace("Bert", "MobileBert", 1)


CLASS_OF_ARCHITECTURE = {}  # transformers class name -> kbert class name
for _name, _task in hf.TASKS.items():
    CLASS_OF_ARCHITECTURE.setdefault(architecture(_task), _name)


def backbone_weights_from_hf(state, config):
    """{kbert backbone path: array} of a (normalised) transformers MobileBERT
    state dict; the pooler where the checkpoint holds one."""
    p = hf._prefix(state)

    def get(name, transposed=False):
        key = p + name
        if key not in state:
            raise PresetError(f"the checkpoint lacks {key!r}")
        return state[key].T if transposed else state[key]

    w = hf.read_table(embeddings_table(config), get)
    table = block_table(config)
    for theirs, ours in _blocks(config):
        for path, names in table["fused"]:
            w[ours + path + "/kernel"] = np.concatenate(
                [get(theirs + n + ".weight", True) for n in names], axis=1
            )
            w[ours + path + "/bias"] = np.concatenate([get(theirs + n + ".bias") for n in names])
        w.update(hf.read_table(table["names"], get, theirs, ours))
    if config["pooler_activation"] and p + "pooler.dense.weight" in state:
        w.update(hf.read_table(POOLER, get))
    return w


def backbone_state_to_hf(backbone, prefix=""):
    """kbert `MobileBertBackbone` weights -> transformers MobileBertModel names."""
    config = backbone.get_config()
    w = {v.path: np.asarray(v.numpy(), dtype=np.float32) for v in backbone.weights}
    out = hf.write_table(embeddings_table(config), w)
    table = block_table(config)
    for theirs, ours in _blocks(config):
        for path, names in table["fused"]:
            kernel, bias = w[ours + path + "/kernel"], w[ours + path + "/bias"]
            width = kernel.shape[1] // len(names)
            for j, name in enumerate(names):
                out[theirs + name + ".weight"] = kernel[:, j * width : (j + 1) * width].T
                out[theirs + name + ".bias"] = bias[j * width : (j + 1) * width]
        out.update(hf.write_table(table["names"], w, theirs, ours))
    if config["pooler_activation"]:
        out.update(hf.write_table(POOLER, w))
    return {prefix + k: v for k, v in out.items()}


_BLOCK_NAME = re.compile(r"encoder\.layer\.(\d+)\.intermediate\.dense\.weight$")


def backbone_shapes_from_hf(shapes):
    """{kbert path: shape} of the embedding tables, the projection and each
    block's last intermediate kernel: what `held_sizes` bounds a config with."""
    p = hf._prefix(shapes)
    out = {}
    for name, path, transposed in hf.tensors(embeddings_table({"embedding_dim": 1})):
        if p + name in shapes:
            out[path] = tuple(shapes[p + name])[:: -1 if transposed else 1]
    for name, shape in shapes.items():
        m = _BLOCK_NAME.match(name[len(p) :]) if name.startswith(p) else None
        if m is not None:
            out[f"transformer_layer_{m.group(1)}/intermediate_dense/kernel"] = tuple(shape)[::-1]
    return out


EXTRA_DECODER = "mlm_head/extra_decoder_kernel"
EXTRA_DECODER_HF = "cls.predictions.dense.weight"


def head_weights(class_name, state, source="the checkpoint"):
    """{kbert head path: array} of the `class_name` head a (normalised)
    transformers MobileBERT state dict holds, or None. A masked-LM head
    over a table as wide as the hidden states holds an empty (0, V) extra
    matrix in transformers and none in kbert."""
    task = hf.TASKS.get(class_name)
    if task is None or not task.heads:
        return None
    if "mlm" in task.heads:
        hf.check_tied_decoder(state, "cls.predictions.decoder.weight", source)
    weights = {}
    for head in task.heads:
        found = hf._read_head(HEADS[head], state)
        if found is None:
            return None
        weights.update(found)
    if EXTRA_DECODER in weights and not np.size(weights[EXTRA_DECODER]):
        del weights[EXTRA_DECODER]
    return weights


class MobileBertLoader(hf.HuggingFaceLoader):
    """A transformers MobileBERT directory (config.json with model_type
    "mobilebert")."""

    format = "huggingface-mobilebert"
    priority = 29  # before the BERT / ALBERT reader, which takes any model_type
    model_type = MODEL_TYPE

    def backbone_config(self):
        return backbone_config_from_hf(self.hf_config, self.config_source)

    def held_shapes(self):
        shapes = backbone_shapes_from_hf(self._read_shapes())
        if not _has_projection(self.backbone_config()):
            # transformers keeps an `embedding_transformation` it never applies
            # when the table is H wide and there is no trigram input
            shapes = {k: v for k, v in shapes.items() if not k.startswith("embeddings/projection")}
        return shapes

    def backbone_weights(self, config):
        weights = backbone_weights_from_hf(self.hf_state, config)
        pad = self.hf_config.get("pad_token_id", 0)
        table = weights["embeddings/token_embedding/embeddings"]
        if config["trigram_input"] and isinstance(pad, int) and 0 <= pad < len(table):
            if np.any(table[pad]):
                hf.logger.warning(
                    "%s: the [PAD] embedding (row %d) is not zero: a row's last token sees it "
                    "as its next neighbour where the row is padded and zeros where it is not, "
                    "in transformers too, so outputs depend on how far a row is padded (kbert's "
                    "length buckets cut padding)",
                    self.directory,
                    pad,
                )
        if config["pooler_activation"] and "pooler/dense/kernel" not in weights:
            hf.logger.warning(
                "%s has no pooler weights; the pooler is freshly initialised", self.directory
            )
        return weights

    def task_head(self, task_cls, load_weights=True):
        head = self.next_sentence_head(task_cls, load_weights)
        if head is not None:
            return head
        return TaskHead(
            hf._task_config(task_cls, "bert", self.hf_config),
            head_weights(task_cls.__name__, self.hf_state, self.directory)
            if load_weights
            else None,
            source=f"Hugging Face head in {self.directory}",
            exact=True,
        )

    def held_model(self):
        architectures = self.hf_config.get("architectures") or ["MobileBertModel"]
        if not isinstance(architectures, list) or not isinstance(architectures[0], str):
            raise PresetError(f"{self.config_source}: architectures must be a list of names")
        held = self.next_sentence_model()
        if held is not None:
            return held
        name = CLASS_OF_ARCHITECTURE.get(architectures[0], "BertBackbone")
        task = hf.TASKS[name]
        if not task.num_labels:
            return name, {}
        head = hf.tensors(HEADS[task.heads[0]])[0][0]
        shape = self._read_shapes().get(head)
        if shape is None or len(shape) != 2:
            raise PresetError(f"{self.directory} is a {architectures[0]} without a {head} matrix")
        return name, {"num_classes": int(shape[0])}


register_format(MobileBertLoader)


def export_state(model, task):
    """(state dict, config.json) of a kbert model on a `MobileBertBackbone`
    as transformers' MobileBERT class for `task` (an `HFTask`)."""
    backbone = getattr(model, "backbone", model)
    config = backbone.get_config()
    hf_architecture = architecture(task)
    for key, value in task.config.get("bert", {}).items():
        if getattr(model, key, None) != value:
            raise ValueError(
                f"this {type(model).__name__} has {key}={getattr(model, key, None)!r}, but "
                f"{hf_architecture}'s head needs {key}={value!r}; export its backbone, or "
                "save it as a kbert preset"
            )
    prefix = "" if hf_architecture.endswith("Model") else "mobilebert."
    state = backbone_state_to_hf(backbone, prefix)
    if not task.pooler:  # transformers builds this model without one
        state = {k: v for k, v in state.items() if not k.startswith(prefix + "pooler.")}
    heads = {v.path: np.asarray(v.numpy(), dtype=np.float32) for v in model.weights}
    if "mlm" in task.heads and EXTRA_DECODER not in heads:
        # a table as wide as the hidden states: transformers' extra matrix is (0, V)
        heads[EXTRA_DECODER] = np.zeros((0, backbone.vocabulary_size), np.float32)
    for head in task.heads:
        written = hf.write_table(HEADS[head], heads)
        state.update(written)
        state.update({WRITTEN_TWICE[k]: v for k, v in written.items() if k in WRITTEN_TWICE})
    hf_config = {"architectures": [hf_architecture], "model_type": MODEL_TYPE}
    for theirs, ours, default in CONFIG:
        hf_config[theirs] = config[ours]
    hf_config["hidden_act"] = hf.KBERT_TO_HF_ACTIVATION[backbone.activation]
    if config["embedding_dim"] is None:
        hf_config["embedding_size"] = backbone.hidden_dim
    hf_config["pad_token_id"] = 0
    if task.num_labels:
        hf_config["num_labels"] = model.num_classes
    if task.regression and model.num_classes == 1:
        hf_config["problem_type"] = "regression"
    return state, hf_config


hf.register_exporter(BACKBONE_TYPE, export_state)
