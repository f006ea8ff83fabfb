"""A request's sampling options on a tree: the target's probabilities per node
with every logits transform vLLM applies (``target_probs``, ``bias_and_min_p``),
masks that follow a node's path (``path_masks``: penalties, bad words), structured
output on tree paths (``tree_grammar``), and the options the method refuses
(``request_options``)."""
