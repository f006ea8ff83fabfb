"""Choosing how much of the tree to draft each step (``"tree": "auto"``).

Pure Python / NumPy, no vLLM: a cost model of a step measured on the machine
(``cost_model``), a model of how many tokens each depth cut of the tree gets
accepted (``acceptance_model``), and the choice that maximises tokens per second
for the batch at hand (``depth_choice``). The verifier sees whatever tree was
drafted, so none of this can change an output distribution.
"""

from .acceptance_model import AcceptanceModel, temperature_band
from .cost_model import ForwardCost, StepCostModel, StepWork
from .depth_choice import DepthChooser, candidate_depths

__all__ = [
    "AcceptanceModel",
    "DepthChooser",
    "ForwardCost",
    "StepCostModel",
    "StepWork",
    "candidate_depths",
    "temperature_band",
]
