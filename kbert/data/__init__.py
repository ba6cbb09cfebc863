"""Pre-training data: corpora, NSP/MLM instance creation, TFRecords, tf.data.

The tf.data parts import TensorFlow when first used, not on `import kbert`.
"""

from kbert.data.corpus import CorpusReport, read_documents
from kbert.data.finetuning import read_conll, read_glue, read_squad
from kbert.data.pretraining import InstanceMaker, MaskingConfig, tokenize_documents

_LAZY = {
    "pretraining_dataset": "kbert.data.tfrecords",
    "dynamic_pretraining_dataset": "kbert.data.tfrecords",
    "feature_spec": "kbert.data.tfrecords",
    "create_pretraining_data": "kbert.data.create",
    "check_directory": "kbert.data.check",
    "export_numpy": "kbert.data.numpy_io",
    "NumpyPretrainingData": "kbert.data.numpy_io",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kbert.data' has no attribute {name!r}")


__all__ = [
    "CorpusReport",
    "InstanceMaker",
    "MaskingConfig",
    "read_conll",
    "read_documents",
    "read_glue",
    "read_squad",
    "tokenize_documents",
    *_LAZY,
]
