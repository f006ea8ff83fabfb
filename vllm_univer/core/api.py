"""Public entry points: ``verify`` (sample one step) and ``outcome_law`` (its exact law).

In vLLM's words (``rejection_sampler.py``): output tokens = accepted tokens +
recovered tokens + bonus tokens. Here the accepted tokens are the path from the
root to the end node e, and one more token Y follows them: the *recovered* token
(drawn from e's residual) when the walk stopped at a node with children, the
*bonus* token (drawn from p_e) when e is a leaf. ``docs/glossary.md`` maps the
paper's symbols (P~, q bar, h) and the dimension letters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .backends import Backend, choose_backend
from .compiled_rules import node_rule_for
from .fused_tree_pass import fused_chain_step, fused_finish, fused_node_weights, fused_wor_step
from .inverse_cdf import sample_from_weights
from .ops import normalize
from .tree import TreeSpec
from .tree_pass import decide_descent, decide_postorder, end_node_law, node_residuals, node_weights
from .validation import check_inputs
from .verifiers import Family, get_verifier
from .verifiers.univer_wor import lone_child_where_near_sure


@dataclass
class VerifyOutput:
    """Result of one verification step for B requests.

    output_token_ids: LongTensor [B, D+1], accepted draft tokens then the next
        token, padded with -1 (the layout of vLLM's rejection sampler).
    num_accepted: LongTensor [B], accepted draft tokens (= depth of end_node).
    end_node: LongTensor [B], the tree node the accepted path ends at (0 = root).
    """

    output_token_ids: torch.Tensor
    num_accepted: torch.Tensor
    end_node: torch.Tensor


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def verify(
    method: str,
    tree: TreeSpec,
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    greedy: torch.Tensor | None = None,
    validate: bool = True,
    fused: bool | None = None,
    compiled: bool | None = None,
) -> VerifyOutput:
    """Verify a batch of draft trees: sample the accepted path and the next token.

    Args:
        method: one of ``METHODS``.
        tree: the shape shared by the batch.
        draft_token_ids: LongTensor [B, N+1]; column 0 ignored; -1 marks a node
            that does not exist (then neither do its descendants).
        target_probs: FloatTensor [B, N+1, V]; row i = p(. | path to node i),
            the distribution non-speculative sampling would draw from.
        draft_probs: FloatTensor [B, N+1, V]; row i = q that node i's children
            were drawn from with the method's draft scheme (leaf rows ignored).
        generator: optional torch.Generator on the inputs' device.
        greedy: BoolTensor [B] or None; rows marked True (temperature 0) use pure
            argmax matching: descend into the child whose token is argmax p, else
            Y = argmax p.
        validate: check the inputs (one host sync); engines that already
            guarantee well-formed inputs may skip it.
        fused: run as Triton kernels (``fused_tree_pass``; the same law): the
            tree methods in one launch per depth level plus one for the rest
            of the step, token / block in one launch per step, univer_wor in
            one or two per level plus one or two for the draw (on trees of at
            most four children per node; elsewhere it runs its PyTorch rule).
            None: on CUDA when Triton is there.
        compiled: run the PyTorch node rule compiled by torch.compile
            (``compiled_rules``; univer_wor only, the same formulas fused).
            None: where ``VLLM_UNIVER_COMPILE_RULES=1``.

    The law of (path, Y) is exactly ``outcome_law``; averaged over the draft
    scheme's trees it is the target's law (lossless). Runs on the inputs' device
    with no host sync beyond the optional validation; loops over depth levels
    (and, for rrs/rrsw/traversal, over child slots); vocabulary-sized
    temporaries are a few [B, nodes of one level, V] tensors in float32 (float64
    for float64 inputs, and in univer_wor's PyTorch rule, per vocabulary chunk on
    CPU: its closed forms need it, see ``univer_wor``); Y is drawn by a two-stage float64 inverse CDF
    (``inverse_cdf.sample_from_weights``), which builds no [B, V] float64 tensor.
    """
    verifier = get_verifier(method)
    if validate:
        check_inputs(verifier, tree, draft_token_ids, target_probs, draft_probs, greedy)
    backend = choose_backend(method, tree, target_probs, draft_probs, fused, compiled)
    rule = node_rule_for(method, backend is Backend.COMPILED, target_probs.device)
    tt = tree.on(target_probs.device)
    dtype = _work_dtype(target_probs)
    tokens = draft_token_ids.long()
    argmax_tokens = tokens  # greedy rows match the argmax against every drafted token
    if method == "univer_wor":  # every path runs the same (lossless) trees
        tokens = lone_child_where_near_sure(tt, tokens, draft_probs)
    # The kernels read any float dtype in place; the PyTorch rules work in dtype.
    p = target_probs if backend.fused else target_probs.to(dtype)
    q = draft_probs if backend.fused else draft_probs.to(dtype)

    if backend is Backend.FUSED_CHAIN:  # the whole step, greedy rows and output rows included
        output_token_ids, end = fused_chain_step(verifier, tokens, p, q, greedy, generator)
        return VerifyOutput(output_token_ids, end, end)
    if backend is Backend.FUSED_TREE:  # node rules per level, then the rest of the step in one launch
        weight, stop, params = fused_node_weights(verifier, tt, tokens, p, q, dtype)
        return VerifyOutput(*fused_finish(verifier, tt, tokens, p, q, weight, stop, params, greedy, generator))
    if backend is Backend.FUSED_WOR:  # node rules per level, the draw in one more launch
        end, next_token = fused_wor_step(tt, tokens, p, q, dtype, generator)
    else:  # TORCH or COMPILED: the PyTorch node rules
        end, next_token = _end_and_next_token(verifier, tt, tree, tokens, p, q, generator, rule)

    if greedy is not None:
        greedy_end, greedy_next = _argmax_matching(tt, argmax_tokens, p.argmax(-1))
        end = torch.where(greedy, greedy_end, end)
        next_token = torch.where(greedy, greedy_next, next_token)

    return _assemble(tt, argmax_tokens, end, next_token, tree.max_depth)


def _end_and_next_token(verifier, tt, tree: TreeSpec, tokens, p, q, generator, node_rule=None):
    """(end node [B], next token [B]) by the PyTorch node rules (``node_rule``: compiled,
    else the verifier's own): weights level by level, the decision, then the draw from
    the end node's residual."""
    weight, stop = node_weights(verifier, tt, tokens, p, q, node_rule)
    uniforms = torch.rand(tokens.shape[0], tree.num_nodes + 1, generator=generator, device=p.device, dtype=p.dtype)
    if verifier.family is Family.POSTORDER:
        end = decide_postorder(tt, stop, uniforms)
    else:
        end = decide_descent(tt, weight, uniforms, tree.max_depth)
    residual = node_residuals(verifier, tt, tokens, p, q, weight, end.unsqueeze(-1), node_rule).squeeze(1)
    p_end = p.gather(1, end.view(-1, 1, 1).expand(-1, 1, p.shape[-1])).squeeze(1)
    # An empty residual at the end node has probability 0 in exact arithmetic;
    # fall back to p_end so rounding can never produce an arbitrary token.
    empty = residual.sum(-1, keepdim=True) <= 0
    return end, sample_from_weights(torch.where(empty, p_end, residual), generator)


def verify_greedy(tree: TreeSpec, draft_token_ids: torch.Tensor, target_argmax: torch.Tensor) -> VerifyOutput:
    """Temperature-0 verification of a batch: ``verify`` with every row greedy,
    from the target's argmax alone (no probabilities, no randomness).

    draft_token_ids: LongTensor [B, N+1] as in ``verify``; target_argmax:
    LongTensor [B, N+1], the token greedy decoding picks after node i (argmax of
    its processed logits, as vLLM's greedy sampler takes it). Descends into the
    first child whose token is its parent's argmax; the next token is the end
    node's argmax.
    """
    tt = tree.on(target_argmax.device)
    tokens = draft_token_ids.long()
    end, next_token = _argmax_matching(tt, tokens, target_argmax)
    return _assemble(tt, tokens, end, next_token, tree.max_depth)


def _argmax_matching(tt, tokens: torch.Tensor, argmax_rows: torch.Tensor):
    """(end node [B], next token [B]) of argmax matching; argmax_rows [B, N+1].

    The walk descends into the first child (slot order) holding its parent's
    argmax. A node is on it iff it and each of its ancestors is its parent's first
    matching child; those nodes form one chain from the root, and the end is its
    deepest node. Found for all depths at once (no loop over levels).
    """
    match = (tokens == tt.at_parents(argmax_rows)) & (tokens >= 0)
    match[:, 0].fill_(False)
    first = match & ~tt.at_earlier_siblings(F.pad(match, (0, 1))).any(-1)
    on_walk = tt.along_paths(F.pad(first, (0, 1), value=True)).all(-1)  # the root: an empty path
    end = torch.where(on_walk, tt.depth, -1).argmax(-1)
    return end, argmax_rows.gather(1, end.unsqueeze(-1)).squeeze(-1)


def _assemble(tt, tokens: torch.Tensor, end: torch.Tensor, next_token: torch.Tensor, max_depth: int) -> VerifyOutput:
    path = tt.ancestors_of(end)  # [B, D]
    accepted = tokens.gather(1, path.clamp(min=0)).masked_fill(path < 0, -1)
    out = torch.cat([accepted, torch.full_like(accepted[:, :1], -1)], 1)
    num_accepted = tt.depth[end]
    out.scatter_(1, num_accepted.unsqueeze(-1), next_token.unsqueeze(-1))
    return VerifyOutput(out, num_accepted, end)


def outcome_law(
    method: str,
    tree: TreeSpec,
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    compiled: bool = False,
    rule_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Exact law of one verification step for these fixed trees.

    Same inputs as ``verify``. Returns DoubleTensor [B, N+1, V]:
    P(end node = i, next token = y), computed in float64 in closed form from
    the same node rules that ``verify`` samples with (``compiled``: their
    compiled form, as ``verify(compiled=True)`` runs them). ``rule_dtype``: the
    dtype the node rules run in (float64, the law; the rows' own dtype, e.g.
    float32: the law that ``verify`` on those rows samples from, its rounding
    included); the law is assembled in float64 either way.
    """
    verifier = get_verifier(method)
    check_inputs(verifier, tree, draft_token_ids, target_probs, draft_probs)
    tt = tree.on(target_probs.device)
    tokens = draft_token_ids.long()
    if method == "univer_wor":
        tokens = lone_child_where_near_sure(tt, tokens, draft_probs)
    p = target_probs.to(rule_dtype)
    q = draft_probs.to(rule_dtype)
    rule = node_rule_for(method, compiled, p.device)
    weight, stop = node_weights(verifier, tt, tokens, p, q, rule)
    end_law = end_node_law(verifier, tt, weight.double(), None if stop is None else stop.double())
    all_nodes = torch.arange(tree.num_nodes + 1, device=p.device).expand(tokens.shape[0], -1)
    residual = node_residuals(verifier, tt, tokens, p, q, weight, all_nodes, rule).double()
    p = p.double()
    y_law, mass = normalize(residual)
    # The same fallback as verify: an empty residual draws from p (zero-probability case).
    y_law = torch.where((mass > 0).unsqueeze(-1), y_law, p)
    exists = (tokens >= 0) | (all_nodes == 0)
    y_law = torch.where(exists.unsqueeze(-1), y_law, torch.zeros_like(y_law))
    return end_law.unsqueeze(-1) * y_law
