"""The preset loader: the one place that builds models from files.

Converters (`kbert.convert`) and the preset format (`kbert.presets`) turn a
directory into config and weight dictionaries; this module picks the reader
for a directory (kbert preset, Hugging Face or original TF checkpoint,
keras-hub preset), builds the model and assigns the weights, and writes task
presets (backbone files + the head's `task.json` and `task.safetensors`).
"""

import contextlib
import inspect
import logging
import os

import keras

import kbert.convert  # noqa: F401  (registers the foreign formats with loader_for)
from kbert.export import export_model
from kbert.layers import initializers
from kbert.layers.banded_attention import BEFORE_SEPARATOR, FIRST_SEGMENT
from kbert.layers.quantization import (
    apply_quantization,
    quantized_layers,
    quantized_layers_config,
)
from kbert.models.preprocessor import BertPreprocessor
from kbert.presets import io
from kbert.presets.architectures import check_backbone_config
from kbert.presets.loader import TASK_CONFIG_FILE, TASK_WEIGHTS_FILE, loader_for
from kbert.presets.positions import resize_position_weights
from kbert.presets.weights import assign_weights, with_global_projections
from kbert.tokenizers.wordpiece import CONFIG_FILE as TOKENIZER_CONFIG_FILE
from kbert.tokenizers.wordpiece import VOCAB_FILE
from kbert.utils.files import load_json

logger = logging.getLogger("kbert")

PREPROCESSOR_FILE = "preprocessor.json"  # kbert.models.preprocessor writes it
HF_TOKENIZER_FILE = "tokenizer.json"
MAX_HF_TOKENIZER_BYTES = 64 << 20  # a multilingual tokenizer.json is tens of MB
# from_preset keyword arguments that go to the backbone
BACKBONE_OVERRIDES = (
    "dtype",
    "dropout",
    "attention_dropout",
    "output_hidden_states",
    "adapter_size",
    "allow_pickle",
    "max_sequence_length",
    "attention_window",
    "global_tokens",
    "max_global_tokens",
    "global_projections",
    "separator_token_id",
)


class PresetMixin:
    """Adds `from_preset`, `save_to_preset` and an `export` that works on
    every backend; see `kbert.presets` and `kbert.export`."""

    def export(
        self, filepath, format="tf_saved_model", verbose=None, input_signature=None, **kwargs
    ):
        """Keras' `export`: `format="tf_saved_model"` or `"onnx"` go through
        `kbert.export.export_model` (dynamic batch and length, from every
        backend that can write the format); anything else, or an explicit
        `input_signature`, goes to Keras."""
        if input_signature is None and format in ("tf_saved_model", "onnx"):
            return export_model(self, filepath, format=format, verbose=verbose, **kwargs)
        return keras.Model.export(self, filepath, format, verbose, input_signature, **kwargs)

    def quantize(self, mode=None, *args, **kwargs):
        """Keras' `quantize`; "float8" is refused for a backbone whose
        blocks share their weights (`share_layers`): float8 keeps one scale
        and abs-max history per Dense, updated through its gradient, and a
        Dense applied in every block gets the sum of those updates (its
        scales grow by the number of layers at each step)."""
        backbone = self if hasattr(self, "share_layers") else getattr(self, "backbone", None)
        if (
            mode == "float8"
            and getattr(backbone, "share_layers", False)
            and getattr(backbone, "num_layers", 1) > 1
        ):
            raise ValueError(
                f'quantize("float8") of a backbone with share_layers=True: each shared Dense '
                f"runs {backbone.num_layers} times a step, and float8's delayed scaling would "
                "add their scale updates together; train it in bf16 (mixed_bfloat16), or "
                'quantize("int8") a trained model for inference'
            )
        return super().quantize(mode, *args, **kwargs)

    @classmethod
    def from_preset(cls, preset, load_weights=True, **kwargs):
        """Builds the model from a registered name, a kbert preset directory
        or a Hugging Face BERT directory.

        Args:
            preset: str or path. registered name (`kbert.presets.list_presets()`)
                or local directory.
            load_weights: bool. False gives the architecture, randomly initialised.
            **kwargs: config overrides, e.g. `dtype="mixed_bfloat16"`.
        """
        return io.load_model_from_preset(cls, preset, load_weights=load_weights, **kwargs)

    def save_to_preset(self, preset_dir, preprocessor=None):
        """Writes config, safetensors weights and checksummed metadata to a directory.

        Args:
            preset_dir: str or path. the directory to write.
            preprocessor: `kbert.BertPreprocessor` or None. tokenizer files to
                write beside the weights, for a backbone (a task writes the
                preprocessor attached to it).
        """
        unsupported = sorted(
            {
                mode
                for mode in quantized_layers(self).values()
                if not mode.startswith(("int8", "float8"))
            }
        )
        if unsupported:
            raise ValueError(
                f"a preset holds float, int8 or float8 layers; this model has {unsupported} "
                "layers: save it with model.save('model.keras'), which keeps them"
            )
        attached = getattr(self, "preprocessor", None)
        if preprocessor is not None and attached is not None and preprocessor is not attached:
            raise ValueError(
                f"this {type(self).__name__} already has a preprocessor, which its preset "
                "saves; attach the other one (model.preprocessor = ...) instead of passing it"
            )
        io.save_model_to_preset(self, preset_dir, preprocessor=None if attached else preprocessor)


def load_backbone(backbone_cls, directory, load_weights=True, **overrides):
    """A `backbone_cls` from a kbert preset, a Hugging Face BERT directory,
    an original TF checkpoint directory or a keras-hub BERT preset."""
    allow_pickle = overrides.pop("allow_pickle", False)
    return build_backbone(
        backbone_cls, loader_for(directory, allow_pickle), load_weights, overrides
    )


def build_backbone(backbone_cls, loader, load_weights, overrides):
    """A `backbone_cls` from what `loader` reads, with config `overrides`."""
    directory = loader.directory
    config, weights = loader.read_backbone(load_weights)
    new_adapters = io.new_adapters(config, overrides)  # the saved config, before overrides
    config = {**config, **overrides}
    if overrides:
        check_backbone_config(
            config, f"{directory} with {sorted(overrides)} overridden", load_weights=load_weights
        )
    io.check_vocabulary_file(directory, loader.vocabulary_file, config["vocabulary_size"])
    if weights is not None and "max_sequence_length" in overrides:
        # more positions than learned: the learned rows tiled; fewer: the first rows
        weights = resize_position_weights(weights, config["max_sequence_length"])
    if weights is not None and config.get("global_projections"):
        weights = with_global_projections(weights)  # copies of the local ones where absent
    # weights the checkpoint sets are built as zeros, not drawn (`kbert.layers.initializers`)
    building = initializers.placeholders() if weights is not None else contextlib.nullcontext()
    try:
        with building as placeholders:
            backbone = backbone_cls.from_config(config)
    except (TypeError, ValueError) as e:
        raise io.PresetError(f"{directory} has an invalid backbone config: {e}") from e
    if weights is not None:
        assign_weights(
            backbone,
            weights,
            source=loader.weights_source,
            allow_missing=loader.optional_weights(weights) + new_adapters,
        )
        initializers.draw_unset(backbone, weights, placeholders)
    return backbone


def _check_tokenizer_settings(directory, backbone, length_follows=False):
    """The kbert and Hugging Face tokenizer settings in `directory`, checked
    before a preprocessor is built from them (`length_follows`: the saved
    sequence length will be replaced by the backbone's, so any is fine)."""
    if os.path.lexists(os.path.join(directory, TOKENIZER_CONFIG_FILE)):
        config = io.read_json(directory, TOKENIZER_CONFIG_FILE)
        source = os.path.join(directory, TOKENIZER_CONFIG_FILE)
        for key in ("lowercase", "do_lower_case", "strip_accents", "tokenize_chinese_chars"):
            _check_json_type(source, config, key, bool, "true or false")
        _check_json_type(source, config, "rules", str, "a rules name such as 'original'")
        chars = config.get("max_input_chars_per_word", 100)
        if not (isinstance(chars, int) and not isinstance(chars, bool) and 1 <= chars <= 1 << 20):
            raise io.PresetError(
                f"{source}: max_input_chars_per_word must be a positive integer, got {chars!r:.60}"
            )
    elif os.path.lexists(os.path.join(directory, VOCAB_FILE)) and os.path.lexists(
        os.path.join(directory, HF_TOKENIZER_FILE)
    ):  # read to tell a Hugging Face tokenizer's rules
        path = io.preset_file(directory, HF_TOKENIZER_FILE)
        load_json(path, max_bytes=MAX_HF_TOKENIZER_BYTES)
    if os.path.lexists(os.path.join(directory, PREPROCESSOR_FILE)):
        config = io.read_json(directory, PREPROCESSOR_FILE)
        source = os.path.join(directory, PREPROCESSOR_FILE)
        length = config.get("sequence_length", 1)
        limit = (1 << 31) if length_follows else backbone.max_sequence_length
        if not (isinstance(length, int) and not isinstance(length, bool) and 1 <= length <= limit):
            raise io.PresetError(
                f"{source}: sequence_length must be an integer in [1, {limit}] (the backbone's "
                f"max_sequence_length), got {length!r:.60}"
            )
        truncate = config.get("truncate", "longest_first")
        if truncate != "longest_first":
            raise io.PresetError(
                f"{source}: truncate must be 'longest_first' (the original BERT rule), "
                f"got {truncate!r:.60}"
            )


def _check_json_type(source, config, key, types, meaning):
    if config.get(key) is not None and not isinstance(config[key], types):
        raise io.PresetError(f"{source}: {key} must be {meaning}, got {config[key]!r:.60}")


def directory_preprocessor(directory, backbone):
    """The `BertPreprocessor` the tokenizer files in `directory` describe
    (kbert preset, Hugging Face, original TF checkpoint or keras-hub), checked
    against `backbone`'s embedding rows and positions; None without them."""
    _check_tokenizer_settings(directory, backbone)
    preprocessor = BertPreprocessor.from_directory(
        directory, min(128, backbone.max_sequence_length)
    )
    _check_preprocessor(preprocessor, backbone, directory)
    return preprocessor


def _check_preprocessor(preprocessor, backbone, directory):
    size = getattr(getattr(preprocessor, "tokenizer", None), "vocabulary_size", None)
    if size is not None and size > backbone.vocabulary_size:
        raise io.PresetError(
            f"the preprocessor's vocabulary holds {size} tokens but the backbone from "
            f"{directory} has {backbone.vocabulary_size} embedding rows: raw text would give "
            "ids past the table; use the checkpoint's own vocabulary"
        )


def write_task_files(task, directory):
    """Backbone files, the head's config and weights, and the tokenizer
    files when a preprocessor is attached; returns the file names."""
    files = io.save_backbone(directory, task.backbone)
    io.write_json(
        directory,
        TASK_CONFIG_FILE,
        {
            "format": "kbert-task",
            "class_name": type(task).__name__,
            "config": task.task_config(),
            **quantized_layers_config(task, exclude=[task.backbone]),
        },
    )
    backbone_paths = tuple(v.path for v in task.backbone.weights)
    io.save_weights_file(directory, TASK_WEIGHTS_FILE, task, exclude=backbone_paths, exact=True)
    files += [TASK_CONFIG_FILE, TASK_WEIGHTS_FILE]
    if task.preprocessor is not None:
        files += task.preprocessor.save_to_directory(directory)
    return files


def load_task(cls, directory, load_weights=True, **kwargs):
    """A task model of class `cls` from a preset directory: its own head
    when the directory holds one of this class (kbert task preset, Hugging
    Face or original TF checkpoint), otherwise a fresh head on its backbone."""
    backbone_overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in BACKBONE_OVERRIDES}
    allow_pickle = backbone_overrides.pop("allow_pickle", False)
    loader = loader_for(directory, allow_pickle)
    backbone_overrides = {**loader.task_backbone_config(cls, kwargs), **backbone_overrides}
    if backbone_overrides.get("attention_window"):
        # the task's choice of global tokens for a window it asks for (e.g. the question)
        defaults = cls.window_defaults(kwargs)
        config = {**loader.backbone_config(), **backbone_overrides}
        if defaults.get("global_tokens") == FIRST_SEGMENT and config.get("type_vocab_size", 2) < 2:
            # one token type (RoBERTa-style packing `<s> q </s></s> c </s>`): the
            # question is what comes before the first separator
            if config.get("separator_token_id") is not None:
                defaults = {**defaults, "global_tokens": BEFORE_SEPARATOR}
            else:
                logger.warning(
                    "%s: one token type (RoBERTa-style packing) and no separator_token_id, so "
                    "the first segment cannot be told from the second: global tokens stay the "
                    "backbone's ([CLS])",
                    directory,
                )
                defaults = {}
        backbone_overrides = {**defaults, **backbone_overrides}
    backbone = build_backbone(cls.backbone_cls, loader, load_weights, backbone_overrides)
    head = loader.task_head(cls, load_weights)
    if "preprocessor" not in kwargs:
        resized = "max_sequence_length" in backbone_overrides
        _check_tokenizer_settings(directory, backbone, length_follows=resized)
        kwargs["preprocessor"] = cls.default_preprocessor(directory, backbone)
        if resized and kwargs["preprocessor"] is not None:
            # a backbone loaded for longer (or shorter) inputs packs rows of its length
            kwargs["preprocessor"].sequence_length = backbone.max_sequence_length
    _check_preprocessor(kwargs["preprocessor"], backbone, directory)
    arguments = {**(head.config if head else {}), **kwargs}
    _fill_head_size(cls, arguments, loader, directory)
    model = cls(backbone=backbone, **arguments)
    apply_quantization(model, head.quantized if head else None, f"{directory}/{TASK_CONFIG_FILE}")
    if head is None or head.weights is None:
        if load_weights:
            logger.warning(
                "%s: the %s head is initialised fresh (the preset has no matching head)",
                directory,
                cls.__name__,
            )
        return model
    paths = model.head_weight_paths()
    weights = head.weights
    if head.exact and set(weights) != set(paths):
        raise io.PresetError(
            f"the Hugging Face head in {directory} does not map onto {cls.__name__}: "
            f"expected {sorted(paths)}, got {sorted(weights)}"
        )
    allow_missing = ()
    if head.subset:
        wanted = set(paths)
        weights = {p: v for p, v in weights.items() if p in wanted}
        allow_missing = cls.head_weights_fresh
    assign_weights(model, weights, source=head.source, paths=paths, allow_missing=allow_missing)
    return model


# constructor arguments that size a task's head
HEAD_SIZES = ("num_classes", "num_choices")


def _fill_head_size(cls, arguments, loader, directory):
    """`num_classes` (or `num_choices`) a task needs and the caller left
    out: from the directory's head of this class where it holds one (a
    transformers classifier's label count), else a clear error naming it."""
    signature = inspect.signature(cls.__init__).parameters
    for name in HEAD_SIZES:
        if name not in signature or name in arguments:
            continue
        if signature[name].default is not inspect.Parameter.empty:
            continue
        held_name, held = loader.held_model()
        if held_name == cls.__name__ and name in held:
            arguments[name] = held[name]
            continue
        raise ValueError(
            f"{cls.__name__}.from_preset({str(directory)!r}) needs {name}=<int>: the directory "
            f"holds no {cls.__name__} head to read it from"
        )


def held_model(directory):
    """(class name, constructor arguments) of the model a directory holds
    with its head: a kbert task preset's class, the Hugging Face
    architecture's counterpart (classes counted from the head's weights),
    BertPreTrainer for an original TF checkpoint (MLM + NSP heads), else
    BertBackbone."""
    loader = loader_for(directory, required=False)
    return loader.held_model() if loader is not None else ("BertBackbone", {})
