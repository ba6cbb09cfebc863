"""Optimizer and schedule, resumable training, distribution helpers."""

from kbert.training.callbacks import NonFiniteLossError, ResumableCheckpoint
from kbert.training.distribution import (
    ENGINES,
    distribution_scope,
    process_count,
    process_index,
)
from kbert.training.loop import fit_resumable, latest_checkpoint, restore_checkpoint
from kbert.training.optimizer import WarmupLinearDecay, create_optimizer

__all__ = [
    "ENGINES",
    "NonFiniteLossError",
    "ResumableCheckpoint",
    "WarmupLinearDecay",
    "create_optimizer",
    "distribution_scope",
    "fit_resumable",
    "latest_checkpoint",
    "process_count",
    "process_index",
    "restore_checkpoint",
]
