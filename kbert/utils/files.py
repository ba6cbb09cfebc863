"""Safe file access inside a model directory: every file a loader reads is a
regular file inside the directory, and JSON is parsed within fixed bounds."""

import hashlib
import json
import math
import os
import stat

# Configs, indexes and tokenizer settings are kilobytes; a bigger file is not one of them.
MAX_JSON_BYTES = 16 << 20
# The largest public WordPiece vocabularies are a few MB.
MAX_VOCABULARY_BYTES = 64 << 20


class PresetError(ValueError):
    """A preset directory that is missing, malformed, corrupt or of another model."""


def preset_file(directory, name, subfolders=False):
    """Path of file `name` in `directory`, refusing anything that leaves it.

    `name` is a plain file name or, with `subfolders`, a relative path with
    "/" separators (keras-hub's `assets/tokenizer/vocabulary.txt`). The
    path may not exist yet (callers check); when it exists it must be a
    regular file reached without symbolic links.
    """
    parts = name.split("/") if isinstance(name, str) and subfolders else [name]
    if not all(
        isinstance(part, str)
        and part
        and part not in (".", "..")
        and os.path.basename(part) == part
        and "\\" not in part
        for part in parts
    ):
        raise PresetError(
            f"preset names an unsafe file {name!r}: only plain file names are allowed"
        )
    path = os.path.join(directory, *parts)
    real_dir = os.path.realpath(directory)
    walked = directory
    for part in parts:
        walked = os.path.join(walked, part)
        if os.path.islink(walked):
            raise PresetError(
                f"preset file {name!r} is a link or resolves outside the preset directory"
            )
    if os.path.realpath(path) != os.path.join(real_dir, *parts):
        raise PresetError(
            f"preset file {name!r} is a link or resolves outside the preset directory"
        )
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    except OSError as e:
        raise PresetError(f"preset file {path} cannot be read: {e}") from e
    if not stat.S_ISREG(mode):
        raise PresetError(
            f"preset file {path} is not a regular file (a directory, FIFO or device); "
            "replace it with the file itself"
        )
    return path


def _reject_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text):
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} overflows a float")
    return value


def load_json(path, max_bytes=MAX_JSON_BYTES):
    """A JSON object (dict) from the regular file `path`, or a PresetError
    naming the file: too big, not UTF-8, malformed, nested too deep, NaN or
    infinite numbers, or a top level that is not an object."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise PresetError(f"{path} cannot be read: {e}") from e
    if not stat.S_ISREG(info.st_mode):
        raise PresetError(f"{path} is not a regular file (a directory, FIFO or device)")
    size = info.st_size
    if size > max_bytes:
        raise PresetError(
            f"{path} is {size} bytes, more than the {max_bytes} a JSON settings file may hold"
        )
    try:
        with open(path, encoding="utf-8") as f:
            value = json.loads(
                f.read(max_bytes + 1),
                parse_constant=_reject_constant,
                parse_float=_finite_float,
            )
    except RecursionError as e:
        raise PresetError(f"{path} is not valid JSON: nested too deeply") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise PresetError(f"{path} is not valid JSON: {str(e)[:200]}") from e
    except OSError as e:
        raise PresetError(f"{path} cannot be read: {e}") from e
    if not isinstance(value, dict):
        raise PresetError(
            f"{path} holds a JSON {type(value).__name__}; a JSON object ({{...}}) is expected"
        )
    return value


def sha256(path):
    """The SHA-256 hex digest of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_safetensors(tensors, path, metadata=None):
    """`safetensors.numpy.save_file`, with the permissions of any other file
    written here (0666 less the umask): safetensors creates the file
    readable by its owner only."""
    from safetensors.numpy import save_file

    save_file(tensors, path, metadata=metadata)
    try:
        os.chmod(path, 0o666 & ~_umask())
    except OSError:  # a file system without permissions: the file is written
        pass


def _umask():
    """The process's umask, read without changing it where Linux tells it
    (`os.umask` sets it, for every thread, while reading it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def verify_checksums(directory, checksums, missing, changed, locate=os.path.join):
    """Raises `PresetError(missing(name))` for the first file of `checksums`
    ({file name: sha256 hex digest}) that `directory` lacks, or
    `PresetError(changed(name))` for one with another digest.
    `locate(directory, name)` gives a file's path (e.g. `preset_file`,
    which refuses links)."""
    for name, expected in checksums.items():
        path = locate(directory, name)
        if not os.path.isfile(path):
            raise PresetError(missing(name))
        if sha256(path) != expected:
            raise PresetError(changed(name))
