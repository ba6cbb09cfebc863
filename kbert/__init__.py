"""kbert: BERT for Keras 3 on JAX, PyTorch and TensorFlow."""

from kbert.version import __version__
from kbert import layers, presets
from kbert.models import BertBackbone
from kbert.tokenizers import BertTokenizer

__all__ = ["BertBackbone", "BertTokenizer", "layers", "presets", "__version__"]
