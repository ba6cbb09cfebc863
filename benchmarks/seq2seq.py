"""BERT for sequence generation: WikiSplit quality and `generate` speed,
kbert against transformers' EncoderDecoderModel on the same weights.

    # quality: each system x seed through examples/seq2seq.py, plus transformers'
    # BERT2BERT with the same recipe; means and spread of SARI, BLEU, exact match
    KERAS_BACKEND=jax python benchmarks/seq2seq.py quality --seeds 0 1 2 --transformers
    # speed: a random BERT-base-sized bert2bert, batch 64, 64-token sources,
    # 64 new tokens, greedy and 4 beams; then fine-tuning steps
    KERAS_BACKEND=jax python benchmarks/seq2seq.py speed --dtype bfloat16
    # the same at a tiny size, to check the script on a CPU
    python benchmarks/seq2seq.py speed --size tiny

Writes one JSON (`--output`). Speed: each call timed after a first call
that compiles (reported separately), the best of `--repeats`; transformers
runs on torch (CUDA when present) in eval mode with its cache, the same
weights exported by kbert. Fine-tuning: seconds per step of kbert's `fit`
(the difference of a fit of 3 x `--train-steps` steps and one of
`--train-steps`, after a first fit that compiles) against a plain
transformers training loop (eager, AdamW) on the same batches; with
`--dtype bfloat16` transformers trains both with bfloat16 weights (as it
ran `generate`) and as `Trainer(bf16=True)` does (float32 weights under
`torch.autocast`), kbert in `mixed_bfloat16` (float32 weights).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

BASE = dict(
    vocabulary_size=30522,
    num_layers=12,
    num_heads=12,
    hidden_dim=768,
    intermediate_dim=3072,
    max_sequence_length=512,
)
MINILM = dict(BASE, num_layers=6, num_heads=12, hidden_dim=384, intermediate_dim=1536)
TINY = dict(
    vocabulary_size=120,
    num_layers=1,
    num_heads=2,
    hidden_dim=16,
    intermediate_dim=32,
    max_sequence_length=160,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="mode", required=True)
    q = sub.add_parser("quality")
    q.add_argument(
        "--systems", nargs="*", default=["rnd2rnd", "bert2rnd", "bert2bert", "shared", "unilm"]
    )
    q.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    q.add_argument("--transformers", action="store_true", help="add transformers' BERT2BERT")
    q.add_argument("--example-args", default="", help="extra flags for examples/seq2seq.py")
    s = sub.add_parser("speed")
    s.add_argument(
        "--size", default="base", choices=["base", "minilm", "tiny"], help="tiny: to check on a CPU"
    )
    s.add_argument("--batch-size", type=int, default=64)
    s.add_argument("--source-length", type=int, default=64)
    s.add_argument("--new-tokens", type=int, default=64)
    s.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--train-steps", type=int, default=20)
    s.add_argument(
        "--check-every",
        type=int,
        default=None,
        help="torch: steps queued on the GPU past the one whose end-of-loop flag is read",
    )
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


def _spread(values):
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "values": values,
    }


def transformers_bert2bert(example, args, seed):
    """transformers' EncoderDecoderModel (BERT2BERT from the preset), trained
    and decoded with the example's recipe; the example's scoring."""
    import torch
    import transformers

    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = transformers.BertTokenizer.from_pretrained(args.preset)
    model = transformers.EncoderDecoderModel.from_encoder_decoder_pretrained(
        args.preset, args.preset
    ).to(device, torch.float32)
    for config in (model.config, model.generation_config):
        config.decoder_start_token_id = tokenizer.cls_token_id
        config.eos_token_id = tokenizer.sep_token_id
        config.pad_token_id = tokenizer.pad_token_id
    train = example.read_wikisplit(os.path.join(args.data_dir, "tune.tsv"), args.max_train_examples)
    held = example.read_wikisplit(
        os.path.join(args.data_dir, "validation.tsv"), args.max_eval_examples
    )
    steps = args.epochs * -(-len(train[0]) // args.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, steps // 10, steps)
    rng = np.random.default_rng(seed)
    model.train()
    start = time.perf_counter()
    epoch_losses = []
    for _ in range(args.epochs):
        losses = []
        order = rng.permutation(len(train[0]))
        for i in range(0, len(order), args.batch_size):
            rows = order[i : i + args.batch_size]
            src = tokenizer(
                [train[0][r] for r in rows],
                max_length=args.source_length,
                truncation=True,
                padding=True,
                return_tensors="pt",
            ).to(device)
            tgt = tokenizer(
                [train[1][r] for r in rows],
                max_length=args.target_length,
                truncation=True,
                padding=True,
                return_tensors="pt",
            ).to(device)
            labels = tgt.input_ids[:, 1:].clone()  # BERT ids [CLS] t [SEP] -> t [SEP]
            labels[tgt.attention_mask[:, 1:] == 0] = -100
            loss = model(
                input_ids=src.input_ids,
                attention_mask=src.attention_mask,
                decoder_input_ids=tgt.input_ids[:, :-1],
                decoder_attention_mask=tgt.attention_mask[:, :-1],
                labels=labels,
            ).loss
            losses.append(float(loss))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        epoch_losses.append(round(statistics.fmean(losses), 4))
    train_seconds = time.perf_counter() - start
    model.eval()
    outputs = []
    for i in range(0, len(held[0]), args.eval_batch_size):
        src = tokenizer(
            held[0][i : i + args.eval_batch_size],
            max_length=args.source_length,
            truncation=True,
            padding=True,
            return_tensors="pt",
        ).to(device)
        with torch.no_grad():
            ids = model.generate(**src, max_length=args.target_length, num_beams=args.num_beams)
        outputs += tokenizer.batch_decode(ids, skip_special_tokens=True)
    import kbert  # the example's scoring: kbert's tokenizer

    words = kbert.BertPreprocessor.from_directory(args.preset).tokenizer
    outputs = example.normalise(words, outputs)
    return {
        "system": "transformers-bert2bert",
        "seed": seed,
        "train_seconds": round(train_seconds, 2),
        "epoch_losses": epoch_losses,
        **example.score(words, held[0], outputs, held[1]),
    }


def quality(args):
    import seq2seq as example

    runs = []
    for system in args.systems:
        for seed in args.seeds:
            flags = ["--system", system, "--seed", str(seed), "--verbose", "0"]
            flags += args.example_args.split()
            result = example.run(example.parse_args(flags))
            result.pop("examples")
            runs.append(result)
            print(json.dumps(result), flush=True)
    if args.transformers:
        base = example.parse_args(args.example_args.split())
        for seed in args.seeds:
            runs.append(transformers_bert2bert(example, base, seed))
            print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for system in {r["system"] for r in runs}:
        mine = [r for r in runs if r["system"] == system]
        summary[system] = {
            m: _spread([r[m] for r in mine]) for m in ("sari", "bleu", "exact_match")
        }
    return {"runs": runs, "summary": summary}


def _timed(fn, repeats):
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return first, best


def transformers_generator(model, x, bfloat16):
    """transformers' `EncoderDecoderModel` on `model`'s weights (exported to
    a temporary directory; bf16 weights with `bfloat16`), in eval mode on
    CUDA when present, and `generate(max_length, num_beams)` of the
    sources `x` with it (its cache; ended by a device sync). Returns
    (model, directory, device, generate)."""
    import torch
    import transformers

    from kbert.convert.huggingface import export_to_huggingface

    directory = tempfile.mkdtemp()
    export_to_huggingface(model, directory)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = transformers.EncoderDecoderModel.from_pretrained(directory).to(device).eval()
    if bfloat16:
        hf = hf.to(torch.bfloat16)
    hf_x = {
        name: torch.tensor(x[key], dtype=torch.long, device=device)
        for name, key in (
            ("input_ids", "encoder_token_ids"),
            ("attention_mask", "encoder_padding_mask"),
        )
    }

    def generate(max_length, num_beams):
        with torch.no_grad():
            out = hf.generate(
                **hf_x,
                max_length=max_length,
                num_beams=num_beams,
                decoder_start_token_id=2,
                eos_token_id=3,
                pad_token_id=0,
            )
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    return hf, directory, device, generate


def speed(args):
    import keras
    import torch
    import transformers

    import kbert
    from kbert.generation.runner import decoding_path, decoding_stats

    if args.check_every and keras.backend.backend() == "torch":
        from kbert.backend import torch_decoding

        torch_decoding.CHECK_EVERY = args.check_every

    sizes = {"base": BASE, "minilm": MINILM, "tiny": TINY}[args.size]
    keras.utils.set_random_seed(0)
    dtype = "mixed_bfloat16" if args.dtype == "bfloat16" else "float32"
    backbone = kbert.BertBackbone(**sizes, dropout=0.0, attention_dropout=0.0, dtype=dtype)
    model = kbert.BertSeq2SeqLM(backbone, start_token_id=2, end_token_id=3)
    rng = np.random.default_rng(0)
    batch, length = args.batch_size, args.source_length
    # random sources; both libraries stop where the same rows end (same weights)
    x = {
        "encoder_token_ids": rng.integers(5, sizes["vocabulary_size"], (batch, length)).astype(
            "int32"
        ),
        "encoder_padding_mask": np.ones((batch, length), "int32"),
    }
    max_length = args.new_tokens + 1
    result = {
        "backend": keras.backend.backend(),
        "sizes": sizes,
        "batch": batch,
        "source_length": length,
        "new_tokens": args.new_tokens,
        "dtype": args.dtype,
    }

    hf, directory, device, theirs_generate = transformers_generator(
        model, x, args.dtype == "bfloat16"
    )
    for beams in (1, 4):

        def ours():
            return model.generate(x, max_length=max_length, num_beams=beams)

        def theirs():
            return theirs_generate(max_length, beams)

        first, best = _timed(ours, args.repeats)
        hf_first, hf_best = _timed(theirs, args.repeats)
        ids = ours()
        tokens = batch * (ids.shape[1] - 1)  # rows all ended: the loop stopped early
        result[f"generate_beams{beams}"] = {
            "output_length": int(ids.shape[1]),
            "kbert_first_s": round(first, 3),
            "kbert_s": round(best, 3),
            "kbert_new_tokens_per_s": round(tokens / best),
            "transformers_first_s": round(hf_first, 3),
            "transformers_s": round(hf_best, 3),
            "transformers_new_tokens_per_s": round(tokens / hf_best),
            "speedup": round(hf_best / best, 2),
            "same_ids": bool(np.array_equal(ids, theirs().cpu().numpy())),
            "decoding_path": decoding_path(model)[0],
        }
        print(json.dumps({f"generate_beams{beams}": result[f"generate_beams{beams}"]}), flush=True)
    result["decoding_path"] = decoding_path(model)[0]
    result["decoding_stats"] = decoding_stats(model)  # torch: replays, eager steps, captures

    # fine-tuning: seconds per step on the same batches
    targets = rng.integers(5, sizes["vocabulary_size"], (batch, args.new_tokens)).astype("int32")
    train_x = {**x, "decoder_token_ids": targets, "decoder_padding_mask": np.ones_like(targets)}
    labels = np.roll(targets, -1, axis=1)
    model.compile(learning_rate=5e-5)
    steps = args.train_steps

    def fit_seconds(n):
        data = {k: np.concatenate([v] * n) for k, v in train_x.items()}
        start = time.perf_counter()
        model.fit(data, np.concatenate([labels] * n), batch_size=batch, epochs=1, verbose=0)
        return time.perf_counter() - start

    fit_seconds(steps)  # compiles
    # a fit's own fixed cost (on torch: its eager warm-up steps and CUDA-graph
    # capture) cancels in the difference of a fit of 3n and one of n steps
    short = fit_seconds(steps)
    kbert_step = (fit_seconds(3 * steps) - short) / (2 * steps)
    t = {k: torch.tensor(v, dtype=torch.long, device=device) for k, v in train_x.items()}
    hf_labels = torch.tensor(labels, dtype=torch.long, device=device)

    def hf_step_seconds(hf_model, autocast):
        """transformers' eager AdamW step: `autocast` as Trainer(bf16=True)
        trains (float32 weights, bfloat16 products), else in the weights'
        own dtype."""
        hf_model.train()
        optimizer = torch.optim.AdamW(hf_model.parameters(), lr=5e-5)

        def step():
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                loss = hf_model(
                    input_ids=t["encoder_token_ids"],
                    attention_mask=t["encoder_padding_mask"],
                    decoder_input_ids=t["decoder_token_ids"],
                    decoder_attention_mask=t["decoder_padding_mask"],
                    labels=hf_labels,
                ).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        step()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(2 * steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / (2 * steps)

    fine_tuning = {"kbert_step_s": round(kbert_step, 4)}
    if args.dtype == "bfloat16":
        # bfloat16 weights (as `generate` ran), and Trainer's mixed precision
        fine_tuning["transformers_bf16_weights_step_s"] = round(hf_step_seconds(hf, False), 4)
        del hf
        hf32 = transformers.EncoderDecoderModel.from_pretrained(directory).to(device)
        fine_tuning["transformers_autocast_step_s"] = round(hf_step_seconds(hf32, True), 4)
        for key in ("transformers_bf16_weights_step_s", "transformers_autocast_step_s"):
            name = "speedup_vs_" + key.removeprefix("transformers_").removesuffix("_step_s")
            fine_tuning[name] = round(fine_tuning[key] / kbert_step, 2)
    else:
        fine_tuning["transformers_step_s"] = round(hf_step_seconds(hf, False), 4)
        fine_tuning["speedup"] = round(fine_tuning["transformers_step_s"] / kbert_step, 2)
    result["fine_tuning"] = fine_tuning
    print(json.dumps({"fine_tuning": result["fine_tuning"]}), flush=True)
    return result


def main(argv=None):
    args = parse_args(argv)
    result = quality(args) if args.mode == "quality" else speed(args)
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
