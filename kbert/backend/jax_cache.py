"""A persistent XLA compilation cache for kbert's JAX steps on a GPU or TPU.

XLA compiles a BERT-base training step for 8 to 13 s on a GPU, and a
short fine-tuning run spends much of its time waiting for it (or running
slower loop programs meanwhile: `kbert.backend.jax_compile`). The
executables depend only on the program, the compiler options, the device
and the JAX version, so a run that compiled them once can keep them on
disk, and the next run of the same model, batch shapes and options loads
them in about a second (JAX's persistent compilation cache, the
counterpart of torch.compile's on-disk caches; what a second run gains:
benchmarks/RESULTS.md).

kbert turns JAX's cache on the first time it makes a step function on an
accelerator (`use_compilation_cache`), in a directory of its own:

- `KBERT_COMPILATION_CACHE`: a directory to use instead, or `0` (or
  `off`, `false`) for no cache;
- the default: `$XDG_CACHE_HOME/kbert/xla`, else `~/.cache/kbert/xla`,
  at most `MAX_BYTES` (least recently used entries removed).

A cache the user configured for JAX (`jax_compilation_cache_dir`,
`JAX_COMPILATION_CACHE_DIR`) is left as it is. The cache holds machine
code that JAX loads without checks: a directory that another user owns or
can write is refused (with a warning), and kbert creates its own with
permissions 0700. CPU runs are left alone: programs there compile in
seconds at most, and JAX's own default (no cache) applies.
"""

import os
import stat
import threading
import warnings

from kbert.backend import jax_on_accelerator

ENV = "KBERT_COMPILATION_CACHE"
MAX_BYTES = 4 * 2**30  # BERT-base step programs are ~2-5 MB each
_OFF = {"0", "off", "false", "no"}
_LOCK = threading.Lock()
_DONE = False


def cache_directory():
    """The directory kbert would use (see module doc), or None for none."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in _OFF or not value.strip() else value
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kbert", "xla")


def _safe_directory(path):
    """Creates `path` (0700) if missing; whether it is the user's own and
    not writable by anyone else."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.stat(path)
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return False
    return not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def use_compilation_cache(force=False):
    """Turns JAX's persistent compilation cache on in `cache_directory()`,
    once per process, where JAX runs on an accelerator (or with `force`),
    unless the user configured JAX's cache or turned kbert's off. Returns
    the directory in use, or None."""
    global _DONE
    import jax

    with _LOCK:
        if _DONE:
            return jax.config.jax_compilation_cache_dir
        if not force and not jax_on_accelerator():
            return None
        _DONE = True
        if jax.config.jax_compilation_cache_dir:  # the user's own
            return jax.config.jax_compilation_cache_dir
        path = cache_directory()
        if path is None:
            return None
        path = os.path.abspath(os.path.expanduser(path))
        try:
            safe = _safe_directory(path)
        except OSError as error:
            warnings.warn(f"kbert: no compilation cache ({error}); set {ENV}=0 to silence this")
            return None
        if not safe:
            warnings.warn(
                f"kbert: not using {path} as a compilation cache: another user owns it or "
                f"can write to it (set {ENV} to a directory only you can write, or to 0)"
            )
            return None
        jax.config.update("jax_compilation_cache_dir", path)
        if getattr(jax.config, "jax_compilation_cache_max_size", None) == -1:  # unbounded
            jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
        return path
