"""One preset loader: a directory's format is decided once, by `loader_for`.

`loader_for(directory)` asks each registered format, in priority order,
whether the directory is one of its own, and returns that format's loader.
Every loader gives the same four things, in kbert's names:

- `read_backbone(load_weights)`: the backbone config (checked against the
  sizes the weights hold) and the backbone weights, {variable path: array};
- `tokenizer()`: the `BertTokenizer` its vocabulary files describe, or None;
- `task_head(task_cls, load_weights)`: the head of a task class the
  directory holds (constructor arguments and weights), or None;
- `held_model()`: (class name, constructor arguments) of the model the
  directory holds with its head, for `kbert convert` and `kbert export`.

The kbert preset format is registered here; the foreign formats register
themselves when `kbert.convert` is imported (`import kbert` does), since
converters sit above presets: `kbert.convert.huggingface` (Hugging Face BERT
and ALBERT), `kbert.convert.tf_checkpoint` (the original Google
checkpoints) and `kbert.convert.keras_hub`. Only `kbert.models.preset_io`
builds models from what a loader returns.

Adding a format (or a model type, e.g. MobileBERT or an encoder-decoder):
1. one module in `kbert/convert/` with a `PresetLoader` subclass: its
   `detect(directory)` classmethod and `backbone_config`, `held_shapes` and
   `backbone_weights`; `task_head`, `held_model` and `tokenizer` where the
   format holds heads or a tokenizer of its own; the name tables it maps
   weights with, used for reading and (if it writes the format) writing;
2. one registry line at the end of that module, `register_format(MyLoader)`,
   and its import in `kbert/convert/__init__.py`. `priority` orders the
   checks when one directory could pass several (a keras-hub preset also
   has a `metadata.json`, for instance).
"""

import dataclasses
import logging
import os

from kbert.presets import io
from kbert.presets.architectures import check_backbone_config
from kbert.presets.weights import held_sizes
from kbert.tokenizers import BertTokenizer, bpe
from kbert.tokenizers.wordpiece import VOCAB_FILE

logger = logging.getLogger("kbert")

TASK_CONFIG_FILE = "task.json"
TASK_WEIGHTS_FILE = "task.safetensors"

_FORMATS = []  # loader classes, in the order their `detect` is asked


def register_format(loader_cls):
    """Adds a `PresetLoader` subclass to the formats `loader_for` detects."""
    _FORMATS[:] = sorted(
        [f for f in _FORMATS if f.format != loader_cls.format] + [loader_cls],
        key=lambda f: f.priority,
    )
    return loader_cls


def formats():
    """The registered format names, in detection order."""
    return [f.format for f in _FORMATS]


def loader_for(directory, allow_pickle=False, required=True):
    """The loader of the format `directory` is in.

    Args:
        directory: str or path. a local directory (`kbert.presets.io.resolve_preset`
            turns registered names and `hf://` handles into one).
        allow_pickle: bool. lets a Hugging Face loader read `pytorch_model.bin`.
        required: bool. False returns None for a directory of no known format
            instead of raising a PresetError.
    """
    directory = os.fspath(directory)
    for loader_cls in _FORMATS:
        if loader_cls.detect(directory):
            return loader_cls(directory, allow_pickle=allow_pickle)
    if not required:
        return None
    raise io.PresetError(
        f"{directory!r} is not a preset: it has neither a kbert {io.METADATA_FILE} nor "
        "a Hugging Face config.json with model_type 'bert'"
    )


@dataclasses.dataclass
class TaskHead:
    """What a directory holds of one task class's head.

    config: constructor arguments of the task (besides backbone and preprocessor).
    weights: {head variable path: array} or None (not loaded, or not held).
    quantized: the task's `quantized_layers` config, or None.
    source: the weights' origin, for error messages.
    subset: the weights are a larger head's; only the task's own paths are taken.
    exact: the weights must be exactly the task's head paths (foreign formats).
    """

    config: dict
    weights: dict = None
    quantized: dict = None
    source: str = ""
    subset: bool = False
    exact: bool = False


class PresetLoader:
    """Reads one directory of one format into kbert configs and weights.

    Subclasses set `format` and `priority` and implement `detect`,
    `backbone_config`, `held_shapes` and `backbone_weights`.
    """

    format = None
    priority = 50  # lower is asked first
    # The file holding the backbone config, and the vocabulary file, relative
    # to the directory ("/" separates subfolders).
    config_file = None
    vocabulary_file = VOCAB_FILE

    def __init__(self, directory, allow_pickle=False):
        self.directory = os.fspath(directory)
        self.allow_pickle = allow_pickle

    @classmethod
    def detect(cls, directory):
        """Whether `directory` is in this format (reads at most small JSON files)."""
        raise NotImplementedError

    # --- backbone -------------------------------------------------------------

    @property
    def config_source(self):
        """The file the backbone config comes from, for messages."""
        return os.path.join(self.directory, self.config_file)

    @property
    def weights_source(self):
        """Where the backbone weights come from, for messages."""
        raise NotImplementedError

    def backbone_config(self):
        """The kbert backbone config (format checks done; sizes not yet checked)."""
        raise NotImplementedError

    def held_shapes(self):
        """{kbert path: shape} of the embedding tables and blocks the weights
        hold, read without the tensor data: what `held_sizes` bounds a config with."""
        raise NotImplementedError

    def check_held(self, config, held):
        """Format-specific checks of `config` against the held sizes."""

    def backbone_weights(self, config):
        """{kbert backbone path: array}."""
        raise NotImplementedError

    def optional_weights(self, weights):
        """Path prefixes of backbone weights that may be left at their initial values."""
        return ()

    def read_backbone(self, load_weights=True):
        """(config, weights or None): the config checked against the held
        weights' sizes before any tensor is read."""
        config = self.backbone_config()
        if not load_weights:
            check_backbone_config(config, self.config_source, load_weights=False)
            return config, None
        held = held_sizes(self.held_shapes())
        check_backbone_config(config, self.config_source, held)
        self.check_held(config, held)
        return config, self.backbone_weights(config)

    # --- tokenizer and heads --------------------------------------------------

    def tokenizer(self, rules=None):
        """The `BertTokenizer` of the directory's vocabulary, the
        `ByteLevelBPETokenizer` of a BPE tokenizer.json without one (RoBERTa,
        Longformer; `rules` do not apply), or None."""
        if os.path.isfile(os.path.join(self.directory, VOCAB_FILE)):
            return BertTokenizer.load(self.directory, rules=rules)
        return bpe.load_if_present(self.directory)

    def task_head(self, task_cls, load_weights=True):
        """The `TaskHead` of `task_cls` the directory holds, or None."""
        return None

    def task_backbone_config(self, task_cls, task_kwargs):
        """Backbone settings the directory's head was trained with, for
        `task_cls` when that head is the one loaded (e.g. Longformer's
        token classifier: no global token), or that the task computes
        with this kind of checkpoint (Longformer's question answering: the
        question global); `task_kwargs`: the task's other arguments. The
        caller's settings win."""
        return {}

    def held_model(self):
        """(class name, constructor arguments) of the model the directory holds."""
        return "BertBackbone", {}


class KbertPresetLoader(PresetLoader):
    """A kbert preset (`kbert.presets.io`): config.json, model.safetensors,
    checksummed by metadata.json; task presets add task.json and task.safetensors."""

    format = "kbert"
    priority = 90  # after keras-hub, whose presets also have a metadata.json
    config_file = io.CONFIG_FILE

    @classmethod
    def detect(cls, directory):
        return io.is_kbert_preset(directory)

    @property
    def weights_source(self):
        return f"weights in {self.directory}/{io.WEIGHTS_FILE}"

    def backbone_config(self):
        return io.read_backbone_config(self.directory)

    def held_shapes(self):
        return io.safetensors_shapes(self.directory, io.WEIGHTS_FILE)

    def backbone_weights(self, config):
        return io.load_weights_file(self.directory, io.WEIGHTS_FILE)

    def _saved_task(self):
        if not os.path.lexists(os.path.join(self.directory, TASK_CONFIG_FILE)):
            return None
        return io.read_json(self.directory, TASK_CONFIG_FILE)

    def task_head(self, task_cls, load_weights=True):
        saved = self._saved_task()
        if saved is None:
            return None
        name = saved.get("class_name")
        weights = lambda: (  # noqa: E731
            io.load_weights_file(self.directory, TASK_WEIGHTS_FILE) if load_weights else None
        )
        source = f"head weights in {self.directory}/{TASK_WEIGHTS_FILE}"
        if name in task_cls.head_weights_from and not saved.get("quantized_layers"):
            # e.g. BertMaskedLM from a BertPreTrainer preset: its MLM head
            return TaskHead({}, weights(), source=source, subset=True)
        if name == task_cls.__name__:
            config = saved.get("config", {})
            if not isinstance(config, dict):
                raise io.PresetError(f"{self.directory}/{TASK_CONFIG_FILE} has no 'config' object")
            return TaskHead(config, weights(), saved.get("quantized_layers"), source)
        logger.warning(
            "%s holds a %s head; building a fresh %s head on its backbone",
            self.directory,
            name,
            task_cls.__name__,
        )
        return None

    def held_model(self):
        saved = self._saved_task()
        if saved is None:
            return "BertBackbone", {}
        name = saved.get("class_name")
        return (name if isinstance(name, str) else repr(name)), {}


register_format(KbertPresetLoader)
