"""What float8 matrix products can buy BERT-large training on this GPU, in
plain JAX (no Keras): the ceiling a float8 path in kbert could reach.

    python benchmarks/float8_ceiling.py --out results/float8_ceiling.json
    python benchmarks/float8_ceiling.py --layers 2 --batch 4 --steps 2   # smoke test (CPU)

Two measurements, each system in its own process (peak memory per system),
the systems alternated over --rounds:

- products: BERT-large's four matrix products at 128 x 128 tokens, forward
  (x @ w) and both backward products (g @ w^T, x^T @ g), in bf16 and with
  float8 operands (e4m3 forward, e5m2 gradients; per-tensor scales given),
  int8 x int8 -> int32 beside them; milliseconds per product.
- step: a BERT-large encoder (post-LN, GELU, cuDNN attention in bf16) with
  float32 master weights, forward + backward + an SGD update, with every
  Dense product in bf16 ("bf16") or in float8 with delayed per-tensor
  scaling kept on device ("float8": each product quantizes its operands by
  last step's scale and records this step's abs-max, the bookkeeping of
  Keras' float8 layers without the history); sequences/s and peak memory.

The products bound what float8 can save: bf16 step time minus (bf16
products - float8 products), with quantization free. The step compares
the two product kinds inside one plain model (slower in bf16 than kbert's
own step, which fuses more), quantization passes included.
Current figures: benchmarks/RESULTS.md (float8 training).
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time

E4M3_MAX = 448.0
E5M2_MAX = 57344.0


def _timed(fn, args, repeats):
    import jax

    jax.block_until_ready(fn(*args))  # compile, warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def products(args):
    """Milliseconds per product, each jitted alone, looped `inner` times
    inside one program (launch cost amortized)."""
    import jax
    import jax.numpy as jnp

    m = args.batch * args.length
    h, f = args.hidden, 4 * args.hidden
    shapes = {"qkv": (m, h, 3 * h), "out": (m, h, h), "ffn_in": (m, h, f), "ffn_out": (m, f, h)}
    inner = args.inner
    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    out = {}

    def loop(body):
        def run(a, b):
            def step(i, acc):
                return acc + body(a, b)[:1, :1].astype(jnp.float32)

            return jax.lax.fori_loop(0, inner, step, jnp.zeros((1, 1), jnp.float32))

        return jax.jit(run)

    nn = (((1,), (0,)), ((), ()))
    nt = (((1,), (1,)), ((), ()))  # g (m, n) @ w (k, n)^T
    tn = (((0,), (0,)), ((), ()))  # x (m, k)^T @ g (m, n)
    key = jax.random.PRNGKey(0)
    for name, (mm, k, n) in shapes.items():
        kx, kw, kg = jax.random.split(jax.random.fold_in(key, len(out)), 3)
        x = jax.random.normal(kx, (mm, k), jnp.bfloat16)
        w = jax.random.normal(kw, (k, n), jnp.bfloat16)
        g = jax.random.normal(kg, (mm, n), jnp.bfloat16)
        row = {}
        for label, dtype_a, dtype_b, a, b, dims in [
            ("fwd", None, None, x, w, nn),
            ("dgrad", None, None, g, w, nt),
            ("wgrad", None, None, x, g, tn),
        ]:
            for system, ta, tb in [
                ("bf16", jnp.bfloat16, jnp.bfloat16),
                ("float8", e4 if label != "dgrad" else e5, e4 if label != "wgrad" else e5),
                ("int8", jnp.int8, jnp.int8),
            ]:
                out_type = jnp.int32 if system == "int8" else jnp.bfloat16

                def body(p, q, dims=dims, out_type=out_type):
                    return jax.lax.dot_general(p, q, dims, preferred_element_type=out_type)

                try:
                    seconds = _timed(loop(body), (a.astype(ta), b.astype(tb)), args.repeats)
                    flops = 2 * mm * k * n
                    row[f"{label}_{system}_ms"] = round(seconds / inner * 1e3, 4)
                    row[f"{label}_{system}_tflops"] = round(flops * inner / seconds / 1e12, 1)
                except Exception as error:  # noqa: BLE001 (an unsupported type is a result)
                    row[f"{label}_{system}_error"] = f"{type(error).__name__}: {str(error)[:200]}"
        out[f"{name} {mm}x{k}x{n}"] = row
    return out


def _quantize(x, scale, dtype, limit):
    import jax.numpy as jnp

    return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(dtype)


def _amax(x):
    import jax.numpy as jnp

    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _float8_dense():
    """y = x @ w with float8 operands; scales (sx, sw, sg) are last step's;
    the cotangents of the scales are this step's abs-max values (the
    "overwrite with gradient" convention of Keras' and Flax's float8)."""
    import jax
    import jax.numpy as jnp

    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2

    def dot(a, b, dims):
        return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.bfloat16)

    @jax.custom_vjp
    def dense(x, w, sx, sw, sg):
        return forward(x, w, sx, sw, sg)[0]

    def forward(x, w, sx, sw, sg):
        xq = _quantize(x, sx, e4, E4M3_MAX)
        wq = _quantize(w, sw, e4, E4M3_MAX)
        nn = (((x.ndim - 1,), (0,)), ((), ()))
        y = dot(xq, wq, nn) * (sx * sw).astype(jnp.bfloat16)
        return y, (xq, wq, sx, sw, sg, _amax(x), _amax(w))

    def backward(residuals, g):
        xq, wq, sx, sw, sg, ax, aw = residuals
        gq = _quantize(g, sg, e5, E5M2_MAX)
        lead = tuple(range(g.ndim - 1))
        dx = dot(gq, wq, (((g.ndim - 1,), (1,)), ((), ()))) * (sg * sw).astype(jnp.bfloat16)
        dw = dot(xq, gq, ((lead, lead), ((), ()))) * (sx * sg).astype(jnp.bfloat16)
        return dx, dw.astype(jnp.float32), ax, aw, _amax(g)

    dense.defvjp(forward, backward)
    return dense


def float8_error(args):
    """Relative error (Frobenius) of the float8 product and its two
    gradients against float32, on random operands with scales set from
    their abs-max: a check that the float8 path computes the product."""
    import jax
    import jax.numpy as jnp

    dense8 = _float8_dense()
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.normal(kx, (256, args.hidden), jnp.float32)
    w = jax.random.normal(kw, (args.hidden, 4 * args.hidden), jnp.float32) * 0.02
    g = jax.random.normal(kg, (256, 4 * args.hidden), jnp.float32) * 1e-3
    sx, sw, sg = _amax(x) / E4M3_MAX, _amax(w) / E4M3_MAX, _amax(g) / E5M2_MAX
    y8, vjp8 = jax.vjp(lambda a, b: dense8(a.astype(jnp.bfloat16), b, sx, sw, sg), x, w)
    y, vjp = jax.vjp(lambda a, b: a @ b, x, w)
    dx8, dw8 = vjp8(g.astype(jnp.bfloat16))
    dx, dw = vjp(g)

    def rel(a, b):
        a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
        return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

    return {"y": rel(y8, y), "dx": rel(dx8, dx), "dw": rel(dw8, dw)}


def step_benchmark(args, system):
    import jax
    import jax.numpy as jnp
    import numpy as np

    h, f, heads, layers = args.hidden, 4 * args.hidden, args.heads, args.layers
    b, t = args.batch, args.length
    dense8 = _float8_dense()
    names = ["qkv", "out", "ffn_in", "ffn_out"]
    dims = {"qkv": (h, 3 * h), "out": (h, h), "ffn_in": (h, f), "ffn_out": (f, h)}
    rng = np.random.default_rng(0)
    params = {n: jnp.asarray(rng.normal(0, 0.02, (layers, *dims[n])), jnp.float32) for n in names}
    for n in names:
        params[n + "_b"] = jnp.zeros((layers, dims[n][1]), jnp.float32)
    for n in ("ln1", "ln2"):
        params[n + "_g"] = jnp.ones((layers, h), jnp.float32)
        params[n + "_b"] = jnp.zeros((layers, h), jnp.float32)
    # scales: last step's abs-max / format max, per layer and product (x, w, g)
    scales = {n: jnp.full((layers, 3), 1.0 / 16, jnp.float32) for n in names}

    def dense(x, w, bias, s):
        if system == "float8":
            y = dense8(x, w, s[0], s[1], s[2])
        else:
            y = jnp.einsum("...i,io->...o", x, w.astype(jnp.bfloat16))
        return y + bias.astype(jnp.bfloat16)

    def layer_norm(x, g, beta):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
        return ((x32 - mean) * jax.lax.rsqrt(var + 1e-12) * g + beta).astype(jnp.bfloat16)

    impl = "cudnn" if jax.default_backend() == "gpu" else "xla"

    def block(x, p, s):
        qkv = dense(x, p["qkv"], p["qkv_b"], s["qkv"]).reshape(b, t, 3, heads, h // heads)
        a = jax.nn.dot_product_attention(
            qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], implementation=impl
        ).reshape(b, t, h)
        x = layer_norm(x + dense(a, p["out"], p["out_b"], s["out"]), p["ln1_g"], p["ln1_b"])
        u = jax.nn.gelu(dense(x, p["ffn_in"], p["ffn_in_b"], s["ffn_in"]), approximate=False)
        y = dense(u, p["ffn_out"], p["ffn_out_b"], s["ffn_out"])
        return layer_norm(x + y, p["ln2_g"], p["ln2_b"])

    def loss_fn(params, scales, x):
        def body(h_, ps):
            p, s = ps
            return jax.checkpoint(block, policy=jax.checkpoint_policies.everything_saveable)(
                h_, p, s
            ), None

        y, _ = jax.lax.scan(body, x, (params, scales))
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    @jax.jit
    def train_step(params, scales, x):
        loss, (grads, amax) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, scales, x)
        params = jax.tree.map(lambda p, g: p - 1e-4 * g, params, grads)
        margin = 2.0  # one power of two of headroom over last step's abs-max
        limits = jnp.asarray([E4M3_MAX, E4M3_MAX, E5M2_MAX], jnp.float32)
        scales = jax.tree.map(lambda a: jnp.maximum(a * margin / limits, 1e-12), amax)
        return params, scales, loss

    train_step = jax.jit(train_step, donate_argnums=(0, 1))
    x = jnp.asarray(rng.normal(0, 1, (b, t, h)), jnp.bfloat16)
    losses = []
    for _ in range(args.warmup):
        params, scales, loss = train_step(params, scales, x)
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for _ in range(args.steps):
        params, scales, loss = train_step(params, scales, x)
        losses.append(loss)
    jax.block_until_ready(loss)
    seconds = time.perf_counter() - start
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "system": system,
        "sequences_per_s": round(args.steps * b / seconds, 1),
        "ms_per_step": round(seconds / args.steps * 1e3, 2),
        "peak_gib": round(stats.get("peak_bytes_in_use", 0) / 2**30, 2),
        "loss_first_last": [float(losses[0]), float(losses[-1])],
        "float8_relative_error": float8_error(args) if system == "float8" else None,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-products", action="store_true")
    parser.add_argument("--child", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        result = products(args) if args.child == "products" else step_benchmark(args, args.child)
        print("RESULT " + json.dumps(result), flush=True)
        return

    def child(name):
        passed = [a for a in sys.argv[1:]]
        if "--out" in passed:
            at = passed.index("--out")
            del passed[at : at + 2]
        cmd = [sys.executable, __file__, "--child", name] + passed
        proc = subprocess.run(cmd, capture_output=True, text=True)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
        return {"system": name, "error": (proc.stderr or proc.stdout)[-2000:]}

    report = {"argv": sys.argv[1:], "host": platform.node(), "date": time.strftime("%Y-%m-%d")}
    try:
        import jax

        report["device"] = str(jax.devices()[0].device_kind)
        report["jax"] = jax.__version__
    except Exception as error:  # noqa: BLE001
        report["device"] = repr(error)
    if not args.skip_products:
        report["products"] = child("products")
        print(json.dumps(report["products"], indent=1), flush=True)
    report["steps"] = []
    for _ in range(args.rounds):
        for system in ("bf16", "float8"):
            result = child(system)
            print(json.dumps(result), flush=True)
            report["steps"].append(result)
    speeds = {}
    for r in report["steps"]:
        if "sequences_per_s" in r:
            speeds.setdefault(r["system"], []).append(r["sequences_per_s"])
    if "bf16" in speeds and "float8" in speeds:
        report["float8_over_bf16"] = round(max(speeds["float8"]) / max(speeds["bf16"]), 3)
        print("float8 / bf16:", report["float8_over_bf16"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
