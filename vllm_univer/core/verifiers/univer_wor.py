"""``univer_wor``: UniVer's prefix scaling with an optimal-transport selection for
children drawn without replacement, scheme ``wor``.

A node v with prefix scale P~_v must pass on, over the draws of its children
and their subtrees, exactly the demand D = P~_v p_v (and be rejected with
probability 1 - P~_v). Children are taken as *pairs* in slot order (slots 1-2,
then 3-4, ...; an odd last slot alone). For a pair {a, b} drawn without
replacement from the stage's draft law q':

* **Selection by ratio.** The child with the larger ratio D/q' is *selected*.
  Ratios are compared by class: their exact rank on small vocabularies, else
  a log scale of 32 classes per octave (ratios within 2 % share a class); a
  pair from one class is settled by a fair coin. The rule depends on p, q'
  and P~ only, so the construction is exact whatever the classes, and it
  needs sums per class and one prefix sum over the classes: O(V) per node,
  where an exact order needs a sort of the vocabulary. Its marginal law is
      Q_sel(y) = P(y drawn and selected)
               = sum_z (u(y) q'(z) + q'(y) u(z)) c(y | z),    u = q' / (1 - q'),
  c(y | z) = 1, 1/2 or 0 as y's class is above, equal to or below z's, and it
  is accepted (its subtree entered with scale) min(1, D(y) / Q_sel(y)):
  single-draft speculative sampling against the selection marginal, which for
  two drafts reaches the one-step optimum on smooth laws. If its subtree
  rejects, the other child is entered with scale min(1, D2(y) / E2(y)),
  D2 = D - min(Q_sel, D) and
      E2(y) = P(y drawn, not selected, the selected one rejected)
            = sum_z (u(y) q'(z) + q'(y) u(z)) (1 - c(y | z)) (1 - s(z)).
* **Slot order.** The first drawn child against q' (min(1, D/q')), then the
  second against its marginal law given the first drawn and rejected,
      E2(y) = q'(y) sum_{z != y} [q'(z) - D(z)]+ / (1 - q'(z)),
  which passes on at least as much as RRSw's second step (its per-pair
  ratios, summed, are bounded by this marginal one). On laws with zeros and
  ties it can beat the selection by ratio.
  Each node takes whichever passes on more demand, each slot's share weighed
  by w = sqrt(nodes in that slot's subtree): a choice made from p, q', P~ and
  the tree's shape alone, never from the drawn pair, so both stay lossless.
  With equal subtrees that is the coupling that leaves less over. Where they
  differ (irregular, EAGLE-like trees) the plain comparison does not see that
  the larger subtree is worth more once entered: it fell 1-21 % below
  traversal there. The first slot's share is one more sum in the third pass:
      by ratio:   sum_y s(y) u(y) A_q(y) + t(y) u(y) B_q(y)
      slot order: sum_y min(q'(y), D(y))
  (A_q, B_q: the partner-law sums of Q_sel and E2 with y drawn first).
* **Uneven pairs favour the larger subtree.** Where the two slots' subtrees differ
  in size, the selection by ratio compares ratios floored at tau = w_big / w_small
  (every ratio below tau is in tau's class) and gives ties to the larger slot: the
  larger subtree is selected unless the other token's ratio is above both its own
  and tau. Among the couplings that pass on about as much demand at this node,
  this routes more of it into the subtree worth more (the LP optimum enters the
  deeper child far more often than plain selection by ratio at the same one-step
  acceptance; ``benchmarks/studies/wor_irregular_gap.py``). Classes and a tie rule chosen
  per node from the shape stay exact: c(y | z) in Q_sel and E2 is 1 for a
  tie won by y's slot, 0 for one lost. Exact, V = 4, smooth laws: skewed trees
  91-92 -> 95 % of the LP optimum, EAGLE-like 91.7 -> 92.6 %; never below
  traversal on the irregular trees of ``tests/core/test_reductions.py``.
* What is left, R = D2 - min(E2, D2), is marginal over the pair: it does not
  depend on which pair was drawn. A later stage (slots 3-4, ...) sees the
  drawn history H: its draft law is q restricted off H and renormalised, its
  demand the density R / Zbar (Zbar = 1 - the pair's mean acceptance, the
  chance that this stage is reached), which gives back exactly R on average.
* **Three children above leaves** (m = 3, the last level): pairs alone stay below the
  one-step optimum (6 % on smooth laws: ``benchmarks/studies/wor_stage_bound.py`` bounds
  every rule that settles the pair before looking at x3), because x3 may have the
  best ratio of the three. So x3 goes first when its class is above both others',
  with probability e = (1 - q1 - q2) / ((1 - q1)(1 - q2)) <= 1, a factor that
  keeps its marginal a product of one-token sums (``_FirstOfThree``); then the
  pair by ratio as above, on what x3 left and with the chance that it was taken
  first in its marginals; then x3 again if it was not tried first
  (``_LastOfThree``, its law given the pair). 98-99 % of the LP optimum on the
  3x1 cases of ``lp_optimum.md``, where pairs reach 94 %. Above subtrees the pairs
  stay: the one-step gain moves scale away from x1, whose subtree the draft
  usually predicts best (on the real pair's 3x3 trees the triple everywhere lost
  3-8 % against traversal on HumanEval contexts).
* A lone slot (odd m, or a single child) is Block Verification's step:
  min(1, D(x) / q'(x)), R = [D - q']+.

At the end, h_v = rho / (rho + 1 - sigma) with rho = sum of the last stage's R
and sigma its demand's mass (sigma = P~_v when there is one stage), and
Y ~ R. With one child per node this is ``block``; at depth 1 it is a one-step
multi-draft coupling (the selection step above).

**Nearly sure drafts.** The closed forms above divide by complements such as
1 - q'(y) and 1 - q1 - q2 and split class sums into a token and the rest; when one
token of a stage's law holds all but a tail t of it, their rounding grows like
eps / t (pairs) and eps / t^2 (three children): law errors of 1e-12 at t ~ 1e-5
and of O(1) at t ~ 1e-16 in float64 (issue 61). So the rule runs in float64
whatever the rows' dtype, and a stage whose law is that sure is not used:
``lone_child_where_near_sure`` keeps, at such a node, the children before that
stage plus the stage's first slot (a lone slot: Block Verification's step,
min(1, D(x) / q'(x)), exact without any complement) and drops the later slots and
their subtrees, before any path runs (PyTorch, compiled, fused): lossless, since
what a node's rule reads no longer depends on the dropped draws; the cost is the
dropped children's second chance at nodes where the draft is that sure.

Every quantity is a closed form over the vocabulary per node and stage: three
passes over it (sums per class, then what the second chance misses, then the
leftover), each a few elementwise operations, scatters into the classes and
reductions; values at the drawn tokens come from the same formulas on those
two columns. Nothing of size [.., V] is kept: on CPU each pass walks the
vocabulary in cache-sized chunks (``vocab_slices``), on a GPU in one piece; a
later stage recomputes the earlier ones on the chunk it reads. No sort, no
loop over tokens, nodes or requests.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..ops import clipped_ratio, mass_off, stop_prob, vocab_slices
from .base import Family, NodeBatch, NodeOutput, TreeVerifier

# Vocabularies up to this size compare ratios by exact rank (a [.., V, V] comparison);
# larger ones by log-scale class: 32 classes per octave over 2^-32 .. 2^32 (the end
# classes beyond), one below for D = 0 and one above for q' = 0 (never drawn).
EXACT_RANK_VOCAB = 64
_CLASSES_PER_OCTAVE = 32
_OCTAVES = 64
_LOG_CLASSES = _CLASSES_PER_OCTAVE * _OCTAVES + 2

# A stage whose law leaves less than this share off its most likely token is not
# used (``lone_child_where_near_sure``): pair stages' float64 rounding is about
# 3e-17 / t in the law (exact enumeration, V = 4-5), so 1e-3 keeps it near 3e-14;
# three children above leaves round like 7e-17 / t^2, hence 0.03 there (~8e-14).
NEAR_SURE_TAIL = 1e-3
NEAR_SURE_TAIL_THREE = 0.03


def lone_child_where_near_sure(tree, tokens: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """tokens [B, N+1] with, at every node whose k-th stage law is nearly sure, the slots
    from 2k + 1 on set to -1 (and their subtrees): the k-th stage then runs its first
    slot alone. Stage k's law is q off the 2k tokens drawn before it; the check takes
    q's 2k most likely tokens as those (the draws that reach the stage most often), and
    calls the stage nearly sure when the mass off its next most likely token is below
    NEAR_SURE_TAIL (NEAR_SURE_TAIL_THREE for three children) of the mass it has, both
    masked sums. A later stage's law is renormalised by the mass off the earlier draws
    (1 - q1 - q2, which the kernels subtract): where q's 2k most likely tokens leave
    less than that share, stage k is dropped whole. tree: the tree's tensors
    (``TreeSpec.on``); draft_probs [B, N+1, V]."""
    children = tree.children  # [N+1, C]
    slots = children.shape[-1]
    vocab = draft_probs.shape[-1]
    if slots < 2:
        return tokens
    ranked = torch.topk(draft_probs, min(slots, vocab), dim=-1).indices  # [B, N+1, <= C]
    first_dropped = torch.full(tokens.shape, slots, dtype=torch.long, device=tokens.device)
    three = ((children >= 0).sum(-1) == 3).unsqueeze(0)  # [1, N+1]
    share = torch.where(three, NEAR_SURE_TAIL_THREE, NEAR_SURE_TAIL)
    for start in range(0, min(slots, ranked.shape[-1]), 2):  # stage k = start // 2: slots start, start + 1
        # The stage's law has the mass off the earlier draws (q's rows sum to 1: the first stage all of it).
        has = 1.0 if start == 0 else mass_off(draft_probs, ranked[..., :start]).squeeze(-1).double()
        if start > 0:  # renormalised by 1 - q1 - q2, which the kernels subtract
            first_dropped = torch.where(has < share, first_dropped.clamp(max=start), first_dropped)
        if start + 1 < slots:  # a pair whose law has (nearly) one token
            kept = mass_off(draft_probs, ranked[..., : start + 1]).squeeze(-1).double()
            first_dropped = torch.where(kept < share * has, first_dropped.clamp(max=start + 1), first_dropped)
    # A child is dropped when its slot is past its parent's first dropped slot; its
    # subtree with it (any dropped node among its ancestors). No host read.
    parent = tree.parent.clamp(min=0).unsqueeze(0).expand_as(tokens)
    dropped = (tree.slot.unsqueeze(0) >= first_dropped.gather(1, parent)) & (tree.parent >= 0)
    ancestors = tree.ancestors  # [N+1, D]: the path's nodes below the root, -1 past the node
    on_path = dropped.gather(1, ancestors.clamp(min=0).flatten().unsqueeze(0).expand(tokens.shape[0], -1))
    on_path = on_path.view(tokens.shape[0], *ancestors.shape) & (ancestors >= 0)
    return tokens.masked_fill(on_path.any(-1), -1)


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den where den > 0, else 0."""
    return (num / den).masked_fill_(den <= 0, 0.0)  # x/0 (inf or NaN) overwritten


def _log_class(ratio: torch.Tensor) -> torch.Tensor:
    """Positive finite ratios -> their log-scale class 1 .. _LOG_CLASSES - 2 (int64);
    ``ratio`` is overwritten (pass a temporary)."""
    octave = ratio.log2_().add_(_OCTAVES / 2).mul_(_CLASSES_PER_OCTAVE)
    return octave.clamp_(0, _LOG_CLASSES - 3).long().add_(1)


def log_ratio_classes(demand: torch.Tensor, law: torch.Tensor, floor: torch.Tensor | None = None) -> torch.Tensor:
    """[.., k] -> class of D/q' in 0 .. _LOG_CLASSES - 1 (int64), non-decreasing in the ratio;
    with ``floor`` [.., 1] (> 0 or 0 for none), ratios below it share the floor's class."""
    positive = (demand > 0) & (law > 0)
    # Where D or q' is 0 the ratio (0, inf or NaN) and its class are overwritten below.
    classes = _log_class(demand / law).masked_fill_(~positive, 0)
    if floor is not None:
        classes = torch.maximum(classes, _log_class(floor.clone()).masked_fill_(floor <= 0, 0))
    return classes.masked_fill_(law <= 0, _LOG_CLASSES - 1)


def rank_ratio_classes(demand: torch.Tensor, law: torch.Tensor, floor: torch.Tensor | None = None) -> torch.Tensor:
    """[.., V] -> the number of tokens with a smaller ratio D/q' (q' = 0: infinite), [.., V];
    with ``floor`` [.., 1], ratios below it count as the floor."""
    ratio = torch.where(law > 0, demand / torch.where(law > 0, law, 1.0), torch.full_like(law, float("inf")))
    if floor is not None:
        ratio = torch.maximum(ratio, floor)
    return (ratio.unsqueeze(-2) < ratio.unsqueeze(-1)).sum(-1)


def _ratio_classes(rank: torch.Tensor | None, cols: _Columns, demand: torch.Tensor, law: torch.Tensor, floor=None):
    """Classes of D / q' at the columns [.., k]: the exact rank (``rank`` [.., V], small
    vocabularies) or the log-scale class (floored at ``floor`` [.., 1] where given)."""
    if rank is None:
        return log_ratio_classes(demand, law, floor)
    return rank.gather(-1, cols.ids.clamp(min=0).expand_as(demand))


@dataclass
class _Columns:
    """Some vocabulary columns of a node batch: p, q [.., k] and their token ids
    ([k], or [.., k] for the drawn tokens; -1 for a missing token). ``memo`` keeps
    what the passes compute on these columns where they are the whole row (a GPU:
    each quantity computed once); None where chunks are walked (CPU: recomputed
    per pass from cached inputs instead of kept at [.., V])."""

    p: torch.Tensor
    q: torch.Tensor
    ids: torch.Tensor
    memo: dict | None = None

    @classmethod
    def chunks(cls, nodes: NodeBatch) -> list[_Columns]:
        # float64 whatever the rows' dtype (the rule's complements need it): per chunk on
        # CPU; whole rows elsewhere (this rule runs on a GPU only past its kernels' shapes).
        parts = vocab_slices(nodes.p)
        memo = len(parts) == 1
        f64 = torch.float64
        return [
            cls(
                nodes.p[..., part].to(f64),
                nodes.q[..., part].to(f64),
                torch.arange(part.start, part.stop, device=nodes.p.device),
            )
            if not memo
            else cls(nodes.p.to(f64), nodes.q.to(f64), torch.arange(nodes.vocab_size, device=nodes.p.device), {})
            for part in parts
        ]

    @classmethod
    def at(cls, nodes: NodeBatch, tokens: torch.Tensor) -> _Columns:
        safe = tokens.clamp(min=0)
        return cls(nodes.p.gather(-1, safe).double(), nodes.q.gather(-1, safe).double(), tokens, {})

    def listed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[.., k] bool: the columns whose token id is among ``tokens`` [.., m] (-1: none)."""
        return (self.ids.unsqueeze(-1) == tokens.unsqueeze(-2)).any(-1)

    @contextmanager
    def scratch(self):
        """A memo for one pass over chunked columns, dropped after it (whole rows keep theirs)."""
        if self.memo is not None:
            yield self
            return
        self.memo = {}
        try:
            yield self
        finally:
            self.memo = None

    def cached(self, owner, name: str, compute):
        """``compute()``, once per (owner, name) where the columns keep a memo."""
        if self.memo is None:
            return compute()
        key = (id(owner), name)
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]


def _walk(parts: list[_Columns]):
    """Each part of a pass, with a memo for that pass (chunks drop it after)."""
    for cols in parts:
        with cols.scratch():
            yield cols


class _NodeInputs:
    """The first stage's demand D = P~ p and draft law q."""

    def __init__(self, nodes: NodeBatch):
        self.scale = nodes.scale.unsqueeze(-1).double()

    def demand_law(self, cols: _Columns):
        return cols.cached(self, "demand_law", lambda: (self.scale * cols.p, cols.q))


class _LaterInputs:
    """A later stage's demand and law, given the earlier stage and the tokens it drew:
    the earlier leftover as a density given that this stage is reached, and the
    earlier law off the drawn tokens, renormalised."""

    def __init__(self, stage, parts: list[_Columns], drawn: torch.Tensor):
        self.stage = stage
        self.drawn = drawn  # [.., 2]
        # The earlier law's mass off the drawn tokens, a masked sum (not its mass less
        # theirs, which cancels when they held nearly all of it).
        norm = 0.0
        for cols in _walk(parts):
            law = stage.inputs.demand_law(cols)[1]
            norm = norm + law.masked_fill(cols.listed(drawn), 0.0).sum(-1, True)
        self.norm = norm.clamp(min=torch.finfo(torch.float64).tiny)
        # P(this stage is reached) = 1 - (demand passed on) = (1 - sigma) + rho.
        self.reached = ((1.0 - stage.sigma) + stage.rho).clamp(min=0)

    def demand_law(self, cols: _Columns):
        return cols.cached(self, "demand_law", lambda: self._demand_law(cols))

    def _demand_law(self, cols: _Columns):
        _, law, left = self.stage.evaluate(cols)
        drawn = cols.listed(self.drawn)
        return _safe_div(left, self.reached), law.masked_fill(drawn, 0.0) / self.norm


class _FirstOfThree:
    """Three children (x1, x2, x3) drawn without replacement: x3 is tried first when its
    ratio class is above both others', but only with probability
        e(x1, x2) = (1 - q1 - q2) / ((1 - q1)(1 - q2))      (<= 1)
    which cancels the 1 / (1 - q1 - q2) of x3's law given the pair and keeps every
    marginal a product of one-token factors (an exact rank of all three draws, the
    one-step optimum's order, needs sums over pairs of tokens: O(V^2)):
        E_A(y) = P(x3 = y tried first) = q'(y) sum_{a != b below y} w_a u_b,  w = u / (1 - q').
    y is accepted (its subtree entered) with t = min(1, D / E_A); the pair stage then
    runs on D_A = D - min(E_A, D), reached unless x3 went first and was taken: averaged
    over x3, with probability 1 - G(k) / ((1 - q1)(1 - q2)), k the pair's higher class,
    G(k) = sum_{c above k} q'(c) t(c). Ratio classes are those of D / q' (exact rank on
    small vocabularies) for all three stages."""

    def __init__(self, nodes: NodeBatch, parts: list[_Columns], inputs: _NodeInputs):
        self.inputs = inputs
        self.rank = None
        if nodes.vocab_size <= EXACT_RANK_VOCAB:
            self.rank = rank_ratio_classes(*inputs.demand_law(parts[0]))
        num_classes = nodes.vocab_size if self.rank is not None else _LOG_CLASSES
        # Pass 1: sums of u, w and w u per class -> sum_{a != b below k} w_a u_b.
        sums = nodes.p.new_zeros((*nodes.p.shape[:-1], 3, num_classes), dtype=torch.float64)
        sigma = 0.0
        for cols in _walk(parts):
            demand, law = inputs.demand_law(cols)
            sigma = sigma + demand.sum(-1, keepdim=True)
            u = _safe_div(law, 1.0 - law)
            w = _safe_div(u, 1.0 - law)
            index = self.classes(cols).unsqueeze(-2).expand(*law.shape[:-1], 3, law.shape[-1])
            sums.scatter_add_(-1, index, torch.stack([u, w, w * u], -2))
        below = sums.cumsum(-1).sub_(sums)
        self.pairs_below = (below[..., 0, :] * below[..., 1, :] - below[..., 2, :]).clamp_(min=0)
        self.sigma = sigma
        # Pass 2: G(k), the mass of the classes above k taken first.
        taken = nodes.p.new_zeros((*nodes.p.shape[:-1], num_classes), dtype=torch.float64)
        for cols in _walk(parts):
            law = inputs.demand_law(cols)[1]
            taken.scatter_add_(-1, self.classes(cols), law * self.take(cols)[0])
        self.taken_above_class = taken.sum(-1, keepdim=True) - taken.cumsum(-1)

    def classes(self, cols: _Columns) -> torch.Tensor:
        return cols.cached(self, "classes", lambda: _ratio_classes(self.rank, cols, *self.inputs.demand_law(cols)))

    def take(self, cols: _Columns):
        """t = min(1, D / E_A) and D_A = D - min(E_A, D) [.., k]."""

        def compute():
            demand, law = self.inputs.demand_law(cols)
            first = law * self.pairs_below.gather(-1, self.classes(cols))
            return clipped_ratio(demand, first), demand - torch.minimum(first, demand)

        return cols.cached(self, "take", compute)

    def taken_above(self, cols: _Columns) -> torch.Tensor:
        """G at the columns' classes [.., k]."""
        return cols.cached(self, "taken_above", lambda: self.taken_above_class.gather(-1, self.classes(cols)))

    def demand_law(self, cols: _Columns):
        """The pair stage's inputs: (D_A, q')."""
        return self.take(cols)[1], self.inputs.demand_law(cols)[1]


class _LastOfThree:
    """x3's second chance, after the pair (x1, x2) rejected: x3 not tried first. Given
    the pair and the stage reached, x3 = y (not x1, x2) with probability
        q'(y) [(1 - q1)(1 - q2) / (1 - q1 - q2) - [y above both]] / ((1 - q1)(1 - q2) - G(k))
    (the rest: x3 was tried first and rejected, nothing to try); the demand is the
    pair stage's leftover R as a density given the stage is reached."""

    def __init__(self, first: _FirstOfThree, pair: _Stage, xa: torch.Tensor, xb: torch.Tensor):
        self.first, self.pair = first, pair
        self.drawn = torch.cat([xa, xb], -1)
        cols = _Columns.at(pair.nodes, self.drawn)
        law = first.inputs.demand_law(cols)[1] * (self.drawn >= 0)
        keep = (1.0 - law[..., :1]) * (1.0 - law[..., 1:])
        self.spread = _safe_div(keep, 1.0 - law.sum(-1, keepdim=True))
        self.top_class = first.classes(cols).max(-1, keepdim=True).values
        self.norm = keep - first.taken_above_class.gather(-1, self.top_class)
        self.reached = (1.0 - (first.sigma - pair.rho)).clamp(min=0)

    def demand_law(self, cols: _Columns):
        return cols.cached(self, "demand_law", lambda: self._demand_law(cols))

    def _demand_law(self, cols: _Columns):
        law = self.first.inputs.demand_law(cols)[1]
        above = self.first.classes(cols) > self.top_class
        drawn = cols.listed(self.drawn)
        law = _safe_div((law * (self.spread - above.to(law.dtype))).masked_fill(drawn, 0.0).clamp(min=0), self.norm)
        return _safe_div(self.pair.evaluate(cols)[2], self.reached), law


class _Stage:
    """One stage: children in slots (a, b) drawn without replacement from the
    stage's law q' against its demand D (b = -1: a lone slot; a = -1: none).

    After construction: sigma (sum of D), rho (sum of the leftover R), law_mass
    (sum of q') [.., 1], and the acceptances of a and b [.., 1]."""

    def __init__(
        self,
        nodes: NodeBatch,
        parts: list[_Columns],
        inputs,
        xa: torch.Tensor,
        xb: torch.Tensor | None,
        slot_weights: torch.Tensor | None,
        first: _FirstOfThree | None = None,
    ):
        self.nodes, self.inputs, self.first = nodes, inputs, first
        self.slot_weights = slot_weights  # [.., 2] or None: weigh the pair's slots equally
        self.paired = xb is not None  # a second slot in the tree's shape (a drawn token or -1)
        xb = torch.full_like(xa, -1) if xb is None else xb
        self.has_a, self.has_b = xa >= 0, xb >= 0
        self.xb = xb
        # Uneven pairs (weighted slots): ratios floored and ties won by the larger subtree.
        self.floor, self.tie_a = None, 0.5
        if slot_weights is not None and first is None:
            w_a, w_b = slot_weights[..., :1], slot_weights[..., 1:]
            uneven = w_a != w_b
            self.floor = torch.where(uneven, torch.maximum(w_a, w_b) / torch.minimum(w_a, w_b), 0.0)
            self.tie_a = torch.where(uneven, (w_a > w_b).to(w_a.dtype), 0.5)
        self.rank = None
        if first is not None:
            self.rank = first.rank
        elif self.paired and nodes.vocab_size <= EXACT_RANK_VOCAB:  # one part: the whole row
            self.rank = rank_ratio_classes(*inputs.demand_law(parts[0]), self.floor)
        num_classes = nodes.vocab_size if self.rank is not None else _LOG_CLASSES

        # Pass 1: masses per class; the sums the lone and slot-order steps need.
        if self.paired:
            self.pair_lower = nodes.p.new_zeros(
                (*nodes.p.shape[:-1], 2 if first is None else 4, num_classes), dtype=torch.float64
            )
        sigma = law_mass = rho_lone = slot_missed = 0.0
        for cols in _walk(parts):
            demand, law = inputs.demand_law(cols)
            sigma = sigma + demand.sum(-1, keepdim=True)
            law_mass = law_mass + law.sum(-1, keepdim=True)
            rho_lone = rho_lone + self._lone_left(cols).sum(-1, keepdim=True)
            if self.paired:
                pair, index = self._pair_mass(cols)
                self.pair_lower.scatter_add_(-1, index, pair)
                slot_missed = slot_missed + self._slot_missed(cols).sum(-1, keepdim=True)
        self.sigma, self.law_mass, self.slot_missed = sigma, law_mass, slot_missed
        self.by_ratio = torch.zeros_like(self.has_a)
        self.rho = torch.where(self.has_a, rho_lone, sigma)
        if self.paired:
            self._pair_passes(parts, sigma, rho_lone)
        self._accept(xa, xb)

    def _pair_passes(self, parts: list[_Columns], sigma: torch.Tensor, rho_lone: torch.Tensor) -> None:
        self.pair_own = self.pair_lower.clone()
        self.pair_lower.copy_(self.pair_own.cumsum(-1)).sub_(self.pair_own)

        # Pass 2: what the selected child leaves unmet, per class; the slot-order leftover.
        self.missed_lower = torch.zeros_like(self.pair_lower)
        rho_slot = 0.0
        for cols in _walk(parts):
            _, index = self._pair_mass(cols)
            self.missed_lower.scatter_add_(-1, index, self._missed(cols))
            rho_slot = rho_slot + self._slot_order(cols)[1].sum(-1, keepdim=True)
        self.missed_own = self.missed_lower.clone()
        self.missed_total = self.missed_own.sum(-1, keepdim=True)
        self.missed_lower.copy_(self.missed_own.cumsum(-1)).sub_(self.missed_own)

        # Pass 3: the selection's leftover and what it passes to the first slot; then the
        # coupling worth more: demand passed on, each slot's share weighed by its subtree.
        weighted = self.slot_weights is not None
        rho_ratio = first_by_ratio = 0.0
        for cols in _walk(parts):
            by_ratio = self._by_ratio(cols)
            rho_ratio = rho_ratio + by_ratio[2].sum(-1, keepdim=True)
            if weighted:
                first_by_ratio = first_by_ratio + by_ratio[3].sum(-1, keepdim=True)
        gain = rho_slot - rho_ratio  # equal weights: the coupling that leaves less over
        if weighted:  # slot order passes sum_y min(q', D) = sigma - rho_lone to the first slot
            w_a, w_b = self.slot_weights[..., :1], self.slot_weights[..., 1:]
            gain = gain * w_b + (w_a - w_b) * (first_by_ratio - (sigma - rho_lone))
        self.by_ratio = gain >= 0
        if self.first is not None:  # the slot order's marginals would need the third draw
            self.by_ratio = torch.ones_like(self.by_ratio)
        self.rho = torch.where(self.has_b, torch.where(self.by_ratio, rho_ratio, rho_slot), self.rho)

    # ------------------------------------------------------------ formulas
    def _lone_left(self, cols: _Columns) -> torch.Tensor:
        """[D - q']+ [.., k]: what one child drawn from q' leaves over."""

        def compute():
            demand, law = self.inputs.demand_law(cols)
            return demand - torch.minimum(law, demand)

        return cols.cached(self, "lone_left", compute)

    def _classes(self, cols: _Columns) -> torch.Tensor:
        if self.first is not None:
            return self.first.classes(cols)
        return _ratio_classes(self.rank, cols, *self.inputs.demand_law(cols), self.floor)

    def _pair_mass(self, cols: _Columns):
        """The partner z's factors of P(pair {y, z} drawn) [.., 2, k]: (q', u), u = q' / (1 - q');
        after a first-of-three stage (q, u, u, w), w = u / (1 - q); their classes [.., r, k]."""

        def compute():
            law = self.inputs.demand_law(cols)[1]
            u = _safe_div(law, 1.0 - law)
            rows = [law, u] if self.first is None else [law, u, u, _safe_div(u, 1.0 - law)]
            pair = torch.stack(rows, -2)
            return pair, self._classes(cols).unsqueeze(-2).expand_as(pair)

        return cols.cached(self, "pair_mass", compute)

    def _own_factors(self, cols: _Columns, partner_above: bool) -> torch.Tensor:
        """y's factors [.., r, k] against ``_pair_mass``: P({y, z}) = u_y q_z + q_y u_z, less,
        after a first-of-three stage, the chance G(k) / ((1 - q_y)(1 - q_z)) that the third
        child was taken first (k: the higher class of y, z; its G on y's side unless
        ``partner_above``, where _missed carries it)."""
        pair, _ = self._pair_mass(cols)
        law, u = pair[..., 0, :], pair[..., 1, :]
        if self.first is None:
            return torch.stack([u, law], -2)
        w = pair[..., 3, :]
        taken = 1.0 if partner_above else self.first.taken_above(cols)
        return torch.stack([u, law, -taken * w, -taken * u], -2)

    def _missed(self, cols: _Columns) -> torch.Tensor:
        """(1 - s) times the partner factors [.., r, k] (and G on the G rows) of a selected z."""
        pair, _ = self._pair_mass(cols)
        missed = pair * (1.0 - self._selected(cols)[0]).unsqueeze(-2)
        if self.first is not None:
            missed = missed * torch.cat(
                [
                    torch.ones_like(pair[..., :2, :]),
                    self.first.taken_above(cols).unsqueeze(-2).expand_as(pair[..., 2:, :]),
                ],
                -2,
            )
        return missed

    def _tie_won(self, by_y: bool):
        """The chance that y (partner z, in one ratio class) is selected ([.., 2, 1], rows as
        ``_own_factors``: y drawn first (slot a), second (slot b); a fair coin: 0.5), or,
        ``by_y`` False, that z is."""
        if isinstance(self.tie_a, float):
            return 0.5
        a = self.tie_a if by_y else 1.0 - self.tie_a
        return torch.stack([a, 1.0 - a], -2)

    def _selected(self, cols: _Columns):
        """s = min(1, D / Q_sel), D2 = D - min(Q_sel, D) [.., k] and the terms of Q_sel
        [.., r, k] (row 0: y drawn first)."""

        def compute():
            demand = self.inputs.demand_law(cols)[0]
            pair, index = self._pair_mass(cols)
            after = self.pair_lower.gather(-1, index) + self._tie_won(True) * (self.pair_own.gather(-1, index) - pair)
            terms = self._own_factors(cols, False) * after  # row 0: y drawn first, z second
            selected = terms.sum(-2).clamp(min=0)  # Q_sel
            take = clipped_ratio(demand, selected)
            return take, demand - torch.minimum(selected, demand), terms

        return cols.cached(self, "selected", compute)

    def _by_ratio(self, cols: _Columns):
        """Selection by ratio class: (s, t, leftover, passed to the first slot) [.., k],
        t = min(1, D2 / E2); the last only for weighted slots (else None)."""

        def compute():
            _, index = self._pair_mass(cols)
            take, left, selected_terms = self._selected(cols)
            missed = self._missed(cols)
            own = self.missed_own.gather(-1, index)
            above = self.missed_total - self.missed_lower.gather(-1, index) - own
            before = above + self._tie_won(False) * (own - missed)
            terms = self._own_factors(cols, True) * before  # row 0: y drawn first
            second = terms.sum(-2).clamp(min=0)  # E2
            second_take = clipped_ratio(left, second)
            to_first = None
            if self.slot_weights is not None:
                to_first = take * selected_terms[..., 0, :] + second_take * terms[..., 0, :]
            return take, second_take, left - torch.minimum(second, left), to_first

        return cols.cached(self, "by_ratio", compute)

    def _slot_missed(self, cols: _Columns) -> torch.Tensor:
        """[q' - D]+ / (1 - q') [.., k]."""

        def compute():
            demand, law = self.inputs.demand_law(cols)
            return _safe_div((law - demand).clamp(min=0), 1.0 - law)

        return cols.cached(self, "slot_missed", compute)

    def _slot_order(self, cols: _Columns):
        """Slot order: (the second's E2, leftover after both) [.., k]."""
        law = self.inputs.demand_law(cols)[1]
        lone_left = self._lone_left(cols)
        second = (law * (self.slot_missed - self._slot_missed(cols))).clamp(min=0)
        return second, lone_left - torch.minimum(second, lone_left)

    def evaluate(self, cols: _Columns):
        """(D, q', leftover R) at the columns ``cols``."""

        def compute():
            demand, law = self.inputs.demand_law(cols)
            left = self._lone_left(cols)
            if self.paired:
                pair_left = torch.where(self.by_ratio, self._by_ratio(cols)[2], self._slot_order(cols)[1])
                left = torch.where(self.has_b, pair_left, left)
            return demand, law, torch.where(self.has_a, left, demand)

        return cols.cached(self, "evaluate", compute)

    def _accept(self, xa: torch.Tensor, xb: torch.Tensor) -> None:
        """accept_a, accept_b [.., 1]: the chance that the pair's a (b) subtree is entered."""
        cols = _Columns.at(self.nodes, torch.cat([xa, xb], -1))
        demand, law = self.inputs.demand_law(cols)
        self.demand_law_at_tokens = (demand, law)
        lone_a = clipped_ratio(demand[..., :1], law[..., :1])
        self.accept_a, self.accept_b = lone_a * self.has_a, torch.zeros_like(lone_a)
        if not self.paired:
            return
        take, second_take = self._by_ratio(cols)[:2]
        classes = self._classes(cols)
        a_above = (classes[..., :1] - classes[..., 1:]).sign().to(law.dtype)
        a_wins = torch.where(a_above == 0, self.tie_a, 0.5 + 0.5 * a_above)  # c(a | b)
        b_wins, rejected = 1.0 - a_wins, 1.0 - take
        ratio_a = a_wins * take[..., :1] + b_wins * rejected[..., 1:] * second_take[..., :1]
        ratio_b = b_wins * take[..., 1:] + a_wins * rejected[..., :1] * second_take[..., 1:]
        second = self._slot_order(cols)[0]
        slot_b = (1.0 - lone_a) * clipped_ratio(self._lone_left(cols)[..., 1:], second[..., 1:])
        accept_a = torch.where(self.has_b, torch.where(self.by_ratio, ratio_a, lone_a), lone_a)
        accept_b = torch.where(self.by_ratio, ratio_b, slot_b)
        self.accept_a = accept_a * self.has_a
        self.accept_b = accept_b * self.has_b


class UniVerWorVerifier(TreeVerifier):
    name = "univer_wor"
    scheme = "wor"
    family = Family.POSTORDER
    uses_kid_sizes = True

    def node_rule(self, nodes: NodeBatch, want_residual: bool) -> NodeOutput:
        parts = _Columns.chunks(nodes)
        weights, last, pairs_stop = self._in_pairs(nodes, parts)
        if nodes.tokens.shape[-1] == 3:
            # Three children: the stage that may try x3 first.
            triple, triple_last = self._three(nodes, parts)
            # Only above leaves, with all three drawn. Leaves: there a node's value is its
            # one-step acceptance, which the triple raises; above subtrees it moves scale
            # to the best-ratio child, rarely the likely x1 whose subtree the draft
            # predicts best (triple everywhere: 3x3 HumanEval trees of the real pair 3-8 %
            # below traversal; above leaves only: level with the pairs, paired contexts).
            # Drawn: a child is missing only where the step cut the tree (the pair rule is
            # exact there, the triple's marginals are not) or where q holds fewer than three
            # tokens (the pair rule serves it): never by chance.
            sizes = nodes.kid_sizes
            above_leaves = (sizes == 1).all(-1, keepdim=True)
            use_triple = above_leaves & (nodes.tokens >= 0).all(-1, keepdim=True)
            weights = torch.where(use_triple, triple, weights)
            last = (triple_last, last, use_triple)
            stop = torch.where(use_triple, stop_prob(triple_last.rho, triple_last.sigma), pairs_stop).squeeze(-1)
        else:
            stop = pairs_stop.squeeze(-1)
        residual = None
        if want_residual:
            residual = torch.cat(
                [self._select(last, lambda stage, c=cols: stage.evaluate(c)[2]) for cols in _walk(parts)], -1
            )
        dtype = nodes.p.dtype  # the rule ran in float64; the tree pass keeps the rows' dtype
        return NodeOutput(weights.to(dtype), stop.to(dtype), None if residual is None else residual.to(dtype))

    @staticmethod
    def _select(last, value):
        """``value`` of the last stage; where both constructions ran, per node."""
        if isinstance(last, tuple):
            triple, pairs, use_triple = last
            return torch.where(use_triple, value(triple), value(pairs))
        return value(last)

    @staticmethod
    def _in_pairs(nodes: NodeBatch, parts: list[_Columns]):
        """Children in pairs of slots: child weights [.., C] (P(the child ends the step) given
        that no earlier one did), the last stage and the node's h [.., 1]."""
        tokens = nodes.tokens
        slots = tokens.shape[-1]
        inputs = _NodeInputs(nodes)
        weights, stop = [], None
        for start in range(0, slots, 2):  # stages; nodes and requests stay batched
            xa = tokens[..., start : start + 1]
            xb = tokens[..., start + 1 : start + 2] if start + 1 < slots else None
            slot_weights = None  # equal subtrees: the unweighted choice, no need to weigh
            if nodes.kid_sizes is not None and start + 1 < slots and not nodes.even_pairs:
                slot_weights = nodes.kid_sizes[..., start : start + 2].to(torch.float64).sqrt()
            stage = _Stage(nodes, parts, inputs, xa, xb, slot_weights)
            # h from the last stage with a child: an empty stage's own sigma is the earlier
            # leftover as a density (sigma ~ 1 at the root), and its 1 - sigma cancels.
            stage_stop = stop_prob(stage.rho, stage.sigma)
            stop = stage_stop if stop is None else torch.where(stage.has_a, stage_stop, stop)
            weights.append(stage.accept_a)
            if start + 1 < slots:
                weights.append(clipped_ratio(stage.accept_b, 1.0 - stage.accept_a))
            # The next stage sees this history: its draft law (q off the drawn tokens) and
            # the leftover as a density given that the stage is reached.
            if start + 2 < slots:
                inputs = _LaterInputs(stage, parts, torch.cat([xa, stage.xb], -1))
        return torch.cat(weights, -1), stage, stop

    @staticmethod
    def _three(nodes: NodeBatch, parts: list[_Columns]):
        """Three children drawn: x3 first (sometimes, see _FirstOfThree), the pair, x3 again.
        Child weights [.., 3] and the last stage."""
        x1, x2, x3 = nodes.tokens.split(1, -1)
        first = _FirstOfThree(nodes, parts, _NodeInputs(nodes))
        pair = _Stage(nodes, parts, first, x1, x2, None, first)
        last = _Stage(nodes, parts, _LastOfThree(first, pair, x1, x2), x3, None, None)
        cols = _Columns.at(nodes, nodes.tokens)
        law = first.inputs.demand_law(cols)[1]
        classes = first.classes(cols)
        above = (classes[..., 2:] > classes[..., :2].max(-1, keepdim=True).values) & (nodes.tokens >= 0).all(-1, True)
        keep = (1.0 - law[..., :1]) * (1.0 - law[..., 1:2])
        tried = above * _safe_div((1.0 - law[..., :2].sum(-1, keepdim=True)).clamp(min=0), keep)
        first_taken = tried * first.take(cols)[0][..., 2:]
        pair_taken = pair.accept_a + pair.accept_b
        third = first_taken + (1.0 - tried) * (1.0 - pair_taken) * last.accept_a
        ends = torch.cat([(1.0 - first_taken) * pair.accept_a, (1.0 - first_taken) * pair.accept_b, third], -1)
        before = torch.cat([torch.zeros_like(third), ends[..., :2].cumsum(-1)], -1)
        return clipped_ratio(ends, 1.0 - before), last
