"""One process of a tiny `BertClassifier.fit` on raw strings, alone or as one
of the torch-ddp processes a launcher started (used by test_torch_ddp.py).

    python -m tests.training.ddp_fit_worker OUT.npz [--engine torch-ddp]

Nine sentences in global batches of 3, no shuffling, two epochs: under
torch-ddp process 0 trains on two rows of every batch and process 1 on one,
so the loss shares must weigh each process by its rows. Dropout is off (see
test_torch_ddp.py). Process 0 writes the final weights and the logged
losses and accuracies.
"""

import argparse
import os
import sys

import keras
import numpy as np

import kbert
from kbert.training import distribution_scope
from kbert.training.distribution import process_count, process_index
from tests.harness import TINY

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + (
    "the a movie was good bad great awful not plot actors film , . !".split()
)
TEXTS = [
    "the movie was good",
    "the film was awful , not good",
    "great actors !",
    "not good , bad plot",
    "a great film",
    "bad",
    "the plot was not bad , the actors were great",
    "awful movie",
    "good !",
]
LABELS = np.array([1, 0, 1, 0, 1, 0, 1, 0, 1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--engine", default="none")
    args = p.parse_args()
    keras.utils.set_random_seed(0)
    scope, _ = distribution_scope(args.engine)
    with scope:
        config = {**TINY, "vocabulary_size": len(VOCAB), "dropout": 0.0, "attention_dropout": 0.0}
        preprocessor = kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), sequence_length=16)
        model = kbert.BertClassifier(
            kbert.BertBackbone(**config), num_classes=2, preprocessor=preprocessor, dropout=0.0
        )
        model.compile(learning_rate=1e-3)
    history = model.fit(TEXTS, LABELS, batch_size=3, epochs=2, shuffle=False, verbose=0).history
    if process_index() == 0:
        np.savez(
            args.out,
            *[keras.ops.convert_to_numpy(v) for v in model.weights],
            loss=np.asarray(history["loss"]),
            accuracy=np.asarray(history["accuracy"]),
            processes=process_count(),
        )
    if args.engine == "torch-ddp":
        import torch.distributed as dist

        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's slow teardown, not under test


if __name__ == "__main__":
    main()
