"""Presets: registered names, the preset directory format, named architectures."""

from kbert.presets.architectures import ARCHITECTURES, architecture_config
from kbert.presets.io import PresetError
from kbert.presets.loader import PresetLoader, loader_for, register_format
from kbert.presets.registry import PRESETS, list_presets, upload_preset

__all__ = [
    "ARCHITECTURES",
    "PRESETS",
    "PresetError",
    "PresetLoader",
    "architecture_config",
    "list_presets",
    "loader_for",
    "register_format",
    "upload_preset",
]
