"""kbert: BERT for Keras 3 on JAX, PyTorch and TensorFlow."""

from kbert import convert, data, layers, metrics, presets, training
from kbert.models import (
    BertBackbone,
    BertChunkClassifier,
    BertClassifier,
    BertDistiller,
    BertMaskedLM,
    BertMemoryClassifier,
    BertMultipleChoice,
    BertPreprocessor,
    BertPreTrainer,
    BertQuestionAnswerer,
    BertSeq2SeqLM,
    BertTextEmbedder,
    BertTokenClassifier,
    MobileBertBackbone,
)
from kbert.tokenizers import BertTokenizer
from kbert.version import __version__

__all__ = [
    "BertBackbone",
    "BertChunkClassifier",
    "BertClassifier",
    "BertDistiller",
    "BertMaskedLM",
    "BertMemoryClassifier",
    "BertMultipleChoice",
    "BertPreprocessor",
    "BertPreTrainer",
    "BertQuestionAnswerer",
    "BertSeq2SeqLM",
    "BertTextEmbedder",
    "BertTokenClassifier",
    "BertTokenizer",
    "MobileBertBackbone",
    "convert",
    "data",
    "layers",
    "metrics",
    "presets",
    "training",
    "__version__",
]
