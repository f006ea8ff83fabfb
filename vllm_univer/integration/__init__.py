"""vLLM 0.32 side of tree speculation (map: docs/engine-integration.md).

- ``plugin``: the ``vllm.general_plugins`` entry point; applies ``patches`` once.
- ``config`` (pure pydantic) and ``speculative_config``: ``method: "univer"``.
- ``tree_runner``, ``tree_drafter``, ``tree_sampler``, ``tree_state``: the step.
- ``cpu_tree_attention``, ``cpu_kv_cache``: tree rows in vLLM's CPU attention.
- ``target_probs``, ``request_options``: exactly vLLM's sampling law; refusals.
"""
