"""Hugging Face `EncoderDecoderModel` directories (a BERT encoder and a
`BertLMHeadModel` decoder with cross-attention) <-> kbert's
`BertSeq2SeqLM` (architecture "bert2bert"; "shared" is written with both
copies and `tie_encoder_decoder`).

The encoder is a Hugging Face BERT under `encoder.` (read with
`kbert.convert.huggingface`'s tables); the decoder's BERT sits under
`decoder.bert.`, its blocks add `crossattention.` (query, and key and value
fused into kbert's one `key_value` projection), and its LM head is
`decoder.cls.predictions`. `EncoderDecoderLoader` is this format's
`kbert.presets.loader_for` loader.
"""

import json
import logging
import os

import numpy as np

from kbert.convert import huggingface as hf
from kbert.presets.io import PresetError, read_json
from kbert.presets.loader import TaskHead, register_format
from kbert.utils.files import save_safetensors

logger = logging.getLogger("kbert")

ENCODER = "encoder."
GENERATION_CONFIG = "generation_config.json"
DECODER = "decoder."  # + "bert." for the decoder's BERT, + "cls." for its head
CROSS_QUERY = "crossattention.self.query"
CROSS_KEY_VALUE = ("crossattention.self.key", "crossattention.self.value")
CROSS = [
    (CROSS_QUERY, "cross_attention/query", "linear"),
    ("crossattention.output.dense", "cross_attention/output", "linear"),
    ("crossattention.output.LayerNorm", "cross_attention_layer_norm", "norm"),
]
LM_HEAD = [
    (name, "lm_" + path[len("mlm_") :], kind) for name, path, kind in hf.HEADS["bert"]["mlm"]
]
SEQ2SEQ_CLASS = "BertSeq2SeqLM"


def _under(state, prefix):
    """The entries of `state` whose names start with `prefix`, without it."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _decoder_path(path):
    """A backbone path -> the bert2bert decoder's path."""
    if path.startswith("embeddings/"):
        return "decoder_" + path
    if path.startswith("transformer_layer_"):
        return "decoder_layer_" + path[len("transformer_layer_") :]
    return None  # the pooler: a decoder has none


def decoder_weights_from_hf(state, num_layers, source="the checkpoint"):
    """{kbert head path: array} of a bert2bert model (decoder embeddings,
    blocks with cross-attention, LM head) from a (normalised)
    `EncoderDecoderModel` state dict."""
    decoder = _under(state, DECODER)
    bert = _under(decoder, "bert.")
    if not bert:
        raise PresetError("the checkpoint has no decoder.bert.* weights: not a BERT decoder")
    # kbert's LM head multiplies by the decoder's token table: an untied one is refused
    hf.check_tied_decoder(decoder, "cls.predictions.decoder.weight", source, prefix="bert.")
    weights, _ = hf.backbone_weights_from_hf(bert, num_layers)
    out = {_decoder_path(p): v for p, v in weights.items() if _decoder_path(p)}

    def get(name, transposed=False):
        if name not in bert and name not in decoder:
            raise PresetError(f"the checkpoint lacks 'decoder.{name}'")
        value = bert[name] if name in bert else decoder[name]
        return value.T if transposed else value

    for i in range(num_layers):
        theirs, ours = f"encoder.layer.{i}.", f"decoder_layer_{i}/"
        out.update(hf.read_table(CROSS, get, theirs, ours))
        out[ours + "cross_attention/key_value/kernel"] = np.concatenate(
            [get(theirs + n + ".weight", True) for n in CROSS_KEY_VALUE], axis=1
        )
        out[ours + "cross_attention/key_value/bias"] = np.concatenate(
            [get(theirs + n + ".bias") for n in CROSS_KEY_VALUE]
        )
    out.update(hf.read_table(LM_HEAD, lambda n, t: get(n, t)))
    return out


def decoder_state_to_hf(model):
    """The `decoder.` names of a BertSeq2SeqLM's decoder and LM head."""
    w = {v.path: np.asarray(v.numpy(), dtype=np.float32) for v in model.weights}
    config = model.decoder_config or model.backbone.get_config()
    h = config["hidden_dim"]
    if model.architecture == "shared":  # the backbone's own names, written for the decoder
        block_prefix, embeddings_prefix = "transformer_layer_", "embeddings/"
    else:
        block_prefix, embeddings_prefix = "decoder_layer_", "decoder_embeddings/"
    out = hf.write_table(hf.EMBEDDINGS, _rename(w, embeddings_prefix, "embeddings/"))
    for i in range(config["num_layers"]):
        theirs, ours = f"encoder.layer.{i}.", f"{block_prefix}{i}/"
        kernel, bias = w[ours + "self_attention/qkv/kernel"], w[ours + "self_attention/qkv/bias"]
        for j, name in enumerate(hf.BERT_BLOCK["qkv"]):
            out[theirs + name + ".weight"] = kernel[:, j * h : (j + 1) * h].T
            out[theirs + name + ".bias"] = bias[j * h : (j + 1) * h]
        out.update(hf.write_table(hf.BERT_BLOCK["names"], w, theirs, ours))
        out.update(hf.write_table(CROSS, w, theirs, ours))
        kernel = w[ours + "cross_attention/key_value/kernel"]
        bias = w[ours + "cross_attention/key_value/bias"]
        for j, name in enumerate(CROSS_KEY_VALUE):
            out[theirs + name + ".weight"] = kernel[:, j * h : (j + 1) * h].T
            out[theirs + name + ".bias"] = bias[j * h : (j + 1) * h]
    state = {DECODER + "bert." + k: v for k, v in out.items()}
    head = hf.write_table(LM_HEAD, w)
    head["cls.predictions.decoder.bias"] = head["cls.predictions.bias"]
    head["cls.predictions.decoder.weight"] = state[
        DECODER + "bert.embeddings.word_embeddings.weight"
    ]
    state.update({DECODER + k: v for k, v in head.items()})
    return state


def _rename(weights, prefix, to):
    return {to + p[len(prefix) :]: v for p, v in weights.items() if p.startswith(prefix)}


def _bert_config(sizes):
    """A Hugging Face BertConfig dict from kbert sizes (`DECODER_KEYS` names)."""
    config = {theirs: sizes[ours] for theirs, ours in hf.HF_TO_KBERT_CONFIG.items()}
    config.update(
        model_type="bert",
        hidden_act=hf.KBERT_TO_HF_ACTIVATION[sizes["activation"]],
        position_embedding_type="absolute",
        pad_token_id=0,
    )
    return config


def export_encoder_decoder(model, directory, preprocessor=None):
    """Writes a Hugging Face `EncoderDecoderModel` directory for a
    BertSeq2SeqLM ("bert2bert" or "shared"): config.json, model.safetensors
    and the tokenizer files of its preprocessor."""
    if model.architecture == "unilm":
        raise ValueError(
            "a 'unilm' BertSeq2SeqLM is one BERT with a sequence-to-sequence mask, which "
            "transformers has no class for; save it as a kbert preset (save_to_preset), or "
            "export its backbone (export_to_huggingface(model.backbone, ...))"
        )
    backbone = model.backbone
    if backbone.embedding_dim is not None or backbone.share_layers:
        raise ValueError(
            "an EncoderDecoderModel of BERTs holds no factorized embeddings or shared layers; "
            "save this model as a kbert preset (save_to_preset) instead"
        )
    os.makedirs(directory, exist_ok=True)
    # (a shared backbone's cross-attention is written for the decoder only)
    state = {ENCODER + k: v for k, v in hf.backbone_state_to_hf(backbone).items()}
    state.update(decoder_state_to_hf(model))
    sizes = model.decoder_config or {k: backbone.get_config()[k] for k in _SIZES}
    decoder = {
        **_bert_config(sizes),
        "is_decoder": True,
        "add_cross_attention": True,
        "architectures": ["BertLMHeadModel"],
    }
    encoder_config = {
        **_bert_config({k: backbone.get_config()[k] for k in _SIZES}),
        "architectures": ["BertModel"],
    }
    if model.end_token_id is not None:
        decoder["eos_token_id"] = model.end_token_id
    config = {
        "architectures": ["EncoderDecoderModel"],
        "model_type": "encoder-decoder",
        "is_encoder_decoder": True,
        "encoder": encoder_config,
        "decoder": decoder,
        "decoder_start_token_id": model.start_token_id,
        "pad_token_id": model.pad_token_id,
        "eos_token_id": model.end_token_id,
        "tie_encoder_decoder": model.architecture == "shared",
    }
    save_safetensors(
        {k: np.ascontiguousarray(v) for k, v in state.items()},
        os.path.join(directory, "model.safetensors"),
        metadata={"format": "pt"},
    )
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    preprocessor = preprocessor or model.preprocessor
    if preprocessor is not None:
        hf.write_tokenizer_files(preprocessor, directory, backbone.max_sequence_length)
    return directory


_SIZES = (
    "vocabulary_size",
    "num_layers",
    "num_heads",
    "hidden_dim",
    "intermediate_dim",
    "max_sequence_length",
    "type_vocab_size",
    "dropout",
    "attention_dropout",
    "activation",
    "layer_norm_epsilon",
    "initializer_range",
)


class EncoderDecoderLoader(hf.HuggingFaceLoader):
    """A Hugging Face `EncoderDecoderModel` directory of two BERTs: the
    encoder is the backbone, the decoder the BertSeq2SeqLM's head."""

    format = "huggingface-encoder-decoder"
    priority = 25  # before the BERT loader, which would take any model_type
    model_type = "encoder-decoder"

    def _part_config(self, part):
        config = self.hf_config.get(part)
        if not isinstance(config, dict):
            raise PresetError(f"{self.config_source} has no '{part}' config object")
        if config.get("model_type") != "bert":
            raise PresetError(
                f"{self.config_source}: the {part} is a {config.get('model_type')!r} model; "
                "kbert reads encoder-decoders of two BERTs"
            )
        return config

    def backbone_config(self):
        return hf.backbone_config_from_hf(self._part_config("encoder"), self.config_source)

    def held_shapes(self):
        return hf.backbone_shapes_from_hf(_under(self._read_shapes(), ENCODER))

    def backbone_weights(self, config):
        weights, _ = hf.backbone_weights_from_hf(
            _under(self.hf_state, ENCODER), config["num_layers"]
        )
        return weights

    def optional_weights(self, weights):
        return () if "pooler/dense/kernel" in weights else ("pooler/",)

    def decoder_config(self):
        """The bert2bert decoder's sizes, kbert names."""
        config = hf.backbone_config_from_hf(
            self._part_config("decoder"), self.config_source, decoder=True
        )
        encoder = hf.backbone_config_from_hf(self._part_config("encoder"), self.config_source)
        defaults = {
            "max_sequence_length": 512,
            "type_vocab_size": 2,
            "dropout": 0.1,
            "attention_dropout": 0.1,
            "activation": "gelu",
            "layer_norm_epsilon": 1e-12,
            "initializer_range": 0.02,
        }
        if config["hidden_dim"] != encoder["hidden_dim"]:
            raise PresetError(
                f"{self.config_source}: the decoder's hidden_size {config['hidden_dim']} differs "
                f"from the encoder's {encoder['hidden_dim']} (transformers then adds a "
                "projection kbert does not have)"
            )
        return {key: config.get(key, defaults.get(key)) for key in _SIZES}

    def task_head(self, task_cls, load_weights=True):
        if task_cls.__name__ != SEQ2SEQ_CLASS:
            return None
        sizes = self.decoder_config()
        config = {"architecture": "bert2bert", "decoder_config": sizes, **self._token_ids()}
        weights = None
        if load_weights:
            weights = decoder_weights_from_hf(self.hf_state, sizes["num_layers"], self.directory)
        return TaskHead(
            config, weights, source=f"Hugging Face decoder in {self.directory}", exact=True
        )

    def held_model(self):
        return SEQ2SEQ_CLASS, {}

    def _token_ids(self):
        """start, end and pad ids as transformers' `generate` finds them: the
        directory's generation_config.json, then config.json, then the
        decoder's config; the start is `decoder_start_token_id`, else the
        `bos_token_id`. Of several end ids (a list), kbert stops at the first."""
        sources = [self.hf_config, self._part_config("decoder")]
        if os.path.isfile(os.path.join(self.directory, GENERATION_CONFIG)):
            sources.insert(0, read_json(self.directory, GENERATION_CONFIG))

        def first(*names):
            for source in sources:
                for name in names:
                    if source.get(name) is not None:
                        return source[name]
            return None

        start = first("decoder_start_token_id")
        pad = first("pad_token_id")
        ids = {
            "start_token_id": first("bos_token_id") if start is None else start,
            "end_token_id": first("eos_token_id"),
            "pad_token_id": 0 if pad is None else pad,
        }
        end = ids["end_token_id"]
        if isinstance(end, list):
            if not end:
                end = None
            elif len(set(end)) > 1:
                logger.warning(
                    "%s: eos_token_id lists %s; kbert's generate ends a row at the first, %s "
                    "(transformers at any of them)",
                    self.directory,
                    end,
                    end[0],
                )
            ids["end_token_id"] = end[0] if end else None
        for name, value in ids.items():
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 0
            ):
                raise PresetError(f"{self.directory}: {name} must be a token id, got {value!r:.60}")
        return ids


register_format(EncoderDecoderLoader)
hf.MODEL_EXPORTERS[SEQ2SEQ_CLASS] = export_encoder_decoder
