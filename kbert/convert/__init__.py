"""Checkpoint interchange: Hugging Face BERT, ALBERT and MobileBERT
directories (both ways), original TF checkpoints and keras-hub presets (read).

Importing this package registers each format with `kbert.presets.loader_for`
(see `kbert.presets.loader` for how to add one).
"""

from kbert.convert import huggingface, keras_hub, mobilebert, tf_checkpoint

__all__ = ["huggingface", "keras_hub", "mobilebert", "tf_checkpoint"]
