"""Checkpoint interchange: Hugging Face BERT, ALBERT and MobileBERT
directories and BERT EncoderDecoderModel directories (both ways), original
TF checkpoints, keras-hub presets and Longformer directories (read).

Importing this package registers each format with `kbert.presets.loader_for`
(see `kbert.presets.loader` for how to add one).
"""

from kbert.convert import (
    encoder_decoder,
    huggingface,
    keras_hub,
    longformer,
    mobilebert,
    tf_checkpoint,
)

__all__ = [
    "encoder_decoder",
    "huggingface",
    "keras_hub",
    "longformer",
    "mobilebert",
    "tf_checkpoint",
]
