"""Presets: registered names, the preset directory format, named architectures."""

from kbert.presets.architectures import ARCHITECTURES, architecture_config
from kbert.presets.io import PresetError
from kbert.presets.registry import PRESETS, list_presets, upload_preset

__all__ = [
    "ARCHITECTURES",
    "PRESETS",
    "PresetError",
    "architecture_config",
    "list_presets",
    "upload_preset",
]
