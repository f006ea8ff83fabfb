"""The verifier core: tree shapes, draft schemes, the verifiers' node rules, their
exact laws, input validation, and the Triton twins of the rules (``kernels/``,
reached through ``fused_tree_pass``).

Pure PyTorch and Triton: nothing here imports vLLM or ``vllm_univer.integration``
(``tests/core/test_layering.py`` enforces it). The public names are re-exported
by ``vllm_univer``.
"""
