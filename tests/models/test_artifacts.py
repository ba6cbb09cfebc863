"""Every kind of model, compiled with kbert's optimizers and saved as a
`.keras` file, reloads in a fresh process that imports nothing but keras and
kbert (no `kbert.training`, no TensorFlow by hand), with its optimizer, and
computes the same outputs."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np

import kbert
from kbert.training import create_optimizer
from tests.harness import TINY

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + "a b c d e f g h".split()


def _models():
    def backbone():
        return kbert.BertBackbone(**{**TINY, "vocabulary_size": len(VOCAB)})

    def pre():
        return kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), sequence_length=8)

    plain = backbone()
    plain.compile(optimizer=create_optimizer(1e-4, 100, 10), loss="mse")
    models = {"BertBackbone": plain}
    tasks = [
        kbert.BertClassifier(backbone(), num_classes=3, preprocessor=pre()),
        kbert.BertTokenClassifier(backbone(), num_classes=4, preprocessor=pre()),
        kbert.BertQuestionAnswerer(backbone(), preprocessor=pre()),
        kbert.BertMultipleChoice(backbone(), num_choices=2, preprocessor=pre()),
        kbert.BertTextEmbedder(backbone(), preprocessor=pre()),
        kbert.BertPreTrainer(backbone(), preprocessor=pre()),
        kbert.BertMaskedLM(backbone(), preprocessor=pre()),
    ]
    for i, task in enumerate(tasks):
        # the task's default (kbert AdamW + warm-up schedule); LAMB for one
        task.compile(optimizer="lamb" if i == 0 else "adamw", num_train_steps=100)
        models[type(task).__name__] = task
    return models


def _inputs(model, rng):
    x = {}
    for name, tensor in model.input.items():
        shape = [2] + [d if d is not None else 8 for d in tensor.shape[1:]]
        if name == "mask_positions":
            x[name] = rng.integers(0, 8, shape).astype("int32")
        elif name == "token_ids":
            x[name] = rng.integers(1, len(VOCAB), shape).astype("int32")
        elif name == "padding_mask":
            x[name] = np.ones(shape, "int32")
        else:
            x[name] = np.zeros(shape, "int32")
    return x


def test_every_model_reloads_in_a_fresh_process_that_only_imports_kbert(tmp_path):
    rng = np.random.default_rng(0)
    expected = {}
    for name, model in _models().items():
        model.optimizer.build(model.trainable_variables)
        x = _inputs(model, rng)
        model.save(tmp_path / f"{name}.keras")
        np.savez(tmp_path / f"{name}-x.npz", **x)
        expected[name] = (
            keras.tree.flatten(keras.tree.map_structure(keras.ops.convert_to_numpy, model(x))),
            type(model.optimizer).__name__,
        )
    code = textwrap.dedent(
        f"""
        import json, sys
        import numpy as np, keras, kbert
        report = {{}}
        for name in {sorted(expected)!r}:
            model = keras.saving.load_model({str(tmp_path)!r} + f"/{{name}}.keras")
            x = dict(np.load({str(tmp_path)!r} + f"/{{name}}-x.npz"))
            y = keras.tree.flatten(keras.tree.map_structure(keras.ops.convert_to_numpy, model(x)))
            np.savez({str(tmp_path)!r} + f"/{{name}}-y.npz", *y)
            report[name] = [type(model).__name__, type(model.optimizer).__name__,
                            type(model.optimizer).__module__]
        print("REPORT", json.dumps(report))
        print("TF_IMPORTED", "tensorflow" in sys.modules)
        """
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    report = json.loads(lines["REPORT"])
    if keras.backend.backend() != "tensorflow":
        assert lines["TF_IMPORTED"] == "False"
    for name, (outputs, optimizer) in expected.items():
        loaded_class, loaded_optimizer, module = report[name]
        assert loaded_class == name
        assert loaded_optimizer == optimizer and module.startswith("kbert."), report[name]
        with np.load(tmp_path / f"{name}-y.npz") as got:
            got = [got[f"arr_{i}"] for i in range(len(got.files))]
        assert len(got) == len(outputs)
        for a, b in zip(got, outputs):
            np.testing.assert_allclose(a, b, atol=1e-6, err_msg=name)
