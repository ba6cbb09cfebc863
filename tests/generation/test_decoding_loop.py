"""The decode loop as each backend runs it (`kbert.backend.decoding`):
compiled on JAX/TensorFlow, one static-shape step per token on torch
(replayed as a CUDA graph on a GPU; here the same capture-and-replay logic
emulated on the CPU), against the plain Keras `while_loop` run eagerly."""

import keras
import numpy as np
import pytest

import kbert
from kbert.backend import decoding
from kbert.generation import beam, runner, search

OPTIONS = [
    dict(),
    dict(num_beams=3),
    dict(num_beams=2, length_penalty=0.5, early_stopping=True),
    dict(do_sample=True, seed=4, top_k=5, top_p=0.9, temperature=0.8),
]


def tiny(architecture, seed=0, dtype=None):
    keras.utils.set_random_seed(seed)
    backbone = kbert.BertBackbone(
        vocabulary_size=41,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=24,
        max_sequence_length=32,
        initializer_range=0.3,
        dtype=dtype,
    )
    model = kbert.BertSeq2SeqLM.from_backbone(
        backbone, architecture, start_token_id=2, end_token_id=3
    )
    bias = np.array(keras.ops.convert_to_numpy(model.lm_head.output_bias))
    bias[3] += 1.0  # rows that end at different steps
    model.lm_head.output_bias.assign(bias)
    return model


def sources(batch=4, length=7, seed=1):
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, length), "int32")
    for row in range(1, batch):
        mask[row, length - row :] = 0
    ids = (rng.integers(4, 41, (batch, length)) * mask).astype("int32")
    return {"encoder_token_ids": ids, "encoder_padding_mask": mask}


def plain_loop(cond, body, state, constants, max_iterations):
    """The loop as Keras runs it: `while_loop`, `cond` read before each step."""
    return keras.ops.while_loop(
        lambda *s: cond(*s), lambda *s: tuple(body(constants, *s)), tuple(state)
    )


def reference(model, x, monkeypatch, **options):
    """Ids from the plain Keras loop run eagerly (no compiled program)."""
    with monkeypatch.context() as m:
        m.setattr(search, "decode_loop", plain_loop)
        m.setattr(beam, "decode_loop", plain_loop)
        m.setattr(runner, "compile_decoding", lambda fn, variables, casts=None: (fn, "reference"))
        m.setattr(runner, "_PROGRAMS", type(runner._PROGRAMS)())
        return model.generate(x, max_length=9, **options)


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """On torch: the CUDA-graph logic emulated on the CPU, the end read
    three steps late."""
    if keras.backend.backend() == "torch":
        from kbert.backend import torch_decoding

        monkeypatch.setattr(decoding, "EMULATE_GRAPHS_ON_CPU", True)
        monkeypatch.setattr(torch_decoding, "CHECK_EVERY", 3)


@pytest.mark.parametrize("architecture", ["bert2bert", "unilm"])
def test_compiled_loop_gives_the_plain_loops_ids(architecture, monkeypatch, graphs_on_cpu):
    torch = keras.backend.backend() == "torch"
    if not torch and architecture == "unilm":
        pytest.skip("the compiled programs of JAX/TensorFlow: one architecture is enough")
    model = tiny(architecture)
    x = sources()
    # JAX/TensorFlow: their beam and sampling programs are checked against
    # transformers in tests/models/test_seq2seq.py
    options_list = OPTIONS if torch else OPTIONS[:1]
    early = []  # rows that ended before others
    for options in options_list:
        expected = reference(model, x, monkeypatch, **options)
        early.append(bool((expected[:, 1:-1] == 3).any()))
        ids = model.generate(x, max_length=9, **options)
        np.testing.assert_array_equal(ids, expected, err_msg=str(options))
        if not torch:
            continue
        # again: the captured step replayed from the first token
        np.testing.assert_array_equal(model.generate(x, max_length=9, **options), expected)
        # another batch shape: another capture (sampling noise follows the
        # row's place in its batch, so each is compared with its reference)
        np.testing.assert_array_equal(
            model.generate(x, max_length=9, batch_size=3, **options),
            reference(model, x, monkeypatch, batch_size=3, **options),
        )
    paths, programs = runner.decoding_path(model)
    assert programs == len(options_list)
    expected_path = {
        "jax": "jax.jit",
        "tensorflow": "tf.function",
        "torch": "torch-cuda-graph (emulated)",
    }[keras.backend.backend()]
    assert paths == [expected_path]
    if torch:  # steps past a row's end, and past the loop's end, ran and changed nothing
        assert any(early)
        stats = [path.stats() for _, path in runner._PROGRAMS[model].values()]
        assert all(s["graphs"] >= 2 and s["replays"] > 0 for s in stats), stats


def test_torch_decoding_casts_each_mixed_precision_weight_once(monkeypatch, graphs_on_cpu):
    """On torch, a mixed-precision model's weights are cast once for all
    decoding steps (kept copies, the same values as Keras' casts): the
    ids are the plain loop's, and after the weights change, the new
    weights'."""
    if keras.backend.backend() != "torch":
        pytest.skip("torch only: compiled programs cast each weight once")
    import torch

    model = tiny("bert2bert", dtype="mixed_bfloat16")
    x = sources()
    for options in (dict(), dict(num_beams=2)):
        expected = reference(model, x, monkeypatch, **options)
        np.testing.assert_array_equal(model.generate(x, max_length=9, **options), expected)
    casts = runner._CASTS[model]
    before = {key: entry[1].clone() for key, entry in casts.copies.items()}
    assert len(before) > 10  # the decoder's and encoder's float weights, in bfloat16
    assert all(copy.dtype == torch.bfloat16 for copy in before.values())

    kernel = model.decoder_blocks[0].output_dense.kernel
    kernel.assign(-keras.ops.convert_to_numpy(kernel))
    for options in (dict(), dict(num_beams=2)):
        expected = reference(model, x, monkeypatch, **options)
        np.testing.assert_array_equal(model.generate(x, max_length=9, **options), expected)
    changed = [key for key, entry in casts.copies.items() if not torch.equal(entry[1], before[key])]
    assert len(changed) == 1  # the kernel's copy, recast in place
    np.testing.assert_array_equal(
        casts.copies[changed[0]][1].float().numpy(),
        keras.ops.convert_to_numpy(keras.ops.cast(kernel.value, "bfloat16")).astype("float32"),
    )


def test_torch_step_without_graphs_is_eager():
    if keras.backend.backend() != "torch":
        pytest.skip("torch only")
    model = tiny("bert2bert")
    model.generate(sources(), max_length=5)
    assert runner.decoding_path(model) == (["eager"], 1)


def test_torch_step_reads_nothing_back_from_the_device(monkeypatch):
    """No `.item()`, `bool()` or data-dependent shape inside the step: each
    would wait for the GPU, and break a CUDA-graph capture."""
    if keras.backend.backend() != "torch":
        pytest.skip("torch only")
    from torch.utils._python_dispatch import TorchDispatchMode

    from kbert.backend import torch_decoding

    reads = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(n in str(func) for n in ("_local_scalar_dense", "nonzero", "masked_select")):
                reads.append(str(func))
            return func(*args, **(kwargs or {}))

    guarded = torch_decoding._guarded

    def watched(cond, body):
        step = guarded(cond, body)

        def run(constants, state):
            with Reads():
                return step(constants, state)

        return run

    monkeypatch.setattr(torch_decoding, "_guarded", watched)
    for architecture in ("bert2bert", "unilm"):
        model = tiny(architecture)
        for options in OPTIONS:
            model.generate(sources(), max_length=5, **options)
    assert reads == []


def test_torch_capture_failure_warns_and_goes_on_eagerly(monkeypatch, graphs_on_cpu):
    if keras.backend.backend() != "torch":
        pytest.skip("torch only")
    from kbert.backend import torch_decoding

    model = tiny("bert2bert")
    x = sources()
    expected = reference(model, x, monkeypatch, num_beams=2)
    write = torch_decoding.cache_write

    def failing(cache, index, values):
        if torch_decoding.is_capturing():
            raise RuntimeError("operation not permitted when stream is capturing")
        return write(cache, index, values)

    monkeypatch.setattr(torch_decoding, "cache_write", failing)
    with pytest.warns(UserWarning, match="could not be captured.*goes on eagerly"):
        ids = model.generate(x, max_length=9, num_beams=2)
    np.testing.assert_array_equal(ids, expected)
    np.testing.assert_array_equal(model.generate(x, max_length=9, num_beams=2), expected)
    assert runner.decoding_path(model) == (["eager"], 1)
