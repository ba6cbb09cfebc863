"""Hugging Face Longformer directories -> kbert's windowed `BertBackbone`.

Reads a transformers Longformer directory (config.json with model_type
"longformer", model.safetensors): a `LongformerModel`, or a task class with
its head (`TASKS`: sequence and token classification, masked LM,
question answering, multiple choice). The backbone is a BERT
with sliding-window attention (`attention_window`) and separate global
projections (`global_projections=True`), which is what Longformer is
(Beltagy et al. 2020): same blocks, same embeddings, plus `query_global`,
`key_global` and `value_global` per block.

Differences the conversion absorbs:
- positions: Longformer (RoBERTa) numbers a row's tokens from
  `pad_token_id + 1`, so its table's first `pad_token_id + 1` rows are
  never used by a right-padded row; kbert's table starts at the first
  used row (`max_sequence_length` = `max_position_embeddings` -
  `pad_token_id` - 1). A row with the pad id inside its real tokens is
  numbered differently by transformers (it skips them); kbert counts
  every position.
- global tokens: transformers' `LongformerModel` makes a token global only
  where `global_attention_mask` says so (its classifiers set [CLS]); the
  backbone's `global_tokens` rule gives the first token (kbert's
  classifier convention), and a `global_attention_mask` input replaces it
  per call.
- one window for all layers: a config whose `attention_window` differs
  between layers is refused.
- task heads: `LongformerForSequenceClassification`'s head is RoBERTa's
  (dense + tanh on `<s>`, then `out_proj`), which is BERT's pooler and
  classifier: its dense loads as the backbone's pooler (the same at
  inference; transformers adds one more dropout in training). A directory
  of a task class whose transformers model makes no token global
  (token classification, masked LM) loads as that task with
  `global_tokens=0`, as it was trained; anything else with [CLS] global,
  as transformers' classifier. Its masked-LM head must apply GELU and be
  tied to the token embeddings, as kbert's is (others are refused).
  Question answering and multiple choice, from any Longformer directory,
  make global what transformers' classes compute from the token ids: the
  tokens before the first `</s>` (`<s>` and the question) and those after
  the first `</s></s>` pair (the ending), at most `max_query_length` + 2
  and `MAX_ENDING_TOKENS` of them (more attend locally; `max_global_tokens`
  changes the bound).

The tokenizer is the directory's byte-level BPE `tokenizer.json`
(`kbert.tokenizers.ByteLevelBPETokenizer`, RoBERTa's packing), which
`BertPreprocessor.from_directory` and the task models' `from_preset` pick
up as they pick up a BERT vocabulary.
"""

import numpy as np

from kbert.convert import huggingface as hf
from kbert.layers.activations import canonical_activation
from kbert.layers.banded_attention import AFTER_SEPARATORS, BEFORE_SEPARATOR
from kbert.presets.io import PresetError
from kbert.presets.loader import TaskHead, register_format

MODEL_TYPE = "longformer"

# (transformers' name, kbert's, transformers' LongformerConfig default)
CONFIG = [
    ("vocab_size", "vocabulary_size", 30522),
    ("num_hidden_layers", "num_layers", 12),
    ("num_attention_heads", "num_heads", 12),
    ("hidden_size", "hidden_dim", 768),
    ("intermediate_size", "intermediate_dim", 3072),
    ("type_vocab_size", "type_vocab_size", 2),
    ("hidden_dropout_prob", "dropout", 0.1),
    ("attention_probs_dropout_prob", "attention_dropout", 0.1),
    ("hidden_act", "activation", "gelu"),
    ("layer_norm_eps", "layer_norm_epsilon", 1e-12),
    ("initializer_range", "initializer_range", 0.02),
]
# the block's names beyond BERT's: the global projections, which kbert
# holds as one query Dense and one key-and-value Dense
GLOBAL_QUERY = "attention.self.query_global"
GLOBAL_KEY_VALUE = ["attention.self.key_global", "attention.self.value_global"]


def position_offset(hf_config):
    """The rows of transformers' position table before a row's first token."""
    pad = hf_config.get("pad_token_id", 1)
    if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
        raise PresetError(f"config.json: pad_token_id must be a non-negative int, got {pad!r:.60}")
    return pad + 1


def backbone_config_from_hf(hf_config, source="config.json"):
    """The windowed `BertBackbone` config of a transformers Longformer config."""
    if hf_config.get("model_type") != MODEL_TYPE:
        raise PresetError(f"{source} is not a Longformer config (model_type 'longformer')")
    config = {ours: hf_config.get(theirs, default) for theirs, ours, default in CONFIG}
    if not isinstance(config["activation"], str):
        raise PresetError(f"{source}: hidden_act must be a name, got {config['activation']!r:.60}")
    try:
        config["activation"] = canonical_activation(config["activation"])
    except ValueError as e:
        raise PresetError(f"{source}: {e}") from e
    positions = hf_config.get("max_position_embeddings", 512)
    offset = position_offset(hf_config)
    if not isinstance(positions, int) or positions <= offset:
        raise PresetError(
            f"{source}: max_position_embeddings={positions!r:.60} leaves no position after "
            f"the {offset} rows Longformer reserves (pad_token_id + 1)"
        )
    config["max_sequence_length"] = positions - offset
    window = hf_config.get("attention_window", 512)
    windows = window if isinstance(window, list) else [window] * config["num_layers"]
    if len(set(map(repr, windows))) != 1:
        raise PresetError(
            f"{source}: attention_window differs between layers ({windows!r:.80}); kbert's "
            "windowed backbone has one window for every layer"
        )
    config["attention_window"] = windows[0]
    config["global_tokens"] = 1
    config["global_projections"] = True
    separator = hf_config.get("sep_token_id", 2)
    if not isinstance(separator, int) or isinstance(separator, bool) or separator < 0:
        raise PresetError(f"{source}: sep_token_id must be a token id, got {separator!r:.60}")
    config["separator_token_id"] = separator
    return config


# transformers' Longformer task class -> (kbert class, head table, global tokens
# transformers' model uses when given no global_attention_mask)
TASKS = {
    "LongformerForSequenceClassification": (
        "BertClassifier",
        [("classifier.out_proj", "logits", "linear")],
        1,
    ),
    "LongformerForTokenClassification": (
        "BertTokenClassifier",
        [("classifier", "logits", "linear")],
        0,
    ),
    "LongformerForMaskedLM": (
        "BertMaskedLM",
        [
            ("lm_head.dense", "mlm_head/transform", "linear"),
            ("lm_head.layer_norm", "mlm_head/layer_norm", "norm"),
            ("lm_head.bias", "mlm_head/output_bias", "tensor"),
        ],
        0,
    ),
    "LongformerForQuestionAnswering": (
        "BertQuestionAnswerer",
        [("qa_outputs", "logits", "linear")],
        BEFORE_SEPARATOR,
    ),
    "LongformerForMultipleChoice": (
        "BertMultipleChoice",
        [("classifier", "logits", "linear")],
        AFTER_SEPARATORS,
    ),
}
# kbert task -> the global rule transformers' class computes from the token
# ids whatever checkpoint it starts from (question answering: `<s>` and the
# question; multiple choice: each ending), and the static number of global
# slots (the rule's tokens beyond it attend locally)
SEPARATOR_TASKS = {"BertQuestionAnswerer": BEFORE_SEPARATOR, "BertMultipleChoice": AFTER_SEPARATORS}
# global slots of a multiple-choice ending (the question answerer's come from
# its max_query_length)
MAX_ENDING_TOKENS = 64
# the classification head's dense, which kbert holds as the backbone's pooler
CLASSIFIER_DENSE = [("classifier.dense", "pooler/dense", "linear")]


def architecture(hf_config, source="config.json"):
    """The directory's transformers class name ("LongformerModel" if none)."""
    names = hf_config.get("architectures") or ["LongformerModel"]
    if not isinstance(names, list) or not names or not isinstance(names[0], str):
        raise PresetError(f"{source}: architectures must be a list of names")
    return names[0]


def _blocks(num_layers):
    return [(f"encoder.layer.{i}.", f"transformer_layer_{i}/") for i in range(num_layers)]


def backbone_weights_from_hf(state, config, offset):
    """{kbert backbone path: array} of a (normalised) transformers
    Longformer state dict: BERT's names, the global projections, and the
    position table without its first `offset` rows."""
    weights, _ = hf.backbone_weights_from_hf(state, config["num_layers"])
    table = weights["embeddings/position_embeddings"]
    weights["embeddings/position_embeddings"] = table[
        offset : offset + config["max_sequence_length"]
    ]
    p = hf._prefix(state)

    def get(name, transposed=False):
        key = p + name
        if key not in state:
            raise PresetError(f"the checkpoint lacks {key!r}")
        return state[key].T if transposed else state[key]

    if "pooler/dense/kernel" not in weights:
        weights.update(hf._read_head(CLASSIFIER_DENSE, state) or {})
    for theirs, ours in _blocks(config["num_layers"]):
        attention = ours + "self_attention/"
        weights[attention + "global_query/kernel"] = get(theirs + GLOBAL_QUERY + ".weight", True)
        weights[attention + "global_query/bias"] = get(theirs + GLOBAL_QUERY + ".bias")
        weights[attention + "global_key_value/kernel"] = np.concatenate(
            [get(theirs + n + ".weight", True) for n in GLOBAL_KEY_VALUE], axis=1
        )
        weights[attention + "global_key_value/bias"] = np.concatenate(
            [get(theirs + n + ".bias") for n in GLOBAL_KEY_VALUE]
        )
    return weights


def held_task(task_cls, hf_config):
    """The `TASKS` entry of the directory's architecture when `task_cls`
    (or a class it derives from) is its kbert class, else None."""
    task = TASKS.get(architecture(hf_config))
    if task is None or task[0] not in {c.__name__ for c in task_cls.__mro__}:
        return None
    return task


def head_weights(task_cls, hf_config, state, source="the checkpoint"):
    """{kbert head path: array} of the `task_cls` head a Longformer
    directory of `hf_config`'s architecture holds, or None."""
    task = held_task(task_cls, hf_config)
    if task is None:
        return None
    if task[0] == "BertMaskedLM":
        _check_lm_head(hf_config, state, source)
        if "lm_head.bias" not in state and "lm_head.decoder.bias" in state:
            state = {**state, "lm_head.bias": state["lm_head.decoder.bias"]}
    return hf._read_head(task[1], state)


def _check_lm_head(hf_config, state, source):
    """Refuses LM heads kbert's `BertMaskedLM` would compute otherwise:
    transformers' applies erf GELU whatever `hidden_act` says (kbert's
    head the backbone's activation), and a decoder not tied to the token
    embeddings (kbert's always is)."""
    try:
        activation = canonical_activation(hf_config.get("hidden_act", "gelu"))
    except (TypeError, ValueError):
        activation = None
    if activation != "gelu":
        raise PresetError(
            f"{source}: transformers' Longformer LM head applies GELU, but kbert's masked-LM "
            f"head applies the encoder's activation ({hf_config.get('hidden_act')!r:.40}); "
            "load the encoder (BertBackbone) and train a new head"
        )
    decoder = state.get("lm_head.decoder.weight")
    embeddings = state.get(hf._prefix(state) + "embeddings.word_embeddings.weight")
    untied = hf_config.get("tie_word_embeddings", True) is False or (
        decoder is not None and not np.array_equal(decoder, embeddings)
    )
    if untied:
        raise PresetError(
            f"{source}: its LM head's decoder is not the token embedding table (untied), "
            "which kbert's masked-LM head always is; load the encoder (BertBackbone) and "
            "train a new head"
        )


class LongformerLoader(hf.HuggingFaceLoader):
    """A transformers Longformer directory (config.json with model_type
    "longformer"): the backbone, and the head of the task classes in
    `TASKS`."""

    format = "huggingface-longformer"
    priority = 28  # before the BERT / ALBERT reader, which takes any model_type
    model_type = MODEL_TYPE

    def backbone_config(self):
        return backbone_config_from_hf(self.hf_config, self.config_source)

    def held_shapes(self):
        shapes = hf.backbone_shapes_from_hf(self._read_shapes())
        table = shapes.get("embeddings/position_embeddings")
        if table is not None:
            offset = position_offset(self.hf_config)
            shapes["embeddings/position_embeddings"] = (table[0] - offset, *table[1:])
        return shapes

    def backbone_weights(self, config):
        return backbone_weights_from_hf(self.hf_state, config, position_offset(self.hf_config))

    def task_head(self, task_cls, load_weights=True):
        if held_task(task_cls, self.hf_config) is None:
            return None
        weights = None
        if load_weights:
            weights = head_weights(task_cls, self.hf_config, self.hf_state, self.directory)
        return TaskHead(
            hf._task_config(task_cls, "bert", self.hf_config),
            weights,
            source=f"Hugging Face head in {self.directory}",
            exact=True,
        )

    def task_backbone_config(self, task_cls, task_kwargs):
        names = {c.__name__ for c in task_cls.__mro__}
        for name, rule in SEPARATOR_TASKS.items():
            if name in names:
                slots = task_cls.window_defaults(task_kwargs).get("max_global_tokens")
                return {"global_tokens": rule, "max_global_tokens": slots or MAX_ENDING_TOKENS}
        task = held_task(task_cls, self.hf_config)
        return {} if task is None or task[2] == 1 else {"global_tokens": task[2]}

    def held_model(self):
        task = TASKS.get(architecture(self.hf_config, self.config_source))
        if task is None:
            return "BertBackbone", {}
        name, table, _ = task
        if not hf.TASKS[name].num_labels:
            return name, {}
        head = hf.tensors(table)[0][0]
        shape = self._read_shapes().get(head)
        if shape is None or len(shape) != 2:
            raise PresetError(f"{self.directory} is a {name} head without a {head} matrix")
        return name, {"num_classes": int(shape[0])}


register_format(LongformerLoader)
