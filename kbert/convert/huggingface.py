"""Hugging Face BERT directories <-> kbert.

Reads `config.json` + `model.safetensors` (or a sharded safetensors index).
ALBERT checkpoints (model_type "albert": `AlbertModel`, `AlbertForPreTraining`,
`AlbertForMaskedLM` and the task heads) load into a backbone with
`embedding_dim` and `share_layers`, when all layers share one block
(num_hidden_groups = inner_group_num = 1, as in every released ALBERT).
`pytorch_model.bin` is a pickle, which can run code when loaded, so it is read
only when the caller passes `allow_pickle=True` (and then with torch's
`weights_only=True` loader).

Reading and writing share one set of tables: `HF_TO_KBERT_CONFIG` for the
config, `EMBEDDINGS` / `BERT_BLOCK` / `ALBERT_BLOCK` / `POOLER` / `HEADS`
for weight names, and `TASKS`, one line per kbert class with a transformers
counterpart (its architecture, heads, pooler, and the config its head
implies). `HuggingFaceLoader` is this format's `kbert.presets.loader_for`
loader. A new task class with a transformers counterpart is one `TASKS`
line (and a `HEADS` entry if its head is new); a new model type (MobileBERT,
an encoder-decoder) is its own module with its tables and a loader, as
`kbert.presets.loader` describes.
"""

import dataclasses
import functools
import json
import logging
import os
import re

import numpy as np

from kbert.layers.activations import canonical_activation
from kbert.presets.io import PresetError, preset_file, read_json, safetensors_shapes
from kbert.presets.loader import PresetLoader, TaskHead, register_format
from kbert.tokenizers.bpe import ByteLevelBPETokenizer
from kbert.utils.files import save_safetensors

logger = logging.getLogger("kbert")

HF_TO_KBERT_CONFIG = {
    "vocab_size": "vocabulary_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "hidden_size": "hidden_dim",
    "intermediate_size": "intermediate_dim",
    "max_position_embeddings": "max_sequence_length",
    "type_vocab_size": "type_vocab_size",
    "hidden_dropout_prob": "dropout",
    "attention_probs_dropout_prob": "attention_dropout",
    "hidden_act": "activation",
    "layer_norm_eps": "layer_norm_epsilon",
    "initializer_range": "initializer_range",
}


# transformers' AlbertConfig defaults where they differ from kbert's.
ALBERT_DEFAULTS = {
    "hidden_act": "gelu_new",
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "embedding_size": 128,
}


def backbone_config_from_hf(hf_config, source="config.json", decoder=False):
    """The `BertBackbone` config of a transformers BERT or ALBERT config;
    `decoder`: the config of an encoder-decoder's decoder (causal, with
    cross-attention), which `kbert.convert.encoder_decoder` builds."""
    model_type = hf_config.get("model_type")
    if model_type not in ("bert", "albert"):
        raise PresetError(
            f"{source} describes a {model_type!r} model; kbert loads BERT (model_type 'bert') "
            "and ALBERT (model_type 'albert')"
        )
    if model_type == "albert":
        hf_config = {**ALBERT_DEFAULTS, **hf_config}
        for key in ("num_hidden_groups", "inner_group_num"):
            if hf_config.get(key, 1) != 1:
                raise PresetError(
                    f"{source}: {key}={hf_config[key]!r:.60}; kbert's shared-layer backbone "
                    "holds one block shared by all layers (num_hidden_groups=1 and "
                    "inner_group_num=1, as in the released ALBERT models); other layer "
                    "groupings cannot be loaded"
                )
    if not decoder and (hf_config.get("is_decoder") or hf_config.get("add_cross_attention")):
        raise PresetError(
            f"{source} describes a decoder (is_decoder / add_cross_attention: causal "
            "self-attention, cross-attention blocks), which kbert's BertBackbone and its tasks "
            "are not (their attention sees both sides); load an encoder-decoder directory "
            "with kbert.BertSeq2SeqLM"
        )
    position_type = hf_config.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise PresetError(
            f"{source} uses position_embedding_type={position_type!r}; kbert BERT has "
            "learned absolute positions only"
        )
    config = {
        ours: hf_config[theirs]
        for theirs, ours in HF_TO_KBERT_CONFIG.items()
        if theirs in hf_config
    }
    if "activation" in config:
        if not isinstance(config["activation"], str):
            raise PresetError(
                f"{source}: hidden_act must be a name such as 'gelu', "
                f"got {config['activation']!r:.60}"
            )
        try:
            config["activation"] = canonical_activation(config["activation"])
        except ValueError as e:
            raise PresetError(f"{source}: {e}") from e
    required = ["vocabulary_size", "num_layers", "num_heads", "hidden_dim", "intermediate_dim"]
    absent = [k for k in required if k not in config]
    if absent:
        raise PresetError(
            f"{source} lacks {absent} (Hugging Face names: "
            f"{[k for k, v in HF_TO_KBERT_CONFIG.items() if v in absent]})"
        )
    if model_type == "albert":
        config["embedding_dim"] = hf_config["embedding_size"]
        config["share_layers"] = True
    return config


def _weight_files(directory, allow_pickle):
    """("safetensors", [file names]) or ("pickle", ["pytorch_model.bin"]):
    the weight files of a Hugging Face directory, each a regular file inside it."""
    if os.path.lexists(preset_file(directory, "model.safetensors")):
        return "safetensors", ["model.safetensors"]
    if os.path.lexists(preset_file(directory, "model.safetensors.index.json")):
        weight_map = read_json(directory, "model.safetensors.index.json").get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise PresetError(
                f"{directory}/model.safetensors.index.json has no weight_map of tensor "
                "names to shard file names"
            )
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            preset_file(directory, shard)
        return "safetensors", shards
    if os.path.lexists(preset_file(directory, "pytorch_model.bin")):
        if not allow_pickle:
            raise PresetError(
                f"{directory} holds only pytorch_model.bin, a pickle that can run code "
                "when loaded; convert it to safetensors, or pass allow_pickle=True if "
                "you trust its source"
            )
        return "pickle", ["pytorch_model.bin"]
    raise PresetError(f"{directory} has no model.safetensors (or sharded index) to load")


def _load_pickle(directory, mmap=False):
    import torch

    try:
        return torch.load(
            preset_file(directory, "pytorch_model.bin"),
            map_location="cpu",
            weights_only=True,
            mmap=mmap,
        )
    except Exception as e:  # torch raises several types for a corrupt or hostile pickle
        raise PresetError(f"{directory}/pytorch_model.bin cannot be loaded safely: {e}") from e


def weight_shapes(directory, allow_pickle=False):
    """{name: shape} of a Hugging Face directory's weights, from the
    safetensors headers (no tensor data read); a pickle is memory-mapped."""
    kind, files = _weight_files(directory, allow_pickle)
    if kind == "pickle":
        return {k: tuple(v.shape) for k, v in _load_pickle(directory, mmap=True).items()}
    shapes = {}
    for name in files:
        shapes.update(safetensors_shapes(directory, name))
    return shapes


def load_state_dict(directory, allow_pickle=False):
    """{name: numpy array} from a Hugging Face model directory."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    kind, files = _weight_files(directory, allow_pickle)
    if kind == "pickle":
        return {
            k: v.float().numpy() if v.is_floating_point() else v.numpy()
            for k, v in _load_pickle(directory).items()
        }
    state = {}
    try:
        for name in files:
            state.update(load_file(preset_file(directory, name)))
    except (SafetensorError, OSError) as e:
        raise PresetError(f"weights in {directory} are corrupt or truncated: {e}") from e
    return state


def _normalise_names(state):
    """Old checkpoints say LayerNorm.gamma/beta; newer ones weight/bias."""
    out = {}
    for name, value in state.items():
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
            "LayerNorm.beta", "LayerNorm.bias"
        )
        value = np.asarray(value)
        if value.dtype.kind == "f" or value.dtype.name == "bfloat16":
            value = value.astype(np.float32, copy=False)  # float32 as read: no copy
        out[name] = value
    return out


def _prefix(state):
    for name in state:
        if name.endswith("embeddings.word_embeddings.weight"):
            return name[: -len("embeddings.word_embeddings.weight")]
    raise PresetError("the checkpoint has no embeddings.word_embeddings.weight: not a BERT")


# --- name tables: one per part of the model, read and written alike ---------
#
# An entry is (Hugging Face name, kbert path, kind): "linear" is a torch
# Linear (`.weight`, (out, in): the transpose of kbert's `/kernel`; `.bias`),
# "norm" a LayerNorm (`.weight`, `.bias` <-> `/gamma`, `/beta`), "tensor" one
# array as it is. `tensors` expands a table into its arrays.
_KINDS = {
    "linear": [(".weight", "/kernel", True), (".bias", "/bias", False)],
    "norm": [(".weight", "/gamma", False), (".bias", "/beta", False)],
    "tensor": [("", "", False)],
}
EMBEDDINGS = [
    ("embeddings.word_embeddings.weight", "embeddings/token_embedding/embeddings", "tensor"),
    (
        "embeddings.token_type_embeddings.weight",
        "embeddings/segment_embedding/embeddings",
        "tensor",
    ),
    ("embeddings.position_embeddings.weight", "embeddings/position_embeddings", "tensor"),
    ("embeddings.LayerNorm", "embeddings/layer_norm", "norm"),
]
ALBERT_PROJECTION = "encoder.embedding_hidden_mapping_in"
ALBERT_EMBEDDINGS = EMBEDDINGS + [(ALBERT_PROJECTION, "embeddings/projection", "linear")]


def _block(qkv, attention_output, attention_norm, intermediate, output, output_norm):
    """A block's names relative to the block (BERT's `encoder.layer.{i}.`,
    ALBERT's one shared `albert_layers.0.`); query, key and value (under
    `qkv`) fuse into kbert's one qkv projection."""
    return {
        "qkv": [qkv + n for n in ("query", "key", "value")],
        "names": [
            (attention_output, "self_attention/output", "linear"),
            (intermediate, "intermediate_dense", "linear"),
            (output, "output_dense", "linear"),
            (attention_norm, "attention_layer_norm", "norm"),
            (output_norm, "output_layer_norm", "norm"),
        ],
    }


BERT_BLOCK = _block(
    "attention.self.",
    "attention.output.dense",
    "attention.output.LayerNorm",
    "intermediate.dense",
    "output.dense",
    "output.LayerNorm",
)
ALBERT_BLOCK = _block(
    "attention.",
    "attention.dense",
    "attention.LayerNorm",
    "ffn",
    "ffn_output",
    "full_layer_layer_norm",
)
ALBERT_SHARED_BLOCK = "encoder.albert_layer_groups.0.albert_layers.0."
SHARED_LAYER = "shared_transformer_layer/"  # kbert.models.backbone.SHARED_LAYER_NAME
_ALBERT_BLOCK_NAME = re.compile(r"encoder\.albert_layer_groups\.(\d+)\.albert_layers\.(\d+)\.")
POOLER = {  # AlbertModel's pooler is a bare Linear
    "bert": [("pooler.dense", "pooler/dense", "linear")],
    "albert": [("pooler", "pooler/dense", "linear")],
}


def _mlm_head(transform, bias):
    """A masked-LM head's names: its transform's dense and LayerNorm, its output bias."""
    return [
        (transform + "dense", "mlm_head/transform", "linear"),
        (transform + "LayerNorm", "mlm_head/layer_norm", "norm"),
        (bias, "mlm_head/output_bias", "tensor"),
    ]


# Heads sit at the checkpoint's top level; by backbone style, then head name.
_TASK_HEADS = {
    "classifier": [("classifier", "logits", "linear")],
    "span": [("qa_outputs", "logits", "linear")],
}
HEADS = {
    "bert": {
        "mlm": _mlm_head("cls.predictions.transform.", "cls.predictions.bias"),
        "sentence": [("cls.seq_relationship", "nsp_head/dense", "linear")],
        **_TASK_HEADS,
    },
    "albert": {
        # H -> E transform, LayerNorm at E, decoder tied to the E-wide
        # embedding; the sentence head predicts sentence order
        "mlm": _mlm_head("predictions.", "predictions.bias"),
        "sentence": [("sop_classifier.classifier", "sop_head/dense", "linear")],
        **_TASK_HEADS,
    },
}
# transformers' *ForNextSentencePrediction (BERT, MobileBERT): the pooled [CLS]
# through `cls.seq_relationship` to 2 logits, no dropout before it: the
# computation of a 2-class `BertClassifier`, which such directories load as
# (and export back as *ForSequenceClassification, the same logits).
NEXT_SENTENCE_AS_CLASSIFIER = [("cls.seq_relationship", "logits", "linear")]


def is_next_sentence_directory(hf_config):
    """Whether a config.json's first architecture is a *ForNextSentencePrediction."""
    architectures = hf_config.get("architectures")
    return (
        isinstance(architectures, list)
        and bool(architectures)
        and isinstance(architectures[0], str)
        and architectures[0].endswith("ForNextSentencePrediction")
    )


# transformers' BertForMaskedLM ties its decoder's bias to cls.predictions.bias;
# written under both names for its loader, read from the first.
WRITTEN_TWICE = {"cls.predictions.bias": "cls.predictions.decoder.bias"}


def tensors(table, theirs="", ours=""):
    """[(Hugging Face name, kbert path, transposed)] of the arrays of a name
    table, under the name prefixes `theirs` and `ours`."""
    return [
        (theirs + hf + hf_suffix, ours + path + suffix, transposed)
        for hf, path, kind in table
        for hf_suffix, suffix, transposed in _KINDS[kind]
    ]


def read_table(table, get, theirs="", ours=""):
    """{kbert path: array} of a name table; `get(name, transposed)` reads one array."""
    return {path: get(name, transposed) for name, path, transposed in tensors(table, theirs, ours)}


def write_table(table, weights, theirs="", ours=""):
    """{Hugging Face name: array} of a name table from {kbert path: array}."""
    return {
        name: weights[path].T if transposed else weights[path]
        for name, path, transposed in tensors(table, theirs, ours)
    }


def _blocks(albert, num_layers):
    """(Hugging Face prefix, kbert prefix, block table) of each block."""
    if albert:
        return [(ALBERT_SHARED_BLOCK, SHARED_LAYER, ALBERT_BLOCK)]
    return [
        (f"encoder.layer.{i}.", f"transformer_layer_{i}/", BERT_BLOCK) for i in range(num_layers)
    ]


def _is_albert(state):
    return any(ALBERT_PROJECTION in name for name in state)


def backbone_weights_from_hf(state, num_layers):
    """Maps a (normalised) Hugging Face BERT or ALBERT state dict to kbert
    backbone paths.

    Returns (weights, used_names)."""
    p = _prefix(state)
    used = set()

    def get(name, transpose=False):
        key = p + name
        if key not in state:
            raise PresetError(f"the checkpoint lacks {key!r}")
        used.add(key)
        return state[key].T if transpose else state[key]

    albert = _is_albert(state)
    if albert:
        _check_albert_groups(state)
    w = read_table(ALBERT_EMBEDDINGS if albert else EMBEDDINGS, get)
    for theirs, ours, block in _blocks(albert, num_layers):
        qkv = block["qkv"]
        w[ours + "self_attention/qkv/kernel"] = np.concatenate(
            [get(theirs + n + ".weight", True) for n in qkv], axis=1
        )
        w[ours + "self_attention/qkv/bias"] = np.concatenate(
            [get(theirs + n + ".bias") for n in qkv]
        )
        w.update(read_table(block["names"], get, theirs, ours))
    pooler = POOLER["albert" if albert else "bert"]
    if p + tensors(pooler)[0][0] in state:
        w.update(read_table(pooler, get))
    return w, used


# buffers transformers saves beside the weights
_BUFFERS = re.compile(r"(^|\.)(position_ids|token_type_ids)$")
# the heads of transformers' BERT and ALBERT task classes, beside the encoder
HEAD_PREFIXES = ("cls.", "classifier.", "qa_outputs.", "predictions.", "sop_classifier.")
_LAYER = re.compile(r"encoder\.layer\.(\d+)\.")


def unread_encoder_tensors(state, used, num_layers):
    """The encoder's tensors (under the state's prefix, not a head's) that
    `backbone_weights_from_hf` did not read (`used`): e.g. cross-attention
    blocks or relative-position tables, which would change what the model
    computes. Layers past `num_layers` are left out (a config that asks for
    fewer layers than the checkpoint holds is warned about where it is read)."""
    p = _prefix(state)
    unread = []
    for name in state:
        if name in used or not name.startswith(p) or _BUFFERS.search(name):
            continue
        rest = name[len(p) :]
        if not p and rest.startswith(HEAD_PREFIXES):
            continue
        layer = _LAYER.match(rest)
        if layer is not None and int(layer.group(1)) >= num_layers:
            continue
        unread.append(name)
    return sorted(unread)


def backbone_state_to_hf(backbone, prefix=""):
    """kbert backbone weights -> Hugging Face BertModel names, or AlbertModel
    names for a backbone with `embedding_dim` and `share_layers` (numpy)."""
    w = {v.path: np.asarray(v.numpy(), dtype=np.float32) for v in backbone.weights}
    h = backbone.hidden_dim
    albert = is_albert_style(backbone)
    out = write_table(ALBERT_EMBEDDINGS if albert else EMBEDDINGS, w)
    for theirs, ours, block in _blocks(albert, backbone.num_layers):
        kernel, bias = w[ours + "self_attention/qkv/kernel"], w[ours + "self_attention/qkv/bias"]
        for j, name in enumerate(block["qkv"]):
            out[theirs + name + ".weight"] = kernel[:, j * h : (j + 1) * h].T
            out[theirs + name + ".bias"] = bias[j * h : (j + 1) * h]
        out.update(write_table(block["names"], w, theirs, ours))
    out.update(write_table(POOLER["albert" if albert else "bert"], w))
    return {prefix + k: v for k, v in out.items()}


def _check_albert_groups(names):
    """Refuses ALBERT weights with more than one layer group or inner layer."""
    for name in names:
        m = _ALBERT_BLOCK_NAME.search(name)
        if m is not None and m.groups() != ("0", "0"):
            raise PresetError(
                f"the checkpoint holds {name!r}: several ALBERT layer groups or inner layers; "
                "kbert loads ALBERT with one block shared by all layers "
                "(num_hidden_groups=1, inner_group_num=1)"
            )


def backbone_shapes_from_hf(shapes):
    """{kbert path: shape} for the embedding tables and blocks of a Hugging
    Face state dict's {name: shape}: what `held_sizes` needs to bound a config."""
    p = _prefix(shapes)
    albert = _is_albert(shapes)
    out = {
        path: tuple(shapes[p + name])[:: -1 if transposed else 1]
        for name, path, transposed in tensors(ALBERT_EMBEDDINGS if albert else EMBEDDINGS)
        if p + name in shapes
    }
    if albert:
        _check_albert_groups(shapes)
        for name, shape in shapes.items():
            if name.startswith(p + ALBERT_SHARED_BLOCK):
                rest = name[len(p + ALBERT_SHARED_BLOCK) :]
                if rest == "ffn.weight":
                    out[SHARED_LAYER + "intermediate_dense/kernel"] = tuple(shape)[::-1]
                else:
                    out[SHARED_LAYER + rest] = tuple(shape)
        return out
    block = re.compile(re.escape(p) + r"encoder\.layer\.(\d+)\.(.+)$")
    for name, shape in shapes.items():
        m = block.match(name)
        if m is None:
            continue
        index, rest = m.groups()
        if rest == "intermediate.dense.weight":  # torch Linear: (out, in)
            out[f"transformer_layer_{index}/intermediate_dense/kernel"] = tuple(shape)[::-1]
        else:
            out[f"transformer_layer_{index}/{rest}"] = tuple(shape)
    return out


def _read_head(table, state):
    """{kbert path: array} of one head, None when the checkpoint has none of it."""
    names = tensors(table)
    missing = [name for name, _, _ in names if name not in state]
    if len(missing) == len(names):
        return None
    if missing:
        raise PresetError(
            f"the checkpoint holds part of a head ({names[0][0]!r}) but lacks {missing}"
        )
    return read_table(table, lambda name, transposed: state[name].T if transposed else state[name])


def check_tied_decoder(state, decoder, source="the checkpoint", prefix=None):
    """Refuses a masked-LM decoder matrix `decoder` that is not the token
    embedding table (an untied head, `tie_word_embeddings=False`): kbert's
    masked-LM heads always multiply by the table, so reading such a head
    would give other logits without a word."""
    matrix = state.get(decoder)
    if matrix is None:
        return  # tied: transformers saves the table once
    p = _prefix(state) if prefix is None else prefix
    table = state.get(p + "embeddings.word_embeddings.weight")
    if table is None or not np.array_equal(np.asarray(matrix), np.asarray(table)):
        raise PresetError(
            f"{source}: its LM head's decoder ({decoder}) is not the token embedding table "
            "(untied), which kbert's masked-LM head always is; load the encoder "
            "(BertBackbone) and train a new head"
        )


def head_weights(class_name, state, source="the checkpoint"):
    """{kbert head path: array} of the `class_name` head (e.g.
    "BertClassifier") a (normalised) Hugging Face state dict holds, or None."""
    task = TASKS.get(class_name)
    if task is None or not task.heads:
        return None
    style = "albert" if _is_albert(state) else "bert"
    if "mlm" in task.heads:
        decoder = (
            "predictions.decoder.weight" if style == "albert" else "cls.predictions.decoder.weight"
        )
        check_tied_decoder(state, decoder, source)
    weights = {}
    for head in task.heads:
        found = _read_head(HEADS[style][head], state)
        if found is None:
            return None
        weights.update(found)
    return weights


# --- kbert classes and their transformers counterparts ------------------------


@dataclasses.dataclass(frozen=True)
class HFTask:
    """A kbert model class as transformers holds it, for reading and writing.

    architecture: str. its BERT class; the ALBERT class is the same name with
        "Albert" for "Bert" (`BertForMaskedLM` -> `AlbertForMaskedLM`).
    heads: tuple. its heads, names in `HEADS`.
    pooler: bool. transformers builds the model with the backbone's pooler.
    num_labels: bool. config.json's num_labels is the head's num_classes.
    regression: bool. num_classes=1 is transformers' "regression" problem_type.
    config: {"bert" or "albert": {argument: value}}. constructor arguments
        that the checkpoint's head implies (checked on export).
    """

    architecture: str
    heads: tuple = ()
    pooler: bool = True
    num_labels: bool = False
    regression: bool = False
    config: dict = dataclasses.field(default_factory=dict)


# One line per kbert class that has a transformers counterpart. The first
# class listed for an architecture is the one that architecture loads as.
TASKS = {
    "BertBackbone": HFTask("BertModel"),
    "BertPreTrainer": HFTask(
        "BertForPreTraining",
        heads=("mlm", "sentence"),
        config={"bert": {"sentence_task": "nsp"}, "albert": {"sentence_task": "sop"}},
    ),
    "BertMaskedLM": HFTask("BertForMaskedLM", heads=("mlm",), pooler=False),
    "BertClassifier": HFTask(
        "BertForSequenceClassification", heads=("classifier",), num_labels=True, regression=True
    ),
    "BertTokenClassifier": HFTask(
        "BertForTokenClassification", heads=("classifier",), pooler=False, num_labels=True
    ),
    "BertQuestionAnswerer": HFTask("BertForQuestionAnswering", heads=("span",), pooler=False),
    "BertMultipleChoice": HFTask("BertForMultipleChoice", heads=("classifier",)),
    "BertTextEmbedder": HFTask("BertModel"),
    "MobileBertBackbone": HFTask("BertModel"),  # written by kbert.convert.mobilebert
}


def architecture(task, albert):
    """The transformers class name of an `HFTask` for a BERT or ALBERT backbone."""
    return task.architecture.replace("Bert", "Albert", 1) if albert else task.architecture


CLASS_OF_ARCHITECTURE = {}  # transformers class name -> kbert class name
for _name, _task in TASKS.items():
    for _albert in (False, True):
        CLASS_OF_ARCHITECTURE.setdefault(architecture(_task, _albert), _name)


def _task_config(task_cls, style, hf_config=None):
    """Constructor arguments the checkpoint implies for `task_cls` (or the
    nearest class it derives from that has a counterpart); with the
    directory's `hf_config`, the dropout before a classifier as
    transformers' classes take it (`classifier_dropout`, else
    `hidden_dropout_prob`; ALBERT's `classifier_dropout_prob`)."""
    config = {}
    for cls in task_cls.__mro__:
        if cls.__name__ in TASKS:
            config = dict(TASKS[cls.__name__].config.get(style, {}))
            break
    if hf_config is not None and "dropout" in getattr(task_cls, "config_names", ()):
        names = ["classifier_dropout_prob"] if style == "albert" else []
        names += ["classifier_dropout", "hidden_dropout_prob"]
        for name in names:
            rate = hf_config.get(name)
            if rate is not None:
                if (
                    isinstance(rate, bool)
                    or not isinstance(rate, (int, float))
                    or not 0 <= rate < 1
                ):
                    raise PresetError(f"config.json: {name} must be in [0, 1), got {rate!r:.40}")
                config["dropout"] = float(rate)
                break
    return config


# --- the loader -------------------------------------------------------------


class HuggingFaceLoader(PresetLoader):
    """A Hugging Face BERT or ALBERT directory (config.json with a
    model_type, and no kbert metadata.json). Subclasses read other files into
    the same Hugging Face names (`kbert.convert.tf_checkpoint`)."""

    format = "huggingface"
    priority = 30
    config_file = "config.json"
    # a subclass for one model type sets it: `detect` takes only that type
    model_type = None

    @classmethod
    def detect(cls, directory):
        if not os.path.lexists(os.path.join(directory, "config.json")) or os.path.lexists(
            os.path.join(directory, "metadata.json")
        ):
            return False
        config = read_json(directory, "config.json")
        if cls.model_type is not None:
            return config.get("model_type") == cls.model_type
        return "model_type" in config

    def _read_config(self):
        return read_json(self.directory, self.config_file)

    def _read_shapes(self):
        return weight_shapes(self.directory, self.allow_pickle)

    def _read_state(self):
        return load_state_dict(self.directory, allow_pickle=self.allow_pickle)

    @functools.cached_property
    def hf_config(self):
        """The config in Hugging Face names."""
        return self._read_config()

    @functools.cached_property
    def hf_state(self):
        """{Hugging Face name: array}, read once for the backbone and the heads."""
        return _normalise_names(self._read_state())

    @property
    def weights_source(self):
        return f"Hugging Face weights in {self.directory}"

    def backbone_config(self):
        return backbone_config_from_hf(self.hf_config, self.config_source)

    def held_shapes(self):
        return backbone_shapes_from_hf(self._read_shapes())

    def check_held(self, config, held):
        if "num_layers" in held and config["num_layers"] < held["num_layers"]:
            logger.warning(
                "%s: the config asks for %d layers; the checkpoint's last %d are unused",
                self.config_source,
                config["num_layers"],
                held["num_layers"] - config["num_layers"],
            )

    def backbone_weights(self, config):
        weights, used = backbone_weights_from_hf(self.hf_state, config["num_layers"])
        unread = unread_encoder_tensors(self.hf_state, used, config["num_layers"])
        if unread:
            shown = ", ".join(unread[:4]) + (
                f", ... ({len(unread)} in all)" if len(unread) > 4 else ""
            )
            raise PresetError(
                f"{self.directory}: the encoder's weights hold tensors kbert's BERT has no place "
                f"for ({shown}); the checkpoint is not the model its config describes"
            )
        if "pooler/dense/kernel" not in weights:
            logger.warning(
                "%s has no pooler weights; the pooler is freshly initialised", self.directory
            )
        return weights

    def optional_weights(self, weights):
        return () if "pooler/dense/kernel" in weights else ("pooler/",)

    def _style(self):
        return "albert" if self.hf_config.get("model_type") == "albert" else "bert"

    def next_sentence_head(self, task_cls, load_weights=True):
        """The head of a *ForNextSentencePrediction directory for a
        `BertClassifier` (or a class derived from it): `cls.seq_relationship`
        as its 2-class head, no dropout before it (transformers has none);
        None for other directories or classes."""
        if not is_next_sentence_directory(self.hf_config) or not any(
            c.__name__ == "BertClassifier" for c in task_cls.__mro__
        ):
            return None
        config = _task_config(task_cls, "bert")
        if "dropout" in getattr(task_cls, "config_names", ()):
            config["dropout"] = 0.0
        return TaskHead(
            config,
            _read_head(NEXT_SENTENCE_AS_CLASSIFIER, self.hf_state) if load_weights else None,
            source=f"Hugging Face next-sentence head in {self.directory}",
            exact=True,
        )

    def next_sentence_model(self):
        """held_model() of a *ForNextSentencePrediction directory, else None."""
        if not is_next_sentence_directory(self.hf_config):
            return None
        head = tensors(NEXT_SENTENCE_AS_CLASSIFIER)[0][0]
        shape = self._read_shapes().get(head)
        if shape is None or len(shape) != 2:
            raise PresetError(
                f"{self.directory} is a {self.hf_config['architectures'][0]} without a "
                f"{head} matrix"
            )
        return "BertClassifier", {"num_classes": int(shape[0])}

    def task_head(self, task_cls, load_weights=True):
        head = self.next_sentence_head(task_cls, load_weights)
        if head is not None:
            return head
        return TaskHead(
            _task_config(task_cls, self._style(), self.hf_config),
            head_weights(task_cls.__name__, self.hf_state, self.directory)
            if load_weights
            else None,
            source=f"Hugging Face head in {self.directory}",
            exact=True,
        )

    def held_model(self):
        """The architecture's kbert class; a classifier's classes are counted
        from its head's weights."""
        architectures = self.hf_config.get("architectures") or ["BertModel"]
        if not isinstance(architectures, list) or not isinstance(architectures[0], str):
            raise PresetError(f"{self.config_source}: architectures must be a list of names")
        held = self.next_sentence_model()
        if held is not None:
            return held
        name = CLASS_OF_ARCHITECTURE.get(architectures[0], "BertBackbone")
        task = TASKS[name]
        if not task.num_labels:
            return name, {}
        head = tensors(HEADS[self._style()][task.heads[0]])[0][0]
        shape = self._read_shapes().get(head)
        if shape is None or len(shape) != 2:
            raise PresetError(f"{self.directory} is a {architectures[0]} without a {head} matrix")
        return name, {"num_classes": int(shape[0])}


register_format(HuggingFaceLoader)


KBERT_TO_HF_ACTIVATION = {
    "gelu": "gelu",
    "gelu_tanh": "gelu_new",
    "relu": "relu",
    "tanh": "tanh",
    "silu": "silu",
}


def is_albert_style(backbone):
    """Whether `backbone` has both ALBERT options (what an ALBERT checkpoint
    holds); raises for one without the other, which neither format holds."""
    if (backbone.embedding_dim is None) != (not backbone.share_layers):
        raise ValueError(
            f"the backbone has embedding_dim={backbone.embedding_dim} and "
            f"share_layers={backbone.share_layers}: a Hugging Face BERT holds neither option, "
            "a Hugging Face ALBERT both; save it as a kbert preset (save_to_preset) or a "
            ".keras file instead"
        )
    return backbone.share_layers


def _bert_export_state(model, task):
    """(state dict, config.json) of a model on a BERT or ALBERT-style backbone."""
    name = type(model).__name__
    backbone = getattr(model, "backbone", model)
    albert = is_albert_style(backbone)
    style = "albert" if albert else "bert"
    hf_architecture = architecture(task, albert)
    for key, value in task.config.get(style, {}).items():
        if getattr(model, key, None) != value:
            raise ValueError(
                f"this {name} has {key}={getattr(model, key, None)!r}, but {hf_architecture}'s "
                f"head needs {key}={value!r}; export its backbone, or save it as a kbert preset"
            )
    prefix = "" if hf_architecture.endswith("Model") else f"{style}."
    state = backbone_state_to_hf(backbone, prefix)
    if not task.pooler:  # transformers builds this model without one
        state = {k: v for k, v in state.items() if not k.startswith(prefix + "pooler.")}
    heads = {v.path: np.asarray(v.numpy(), dtype=np.float32) for v in model.weights}
    for head in task.heads:
        written = write_table(HEADS[style][head], heads)
        state.update(written)
        state.update({WRITTEN_TWICE[k]: v for k, v in written.items() if k in WRITTEN_TWICE})
    config = {"architectures": [hf_architecture], "model_type": style}
    config.update({theirs: getattr(backbone, ours) for theirs, ours in HF_TO_KBERT_CONFIG.items()})
    config.update(
        hidden_act=KBERT_TO_HF_ACTIVATION[backbone.activation],
        position_embedding_type="absolute",
        pad_token_id=0,
    )
    if albert:
        config.update(embedding_size=backbone.embedding_dim, num_hidden_groups=1, inner_group_num=1)
    if task.num_labels:
        config["num_labels"] = model.num_classes
    if task.regression and model.num_classes == 1:
        config["problem_type"] = "regression"
    return state, config


# kbert class name -> the function writing its whole directory, for model
# types whose converter is a module of its own (`kbert.convert.encoder_decoder`).
MODEL_EXPORTERS = {}

# Exporters of other model types, by their backbone's `backbone_type`:
# (model, its `HFTask`) -> (state dict, config.json).
EXPORTERS = {}


def register_exporter(backbone_type, exporter):
    """Makes `export_to_huggingface` write backbones of `backbone_type` (and
    models on them) with `exporter`."""
    EXPORTERS[backbone_type] = exporter
    return exporter


def export_to_huggingface(model, directory, preprocessor=None):
    """Writes a Hugging Face BERT directory that `transformers` loads with the
    matching `BertFor...` class: config.json, model.safetensors and, when the
    model has a preprocessor attached (or one is passed, as a backbone needs),
    vocab.txt and tokenizer_config.json with its casing and rules. A model
    whose backbone has `embedding_dim` and `share_layers` is written as a
    Hugging Face ALBERT (`AlbertModel`, `AlbertFor...`; a `BertPreTrainer`
    then needs `sentence_task="sop"`), and a model on a `MobileBertBackbone`
    as transformers' MobileBERT (`kbert.convert.mobilebert`).

    Args:
        model: a kbert BertBackbone or task model.
        directory: str or path. where to write.
        preprocessor: `kbert.BertPreprocessor` or None. the tokenizer to
            write; defaults to the one attached to `model`.
    """
    name = type(model).__name__
    if name in MODEL_EXPORTERS:  # a model type of another module (e.g. an encoder-decoder)
        return MODEL_EXPORTERS[name](model, directory, preprocessor)
    if name not in TASKS:
        raise ValueError(f"{name} has no Hugging Face counterpart; export its backbone instead")
    task = TASKS[name]
    if name == "BertClassifier" and getattr(model, "pooling", "pooled") != "pooled":
        raise ValueError(
            f"{model.name} classifies from pooling={model.pooling!r} of the token vectors; "
            "transformers' BertForSequenceClassification reads the pooled [CLS] only "
            "(pooling='pooled'); save it as a kbert preset (save_to_preset) instead"
        )
    from kbert.layers.quantization import quantized_layers

    quantized = quantized_layers(model)
    if quantized:
        named = ", ".join(sorted(quantized)[:3]) + (", ..." if len(quantized) > 3 else "")
        raise ValueError(
            f"{model.name} has {len(quantized)} quantized layers ({named}): a Hugging Face "
            "BERT holds float weights; export the float model (before `quantize`), and "
            "quantize after loading it there"
        )
    backbone = getattr(model, "backbone", model)
    if getattr(backbone, "global_projections", False):
        raise ValueError(
            f"{model.name}'s backbone has global projections (Longformer's), which a Hugging "
            "Face BERT cannot hold; save it as a kbert preset (save_to_preset) instead"
        )
    exporter = EXPORTERS.get(getattr(backbone, "backbone_type", None), _bert_export_state)
    state, config = exporter(model, task)
    os.makedirs(directory, exist_ok=True)
    save_safetensors(
        {k: np.ascontiguousarray(v) for k, v in state.items()},
        os.path.join(directory, "model.safetensors"),
        metadata={"format": "pt"},
    )
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    attached = getattr(model, "preprocessor", None)
    if preprocessor is not None and attached is not None and preprocessor is not attached:
        raise ValueError(
            f"this {name} already has a preprocessor; attach the other one "
            "(model.preprocessor = ...) instead of passing it"
        )
    preprocessor = preprocessor or attached
    if preprocessor is not None:
        write_tokenizer_files(preprocessor, directory, backbone.max_sequence_length)
    return directory


def write_tokenizer_files(preprocessor, directory, max_length):
    """vocab.txt and tokenizer_config.json of `preprocessor`'s tokenizer
    (tokenizer.json with kbert's packing for a BPE tokenizer)."""
    tokenizer = preprocessor.tokenizer
    if isinstance(tokenizer, ByteLevelBPETokenizer):
        _write_bpe_tokenizer_files(tokenizer, directory, max_length)
        return
    tokenizer.save(directory)
    # kbert's own settings (casing, rules, special tokens) read back by
    # kbert, plus the names transformers' BertTokenizer reads.
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                **tokenizer.get_config(),
                "tokenizer_class": "BertTokenizer",
                "do_lower_case": tokenizer.lowercase,
                "model_max_length": max_length,
            },
            f,
            indent=2,
            sort_keys=True,
        )


def _write_bpe_tokenizer_files(tokenizer, directory, max_length):
    """tokenizer.json (the file's model, kbert's packing as its
    post-processor) and a tokenizer_config.json transformers' fast
    tokenizer reads."""
    with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer.serving_json(), f, ensure_ascii=False)
    special = tokenizer.special_tokens
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "bos_token": special["cls"],
        "cls_token": special["cls"],
        "eos_token": special["sep"],
        "sep_token": special["sep"],
        "pad_token": special["pad"],
        "unk_token": special["unk"],
        "mask_token": special["mask"],
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
