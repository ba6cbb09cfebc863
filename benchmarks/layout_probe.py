"""A/B probe for the JAX training step: one process per variant, each variant
a monkeypatch that puts back (or tries) one graph choice, timed on the same
GPU with the large transposes of its optimized HLO counted.

    KERAS_BACKEND=jax python benchmarks/layout_probe.py --variants base kerasln philox --out probe.json

BERT-base, seq 128, batch 256, bf16, hidden dropout 0.1, attention dropout 0,
steps_per_execution 1, best of two fits of 30 steps. Variants (combine with
'+'): base (the code as it is); posgather/posbar/posscatter/posdot/possum2d
(forms of the position embedding and its gradient); mlmflat, poolbar,
poolgather, embflat (other gathers and slices, tried while looking for what
set the (T, H, B) layout); autogelu (jax.nn.gelu, erfc form); erfauto (erf
form through autodiff); kerasln (Keras' LayerNormalization); drop32 (the
session-3 Philox dropout); philox (Philox bits instead of the hashed mask,
float32 scaling; in the results JSON the hash ran as "hashdrop" against a
Philox "base", before it became the code); qkv3 (three
Q/K/V products instead of one fused product); nodrop (no hidden dropout).
Results of session 4: benchmarks/results/gpu_layout_probe_h100.json.
"""

import argparse
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def patch(names):
    import jax
    from keras import ops

    from kbert.layers import embeddings, heads

    if "mlmflat" in names:  # MLM gather on (B*T, H) rows instead of take_along_axis

        def call(self, sequence_output, mask_positions):
            b, t, h = ops.shape(sequence_output)
            flat = ops.reshape(sequence_output, (-1, h))
            idx = ops.cast(mask_positions, "int32") + ops.arange(b, dtype="int32")[:, None] * t
            x = ops.take(flat, ops.reshape(idx, (-1,)), axis=0)
            x = ops.reshape(x, (b, -1, h))
            x = self.layer_norm(self.transform(x))
            logits = self.token_embedding(x, reverse=True)
            return ops.cast(logits, "float32") + ops.cast(self.output_bias, "float32")

        heads.MaskedLMHead.call = call
    if "poolbar" in names:  # the [CLS] slice cannot pass a layout back

        def pcall(self, sequence_output):
            x = jax.lax.optimization_barrier(sequence_output)
            return self.dense(x[:, 0, :])

        heads.Pooler.call = pcall
    if "poolgather" in names:

        def pcall2(self, sequence_output):
            b, t, h = ops.shape(sequence_output)
            flat = ops.reshape(sequence_output, (-1, h))
            return self.dense(ops.take(flat, ops.arange(b, dtype="int32") * t, axis=0))

        heads.Pooler.call = pcall2
    if "posgather" in names or "posbar" in names:  # position embeddings without a broadcast

        def pcall3(self, token_ids, segment_ids, training=None):
            b, t = ops.shape(token_ids)
            table = ops.cast(self.position_embeddings, self.compute_dtype)
            if "posgather" in names:
                ids = ops.broadcast_to(ops.arange(t, dtype="int32")[None], (b, t))
                positions = ops.take(table, ids, axis=0)
            else:
                positions = jax.lax.optimization_barrier(
                    ops.broadcast_to(table[None, :t], (b, t, table.shape[-1]))
                )
            x = self.token_embedding(token_ids) + self.segment_embedding(segment_ids) + positions
            x = self.layer_norm(x)
            return self.dropout_layer(x, training=training)

        embeddings.BertEmbeddings.call = pcall3
    if "qkv3" in names:  # three projections instead of one QKV product and a split copy
        from keras import ops as kops

        from kbert.layers import attention
        from kbert.layers import fused as kfused

        def acall(self, inputs, padding_mask, training=None):
            b, t = kops.shape(inputs)[0], kops.shape(inputs)[1]
            h = self.hidden_dim
            kernel = kops.cast(self.qkv.kernel, self.compute_dtype)
            bias = kops.cast(self.qkv.bias, self.compute_dtype)
            x = kops.cast(inputs, self.compute_dtype)
            q, k, v = (
                kops.reshape(
                    kops.matmul(x, kernel[:, i * h : (i + 1) * h]) + bias[i * h : (i + 1) * h],
                    (b, t, self.num_heads, self.head_dim),
                )
                for i in range(3)
            )
            context = kfused.fused_attention(q, k, v, padding_mask, 1.0 / self.head_dim**0.5)
            return self.output_dense(kops.reshape(context, (b, t, h)))

        attention.MultiHeadSelfAttention.call = acall
    if "philox" in names:  # XLA's Philox RngBitGenerator bits in memory instead of the hashed mask
        import jax.numpy as jnp
        import numpy as np

        from kbert.layers import dropout

        def philox_dropout(inputs, rate, seed_generator):
            seed = jnp.asarray(seed_generator.next(), "uint32")
            key = jax.random.wrap_key_data(
                jnp.concatenate([seed, seed ^ jnp.uint32(0x9E3779B9)]), impl="rbg"
            )
            keep = jax.random.bits(key, inputs.shape, jnp.uint32) < jnp.uint32(
                int(round((1.0 - rate) * 2**32))
            )
            scale = np.float32(1 / (1 - rate))
            return jnp.where(
                keep,
                (inputs.astype(jnp.float32) * scale).astype(inputs.dtype),
                jnp.zeros_like(inputs),
            )

        dropout.fused_dropout = philox_dropout
    if "drop32" in names:  # dropout with one 32-bit draw per element and autodiff'd scaling
        import jax.numpy as jnp

        from kbert.layers import dropout

        def old_dropout(inputs, rate, seed_generator):
            seed = jnp.asarray(seed_generator.next(), "uint32")
            key = jax.random.wrap_key_data(
                jnp.concatenate([seed, seed ^ jnp.uint32(0x9E3779B9)]), impl="rbg"
            )
            bits = jax.random.bits(key, inputs.shape, jnp.uint32)
            keep = bits < jnp.uint32(int(round((1.0 - rate) * 2**32)))
            return jnp.where(
                keep, inputs / jnp.asarray(1.0 - rate, inputs.dtype), jnp.zeros_like(inputs)
            )

        dropout.fused_dropout = old_dropout
    if "kerasln" in names:  # Keras' LayerNormalization (autodiff, two-pass variance)
        import keras

        from kbert.layers import layer_norm

        layer_norm.LayerNorm.call = keras.layers.LayerNormalization.call
    if "autogelu" in names:  # GELU through autodiff instead of fused_gelu's custom gradient
        import keras

        from kbert.layers import activations

        activations._ACTIVATIONS["gelu"] = lambda x: keras.activations.gelu(x, approximate=False)
    if "erfauto" in names:  # erf-form GELU through autodiff
        import jax
        import jax.numpy as jnp

        from kbert.layers import activations

        def erf_gelu(x):
            x32 = x.astype(jnp.float32)
            return (x32 * 0.5 * (1.0 + jax.lax.erf(x32 * 0.7071067811865476))).astype(x.dtype)

        activations._ACTIVATIONS["gelu"] = erf_gelu
    for mode in ("posdot", "posscatter", "possum2d"):
        if mode in names:
            embeddings.fused_embedding_sum = _embedding_sum_variant(mode)
    if "embflat" in names:  # embedding lookups on flattened ids
        orig = embeddings.BertEmbeddings.call

        def ecall(self, token_ids, segment_ids, training=None):
            b, t = ops.shape(token_ids)
            tok = ops.take(
                ops.cast(self.token_embedding.embeddings, self.compute_dtype),
                ops.reshape(token_ids, (-1,)),
                axis=0,
            )
            seg = ops.take(
                ops.cast(self.segment_embedding.embeddings, self.compute_dtype),
                ops.reshape(segment_ids, (-1,)),
                axis=0,
            )
            pos = ops.cast(self.position_embeddings, self.compute_dtype)[:t]
            x = ops.reshape(tok + seg, (b, t, -1)) + pos[None]
            x = self.layer_norm(x)
            return self.dropout_layer(x, training=training)

        embeddings.BertEmbeddings.call = ecall


def _embedding_sum_variant(mode):
    """fused_embedding_sum with another gradient for the position table."""
    import jax
    import jax.numpy as jnp

    def fn(tokens, positions, segments, segment_ids):
        segment_ids = jnp.asarray(segment_ids, jnp.int32)
        batch, length = segment_ids.shape

        def gather(positions, segments):
            ids = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (batch, length))
            return jnp.take(positions, ids, axis=0) + jnp.take(segments, segment_ids, axis=0)

        if mode == "posscatter":
            return tokens + gather(positions, segments)

        @jax.custom_vjp
        def embed(positions, segments):
            return gather(positions, segments)

        def forward(positions, segments):
            return embed(positions, segments), None

        def backward(_, grad):
            if mode == "posdot":
                d_pos = jnp.einsum(
                    "b,bth->th",
                    jnp.ones((batch,), grad.dtype),
                    grad,
                    preferred_element_type=jnp.float32,
                )
            else:
                d_pos = jnp.sum(grad.reshape(batch, -1), axis=0, dtype=jnp.float32).reshape(
                    length, -1
                )
            one_hot = jax.nn.one_hot(segment_ids, segments.shape[0], dtype=grad.dtype)
            d_seg = jnp.einsum("bts,bth->sh", one_hot, grad, preferred_element_type=jnp.float32)
            return d_pos.astype(positions.dtype), d_seg.astype(segments.dtype)

        embed.defvjp(forward, backward)
        return tokens + embed(positions, segments)

    return fn


def analyse(path):
    txt = open(path).read()
    comps = {}
    for m in re.finditer(r"\n%(\S+) \(.*?\) -> .*? \{\n(.*?)\n\}\n", txt, re.S):
        comps[m.group(1)] = m.group(2)
    entry = txt[txt.index("\nENTRY") :]
    big, nbytes, lines = 0, 0, []
    sizes = {"bf16": 2, "f32": 4, "pred": 1, "f16": 2, "s32": 4, "u32": 4}
    for l in entry.split("\n"):
        m = re.match(r"\s*%(\S+) = (.*?) fusion\(.*calls=%([\w.\-]+)", l)
        if not m:
            continue
        name, shape, called = m.groups()
        body = comps.get(called, "")
        on = re.search(r'op_name="([^"]*)"', l)
        lines.append(f"{name} | {shape[:100]} | {on.group(1)[-90:] if on else ''}")
        for t in re.finditer(r"= (\w+)\[([\d,]+)\]\S* transpose\(", body):
            n = 1
            for d in t.group(2).split(","):
                n *= int(d)
            if n >= 1 << 20:
                big += 1
                nbytes += n * sizes.get(t.group(1), 4)
    return {"large_transposes": big, "transpose_mbytes": nbytes / 1e6}, lines


def child(variant, steps, out):
    import gpu_pretrain
    import keras
    import numpy as np

    import kbert

    patch(variant.split("+"))
    arch, t, b, p = gpu_pretrain.CONFIGS["base128"]
    keras.config.set_dtype_policy("mixed_bfloat16")
    backbone = kbert.BertBackbone.from_architecture(
        arch,
        max_sequence_length=512,
        attention_dropout=0.0,
        dtype="mixed_bfloat16",
        dropout=0.0 if "nodrop" in variant else 0.1,
    )
    model = kbert.BertPreTrainer(backbone)
    model.compile(
        optimizer=kbert.training.create_optimizer(1e-4, 10_000, 100),
        steps_per_execution=1,
        jit_compile=True,
    )
    x, y = gpu_pretrain.batch(t, b, p)
    xs = {k: np.concatenate([v] * steps) for k, v in x.items()}
    ys = {k: np.concatenate([v] * steps) for k, v in y.items()}
    model.fit(
        {k: v[: 2 * b] for k, v in xs.items()},
        {k: v[: 2 * b] for k, v in ys.items()},
        batch_size=b,
        verbose=0,
        shuffle=False,
    )
    best = None
    for _ in range(2):
        start = time.perf_counter()
        h = model.fit(xs, ys, batch_size=b, verbose=0, shuffle=False).history
        s = time.perf_counter() - start
        best = s if best is None else min(best, s)
    print("RESULT " + json.dumps({"seq_per_s": steps * b / best, "loss": h["loss"][-1]}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", nargs="+", default=["base"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="probe.json")
    parser.add_argument("--child")
    parser.add_argument("--dump-dir", default="/tmp/probe_hlo")
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.steps, args.out)
    report = []
    for v in args.variants:
        d = os.path.join(args.dump_dir, v.replace("+", "_"))
        env = dict(
            os.environ,
            XLA_FLAGS=f"--xla_dump_to={d} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train.*",
        )
        started = time.time()
        proc = subprocess.run(
            [sys.executable, __file__, "--child", v, "--steps", str(args.steps)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        res = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        r = {"variant": v, "wall_s": time.time() - started}
        if res:
            r.update(json.loads(res[-1][7:]))
        else:
            r["error"] = (proc.stderr or proc.stdout)[-1500:]
        files = [f for f in glob.glob(os.path.join(d, "*after_optimizations.txt"))]
        if files:
            big = max(files, key=os.path.getsize)
            stats, lines = analyse(big)
            r.update(stats, hlo=os.path.basename(big))
            out_dir = os.environ.get("OUT", "/tmp")
            with gzip.open(os.path.join(out_dir, f"entry_{v.replace('+', '_')}.txt.gz"), "wt") as f:
                f.write("\n".join(lines))
            if v == args.variants[0] or "keep" in v:
                with (
                    open(big, "rb") as src,
                    gzip.open(
                        os.path.join(out_dir, f"hlo_{v.replace('+', '_')}.txt.gz"), "wb"
                    ) as f,
                ):
                    f.write(src.read())
        print(
            json.dumps({k: r[k] for k in r if k != "error"}), r.get("error", "")[-800:], flush=True
        )
        report.append(r)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
