"""Attention over a draft tree inside vLLM: the per-step tree plan
(``tree_attention_plan``), views of vLLM's paged KV cache (``kv_cache_views``),
tree attention (PyTorch reference ``tree_attention``, CPU path
``cpu_tree_attention``, Triton kernel ``triton_paged_tree_attention`` behind
``cuda_tree_attention``), and moving the accepted path's keys/values into place
(``kv_compaction``, ``triton_kv_moves``)."""
