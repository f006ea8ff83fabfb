"""Choosing how much of the tree to draft each step (``"tree": "auto"``).

Pure Python / NumPy, no vLLM: a cost model of a step measured on the machine
(``cost_model``) and a model of how many tokens each depth cut gets accepted
(``acceptance_model``), one of each per shape (the tree and its width cuts),
and the choice that maximises tokens per second for the batch at hand
(``tree_choice``). The verifier sees whatever tree was
drafted, so none of this can change an output distribution.
"""

from .acceptance_model import (
    NUM_BANDS,
    AcceptanceModel,
    children_per_node,
    prior_hazards,
    share_priors,
    temperature_band,
)
from .catch_up import MIN_CATCH_UP_TOKENS, catch_up_budget, split_catch_up
from .cost_model import ForwardCost, StepCostModel, StepWork
from .tree_choice import Cut, ShapeModels, TreeChooser

__all__ = [
    "NUM_BANDS",
    "AcceptanceModel",
    "Cut",
    "ForwardCost",
    "StepCostModel",
    "StepWork",
    "ShapeModels",
    "TreeChooser",
    "MIN_CATCH_UP_TOKENS",
    "catch_up_budget",
    "children_per_node",
    "split_catch_up",
    "prior_hazards",
    "share_priors",
    "temperature_band",
]
