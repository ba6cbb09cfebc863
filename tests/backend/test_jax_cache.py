"""kbert's persistent XLA compilation cache (kbert.backend.jax_cache): each
case in a new process, as JAX decides once per process."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import pytest

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's compilation cache")

# Turns the cache on as a step on an accelerator would (forced on this
# CPU), then compiles a program that takes over the minimum compile time;
# prints the directory in use, whether JAX found the program in the cache,
# and the warnings.
SCRIPT = textwrap.dedent(
    """
    import json, warnings
    import jax, jax.numpy as jnp
    from jax import monitoring
    hits = []
    monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None
    )
    jax.jit(lambda x: x + 1)(jnp.ones(3))  # a compilation before kbert's, as Keras makes
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    from kbert.backend import jax_cache
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = jax_cache.use_compilation_cache(force=True)
    jax.jit(lambda x: jnp.tanh(x) * 3 - x)(jnp.ones((4, 5)))
    print(json.dumps({"path": path, "hits": len(hits),
                      "warnings": [str(w.message) for w in caught]}))
    """
)


def run(tmp_path, **variables):
    """SCRIPT in a new process with HOME and XDG_CACHE_HOME in `tmp_path`,
    no JAX cache configured, and `variables` set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.pop("KBERT_COMPILATION_CACHE", None)
    env.update(
        HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "cache"), KERAS_BACKEND="jax"
    )
    env.update(variables)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_programs_the_first_compiled(tmp_path):
    first = run(tmp_path)
    want = os.path.realpath(tmp_path / "cache" / "kbert" / "xla")
    assert first["path"] == want and first["hits"] == 0 and not first["warnings"]
    assert os.listdir(want)  # the program, written
    assert oct(os.stat(want).st_mode & 0o777) == oct(0o700)
    second = run(tmp_path)
    assert second["path"] == want and second["hits"] >= 1


def test_the_users_own_jax_cache_and_opting_out_are_respected(tmp_path):
    own = tmp_path / "own"
    result = run(tmp_path, JAX_COMPILATION_CACHE_DIR=str(own))
    assert result["path"] == str(own)  # as the user gave it
    assert not (tmp_path / "cache" / "kbert").exists()
    for off in ("0", "off"):
        assert run(tmp_path, KBERT_COMPILATION_CACHE=off)["path"] is None
    assert not (tmp_path / "cache" / "kbert").exists()
    default = os.path.realpath(tmp_path / "cache" / "kbert" / "xla")
    assert run(tmp_path, KBERT_COMPILATION_CACHE="on")["path"] == default
    chosen = tmp_path / "chosen"
    assert run(tmp_path, KBERT_COMPILATION_CACHE=str(chosen))["path"] == os.path.realpath(chosen)


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_a_directory_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    result = run(tmp_path, KBERT_COMPILATION_CACHE=str(shared))
    assert result["path"] is None and result["hits"] == 0
    assert any("only you can write" in warning for warning in result["warnings"])
    assert os.listdir(shared) == []


def test_no_cache_on_a_cpu_unless_asked():
    from kbert.backend import jax_cache, jax_on_accelerator

    if jax_cache._DONE or jax_on_accelerator():
        pytest.skip("this process has decided already")
    assert jax_cache.use_compilation_cache() is None  # the CPU suite
    assert not jax_cache._DONE
