"""Hugging Face Hub handles, registered preset names, and publishing.

A Hub handle is `hf://org/name` or `hf://org/name@revision` (a branch, tag
or commit hash). Resolving one downloads, through `huggingface_hub`, only the
files kbert reads (`HUB_FILES`) into the Hugging Face cache (`HF_HUB_CACHE`,
default ~/.cache/huggingface/hub; resumable, shared with `transformers`),
then returns a directory the preset loaders read like any local one. The
cache's snapshot files are links into its blob store, and the loaders refuse
links, so the snapshot is mirrored as hard links (copies where the file
system has none) under `$KBERT_CACHE/hub` (default ~/.cache/kbert/hub).

`HF_ENDPOINT`, `HF_HUB_CACHE`, `HF_HUB_OFFLINE` and `HF_TOKEN` are read when
a handle is resolved, not only when `huggingface_hub` is imported, so setting
them in a running process takes effect.

A registered name is an alias of a handle. The names, handles, descriptions
and optional sha256 checksums of files are data in `presets.json`, which the
`kbert` command (`kbert_cli`) reads to list them without importing kbert, and
with it Keras and a backend. `huggingface_hub` is imported only when a handle
or registered name is resolved or a preset is published.
"""

import json
import os
import re
import shutil
import tempfile

from kbert.utils.files import PresetError, verify_checksums
from kbert.utils.naming import closest

SCHEME = "hf://"

# Every file a kbert loader reads (kbert preset, Hugging Face BERT directory,
# Google TF checkpoint, keras-hub preset); nothing else is downloaded.
HUB_FILES = (
    "config.json",
    "metadata.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*-of-*.safetensors",
    "task.json",
    "task.safetensors",
    "preprocessor.json",
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "bert_config.json",
    "*.ckpt.index",
    "*.ckpt.data-*",
    "model.weights.h5",
    "assets/tokenizer/*",
)
# Pickled weights execute code when loaded: fetched only with allow_pickle=True.
PICKLED_FILES = ("pytorch_model.bin",)

REGISTRY_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets.json")


def _read_registry():
    with open(REGISTRY_FILE, encoding="utf-8") as f:
        entries = json.load(f)
    return {
        name: {
            "handle": entry["handle"],
            "description": entry["description"],
            "sha256": dict(entry.get("sha256", {})),
        }
        for name, entry in entries.items()
    }


PRESETS = _read_registry()


def list_presets():
    """{name: description} of the registered presets."""
    return {name: spec["description"] for name, spec in PRESETS.items()}


def cache_dir():
    return os.environ.get("KBERT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kbert")


def is_hub_handle(preset):
    return isinstance(preset, str) and preset.startswith(SCHEME)


def parse_handle(handle):
    """`hf://org/name@revision` -> ("org/name", "revision" or None)."""
    if not is_hub_handle(handle):
        raise PresetError(f"{handle!r} is not a Hub handle; write it as hf://org/name[@revision]")
    repo_id, _, revision = handle[len(SCHEME) :].partition("@")
    if not repo_id or repo_id.count("/") > 1 or "" in repo_id.split("/"):
        raise PresetError(
            f"Hub handle {handle!r} does not name a repository; write it as hf://org/name[@revision]"
        )
    if "@" in handle[len(SCHEME) :] and not revision:
        raise PresetError(
            f"Hub handle {handle!r} has an empty revision after '@'; name a branch, tag or "
            "commit, or drop the '@'"
        )
    return repo_id, revision or None


def _env_flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _hub_settings():
    """Endpoint, cache and offline flag, read from the environment now."""
    from huggingface_hub import constants

    offline = constants.HF_HUB_OFFLINE
    if os.environ.get("HF_HUB_OFFLINE"):
        offline = _env_flag("HF_HUB_OFFLINE")
    return {
        "endpoint": os.environ.get("HF_ENDPOINT", "").rstrip("/") or constants.ENDPOINT,
        "cache_dir": os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE,
        "local_files_only": offline,
    }


def download_preset(preset, allow_pickle=False, token=None):
    """Local directory of a registered name or `hf://` handle, downloading it once.

    Args:
        preset: str. a registered name (`list_presets()`) or `hf://org/name[@revision]`.
        allow_pickle: bool. also fetch `pytorch_model.bin` (pickled; runs code when loaded).
        token: str or None. Hub token for private or gated repositories; None uses
            `HF_TOKEN` or the `hf auth login` token.
    """
    if is_hub_handle(preset):
        handle, checksums = preset, {}
    elif preset in PRESETS:
        handle, checksums = PRESETS[preset]["handle"], PRESETS[preset]["sha256"]
    else:
        raise ValueError(
            f"{preset!r} is neither a directory, a Hub handle (hf://org/name) nor a "
            f"registered preset; registered: {sorted(PRESETS)}" + closest(preset, PRESETS)
        )
    repo_id, revision = parse_handle(handle)
    snapshot = _snapshot(preset, handle, repo_id, revision, allow_pickle, token)
    directory = _mirror(snapshot, repo_id)
    _verify(preset, directory, checksums)
    return directory


def _snapshot(preset, handle, repo_id, revision, allow_pickle, token):
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    settings = _hub_settings()
    patterns = list(HUB_FILES) + (list(PICKLED_FILES) if allow_pickle else [])
    try:
        snapshot = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=patterns,
            token=token,
            library_name="kbert",
            **settings,
        )
    except HFValidationError as e:
        raise PresetError(f"Hub handle {handle!r} is not a valid repository id: {e}") from e
    except RevisionNotFoundError as e:
        raise PresetError(
            f"Hub repository {repo_id!r} has no revision {revision!r} (from {preset!r}); "
            "name an existing branch, tag or commit after '@'"
        ) from e
    except RepositoryNotFoundError as e:
        raise PresetError(
            f"Hub repository {repo_id!r} (from {preset!r}) was not found at "
            f"{settings['endpoint']}: check the name, or for a private or gated repository "
            "log in (`hf auth login`) or set HF_TOKEN"
        ) from e
    except LocalEntryNotFoundError as e:
        if settings["local_files_only"]:
            why, retry = "HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE to download it"
        else:
            why = f"{settings['endpoint']} could not be reached"
            retry = "check the network (and HF_ENDPOINT) and retry"
        raise OSError(
            f"could not load preset {preset!r}: {why} and the Hugging Face cache "
            f"({settings['cache_dir']}) holds no complete copy of {handle}. Either {retry}, "
            f"or fetch the files elsewhere (`hf download {repo_id}`) and pass their directory "
            "instead, e.g. BertBackbone.from_preset('/path/to/dir')"
        ) from e
    except HfHubHTTPError as e:
        raise OSError(
            f"could not download preset {preset!r} from {settings['endpoint']}: {e}"
        ) from e
    if not any(
        os.path.isfile(os.path.join(snapshot, f)) for f in ("config.json", "bert_config.json")
    ):
        raise PresetError(
            f"Hub repository {repo_id!r} (from {preset!r}) has no config.json or "
            "bert_config.json: it is not a BERT checkpoint kbert can read"
        )
    return snapshot


def _mirror(snapshot, repo_id):
    """The snapshot as plain files: hard links to the cache's blobs.

    Each file appears atomically (linked under a temporary name, then
    renamed), so concurrent loaders and interrupted runs never see a
    partial file, and a later download with more files (allow_pickle)
    adds to the same directory.
    """
    commit = os.path.basename(os.path.normpath(snapshot))
    target = os.path.join(cache_dir(), "hub", repo_id.replace("/", "--"), commit)
    for root, _, files in os.walk(snapshot):
        for name in files:
            source = os.path.join(root, name)
            dest = os.path.join(target, os.path.relpath(source, snapshot))
            if os.path.isfile(dest) and os.path.getsize(dest) == os.path.getsize(source):
                continue
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            fd, staging = tempfile.mkstemp(prefix=f".{name}-", dir=os.path.dirname(dest))
            os.close(fd)
            try:
                os.remove(staging)
                try:
                    os.link(os.path.realpath(source), staging)
                except OSError:
                    shutil.copyfile(source, staging)
                os.replace(staging, dest)
            finally:
                if os.path.exists(staging):
                    os.remove(staging)
    return target


def _verify(preset, directory, checksums):
    verify_checksums(
        directory,
        checksums,
        missing=lambda name: f"preset {preset!r} has no file {name!r}, which the registry pins",
        changed=lambda name: (
            f"preset {preset!r}: {name} does not match its sha256 in the registry "
            "(changed upstream, or a corrupt download); delete it from the Hugging Face "
            "cache (`hf cache delete`) and $KBERT_CACHE/hub, then retry"
        ),
    )


def upload_preset(preset, handle, token=None, private=None, commit_message=None):
    """Publishes a preset directory (or a model, saved first) to a Hub repository.

    Creates the repository if needed and commits every file of the directory
    (hidden files excepted) to the handle's branch (default `main`).

    Args:
        preset: str, path or model. a preset directory, or any kbert model
            (saved with `save_to_preset` into a temporary directory).
        handle: str. `hf://org/name`, or `hf://org/name@branch`.
        token: str or None. a Hub token with write access; None uses `HF_TOKEN`
            or the `hf auth login` token.
        private: bool or None. visibility of a repository this creates.
        commit_message: str or None. defaults to "Upload kbert preset".

    Returns:
        str. the handle pinned to the new commit, `hf://org/name@<commit>`.

    Example (needs a Hub account):
        upload_preset(classifier, "hf://me/bert-sst2")
    """
    repo_id, revision = parse_handle(handle)
    if revision is not None and re.fullmatch(r"[0-9a-f]{40}", revision):
        raise PresetError(
            f"cannot publish to {handle!r}: a commit is fixed once made; name a branch after "
            f"'@', or drop the '@' to publish to main"
        )
    if hasattr(preset, "save_to_preset"):
        with tempfile.TemporaryDirectory() as directory:
            preset.save_to_preset(directory)
            return _upload(directory, repo_id, revision, token, private, commit_message)
    directory = os.fspath(preset)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise PresetError(
            f"{directory!r} is not a preset directory (no config.json); save one with "
            "model.save_to_preset(directory) or pass the model itself"
        )
    return _upload(directory, repo_id, revision, token, private, commit_message)


def _upload(directory, repo_id, revision, token, private, commit_message):
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(endpoint=_hub_settings()["endpoint"], token=token, library_name="kbert")
    api.create_repo(repo_id, private=private, exist_ok=True)
    files = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [
            os.path.relpath(os.path.join(root, n), directory)
            for n in sorted(names)
            if not n.startswith(".")
        ]
    # create_commit with the files listed, not upload_folder: only these
    # files change, and nothing else in the repository is deleted.
    info = api.create_commit(
        repo_id,
        operations=[
            CommitOperationAdd(
                path_in_repo=f.replace(os.sep, "/"), path_or_fileobj=os.path.join(directory, f)
            )
            for f in files
        ],
        commit_message=commit_message or "Upload kbert preset",
        revision=revision,
    )
    return f"{SCHEME}{repo_id}@{info.oid}"
