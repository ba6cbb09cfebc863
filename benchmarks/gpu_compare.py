"""Two kbert source trees on one GPU, alternately, in one call: pre-training
throughput (`gpu_pretrain.py`'s measurement) and one SST-2 fine-tuning epoch
from raw text, with each figure's ratio HEAD / BASE.

    # here (git): lay out the trees to carry to the GPU machine (no git there)
    python benchmarks/gpu_compare.py --prepare a9716e8 .gpu/base
    python benchmarks/gpu_compare.py --prepare WORKTREE .gpu/head   # the files as they are
    # there: both trees, two rounds, every benchmark
    python benchmarks/gpu_compare.py .gpu/base .gpu/head --out $OUT/compare.json
    # one backend and config, three rounds, no fine-tuning
    python benchmarks/gpu_compare.py .gpu/base .gpu/head --configs base128 --backends jax \\
        --finetune none --rounds 3

A tree is `[NAME=]DIR[@MODULE.ATTR=VALUE...]`: DIR holds a kbert source
tree (`DIR/kbert`); the settings are applied in each of its processes after
`import kbert` (values read by `ast.literal_eval`), e.g.
`at=.gpu/main@kbert.backend.jax_compile.AUTOTUNE_MIN_STEPS=0`, to time a
variant of a tree without copying it. More than two trees may be given:
ratios are against the first (BASE); the last is HEAD.

Every run is a process of its own with `PYTHONPATH` set to its tree first,
and runs the measuring code of this directory (so both trees are measured
by the same code; it uses only the public API both must have). Within a
round each benchmark runs every tree before the next benchmark, the trees
in alternating order (reversed every other round). Each JAX run of a tree
uses a compilation cache of that tree's own (`KBERT_COMPILATION_CACHE`),
kept across rounds unless `--fresh-cache`: throughput is steady state, and
a second round then spends less of the call compiling.

Benchmarks:
    pretrain/<config>/<backend>   `gpu_pretrain.py`'s kbert variant
        `kbert-<backend>-drop0` (bf16, AdamW with a 10,000-step schedule):
        sequences/s over 2 x --steps steady-state steps, the whole fit of
        3 x --steps steps, the first fit (compilation and 2 executions),
        peak device memory
    finetune/sst2/<backend>       BERT-base (random weights) `fit(texts,
        labels)` of --sst2-examples SST-2 sentences (all 67,349 by default),
        batch 32, `compile(learning_rate=2e-5)`, every other argument the
        tree's default: sentences/s from raw text, compilation included

Prints a table of medians over the rounds and HEAD / BASE ratios, and writes
JSON (--out): every run, medians and ratios. Runs out of time or failing
are recorded with their error and the call goes on.
"""

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "shared", "data")


def prepare(rev, directory):
    """Lays out `rev`'s kbert/ and benchmarks/ in `directory` (emptied
    first): `git archive`, or for `WORKTREE` the working tree's files as
    they are (tracked and untracked, not ignored)."""
    import shutil

    root = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if os.path.isdir(directory):
        shutil.rmtree(directory)
    os.makedirs(directory)
    if rev == "WORKTREE":
        listed = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "kbert", "benchmarks"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        for path in listed:
            if "/results/" in path or not os.path.isfile(os.path.join(root, path)):
                continue
            target = os.path.join(directory, path)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(os.path.join(root, path), target)
    else:
        archive = subprocess.Popen(
            ["git", "archive", rev, "kbert", "benchmarks"], cwd=root, stdout=subprocess.PIPE
        )
        subprocess.run(["tar", "-x", "-C", directory], stdin=archive.stdout, check=True)
        if archive.wait():
            raise SystemExit(f"git archive {rev} failed")
        shutil.rmtree(os.path.join(directory, "benchmarks", "results"), ignore_errors=True)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD" if rev == "WORKTREE" else rev],
        cwd=root,
        capture_output=True,
        text=True,
    ).stdout.strip()
    with open(os.path.join(directory, "REVISION"), "w") as f:
        f.write(f"{rev} {head}\n")
    print(f"{directory}: {rev} ({head})")


def parse_tree(spec):
    """`[NAME=]DIR[@MODULE.ATTR=VALUE...]` -> {name, dir, settings}."""
    spec, *settings = spec.split("@")
    name, _, directory = spec.rpartition("=")
    directory = os.path.abspath(directory)
    if not os.path.isdir(os.path.join(directory, "kbert")):
        raise SystemExit(f"{directory} holds no kbert/ tree (lay one out with --prepare)")
    pairs = {}
    for item in filter(None, settings):
        target, _, value = item.partition("=")
        pairs[target] = ast.literal_eval(value)
    revision = os.path.join(directory, "REVISION")
    rev = open(revision).read().strip() if os.path.exists(revision) else None
    return {
        "name": name or os.path.basename(directory.rstrip("/")),
        "dir": directory,
        "settings": pairs,
        "revision": rev,
    }


def apply_settings(settings):
    import importlib

    for target, value in settings.items():
        module, _, attr = target.rpartition(".")
        module = importlib.import_module(module)
        if not hasattr(module, attr):
            raise AttributeError(f"{module.__name__} has no {attr} to set")
        setattr(module, attr, value)


def child_pretrain(args):
    import gpu_pretrain

    arch, t, b, p = gpu_pretrain.CONFIGS[args.config]
    variant = f"kbert-{args.backend}-drop0"
    result = gpu_pretrain.run_kbert(arch, t, b, p, variant, args.steps, args.spe)
    result["seq_per_s"] = result["sequences"] / result["seconds"]
    return result


def child_finetune(args):
    import gpu_finetune
    import keras

    import kbert

    keras.utils.set_random_seed(0)
    texts, labels = gpu_finetune.load("sst2", args.data_dir, args.sst2_examples)
    start = time.perf_counter()
    tokenizer = kbert.BertTokenizer(args.vocab, lowercase=True)
    preprocessor = kbert.BertPreprocessor(tokenizer, gpu_finetune.LENGTH)
    backbone = kbert.BertBackbone.from_architecture(
        args.architecture, vocabulary_size=30522, dtype="mixed_bfloat16"
    )
    model = kbert.BertClassifier(backbone, preprocessor=preprocessor, num_classes=2)
    model.compile(learning_rate=gpu_finetune.LR)
    built = time.perf_counter()
    history = model.fit(texts, labels, batch_size=gpu_finetune.BATCH, epochs=1, verbose=0)
    trained = time.perf_counter()
    result = gpu_finetune.fit_result(len(labels), start, built, trained)
    result["loss"] = float(history.history["loss"][-1])
    return result


def child(args):
    import kbert

    apply_settings(json.loads(args.settings))
    if args.child == "pretrain":
        result = child_pretrain(args)
    else:
        result = child_finetune(args)
    result["kbert_file"] = kbert.__file__
    print("RESULT " + json.dumps(result), flush=True)


# what each benchmark reports, the figure compared first
FIGURES = {
    "pretrain": ("seq_per_s", "whole_fit_seq_per_s", "first_fit_seconds", "peak_gib"),
    "finetune": ("fit_examples_per_second", "fit_seconds"),
}


def run_one(bench, tree, args, caches):
    kind, what, backend = bench
    env = dict(os.environ, KERAS_BACKEND=backend)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree["dir"], env.get("PYTHONPATH")]))
    for name in [k for k in env if k.startswith("JAX_COMPILATION_CACHE")]:
        del env[name]
    if backend == "jax":
        env["KBERT_COMPILATION_CACHE"] = caches.setdefault(
            tree["name"], tempfile.mkdtemp(prefix=f"xla-{tree['name']}-", dir=args.scratch)
        )
        if args.fresh_cache:
            env["KBERT_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="xla-", dir=args.scratch)
    command = [sys.executable, os.path.abspath(__file__), "--child", kind]
    command += ["--backend", backend, "--settings", json.dumps(tree["settings"])]
    if kind == "pretrain":
        command += ["--config", what, "--steps", str(args.steps), "--spe", str(args.spe)]
    else:
        command += ["--data-dir", args.data_dir, "--vocab", args.vocab]
        command += ["--architecture", args.architecture]
        if args.sst2_examples:
            command += ["--sst2-examples", str(args.sst2_examples)]
    begin = time.perf_counter()
    try:
        proc = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=args.timeout
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if lines:
            run = json.loads(lines[-1][7:])
        else:
            run = {"error": (proc.stderr or proc.stdout)[-2000:]}
    except subprocess.TimeoutExpired:
        run = {"error": f"timed out after {args.timeout} s"}
    run["process_seconds"] = time.perf_counter() - begin
    if kind == "pretrain" and "error" not in run:
        run["whole_fit_seq_per_s"] = run["whole_fit"]["seq_per_s"]
        run["peak_gib"] = (run.get("peak_bytes") or 0) / 2**30
    expected = os.path.join(tree["dir"], "kbert")
    if "kbert_file" in run and not run["kbert_file"].startswith(expected):
        run["error"] = f"imported {run['kbert_file']}, not the tree's {expected}"
    return run


def summarize(report, trees, benches):
    """Medians over rounds per (benchmark, tree) and ratios to the first tree."""
    base = trees[0]["name"]
    medians, ratios = {}, {}
    for bench in benches:
        key = "/".join(bench)
        figures = FIGURES[bench[0]]
        medians[key] = {}
        for tree in trees:
            runs = [r for r in report["runs"] if r["bench"] == key and r["tree"] == tree["name"]]
            good = [r for r in runs if "error" not in r]
            medians[key][tree["name"]] = {
                f: statistics.median([r[f] for r in good if r.get(f) is not None])
                for f in figures
                if any(r.get(f) is not None for r in good)
            }
            medians[key][tree["name"]]["runs"] = len(good)
        ratios[key] = {}
        for tree in trees[1:]:
            ratios[key][f"{tree['name']}/{base}"] = {
                f: medians[key][tree["name"]][f] / medians[key][base][f]
                for f in figures
                if medians[key][base].get(f) and f in medians[key][tree["name"]]
            }
    report["medians"], report["ratios"] = medians, ratios


def print_table(report, trees):
    base = trees[0]["name"]
    print(f"\n{'benchmark':28s} {'tree':14s} {'figure':26s} {'median':>10s} {'vs ' + base:>8s}")
    for key, by_tree in report["medians"].items():
        for tree in trees:
            values = by_tree[tree["name"]]
            for figure in FIGURES[key.split("/")[0]]:
                if figure not in values:
                    continue
                ratio = report["ratios"][key].get(f"{tree['name']}/{base}", {}).get(figure)
                shown = f"{ratio:8.3f}" if ratio else " " * 8
                print(f"{key:28s} {tree['name']:14s} {figure:26s} {values[figure]:10.2f} {shown}")
            if not values["runs"]:
                print(f"{key:28s} {tree['name']:14s} (no run succeeded)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "trees", nargs="*", help="BASE [HEAD ...]: [NAME=]DIR[@MODULE.ATTR=VALUE...]"
    )
    parser.add_argument("--prepare", nargs=2, metavar=("REV", "DIR"), help="lay out a tree here")
    parser.add_argument("--configs", nargs="*", default=["base128", "large128"])
    parser.add_argument("--backends", nargs="+", default=["jax", "torch"])
    parser.add_argument("--finetune", default="sst2", choices=["sst2", "none"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="gpu_pretrain.py --steps")
    parser.add_argument("--spe", type=int, default=10, help="steps_per_execution (JAX)")
    parser.add_argument("--sst2-examples", type=int, default=None, help="first N sentences")
    parser.add_argument("--architecture", default="bert_base", help="fine-tuning backbone")
    parser.add_argument("--data-dir", default=DATA, help="holding glue/SST-2/train.tsv")
    parser.add_argument("--vocab", default=None, help="uncased vocab.txt (default: MiniLM's)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per run")
    parser.add_argument("--fresh-cache", action="store_true", help="an empty XLA cache per run")
    parser.add_argument("--out", default="gpu_compare.json")
    parser.add_argument("--child", choices=["pretrain", "finetune"], help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prepare:
        return prepare(*args.prepare)
    if args.child:
        return child(args)
    if not args.trees:
        parser.error("give BASE [HEAD] (or --prepare REV DIR)")
    trees = [parse_tree(spec) for spec in args.trees]
    if len({t["name"] for t in trees}) != len(trees):
        parser.error("tree names must differ (NAME=DIR)")
    if args.finetune != "none" and args.vocab is None:
        import gpu_finetune

        args.vocab = gpu_finetune.vocab_file(argparse.Namespace(vocab=None))
    benches = [("pretrain", c, b) for c in args.configs for b in args.backends]
    if args.finetune != "none":
        benches += [("finetune", args.finetune, b) for b in args.backends]
    import torch

    report = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "trees": trees,
        "rounds": args.rounds,
        "steps": args.steps,
        "steps_per_execution": args.spe,
        "sst2_examples": args.sst2_examples,
        "runs": [],
    }
    args.scratch = tempfile.mkdtemp(prefix="gpu-compare-")
    caches = {}  # tree name -> its XLA compilation cache
    for round_ in range(args.rounds):
        order = trees if round_ % 2 == 0 else trees[::-1]
        for bench in benches:
            for tree in order:
                run = run_one(bench, tree, args, caches)
                run.update(bench="/".join(bench), tree=tree["name"], round=round_ + 1)
                report["runs"].append(run)
                figure = FIGURES[bench[0]][0]
                shown = f"{run[figure]:.1f} {figure}" if figure in run else run.get("error", "")
                print(
                    f"round {round_ + 1} {'/'.join(bench):28s} {tree['name']:14s} "
                    f"{shown[:300]} ({run['process_seconds']:.0f} s)",
                    flush=True,
                )
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=2)
    summarize(report, trees, benches)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print_table(report, trees)


if __name__ == "__main__":
    main()
