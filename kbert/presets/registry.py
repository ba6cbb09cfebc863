"""Registered preset names and where their files come from.

A registered preset is a Hugging Face BERT directory served over HTTPS; it is
downloaded once into the cache (`$KBERT_CACHE`, default ~/.cache/kbert) and
then loaded like any local directory. Offline, loading fails with one message
that names the URL and how to pass a local directory instead.

The names, repositories and descriptions are data in `presets.json`, which the
`kbert` command (`kbert_cli`) reads to list them without importing kbert, and
with it Keras and a backend.
"""

import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request

from kbert.utils.naming import closest

_HF = "https://huggingface.co/{repo}/resolve/main/"
_FILES = ("config.json", "model.safetensors", "vocab.txt", "tokenizer_config.json")

REGISTRY_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets.json")


def _read_registry():
    with open(REGISTRY_FILE, encoding="utf-8") as f:
        entries = json.load(f)
    return {
        name: {
            "url": _HF.format(repo=entry["huggingface"]),
            "files": _FILES,
            "description": entry["description"],
        }
        for name, entry in entries.items()
    }


PRESETS = _read_registry()

OPTIONAL_FILES = {"tokenizer_config.json"}


def list_presets():
    """{name: description} of the registered presets."""
    return {name: spec["description"] for name, spec in PRESETS.items()}


def cache_dir():
    return os.environ.get("KBERT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kbert")


def download_preset(name, timeout=30):
    """Returns the local directory of registered preset `name`, downloading it once."""
    if name not in PRESETS:
        raise ValueError(
            f"{name!r} is neither a directory nor a registered preset; registered: "
            f"{sorted(PRESETS)}" + closest(name, PRESETS)
        )
    spec = PRESETS[name]
    target = os.path.join(cache_dir(), name)
    if os.path.exists(os.path.join(target, ".complete")):
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir())
    try:
        for filename in spec["files"]:
            url = spec["url"] + filename
            try:
                with (
                    urllib.request.urlopen(url, timeout=timeout) as response,
                    open(os.path.join(staging, filename), "wb") as f,
                ):
                    shutil.copyfileobj(response, f)
            except urllib.error.HTTPError as e:
                if e.code == 404 and filename in OPTIONAL_FILES:
                    continue
                raise _offline_error(name, url, e) from e
            except (urllib.error.URLError, OSError) as e:
                raise _offline_error(name, url, e) from e
        open(os.path.join(staging, ".complete"), "w").close()
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _offline_error(name, url, error):
    return OSError(
        f"could not download preset {name!r} from {url} ({error}). Without network "
        "access, fetch the preset's files elsewhere and pass their directory "
        "instead of the name, e.g. BertBackbone.from_preset('/path/to/dir')"
    )
