"""Hugging Face BERT directories <-> kbert.

Reads `config.json` + `model.safetensors` (or a sharded safetensors index).
ALBERT checkpoints (model_type "albert": `AlbertModel`, `AlbertForPreTraining`,
`AlbertForMaskedLM` and the task heads) load into a backbone with
`embedding_dim` and `share_layers`, when all layers share one block
(num_hidden_groups = inner_group_num = 1, as in every released ALBERT).
`pytorch_model.bin` is a pickle, which can run code when loaded, so it is read
only when the caller passes `allow_pickle=True` (and then with torch's
`weights_only=True` loader).
"""

import json
import logging
import os
import re

import numpy as np

from kbert.convert import tf_checkpoint
from kbert.layers.activations import canonical_activation
from kbert.presets.architectures import check_backbone_config
from kbert.presets.io import PresetError, preset_file, read_json, safetensors_shapes
from kbert.presets.weights import held_sizes
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


def is_huggingface_dir(directory):
    """A Hugging Face BERT directory, or an original TF checkpoint directory
    (both are read through this module)."""
    if tf_checkpoint.is_tf_checkpoint_dir(directory):
        return True
    if not os.path.lexists(os.path.join(directory, "config.json")) or os.path.lexists(
        os.path.join(directory, "metadata.json")
    ):
        return False
    return "model_type" in read_json(directory, "config.json")


# transformers' AlbertConfig defaults where they differ from kbert's.
ALBERT_DEFAULTS = {
    "hidden_act": "gelu_new",
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "embedding_size": 128,
}


def backbone_config_from_hf(hf_config, source="config.json"):
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


# A block's Hugging Face names (relative to the block) -> kbert's, for BERT's
# `encoder.layer.{i}` and ALBERT's shared `albert_layers.0`.
BERT_BLOCK = {
    "qkv": [f"attention.self.{n}" for n in ("query", "key", "value")],
    "dense": [
        ("attention.output.dense", "self_attention/output"),
        ("intermediate.dense", "intermediate_dense"),
        ("output.dense", "output_dense"),
    ],
    "layer_norm": [
        ("attention.output.LayerNorm", "attention_layer_norm"),
        ("output.LayerNorm", "output_layer_norm"),
    ],
}
ALBERT_BLOCK = {
    "qkv": [f"attention.{n}" for n in ("query", "key", "value")],
    "dense": [
        ("attention.dense", "self_attention/output"),
        ("ffn", "intermediate_dense"),
        ("ffn_output", "output_dense"),
    ],
    "layer_norm": [
        ("attention.LayerNorm", "attention_layer_norm"),
        ("full_layer_layer_norm", "output_layer_norm"),
    ],
}
ALBERT_SHARED_BLOCK = "encoder.albert_layer_groups.0.albert_layers.0."
ALBERT_PROJECTION = "encoder.embedding_hidden_mapping_in"
SHARED_LAYER = "shared_transformer_layer/"  # kbert.models.backbone.SHARED_LAYER_NAME
_ALBERT_BLOCK_NAME = re.compile(r"encoder\.albert_layer_groups\.(\d+)\.albert_layers\.(\d+)\.")


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

    def block(hf, ours, names):
        qkv = names["qkv"]
        w[ours + "self_attention/qkv/kernel"] = np.concatenate(
            [get(hf + n + ".weight", True) for n in qkv], axis=1
        )
        w[ours + "self_attention/qkv/bias"] = np.concatenate([get(hf + n + ".bias") for n in qkv])
        for theirs, mine in names["dense"]:
            w[ours + mine + "/kernel"] = get(hf + theirs + ".weight", True)
            w[ours + mine + "/bias"] = get(hf + theirs + ".bias")
        for theirs, mine in names["layer_norm"]:
            w[ours + mine + "/gamma"] = get(hf + theirs + ".weight")
            w[ours + mine + "/beta"] = get(hf + theirs + ".bias")

    w = {
        "embeddings/token_embedding/embeddings": get("embeddings.word_embeddings.weight"),
        "embeddings/segment_embedding/embeddings": get("embeddings.token_type_embeddings.weight"),
        "embeddings/position_embeddings": get("embeddings.position_embeddings.weight"),
        "embeddings/layer_norm/gamma": get("embeddings.LayerNorm.weight"),
        "embeddings/layer_norm/beta": get("embeddings.LayerNorm.bias"),
    }
    if _is_albert(state):
        _check_albert_groups(state)
        w["embeddings/projection/kernel"] = get(ALBERT_PROJECTION + ".weight", True)
        w["embeddings/projection/bias"] = get(ALBERT_PROJECTION + ".bias")
        block(ALBERT_SHARED_BLOCK, SHARED_LAYER, ALBERT_BLOCK)
        pooler = "pooler."  # AlbertModel's pooler is a bare Linear
    else:
        for i in range(num_layers):
            block(f"encoder.layer.{i}.", f"transformer_layer_{i}/", BERT_BLOCK)
        pooler = "pooler.dense."
    if p + pooler + "weight" in state:
        w["pooler/dense/kernel"] = get(pooler + "weight", True)
        w["pooler/dense/bias"] = get(pooler + "bias")
    return w, used


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


_HF_EMBEDDINGS = {
    "embeddings.word_embeddings.weight": "embeddings/token_embedding/embeddings",
    "embeddings.position_embeddings.weight": "embeddings/position_embeddings",
    "embeddings.token_type_embeddings.weight": "embeddings/segment_embedding/embeddings",
}


def backbone_shapes_from_hf(shapes):
    """{kbert path: shape} for the embedding tables and blocks of a Hugging
    Face state dict's {name: shape}: what `held_sizes` needs to bound a config."""
    p = _prefix(shapes)
    out = {
        ours: tuple(shapes[p + theirs])
        for theirs, ours in _HF_EMBEDDINGS.items()
        if p + theirs in shapes
    }
    if _is_albert(shapes):
        _check_albert_groups(shapes)
        projection = shapes.get(p + ALBERT_PROJECTION + ".weight")
        if projection is not None:  # torch Linear: (out, in)
            out["embeddings/projection/kernel"] = tuple(projection)[::-1]
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


def _read_config(directory):
    """(HF-style config, the file it came from) for a Hugging Face directory
    or an original TensorFlow checkpoint directory."""
    if tf_checkpoint.is_tf_checkpoint_dir(directory):
        return tf_checkpoint.read_config(directory), os.path.join(
            directory, tf_checkpoint.CONFIG_FILE
        )
    return read_json(directory, "config.json"), os.path.join(directory, "config.json")


def _config_and_state(directory, allow_pickle=False):
    """(HF-style config, HF-style state dict) for a Hugging Face directory
    or an original TensorFlow checkpoint directory."""
    config, _ = _read_config(directory)
    if tf_checkpoint.is_tf_checkpoint_dir(directory):
        return config, _normalise_names(tf_checkpoint.read_state(directory))
    return config, _normalise_names(load_state_dict(directory, allow_pickle=allow_pickle))


def read_backbone(directory, load_weights=True, allow_pickle=False):
    """(kbert backbone config, {kbert path: array} or None, weight path
    prefixes the checkpoint may lack) from a Hugging Face BERT directory or
    an original TF checkpoint directory. Refuses other models, and configs
    that do not match the weights' shapes, before reading any weight data."""
    hf_config, source = _read_config(directory)
    config = backbone_config_from_hf(hf_config, source)
    if not load_weights:
        check_backbone_config(config, source, load_weights=False)
        return config, None, ()
    if tf_checkpoint.is_tf_checkpoint_dir(directory):
        shapes = tf_checkpoint.read_shapes(directory)
    else:
        shapes = weight_shapes(directory, allow_pickle)
    held = held_sizes(backbone_shapes_from_hf(shapes))
    check_backbone_config(config, source, held)
    if "num_layers" in held and config["num_layers"] < held["num_layers"]:
        logger.warning(
            "%s: the config asks for %d layers; the checkpoint's last %d are unused",
            source,
            config["num_layers"],
            held["num_layers"] - config["num_layers"],
        )
    state = _config_and_state(directory, allow_pickle)[1]
    weights, _ = backbone_weights_from_hf(state, config["num_layers"])
    if "pooler/dense/kernel" in weights:
        return config, weights, ()
    logger.warning("%s has no pooler weights; the pooler is freshly initialised", directory)
    return config, weights, ("pooler/",)


def _pretraining_head_weights(name, state, mlm, sentence, sentence_head):
    """kbert head paths -> arrays for a masked-LM head and, for a
    pre-trainer, its sentence head (NSP or SOP).

    `mlm`: (prefix of the transform's `dense` and `LayerNorm` keys, key of
    the output bias); `sentence`: prefix of the sentence head's keys;
    `sentence_head`: its kbert layer name."""
    transform, bias = mlm
    needed = [f"{transform}dense.weight", bias]
    if not all(k in state for k in needed):
        return None
    w = {
        "mlm_head/transform/kernel": state[f"{transform}dense.weight"].T,
        "mlm_head/transform/bias": state[f"{transform}dense.bias"],
        "mlm_head/layer_norm/gamma": state[f"{transform}LayerNorm.weight"],
        "mlm_head/layer_norm/beta": state[f"{transform}LayerNorm.bias"],
        "mlm_head/output_bias": state[bias],
    }
    if name == "BertPreTrainer":
        if f"{sentence}weight" not in state:
            return None
        w[f"{sentence_head}/dense/kernel"] = state[f"{sentence}weight"].T
        w[f"{sentence_head}/dense/bias"] = state[f"{sentence}bias"]
    return w


def _head_weights(name, state):
    """kbert head paths -> arrays for the heads a Hugging Face checkpoint has."""
    if name in ("BertPreTrainer", "BertMaskedLM") and _is_albert(state):
        # ALBERT: H -> E transform, LayerNorm at E, decoder tied to the
        # E-wide embedding; sentence-order head
        mlm = ("predictions.", "predictions.bias")
        return _pretraining_head_weights(name, state, mlm, "sop_classifier.classifier.", "sop_head")
    if name in ("BertPreTrainer", "BertMaskedLM"):
        mlm = ("cls.predictions.transform.", "cls.predictions.bias")
        return _pretraining_head_weights(name, state, mlm, "cls.seq_relationship.", "nsp_head")
    if name in ("BertClassifier", "BertTokenClassifier", "BertMultipleChoice"):
        if "classifier.weight" not in state:
            return None
        return {
            "logits/kernel": state["classifier.weight"].T,
            "logits/bias": state["classifier.bias"],
        }
    if name == "BertQuestionAnswerer":
        if "qa_outputs.weight" not in state:
            return None
        return {
            "logits/kernel": state["qa_outputs.weight"].T,
            "logits/bias": state["qa_outputs.bias"],
        }
    return None


def sentence_task(directory):
    """ "sop" for a Hugging Face ALBERT directory (its pre-training head
    predicts sentence order), "nsp" for other Hugging Face directories,
    None for anything else."""
    if tf_checkpoint.is_tf_checkpoint_dir(directory):
        return "nsp"
    if not is_huggingface_dir(directory):
        return None
    return "sop" if read_json(directory, "config.json").get("model_type") == "albert" else "nsp"


def read_task_head(class_name, directory, allow_pickle=False):
    """{kbert head path: array} of the `class_name` head (e.g.
    "BertClassifier") a Hugging Face checkpoint holds, or None when the
    directory is not a Hugging Face one or has no such head."""
    if not is_huggingface_dir(directory):
        return None
    _, state = _config_and_state(directory, allow_pickle=allow_pickle)
    return _head_weights(class_name, state)


KBERT_TO_HF_ACTIVATION = {
    "gelu": "gelu",
    "gelu_tanh": "gelu_new",
    "relu": "relu",
    "tanh": "tanh",
    "silu": "silu",
}
HF_ARCHITECTURES = {
    "BertBackbone": "BertModel",
    "BertPreTrainer": "BertForPreTraining",
    "BertMaskedLM": "BertForMaskedLM",
    "BertClassifier": "BertForSequenceClassification",
    "BertTokenClassifier": "BertForTokenClassification",
    "BertQuestionAnswerer": "BertForQuestionAnswering",
    "BertMultipleChoice": "BertForMultipleChoice",
    "BertTextEmbedder": "BertModel",
}


def backbone_state_to_hf(backbone, prefix=""):
    """kbert backbone weights -> Hugging Face BertModel names, or AlbertModel
    names for a backbone with `embedding_dim` and `share_layers` (numpy)."""
    w = {v.path: np.asarray(v.numpy(), dtype=np.float32) for v in backbone.weights}
    h = backbone.hidden_dim
    out = {
        "embeddings.word_embeddings.weight": w["embeddings/token_embedding/embeddings"],
        "embeddings.token_type_embeddings.weight": w["embeddings/segment_embedding/embeddings"],
        "embeddings.position_embeddings.weight": w["embeddings/position_embeddings"],
        "embeddings.LayerNorm.weight": w["embeddings/layer_norm/gamma"],
        "embeddings.LayerNorm.bias": w["embeddings/layer_norm/beta"],
    }

    def block(ours, hf, names):
        kernel, bias = w[ours + "self_attention/qkv/kernel"], w[ours + "self_attention/qkv/bias"]
        for j, name in enumerate(names["qkv"]):
            out[hf + name + ".weight"] = kernel[:, j * h : (j + 1) * h].T
            out[hf + name + ".bias"] = bias[j * h : (j + 1) * h]
        for theirs, mine in names["dense"]:
            out[hf + theirs + ".weight"] = w[ours + mine + "/kernel"].T
            out[hf + theirs + ".bias"] = w[ours + mine + "/bias"]
        for theirs, mine in names["layer_norm"]:
            out[hf + theirs + ".weight"] = w[ours + mine + "/gamma"]
            out[hf + theirs + ".bias"] = w[ours + mine + "/beta"]

    if is_albert_style(backbone):
        out[ALBERT_PROJECTION + ".weight"] = w["embeddings/projection/kernel"].T
        out[ALBERT_PROJECTION + ".bias"] = w["embeddings/projection/bias"]
        block(SHARED_LAYER, ALBERT_SHARED_BLOCK, ALBERT_BLOCK)
        out["pooler.weight"] = w["pooler/dense/kernel"].T
        out["pooler.bias"] = w["pooler/dense/bias"]
    else:
        for i in range(backbone.num_layers):
            block(f"transformer_layer_{i}/", f"encoder.layer.{i}.", BERT_BLOCK)
        out["pooler.dense.weight"] = w["pooler/dense/kernel"].T
        out["pooler.dense.bias"] = w["pooler/dense/bias"]
    return {prefix + k: v for k, v in out.items()}


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


def export_to_huggingface(model, directory, preprocessor=None):
    """Writes a Hugging Face BERT directory that `transformers` loads with the
    matching `BertFor...` class: config.json, model.safetensors and, when the
    model has a preprocessor attached (or one is passed, as a backbone needs),
    vocab.txt and tokenizer_config.json with its casing and rules. A model
    whose backbone has `embedding_dim` and `share_layers` is written as a
    Hugging Face ALBERT (`AlbertModel`, `AlbertFor...`; a `BertPreTrainer`
    then needs `sentence_task="sop"`).

    Args:
        model: a kbert BertBackbone or task model.
        directory: str or path. where to write.
        preprocessor: `kbert.BertPreprocessor` or None. the tokenizer to
            write; defaults to the one attached to `model`.
    """
    name = type(model).__name__
    if name not in HF_ARCHITECTURES:
        raise ValueError(f"{name} has no Hugging Face counterpart; export its backbone instead")
    from kbert.layers.quantization import quantized_layers

    quantized = quantized_layers(model)
    if quantized:
        named = ", ".join(sorted(quantized)[:3]) + (", ..." if len(quantized) > 3 else "")
        raise ValueError(
            f"{model.name} has {len(quantized)} quantized layers ({named}): a Hugging Face "
            "BERT holds float weights; export the float model (before `quantize`), and "
            "quantize after loading it there"
        )
    backbone = model if name == "BertBackbone" else model.backbone
    albert = is_albert_style(backbone)
    task = getattr(model, "sentence_task", None)
    if name == "BertPreTrainer" and task != ("sop" if albert else "nsp"):
        raise ValueError(
            f"this BertPreTrainer predicts {task.upper()}, but "
            + ("AlbertForPreTraining's head is SOP" if albert else "BertForPreTraining's is NSP")
            + "; export its backbone, or save it as a kbert preset"
        )
    os.makedirs(directory, exist_ok=True)
    architecture = HF_ARCHITECTURES[name]
    if albert:
        architecture = architecture.replace("Bert", "Albert")
    prefix = "" if architecture.endswith("Model") else ("albert." if albert else "bert.")
    state = backbone_state_to_hf(backbone, prefix)
    config = {
        "architectures": [architecture],
        "model_type": "albert" if albert else "bert",
        "vocab_size": backbone.vocabulary_size,
        "hidden_size": backbone.hidden_dim,
        "num_hidden_layers": backbone.num_layers,
        "num_attention_heads": backbone.num_heads,
        "intermediate_size": backbone.intermediate_dim,
        "max_position_embeddings": backbone.max_sequence_length,
        "type_vocab_size": backbone.type_vocab_size,
        "hidden_dropout_prob": backbone.dropout,
        "attention_probs_dropout_prob": backbone.attention_dropout,
        "hidden_act": KBERT_TO_HF_ACTIVATION[backbone.activation],
        "layer_norm_eps": backbone.layer_norm_epsilon,
        "initializer_range": backbone.initializer_range,
        "position_embedding_type": "absolute",
        "pad_token_id": 0,
    }
    if albert:
        config.update(embedding_size=backbone.embedding_dim, num_hidden_groups=1, inner_group_num=1)
    heads = (
        {v.path: np.asarray(v.numpy(), dtype=np.float32) for v in model.weights}
        if name != "BertBackbone"
        else {}
    )
    if name in ("BertPreTrainer", "BertMaskedLM") and albert:
        state.update(
            {
                "predictions.dense.weight": heads["mlm_head/transform/kernel"].T,
                "predictions.dense.bias": heads["mlm_head/transform/bias"],
                "predictions.LayerNorm.weight": heads["mlm_head/layer_norm/gamma"],
                "predictions.LayerNorm.bias": heads["mlm_head/layer_norm/beta"],
                "predictions.bias": heads["mlm_head/output_bias"],
            }
        )
        if name == "BertPreTrainer":
            state["sop_classifier.classifier.weight"] = heads["sop_head/dense/kernel"].T
            state["sop_classifier.classifier.bias"] = heads["sop_head/dense/bias"]
        else:
            state = {k: v for k, v in state.items() if not k.startswith("albert.pooler.")}
    elif name in ("BertPreTrainer", "BertMaskedLM"):
        state.update(
            {
                "cls.predictions.transform.dense.weight": heads["mlm_head/transform/kernel"].T,
                "cls.predictions.transform.dense.bias": heads["mlm_head/transform/bias"],
                "cls.predictions.transform.LayerNorm.weight": heads["mlm_head/layer_norm/gamma"],
                "cls.predictions.transform.LayerNorm.bias": heads["mlm_head/layer_norm/beta"],
                "cls.predictions.bias": heads["mlm_head/output_bias"],
                "cls.predictions.decoder.bias": heads["mlm_head/output_bias"],
            }
        )
        if name == "BertPreTrainer":
            state["cls.seq_relationship.weight"] = heads["nsp_head/dense/kernel"].T
            state["cls.seq_relationship.bias"] = heads["nsp_head/dense/bias"]
        else:
            state = {k: v for k, v in state.items() if not k.startswith("bert.pooler.")}
    elif name in ("BertClassifier", "BertTokenClassifier"):
        state["classifier.weight"] = heads["logits/kernel"].T
        state["classifier.bias"] = heads["logits/bias"]
        config["num_labels"] = model.num_classes
        if name == "BertClassifier" and model.num_classes == 1:
            config["problem_type"] = "regression"
    elif name == "BertMultipleChoice":
        state["classifier.weight"] = heads["logits/kernel"].T
        state["classifier.bias"] = heads["logits/bias"]
    elif name == "BertQuestionAnswerer":
        state["qa_outputs.weight"] = heads["logits/kernel"].T
        state["qa_outputs.bias"] = heads["logits/bias"]
    if name in (
        "BertTokenClassifier",
        "BertQuestionAnswerer",
    ):  # transformers builds these without a pooler
        state = {k: v for k, v in state.items() if not k.startswith(prefix + "pooler.")}
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
        tokenizer = preprocessor.tokenizer
        tokenizer.save(directory)
        # kbert's own settings (casing, rules, special tokens) read back by
        # kbert, plus the names transformers' BertTokenizer reads.
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(
                {
                    **tokenizer.get_config(),
                    "tokenizer_class": "BertTokenizer",
                    "do_lower_case": tokenizer.lowercase,
                    "model_max_length": backbone.max_sequence_length,
                },
                f,
                indent=2,
                sort_keys=True,
            )
    return directory
