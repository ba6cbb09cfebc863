"""Safe file access inside a model directory."""

import os


class PresetError(ValueError):
    """A preset directory that is missing, malformed, corrupt or of another model."""


def preset_file(directory, name):
    """Path of file `name` in `directory`, refusing anything that leaves it."""
    if (
        not isinstance(name, str)
        or not name
        or os.path.basename(name) != name
        or name in (".", "..")
    ):
        raise PresetError(
            f"preset names an unsafe file {name!r}: only plain file names are allowed"
        )
    path = os.path.join(directory, name)
    real_dir = os.path.realpath(directory)
    if os.path.islink(path) or os.path.dirname(os.path.realpath(path)) != real_dir:
        raise PresetError(f"preset file {name!r} is a link or leaves the preset directory")
    return path
