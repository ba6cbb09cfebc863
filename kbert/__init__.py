"""kbert: BERT for Keras 3 on JAX, PyTorch and TensorFlow."""

from kbert.version import __version__
from kbert import layers, presets
from kbert.models import BertBackbone

__all__ = ["BertBackbone", "layers", "presets", "__version__"]
