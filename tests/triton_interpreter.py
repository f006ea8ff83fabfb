"""Run a test script under Triton's interpreter (CPU), in a subprocess:
TRITON_INTERPRET must be set before Triton decorates the kernels.

The interpreter re-patches ``triton.language`` (an ``inspect.getmembers`` walk
over every module it patches) at each call of a ``@triton.jit`` helper from a
kernel, although the launch has already patched the same modules: 41 % of
the interpreter's time (cProfile, univer on an irregular tree) in this package's kernels, which call their row helpers
per node and block. ``skip_repeated_lang_patches`` skips a repeat within one
launch (the modules it would patch are patched already, with the same
members), so kernels run exactly as before, 1.8x as fast there.
"""

from __future__ import annotations

import os
import subprocess
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PRELUDE = "import triton_interpreter\ntriton_interpreter.skip_repeated_lang_patches()\n"


def skip_repeated_lang_patches() -> None:
    """Patch the interpreter (this process) so that a helper call inside a launch
    re-patches ``triton.language`` only for modules the launch has not patched."""
    import inspect
    import threading

    import triton.language as tl
    import triton.runtime.interpreter as interp

    patch_lang, launch = interp._patch_lang, interp.GridExecutor.__call__
    state = threading.local()

    def lang_modules(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def tracked_launch(self, *args, **kwargs):
        state.patched = set()  # modules patched so far in this launch
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.patched = None

    def patch_lang_once(fn):
        patched = getattr(state, "patched", None)
        if patched is not None:
            modules = lang_modules(fn)
            if patched and modules <= patched:
                return interp._LangPatchScope()  # nothing to patch, nothing to restore
            patched |= modules
        return patch_lang(fn)

    interp.GridExecutor.__call__ = tracked_launch
    interp._patch_lang = patch_lang_once


def run_interpreted(script: str, marker: str, *argv: str, env: dict | None = None, timeout: int = 1800) -> str:
    """Run ``script`` (``python -c``) with TRITON_INTERPRET=1 and the speed-up
    above; assert it exits 0 and prints ``marker``. Returns its stdout."""
    path = os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")]))
    full_env = {**os.environ, **(env or {}), "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + script, *argv], capture_output=True, text=True, env=full_env, timeout=timeout
    )
    assert proc.returncode == 0 and marker in proc.stdout, (proc.stdout[-2000:], proc.stderr[-5000:])
    return proc.stdout
