"""vLLM 0.32 side of tree speculation (map: docs/engine-integration.md).

- ``plugin``: the ``vllm.general_plugins`` entry point; applies ``patches`` once.
- ``config`` (pure pydantic) and ``speculative_config``: ``method: "univer"``.
- ``tree_speculation``, ``tree_drafter``, ``tree_sampler``, ``tree_state``: the step.
- ``tree_attention_plan``: what a tree forward tells the attention backends;
  ``cpu_tree_attention``, ``cuda_tree_attention``, ``kv_cache_views``: tree rows in
  vLLM's CPU, FlashAttention and Triton backends, over views of their caches.
- ``target_probs``, ``request_options``: exactly vLLM's sampling law; refusals.
"""
