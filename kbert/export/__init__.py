"""Serving artifacts: SavedModels (model inputs, or raw strings with the
tokenizer in the graph), ONNX, and the tokenizer as a `tokenizer.json`.

Imports no TensorFlow, ONNX or torch until an export runs.
"""

from kbert.export.model import export_model
from kbert.export.text import export_text_model
from kbert.export.tokenizer_json import export_tokenizer_json, tokenizer_json

__all__ = ["export_model", "export_text_model", "export_tokenizer_json", "tokenizer_json"]
