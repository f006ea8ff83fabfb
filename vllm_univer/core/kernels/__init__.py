"""Triton twins of the core's rules: one launch per depth level for a tree
verifier's node rules (``triton_topk1_verify``, ``triton_replay_verify``,
``triton_wor_verify``), one for a chain verifier's whole step
(``triton_chain_verify``), one for the rest of a step (``triton_finish_step``),
the drafting schemes (``triton_draft_children``) and the temperature softmax of
draft rows. Each follows the PyTorch rule it twins exactly (same law, tested in
Triton's interpreter); ``..fused_tree_pass`` chooses and launches them.
"""
