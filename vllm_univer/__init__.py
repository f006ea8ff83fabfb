"""vllm-univer: lossless tree speculative decoding (UniVer and its baselines) for vLLM.

The verifier core (this namespace) is pure PyTorch and does not import vLLM:

    from vllm_univer import TreeSpec, draft_children, verify, outcome_law, METHODS
"""

from .core.api import VerifyOutput, outcome_law, verify, verify_greedy
from .core.drafting import SCHEMES, draft_children
from .core.tree import MAX_TREE_NODES, TreeSpec
from .core.verifiers import METHODS, scheme_for

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "MAX_TREE_NODES",
    "SCHEMES",
    "TreeSpec",
    "VerifyOutput",
    "draft_children",
    "outcome_law",
    "scheme_for",
    "verify",
    "verify_greedy",
]
