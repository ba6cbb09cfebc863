"""Exported models run without kbert and give `model.predict`'s outputs.

Each test exports on the current backend, then one fresh Python process
(isolated mode, outside the repository, with kbert made
unimportable) loads every artifact with `tf.saved_model.load` or
`onnxruntime.InferenceSession` and writes its outputs back.
"""

import csv
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import kbert
import kbert_cli
from kbert.export import export_model, export_text_model
from tests.tokenizers.reference import data_dir

pytest.importorskip("tensorflow")
pytest.importorskip("tensorflow_text")
pytest.importorskip("onnxruntime")
pytest.importorskip("tf2onnx")

BACKEND = keras.backend.backend()
SAVED_MODEL = BACKEND in ("tensorflow", "jax")
LETTERS = "abcdefghijklmnopqrstuvwxyz"
VOCAB = (
    ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    + list(LETTERS)
    + ["##" + c for c in LETTERS]
    + list(".,!?'-\"")
    + ["the", "中", "文"]
)

LOADER = r"""
import importlib.abc, json, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "kbert":
            raise ImportError(f"{name} is not importable here")

sys.meta_path.insert(0, Blocked())
try:
    import kbert  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("kbert is importable")

import numpy as np

outputs = {}
for job in json.load(open("jobs.json")):
    inputs = dict(np.load(job["inputs"]))
    if job["kind"] == "onnx":
        import onnxruntime
        session = onnxruntime.InferenceSession(job["path"], providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        feed = {i.name: inputs[i.name] for i in session.get_inputs()}
        result = dict(zip(names, session.run(None, feed)))
    else:
        import tensorflow as tf
        import tensorflow_text  # noqa: F401  (the tokenizer's ops)
        loaded = tf.saved_model.load(job["path"])
        endpoint = getattr(loaded, job.get("endpoint", "serve"))
        if job["kind"] == "text":
            args = [tf.constant([s.decode() for s in inputs[n]]) for n in job["args"]]
            result = endpoint(*args)
        else:
            result = endpoint({k: tf.constant(v) for k, v in inputs.items()})
        result = result if isinstance(result, dict) else {"output_0": result}
        result = {k: v.numpy() for k, v in result.items()}
    for name, value in result.items():
        outputs[job["id"] + "/" + name] = value
np.savez("outputs.npz", **outputs)
"""


def run_without_kbert(jobs, directory):
    """Runs LOADER on `jobs` in a fresh isolated process; {id/output: array}."""
    with open(os.path.join(directory, "jobs.json"), "w") as f:
        json.dump(jobs, f)
    with open(os.path.join(directory, "loader.py"), "w") as f:
        f.write(LOADER)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KERAS_BACKEND")}
    result = subprocess.run(
        [sys.executable, "-I", "loader.py"],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(np.load(os.path.join(directory, "outputs.npz")))


def model_inputs(batch, length, seed, choices=None):
    rng = np.random.default_rng(seed)
    shape = (batch, length) if choices is None else (batch, choices, length)
    mask = np.ones(shape, "int32")
    mask[..., length - 2 :] = 0
    mask[0, ..., 3:] = 0
    return {
        "token_ids": rng.integers(0, len(VOCAB), shape).astype("int32") * mask,
        "segment_ids": (rng.integers(0, 2, shape) * mask).astype("int32"),
        "padding_mask": mask,
    }


def backbone(**kwargs):
    return kbert.BertBackbone(len(VOCAB), 2, 2, 16, 32, max_sequence_length=32, **kwargs)


def as_dict(outputs):
    return outputs if isinstance(outputs, dict) else {"output_0": outputs}


@pytest.mark.large
def test_exported_models_match_predict(tmp_path):
    """ONNX (every backend; the classifier through `kbert export` from a
    .keras file) and SavedModel (TensorFlow, JAX): fp32 outputs within 1e-4
    and 1e-5 of `predict` at two batch sizes and sequence lengths."""
    classifier = kbert.BertClassifier(backbone(), num_classes=3)
    answerer = kbert.BertQuestionAnswerer(backbone())
    classifier.save(str(tmp_path / "classifier.keras"))
    code = kbert_cli.main(
        ["export", str(tmp_path / "classifier.keras"), str(tmp_path / "cls"), "--format", "onnx"]
    )
    assert code == 0 and os.path.isfile(tmp_path / "cls" / "model.onnx")
    export_model(answerer, str(tmp_path / "qa.onnx"), format="onnx", verbose=False)
    artifacts = [("cls_onnx", classifier, "onnx", str(tmp_path / "cls" / "model.onnx"), 1e-4)]
    artifacts.append(("qa_onnx", answerer, "onnx", str(tmp_path / "qa.onnx"), 1e-4))
    if SAVED_MODEL:
        export_model(answerer, str(tmp_path / "qa_sm"), format="tf_saved_model", verbose=False)
        artifacts.append(("qa_sm", answerer, "saved_model", str(tmp_path / "qa_sm"), 1e-5))
    jobs, expected = [], {}
    for batch, length in [(2, 7), (3, 12)]:
        x = model_inputs(batch, length, seed=length)
        np.savez(tmp_path / f"x{length}.npz", **x)
        for name, model, kind, path, tolerance in artifacts:
            job = f"{name}_{length}"
            jobs.append({"id": job, "kind": kind, "path": path, "inputs": f"x{length}.npz"})
            for key, value in as_dict(model.predict(x, verbose=0)).items():
                expected[f"{job}/{key}"] = (np.asarray(value), tolerance)
    got = run_without_kbert(jobs, str(tmp_path))
    for key, (value, tolerance) in expected.items():
        assert key in got, f"{key} missing from {sorted(got)}"
        assert got[key].shape == value.shape, key
        np.testing.assert_allclose(got[key], value, atol=tolerance, rtol=0, err_msg=key)


@pytest.mark.large
def test_pre_trainer_onnx_matches_predict_at_other_sizes(tmp_path):
    """`BertPreTrainer` to ONNX on every backend (torch: `torch.export`,
    which kept batch, tokens and masked positions dynamic only once the MLM
    head gathered with `torch.gather`): MLM and NSP logits within 1e-4 of
    `predict` at two batch sizes, sequence lengths and position counts,
    none of them the export's example sizes."""
    model = kbert.BertPreTrainer(backbone())
    path = str(tmp_path / "pre_trainer.onnx")
    export_model(model, path, format="onnx", verbose=False)
    jobs, expected = [], {}
    for batch, length, predictions in [(3, 12, 5), (1, 20, 2)]:
        x = model_inputs(batch, length, seed=length)
        rng = np.random.default_rng(predictions)
        real = x["padding_mask"].sum(-1, keepdims=True)  # masked positions hold real tokens
        x["mask_positions"] = rng.integers(0, real, (batch, predictions)).astype("int32")
        np.savez(tmp_path / f"x{length}.npz", **x)
        job = f"pre_trainer_{length}"
        jobs.append({"id": job, "kind": "onnx", "path": path, "inputs": f"x{length}.npz"})
        for key, value in model.predict(x, verbose=0).items():
            expected[f"{job}/{key}"] = np.asarray(value)
    got = run_without_kbert(jobs, str(tmp_path))
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key].shape == value.shape, key
        np.testing.assert_allclose(got[key], value, atol=1e-4, rtol=0, err_msg=key)


def _real_texts():
    """Sentences from ../shared/data (or stand-ins) and the hard cases."""
    texts = ["A gripping, funny film.", "the cat sat on the mat"]
    root = data_dir()
    if root is not None:
        with open(os.path.join(root, "glue", "SST-2", "dev.tsv"), encoding="utf-8") as f:
            texts = [r[0] for r in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)][1:4]
        with open(os.path.join(root, "conll2003", "eng.testa"), encoding="utf-8") as f:
            words = [line.split(" ")[0] for line in f.read().split("\n\n")[1].splitlines()]
        texts.append(" ".join(words))
    ten_kb = ("Élan vital, naïve café! " * 500)[:10240]
    return texts + ["", "😀 great 👍🏽", "中文 text 日本語", ten_kb]


@pytest.mark.large
def test_text_model_matches_predict_on_raw_strings(tmp_path):
    """Raw strings in: the SavedModel equals `predict(texts)` (classifier,
    embedder, tagger, question answerer on TensorFlow; the classifier from
    JAX and torch, exported through a TensorFlow-backend process, with
    KBERT_EXPORT_ALL_BACKENDS=1). CI runs it on TensorFlow only: the other
    backends hand their weights to the same TensorFlow-process path, which
    `test_exported_models_match_predict` runs from JAX."""
    if BACKEND != "tensorflow" and not os.environ.get("KBERT_EXPORT_ALL_BACKENDS"):
        pytest.skip("the text model is a TensorFlow graph: run on TensorFlow in CI")
    preprocessor = kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), sequence_length=24)
    texts = _real_texts()
    questions = ["who?", "", "what is it", "q", "why " * 30, "x", "a b", "中"][: len(texts)]
    np.savez(tmp_path / "texts.npz", texts=np.array([t.encode() for t in texts], dtype=bytes))
    np.savez(
        tmp_path / "qa.npz",
        questions=np.array([q.encode() for q in questions], dtype=bytes),
        contexts=np.array([t.encode() for t in texts], dtype=bytes),
    )
    jobs, expected = [], {}
    models = {"classifier": kbert.BertClassifier(backbone(), 3, preprocessor=preprocessor)}
    if BACKEND == "tensorflow":
        models["embedder"] = kbert.BertTextEmbedder(backbone(), preprocessor=preprocessor)
        models["tagger"] = kbert.BertTokenClassifier(backbone(), 3, preprocessor=preprocessor)
        models["qa"] = kbert.BertQuestionAnswerer(backbone(), preprocessor=preprocessor)
    for name, model in models.items():
        path = str(tmp_path / name)
        export_text_model(model, path)
        if name == "qa":
            jobs.append(
                {
                    "id": name,
                    "kind": "text",
                    "path": path,
                    "inputs": "qa.npz",
                    "args": ["questions", "contexts"],
                }  # fmt: skip
            )
            reference = model.predict((questions, texts), verbose=0)
        else:
            jobs.append(
                {"id": name, "kind": "text", "path": path, "inputs": "texts.npz", "args": ["texts"]}
            )
            reference = as_dict(model.predict(texts, verbose=0))
        key = {"classifier": "logits", "embedder": "embeddings", "tagger": "logits"}
        if name in key:
            reference = {key[name]: reference["output_0"]}
        for output, value in reference.items():
            expected[f"{name}/{output}"] = np.asarray(value)
    got = run_without_kbert(jobs, str(tmp_path))
    real = np.asarray(preprocessor(texts)["padding_mask"]) > 0
    for key, value in expected.items():
        if key == "tagger/logits":  # per token: the padding positions carry no output
            got[key], value = got[key][real], value[real]
        np.testing.assert_allclose(got[key], value, atol=1e-5, rtol=0, err_msg=key)
    if BACKEND != "tensorflow":
        return
    tokenizer = preprocessor.tokenizer
    # The tagger's word index of each token: a word's tokens share it.
    word_ids = got["tagger/word_ids"]
    for row, text in enumerate(texts[:-1]):
        words = tokenizer.split_words(text)
        pieces = [len(tokenizer.tokenize(w)) for w in words]
        index = [w for w, n in enumerate(pieces) for _ in range(n)][:22]
        assert word_ids[row].tolist() == [-1] + index + [-1] * (23 - len(index)), text
    # The answerer's character spans are `tokenize_with_offsets`'.
    segments = preprocessor(questions, texts)["segment_ids"]
    for row, context in enumerate(texts):
        _, starts, ends = tokenizer.tokenize_with_offsets(context)
        inside = (segments[row] == 1) & (got["qa/token_starts"][row] >= 0)
        n = int(inside.sum())
        assert got["qa/token_starts"][row][inside].tolist() == starts[:n].tolist(), context
        assert got["qa/token_ends"][row][inside].tolist() == ends[:n].tolist(), context


@pytest.mark.large
def test_int8_classifier_onnx_matches_predict(tmp_path):
    """An int8-quantized classifier to ONNX on every backend (torch exports
    it from a TensorFlow-backend process: torch.export's graph of the
    on-the-fly input quantization does not load in ONNX Runtime): logits
    within 1e-4 of the quantized model's `predict`."""
    model = kbert.BertClassifier(backbone(), num_classes=3)
    model.quantize("int8")
    path = str(tmp_path / "int8.onnx")
    export_model(model, path, format="onnx", verbose=False)
    x = model_inputs(3, 12, seed=3)
    np.savez(tmp_path / "x.npz", **x)
    got = run_without_kbert(
        [{"id": "int8", "kind": "onnx", "path": path, "inputs": "x.npz"}], str(tmp_path)
    )
    np.testing.assert_allclose(
        got["int8/output_0"], np.asarray(model.predict(x, verbose=0)), atol=1e-4, rtol=0
    )


def test_errors_name_the_fix(tmp_path):
    model = kbert.BertClassifier(backbone(), 2)
    with pytest.raises(ValueError, match="no preprocessor.*attach one"):
        export_text_model(model, str(tmp_path / "a"))
    with pytest.raises(ValueError, match="takes a BertClassifier.*export_tokenizer_json"):
        export_text_model(backbone(), str(tmp_path / "b"))
    with pytest.raises(ValueError, match="format='saved'.*tf_saved_model"):
        export_model(model, str(tmp_path / "c"), format="saved")
    mixed = kbert.BertClassifier(backbone(dtype="mixed_bfloat16"), 2)
    with pytest.raises(ValueError, match="float32.*dtype='float32'"):
        export_model(mixed, str(tmp_path / "d.onnx"), format="onnx")
