"""Fixtures of the example tests: no network, a tiny preset."""

import importlib
import socket

import pytest

from .helpers import VOCAB


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Connections leave this machine in no example test; `datasets` and the
    Hub client run offline (their cache and local files only)."""
    connect = socket.socket.connect

    def local_only(sock, address):
        host = address[0] if isinstance(address, tuple) else address
        if sock.family in (socket.AF_INET, socket.AF_INET6) and host not in (
            "127.0.0.1",
            "::1",
            "localhost",
        ):
            raise OSError(f"example tests must not reach the network (connect to {address})")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for module, name in (
        ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
        ("datasets.config", "HF_HUB_OFFLINE"),
    ):
        try:
            monkeypatch.setattr(importlib.import_module(module), name, True)
        except ImportError:
            pass


@pytest.fixture(scope="session")
def tiny_preset(tmp_path_factory):
    """A kbert preset directory: a random 1-layer, hidden-16 BERT and a
    71-token character vocabulary."""
    import kbert

    directory = str(tmp_path_factory.mktemp("tiny_preset"))
    backbone = kbert.BertBackbone(
        vocabulary_size=len(VOCAB),
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=128,
    )
    backbone.save_to_preset(directory)
    kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), 64).save_to_directory(directory)
    return directory
