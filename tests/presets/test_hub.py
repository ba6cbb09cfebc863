"""Hub handles (hf://org/name[@revision]) and publishing, against a Hub
stand-in on loopback (tests/presets/hub_server.py) that serves the routes
huggingface_hub downloads and commits through."""

import hashlib
import os
import pathlib

import numpy as np
import pytest
from huggingface_hub import constants as hub_constants

import kbert
from kbert.convert.huggingface import export_to_huggingface
from kbert.presets import PresetError, registry
from tests.harness import TINY
from tests.presets.hub_server import FakeHub

REPO = "kbert-test/tiny"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A running Hub stand-in, with huggingface_hub pointed at it and empty caches."""
    server = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("KBERT_CACHE", str(tmp_path / "kbert"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    yield server
    server.stop()


def read_tree(directory):
    return {
        os.path.relpath(os.path.join(root, n), directory): pathlib.Path(root, n).read_bytes()
        for root, _, names in os.walk(directory)
        for n in names
    }


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Two kbert presets of one tiny backbone, then a Hugging Face directory
    of it: (directory, files, weights) each."""
    model = kbert.BertBackbone(**TINY)
    out = []
    for version in ("old", "new"):
        directory = tmp_path_factory.mktemp(version)
        model.save_to_preset(directory)
        out.append((directory, read_tree(directory), model.get_weights()))
        model.set_weights([w + 1.0 for w in model.get_weights()])
    directory = tmp_path_factory.mktemp("huggingface")
    export_to_huggingface(model, directory)
    out.append((directory, read_tree(directory), model.get_weights()))
    return out


def same_weights(model, weights):
    got = model.get_weights()
    return len(got) == len(weights) and all(np.array_equal(a, b) for a, b in zip(got, weights))


def fetched(server):
    return {path.rsplit("/", 1)[-1] for method, path, _ in server.requests if method == "GET"}


def test_handle_downloads_pins_revision_and_works_offline_from_cache(hub, versions, monkeypatch):
    (_, old_files, old), (_, new_files, new), _ = versions
    first = hub.commit(REPO, old_files)
    # Files kbert never reads stay on the server: no README, no pickle.
    hub.commit(REPO, {**new_files, "README.md": b"# tiny"})
    hub.commit(REPO, {"pytorch_model.bin": b"not fetched without allow_pickle"})

    assert same_weights(kbert.BertBackbone.from_preset(f"hf://{REPO}"), new)
    assert {"config.json", "model.safetensors", "metadata.json"} <= fetched(hub)
    assert not {"README.md", "pytorch_model.bin"} & fetched(hub)
    assert same_weights(kbert.BertBackbone.from_preset(f"hf://{REPO}@{first}"), old)
    with_pickle = registry.download_preset(f"hf://{REPO}", allow_pickle=True)
    assert os.path.isfile(os.path.join(with_pickle, "pytorch_model.bin"))

    hub.stop()  # the cache answers with the server gone, and when offline
    assert same_weights(kbert.BertBackbone.from_preset(f"hf://{REPO}"), new)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert same_weights(kbert.BertBackbone.from_preset(f"hf://{REPO}@{first}"), old)


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "server-down"])
def test_uncached_handle_without_network_names_handle_and_remedy(hub, monkeypatch, offline):
    hub.commit(REPO, {"config.json": b"{}"})
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        why = "HF_HUB_OFFLINE is set"
    else:
        hub.stop()
        why = "could not be reached"
    with pytest.raises(OSError, match=rf"'hf://{REPO}'.*{why}.*pass their directory") as info:
        kbert.BertBackbone.from_preset(f"hf://{REPO}")
    assert not isinstance(info.value, PresetError)
    if offline:
        assert hub.requests == []


@pytest.mark.parametrize(
    "handle, message",
    [
        ("hf://", "does not name a repository"),
        ("hf://a/b/c", "does not name a repository"),
        (f"hf://{REPO}@", "empty revision"),
        ("hf://kbert-test/missing", "'kbert-test/missing'.*was not found.*HF_TOKEN"),
        (f"hf://{REPO}@v9", "has no revision 'v9'"),
        ("hf://kbert-test/not-bert", "no config.json"),
    ],
)
def test_bad_handles_name_the_problem(hub, handle, message):
    hub.commit(REPO, {"config.json": b"{}"})
    hub.commit("kbert-test/not-bert", {"README.md": b"# not a model"})
    with pytest.raises(PresetError, match=message):
        kbert.BertBackbone.from_preset(handle)


def test_any_huggingface_bert_repository_loads(hub, versions):
    _, files, weights = versions[2]
    hub.commit("google-like/bert-tiny", {**files, "flax_model.msgpack": b"not read"})
    assert same_weights(kbert.BertBackbone.from_preset("hf://google-like/bert-tiny"), weights)
    assert "flax_model.msgpack" not in fetched(hub)


def test_private_repository_needs_a_token(hub, versions, monkeypatch):
    _, files, weights = versions[0]
    hub.commit("me/private", files)
    hub.private["me/private"] = "hf_reader"
    with pytest.raises(PresetError, match="'me/private'.*not found.*HF_TOKEN"):
        kbert.BertBackbone.from_preset("hf://me/private")
    monkeypatch.setenv("HF_TOKEN", "hf_reader")
    assert same_weights(kbert.BertBackbone.from_preset("hf://me/private"), weights)


def test_registered_name_is_an_alias_and_checks_registry_checksums(hub, versions, monkeypatch):
    _, files, weights = versions[0]
    hub.commit(REPO, files)
    sha = hashlib.sha256(files["model.safetensors"]).hexdigest()
    entry = {"handle": f"hf://{REPO}", "description": "tiny", "sha256": {"model.safetensors": sha}}
    monkeypatch.setitem(registry.PRESETS, "tiny_test", entry)
    assert same_weights(kbert.BertBackbone.from_preset("tiny_test"), weights)

    bad = {**entry, "sha256": {"model.safetensors": "0" * 64}}
    monkeypatch.setitem(registry.PRESETS, "tiny_test", bad)
    with pytest.raises(PresetError, match="'tiny_test': model.safetensors does not match"):
        kbert.BertBackbone.from_preset("tiny_test")


def test_shipped_registry_entries_are_hub_handles():
    for name, spec in registry.PRESETS.items():
        repo_id, _ = registry.parse_handle(spec["handle"])
        assert repo_id.count("/") == 1, name


def test_upload_preset_publishes_a_task_or_a_directory(hub, versions):
    model = kbert.BertClassifier(kbert.BertBackbone(**TINY), num_classes=3)
    handle = registry.upload_preset(model, "hf://me/tiny-clf", token="hf_test", private=True)
    assert handle.startswith("hf://me/tiny-clf@")
    sent = [auth for method, _, auth in hub.requests if method == "POST"]
    assert sent and all(auth == "Bearer hf_test" for auth in sent)
    loaded = kbert.BertClassifier.from_preset(handle)
    assert loaded.num_classes == 3 and same_weights(loaded, model.get_weights())

    directory, _, weights = versions[0]
    handle = registry.upload_preset(directory, "hf://me/tiny", token="hf_test")
    assert same_weights(kbert.BertBackbone.from_preset(handle), weights)


def test_upload_refuses_a_directory_without_config_or_a_commit_target(tmp_path):
    with pytest.raises(PresetError, match="no config.json.*save_to_preset"):
        registry.upload_preset(tmp_path, "hf://me/x")
    with pytest.raises(PresetError, match="a commit is fixed.*name a branch"):
        registry.upload_preset(tmp_path, "hf://me/x@" + "a" * 40)
