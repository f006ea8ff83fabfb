"""The vLLM patches (``vllm_univer.integration.patches``) applied as on a GPU machine."""

import subprocess
import sys
import textwrap

GPU_PLATFORM_PATCHES = textwrap.dedent("""
    import torch

    event, stream, current_stream = torch.cuda.Event, torch.cuda.Stream, torch.cuda.current_stream
    synchronize, pin_memory = torch.accelerator.synchronize, torch.Tensor.pin_memory
    from vllm.platforms import current_platform

    type(current_platform).is_cpu = lambda self: False  # what a CUDA platform answers
    from vllm_univer.integration import patches

    for patch in patches.ALL_PATCHES:
        patch()
    assert torch.cuda.Event is event and torch.cuda.Stream is stream, "torch.cuda replaced"
    assert torch.cuda.current_stream is current_stream, "torch.cuda.current_stream replaced"
    assert torch.accelerator.synchronize is synchronize and torch.Tensor.pin_memory is pin_memory
    print("TORCH CUDA INTACT")
""")


def test_patches_leave_torch_cuda_alone_off_the_cpu_platform():
    # vLLM's CPU worker module swaps torch.cuda.Event / Stream for no-op stand-ins when
    # imported. On the H200 that import (from a patch) broke Inductor's autotuning
    # ("'_EventPlaceholder' object has no attribute 'elapsed_time'") and vLLM's sampler.
    proc = subprocess.run([sys.executable, "-c", GPU_PLATFORM_PATCHES], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "TORCH CUDA INTACT" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
