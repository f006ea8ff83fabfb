"""Run a test script in a subprocess under Triton's interpreter (CPU;
TRITON_INTERPRET must be set before Triton decorates the kernels), or with
Triton compiling (``run_compiled``, ``test_triton_compiles``).

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
REPO_DIR = os.path.dirname(TESTS_DIR)
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
    return _run(PRELUDE + script, marker, argv, full_env, timeout)


def run_compiled(script: str, marker: str, site: str | None = None, timeout: int = 1200) -> str:
    """Run ``script`` (``python -c``) with Triton compiling (TRITON_INTERPRET unset),
    ``site`` (a folder holding another Triton release) first on the path; assert it
    exits 0 and prints ``marker``. Returns its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, TESTS_DIR, os.environ.get("PYTHONPATH")]))
    return _run(script, marker, (), env, timeout)


def _run(script: str, marker: str, argv, env: dict, timeout: int) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO_DIR
    )
    assert proc.returncode == 0 and marker in proc.stdout, (proc.stdout[-2000:], proc.stderr[-5000:])
    return proc.stdout
