"""How this package serves on the machine at hand: the one dtype rule, the
environment of a local server, and the main job's per-machine settings. Shared by
the main job (``scripts/serve_default.py``), the benchmarks and the tests."""

from __future__ import annotations

import os

from . import host_cpu as host_cpu_module  # looked up per call: tests stand in a CPU

# A server on 127.0.0.1 with no model hub: what every local server of the main job
# and the benchmarks runs with (the caller's environment and its own settings on top).
LOCAL_SERVER_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "4"}


def serving_dtype() -> tuple[str, str]:
    """(dtype, why): bfloat16 on a GPU; on a CPU what ``host_cpu`` finds it computes
    fastest (bfloat16 with native bf16, else float32)."""
    import torch

    if torch.cuda.is_available():
        return "bfloat16", "GPU"
    return host_cpu_module.host_cpu().serving_dtype()


# On a CPU, vLLM profiles (and warms up) each model with one forward of
# max_num_batched_tokens tokens (2048 by default: minutes per forward on 2 cores).
# A CPU server never batches that many tokens in a step; longer prompts are
# prefilled in chunks of this size.
CPU_MAX_BATCHED_TOKENS = 512


def hardware_defaults(user_args: list[str]) -> tuple[str, str, list[str], dict[str, str]]:
    """(dtype, a line saying what was chosen and why, extra vllm serve arguments,
    extra environment) for the machine at hand; DTYPE, the user's own arguments
    and VLLM_CPU_NUM_OF_RESERVED_CPU win."""
    import torch

    dtype, why = serving_dtype()
    if "DTYPE" in os.environ:
        dtype, why = os.environ["DTYPE"], "set by DTYPE"
    if torch.cuda.is_available():
        return dtype, f"GPU: {torch.cuda.get_device_name()}, dtype {dtype} ({why})", [], {}
    cpu = host_cpu_module.host_cpu()
    parts = [f"CPU: {cpu.label}; dtype {dtype} ({why})"]
    env = {}
    reserved, why = cpu.reserved_cores()
    if "VLLM_CPU_NUM_OF_RESERVED_CPU" in os.environ:
        reserved, why = os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"], "set by VLLM_CPU_NUM_OF_RESERVED_CPU"
    elif reserved is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved)
    parts.append(f"{'vLLM default' if reserved is None else reserved} reserved cores ({why})")
    args = []
    if not any(a.startswith("--max-num-batched-tokens") for a in user_args):
        parts.append(f"at most {CPU_MAX_BATCHED_TOKENS} tokens per step")
        args = ["--max-num-batched-tokens", str(CPU_MAX_BATCHED_TOKENS)]
    return dtype, "; ".join(parts), args, env
