"""``univer_wor``: UniVer's prefix scaling with an optimal-transport selection for
children drawn without replacement, scheme ``wor``.

A node v with prefix scale P~_v must pass on, over the draws of its children
and their subtrees, exactly the demand D = P~_v p_v (and be rejected with
probability 1 - P~_v). Children are taken as *pairs* in slot order (slots 1-2,
then 3-4, ...; an odd last slot alone). For a pair {a, b} drawn without
replacement from the stage's draft law q':

* **Selection by ratio.** The child with the larger ratio D/q' (ties: the
  lower rank of a stable sort, a fixed total order) is *selected*. Its
  marginal law is
      Q_sel(y) = P(y drawn and ranked first in its pair)
               = u(y) q'(after y) + q'(y) u(after y),    u = q' / (1 - q')
  (prefix sums in rank order: one sort per stage), and it is accepted (its
  subtree entered with scale) min(1, D(y) / Q_sel(y)): single-draft speculative
  sampling against the selection marginal, which for two drafts reaches the
  one-step optimum on smooth laws. If its subtree rejects, the other child is
  entered with scale min(1, D2(y) / E2(y)), D2 = D - min(Q_sel, D) and
      E2(y) = P(y drawn, ranked second, the first rejected)
            = u(y) sum_{z before y} q'(z) (1 - s(z)) + q'(y) sum_{z before y} u(z) (1 - s(z)).
* **Slot order.** The first drawn child against q' (min(1, D/q')), then the
  second against its marginal law given the first drawn and rejected,
      E2(y) = q'(y) sum_{z != y} [q'(z) - D(z)]+ / (1 - q'(z)),
  which passes on at least as much as RRSw's second step (its per-pair
  ratios, summed, are bounded by this marginal one). On laws with zeros and
  ties it can beat the selection by ratio.
  Each node takes whichever of the two leaves less demand over: a choice made
  from p, q' and P~ alone, never from the drawn pair, so both stay lossless.
  Where the pair's two slots carry subtrees of different sizes (irregular,
  EAGLE-like trees), slot order always: the one-step comparison does not see
  that the first slot's larger subtree is worth more once entered (it fell
  1-21 % below traversal there; now within 2e-3 of it, tests/test_reductions.py).
* What is left, R = D2 - min(E2, D2), is marginal over the pair: it does not
  depend on which pair was drawn. A later stage (slots 3-4, ...) sees the
  drawn history H: its draft law is q restricted off H and renormalised, its
  demand the density R / Zbar (Zbar = 1 - the pair's mean acceptance, the
  chance that this stage is reached), which gives back exactly R on average.
* A lone slot (odd m, or a single child) is Block Verification's step:
  min(1, D(x) / q'(x)), R = [D - q']+.

At the end, h_v = rho / (rho + 1 - sigma) with rho = sum of the last stage's R
and sigma its demand's mass (sigma = P~_v when there is one stage), and
Y ~ R. With one child per node this is ``block``; at depth 1 it is a one-step
multi-draft coupling (the selection step above).

Every quantity is a closed form over the vocabulary per node and stage (one
sort by ratio, prefix sums, gathers); no loop over tokens, nodes or requests.
"""

from __future__ import annotations

import torch

from ..ops import clipped_ratio, continue_prob, exclusive_cumsum, gather_tokens, token_set_mask
from .base import Family, NodeBatch, NodeOutput, TreeVerifier


def _exclusive_after(x: torch.Tensor) -> torch.Tensor:
    """Sum of the entries after each one along the last dim."""
    return x.flip(-1).cumsum(-1).flip(-1) - x


def _pair_stage(
    demand: torch.Tensor, law: torch.Tensor, xa: torch.Tensor, xb: torch.Tensor, single: tuple, even: torch.Tensor
):
    """One pair {xa, xb} drawn without replacement from ``law`` [.., V] against
    ``demand`` [.., V]: whichever of the two couplings below passes on more
    demand at this node (a choice made from p, q and P~ only, never from the
    drawn pair, so either is lossless). Returns (accept_a, accept_b) [.., 1]
    given the stage is reached, and the leftover demand R [.., V] (marginal over
    the pair). ``single``: ``_single_stage(demand, law, xa)``, the slot-order
    coupling's first step, already computed by the caller. ``even`` [.., 1]:
    whether the two slots carry subtrees of the same size; where they do not,
    slot order (the one-step comparison does not see that the first slot, the
    larger subtree on EAGLE-like trees, is worth more once accepted)."""
    by_ratio = _pair_by_ratio(demand, law, xa, xb)
    in_order = _pair_in_slot_order(demand, law, xb, *single)
    better = by_ratio[2].sum(-1, keepdim=True) <= in_order[2].sum(-1, keepdim=True)  # less left over
    better = better & even
    return tuple(torch.where(better, a, b) for a, b in zip(by_ratio, in_order))


def _pair_in_slot_order(
    demand: torch.Tensor, law: torch.Tensor, xb: torch.Tensor, accept_a: torch.Tensor, left: torch.Tensor
):
    """The first drawn child against the draft law (``accept_a``, ``left``: its
    ``_single_stage``), then the second against its marginal law given that the
    first was drawn and rejected:
        E2(y) = q'(y) sum_{z != y} [q'(z) - D(z)]+ / (1 - q'(z))."""
    rest = 1.0 - law
    over = law - (demand - left)  # [q' - D]+
    missed = torch.where(rest > 0, over / torch.where(rest > 0, rest, 1.0), torch.zeros_like(law))
    second = (law * (missed.sum(-1, keepdim=True) - missed)).clamp(min=0)
    leftover = left - torch.minimum(second, left)
    accept_b = (1.0 - accept_a) * clipped_ratio(gather_tokens(left, xb), gather_tokens(second, xb))
    return accept_a, accept_b, leftover


def _pair_by_ratio(demand: torch.Tensor, law: torch.Tensor, xa: torch.Tensor, xb: torch.Tensor):
    """Selection by ratio D/q', then a second chance for the other child (module docstring)."""
    ratio = torch.where(law > 0, demand / torch.where(law > 0, law, 1.0), torch.full_like(law, float("inf")))
    order = torch.sort(ratio, dim=-1, descending=True, stable=True).indices
    q = law.gather(-1, order)
    d = demand.gather(-1, order)
    rest = 1.0 - q
    u = torch.where(rest > 0, q / torch.where(rest > 0, rest, 1.0), torch.zeros_like(q))
    selected = u * _exclusive_after(q) + q * _exclusive_after(u)  # Q_sel
    take_selected = clipped_ratio(d, selected)
    left = d - torch.minimum(selected, d)  # D2
    missed = 1.0 - take_selected
    second = u * exclusive_cumsum(q * missed) + q * exclusive_cumsum(u * missed)  # E2
    take_second = clipped_ratio(left, second)
    leftover = left - torch.minimum(second, left)

    def to_tokens(sorted_rows: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(sorted_rows).scatter_(-1, order, sorted_rows)

    rank = to_tokens(torch.arange(law.shape[-1], device=law.device, dtype=law.dtype).expand_as(law))
    take_selected, take_second = to_tokens(take_selected), to_tokens(take_second)
    a_first = gather_tokens(rank, xa) < gather_tokens(rank, xb)
    sel_a, sel_b = gather_tokens(take_selected, xa), gather_tokens(take_selected, xb)
    sec_a, sec_b = gather_tokens(take_second, xa), gather_tokens(take_second, xb)
    accept_a = torch.where(a_first, sel_a, (1.0 - sel_b) * sec_a)
    accept_b = torch.where(a_first, (1.0 - sel_a) * sec_b, sel_b)
    return accept_a, accept_b, to_tokens(leftover)


def _single_stage(demand: torch.Tensor, law: torch.Tensor, x: torch.Tensor):
    """One child x drawn from ``law``: accept min(1, D(x) / law(x)); leftover [D - law]+."""
    accept = clipped_ratio(gather_tokens(demand, x), gather_tokens(law, x))
    return accept, demand - torch.minimum(law, demand)


class UniVerWorVerifier(TreeVerifier):
    name = "univer_wor"
    scheme = "wor"
    family = Family.POSTORDER
    uses_kid_sizes = True

    def node_rule(self, nodes: NodeBatch, want_residual: bool) -> NodeOutput:
        tokens = nodes.tokens
        demand = nodes.scale.unsqueeze(-1) * nodes.p  # D = P~ p
        sigma = nodes.scale.unsqueeze(-1)
        law = nodes.q
        slots = tokens.shape[-1]
        weights = []
        for start in range(0, slots, 2):  # stages; nodes and requests stay batched
            xa = tokens[..., start : start + 1]
            xb = tokens[..., start + 1 : start + 2] if start + 1 < slots else torch.full_like(xa, -1)
            has_a, has_b = xa >= 0, xb >= 0
            single = acc_a, left = _single_stage(demand, law, xa)
            acc_b = torch.zeros_like(acc_a)
            if start + 1 < slots:
                even = torch.ones_like(has_b)
                if nodes.kid_sizes is not None:
                    sizes = nodes.kid_sizes
                    even = sizes[..., start : start + 1] == sizes[..., start + 1 : start + 2]
                pair_a, pair_b, pair_left = _pair_stage(demand, law, xa, xb, single, even)
                acc_a = torch.where(has_b, pair_a, acc_a)
                acc_b = torch.where(has_b, pair_b, acc_b)
                left = torch.where(has_b, pair_left, left)
            acc_a, acc_b = acc_a * has_a, acc_b * has_b
            left = torch.where(has_a, left, demand)
            weights.append(acc_a)
            if start + 1 < slots:
                weights.append(clipped_ratio(acc_b, 1.0 - acc_a))
            if start + 2 >= slots:
                demand = left
                break
            # The next stage sees this history: its draft law (q off the drawn tokens) and
            # the leftover as a density given that the stage is reached.
            reached = (1.0 - (demand - left).sum(-1, keepdim=True)).clamp(min=0)
            demand = torch.where(reached > 0, left / torch.where(reached > 0, reached, 1.0), torch.zeros_like(left))
            sigma = demand.sum(-1, keepdim=True)
            law = law.masked_fill(token_set_mask(torch.cat([xa, xb], -1), law.shape[-1], law.dtype), 0.0)
            law = law / law.sum(-1, keepdim=True).clamp(min=torch.finfo(law.dtype).tiny)
        rho = demand.sum(-1, keepdim=True)
        stop = continue_prob(rho, sigma).squeeze(-1)
        return NodeOutput(torch.cat(weights, -1), stop, demand if want_residual else None)
