"""from_preset / save_to_preset for every kbert model."""


class PresetMixin:
    """Adds `from_preset` and `save_to_preset`; see `kbert.presets`."""

    @classmethod
    def from_preset(cls, preset, load_weights=True, **kwargs):
        """Builds the model from a registered name, a kbert preset directory
        or a Hugging Face BERT directory.

        Args:
            preset: str or path. registered name (`kbert.presets.list_presets()`)
                or local directory.
            load_weights: bool. False gives the architecture, randomly initialised.
            **kwargs: config overrides, e.g. `dtype="mixed_bfloat16"`.
        """
        from kbert.presets.io import load_model_from_preset

        return load_model_from_preset(cls, preset, load_weights=load_weights, **kwargs)

    def save_to_preset(self, preset_dir):
        """Writes config, safetensors weights and checksummed metadata to a directory."""
        from kbert.presets.io import save_model_to_preset

        save_model_to_preset(self, preset_dir)
