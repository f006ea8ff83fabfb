"""vLLM 0.32 side of tree speculation (in progress, see docs/engine-integration.md).

- ``config``: the user-facing ``method: "univer"`` fields (pure pydantic).
- ``target_probs``: tree rows' target distribution through vLLM's own top-k/top-p.
- ``cpu_kv_cache``: views of vLLM's CPU paged KV cache for the tree kernels.

The model-runner patches will live next to these, each named after what it
patches, applied once from the plugin entry point.
"""
