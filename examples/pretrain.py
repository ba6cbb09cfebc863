"""Pre-train a BERT (masked LM + next sentence prediction) from raw text.

    KERAS_BACKEND=jax python examples/pretrain.py

With no arguments: trains a WordPiece vocabulary on the shipped corpus in
examples/data, creates MLM/NSP TFRecords, pre-trains a small BERT on the CPU
for a few minutes, reports held-out masked-LM and NSP accuracy, and saves a
`.keras` file, a preset and `curves.png` under runs/pretrain. Re-running the
same command resumes from the last checkpoint.

The program is `kbert.programs.pretrain`, the same one `kbert pretrain` runs:
vocabulary -> documents split into training and held-out -> TFRecords ->
`BertPreTrainer` -> `fit_resumable` with checkpoints -> held-out evaluation
-> `.keras`, preset and curves. `--help` lists every flag (sizes, corpus,
steps, precision, a second phase at a longer sequence length, several GPUs
or hosts).
"""

import os
import sys

from kbert.programs import pretrain

# WikiText-2 validation articles, The Adventures of Sherlock Holmes and
# tiny-shakespeare (sources and licences in examples/data/README.md).
CORPUS = pretrain.shipped_corpus(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))


def main(argv=None, prog=None):
    """Runs the program with the command-line arguments `argv`; returns the
    held-out results."""
    return pretrain.main(argv, prog=prog, default_corpus=CORPUS)


if __name__ == "__main__":
    main(sys.argv[1:])
