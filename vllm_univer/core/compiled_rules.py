"""Node rules compiled by ``torch.compile`` (Inductor): the same formulas, fused.

univer_wor's hand-written kernels (``kernels/triton_wor_verify.py``) run on CUDA,
for trees of at most four children per node; its PyTorch rule is three passes over the
vocabulary per stage, each a chain of elementwise ops, scatters into ratio classes
and reductions, about 1 500 ATen ops per ``verify`` call on a 2x5 tree (each a
launch on CUDA) and, on CPU, [.., V] temporaries written and read back between
them. Inductor fuses those chains into a few loops per level (Triton kernels on
CUDA, C++ on CPU) from the very code the exact tests check: no second copy of
the rule to keep in step with the first.

The law is the rule's: the compiled code evaluates the same expressions, only
sums are taken in another order, so probabilities differ by float rounding
(``tests/core/test_compiled_rules.py`` checks the exact end-node and residual laws
against the eager rule in float64 and samples ``verify`` through it).

Shapes: the node batch is flattened to [1, B * n, ..] and compiled with dynamic
sizes, so one graph serves every level and batch size of a tree (a batch of one
node is specialised once more by the compiler); the vocabulary is one piece
(``ops.vocab_slices`` while compiling). The first call of each variant compiles
(seconds to a minute; later processes reuse Inductor's cache).
"""

from __future__ import annotations

import functools
import os

import torch

from .verifiers import NodeBatch, NodeOutput, get_verifier

# Methods whose rule ``verify`` compiles when asked to (``compiled=True`` or the
# environment variable below): those without hand-written Triton kernels.
COMPILABLE_METHODS = ("univer_wor",)
COMPILE_ENV = "VLLM_UNIVER_COMPILE_RULES"
# Variants one rule may compile: with or without the residual, dtype, tree shape
# (children per node, even pairs), small vocabularies (exact ratio ranks), one node.
# A serving process meets a few; a test session many (torch's default is 8).
RECOMPILE_LIMIT = 64


# On an H200 (torch 2.11, Inductor's Triton code) the compiled univer_wor rule sampled
# a law the exact one rejects (benchmarks/results/gpu_check.md, 2026-12-04: chi-square
# p = 1.8e-44 on 4 trees x 50 000; the eager rule passed on the same inputs). Until
# that is found and the check passes there, compiled rules run on CPU only
# (benchmarks/gpu_check.py sets CUDA_CHECK_ENV=1 to run that check again).
CUDA_CHECK_ENV = "VLLM_UNIVER_CHECK_COMPILED_ON_CUDA"
CUDA_REFUSAL = (
    "compiled node rules are refused on CUDA: on an H200 the compiled univer_wor rule failed its "
    "law check (benchmarks/results/gpu_check.md); pass compiled=False (the PyTorch rule passed)"
)


def compile_by_default(method: str, device: torch.device | str = "cpu") -> bool:
    """Whether ``verify(compiled=None)`` compiles ``method``'s rule on ``device``:
    ``VLLM_UNIVER_COMPILE_RULES=1`` for every compilable method, off CUDA; else not."""
    on_cuda = torch.device(device).type == "cuda"
    return method in COMPILABLE_METHODS and os.environ.get(COMPILE_ENV, "0") == "1" and not on_cuda


def node_rule_for(method: str, compiled: bool, device: torch.device | str = "cpu"):
    """The compiled node rule of ``method`` where ``compiled``, else None (the
    verifier's own rule); a clear error for a method with no compiled rule, and
    on CUDA (``CUDA_REFUSAL``)."""
    if not compiled:
        return None
    if method not in COMPILABLE_METHODS:
        raise ValueError(f"no compiled rule for {method!r}; it exists for {', '.join(COMPILABLE_METHODS)}")
    if torch.device(device).type == "cuda" and os.environ.get(CUDA_CHECK_ENV) != "1":
        raise ValueError(CUDA_REFUSAL)
    return compiled_node_rule(method)


@functools.cache
def compiled_node_rule(method: str):
    """``node_rule(nodes, want_residual) -> NodeOutput`` of ``method``, compiled."""
    verifier = get_verifier(method)

    def rule_on_tensors(p, q, tokens, scale, kid_sizes, even_pairs: bool, want_residual: bool):
        out = verifier.node_rule(NodeBatch(p, q, tokens, scale, kid_sizes, even_pairs), want_residual)
        return out.child_weights, out.stop_prob, out.residual

    compiled = torch.compile(rule_on_tensors, fullgraph=True, dynamic=True)

    def node_rule(nodes: NodeBatch, want_residual: bool) -> NodeOutput:
        batch, n = nodes.scale.shape
        vocab, slots = nodes.p.shape[-1], nodes.tokens.shape[-1]
        sizes = nodes.kid_sizes
        if sizes is not None:
            sizes = sizes.expand(batch, n, slots).reshape(1, batch * n, slots).contiguous()
        # Contiguous inputs: a compiled graph is specialised on strides too.
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            weights, stop, residual = compiled(
                nodes.p.reshape(1, batch * n, vocab).contiguous(),
                nodes.q.reshape(1, batch * n, vocab).contiguous(),
                nodes.tokens.reshape(1, batch * n, slots).contiguous(),
                nodes.scale.reshape(1, batch * n).contiguous(),
                sizes,
                nodes.even_pairs,
                want_residual,
            )
        return NodeOutput(
            weights.view(batch, n, slots),
            None if stop is None else stop.view(batch, n),
            None if residual is None else residual.view(batch, n, vocab),
        )

    return node_rule
