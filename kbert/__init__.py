"""kbert: BERT for Keras 3 on JAX, PyTorch and TensorFlow."""

from kbert import layers, metrics, presets
from kbert.models import (
    BertBackbone,
    BertClassifier,
    BertMaskedLM,
    BertMultipleChoice,
    BertPreprocessor,
    BertPreTrainer,
    BertQuestionAnswerer,
    BertTextEmbedder,
    BertTokenClassifier,
)
from kbert.tokenizers import BertTokenizer
from kbert.version import __version__

__all__ = [
    "BertBackbone",
    "BertClassifier",
    "BertMaskedLM",
    "BertMultipleChoice",
    "BertPreprocessor",
    "BertPreTrainer",
    "BertQuestionAnswerer",
    "BertTextEmbedder",
    "BertTokenClassifier",
    "BertTokenizer",
    "layers",
    "metrics",
    "presets",
    "__version__",
]


def __getattr__(name):
    # Submodules that import TensorFlow or heavy extras load on first use.
    if name in ("data", "convert", "training", "cli"):
        import importlib

        return importlib.import_module(f"kbert.{name}")
    raise AttributeError(f"module 'kbert' has no attribute {name!r}")
