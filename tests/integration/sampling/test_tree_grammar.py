"""Grammar bitmask rows per tree node (``tree_grammar``) against the row vLLM's
grammar gives a chain: for every node, the row of a fresh grammar that has
accepted the node's path, on vLLM's own ``XgrammarGrammar`` and a real tokenizer."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("vllm")
xgr = pytest.importorskip("xgrammar")

from tiny_models import build_tokenizer  # noqa: E402

from vllm_univer import TreeSpec  # noqa: E402
from vllm_univer.integration.sampling.tree_grammar import TreeGrammarBitmask, _allows  # noqa: E402

REGEX = "([a-m][n-z])+"  # letters alternate between the two halves: every row depends on its path


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    tokenizer = build_tokenizer(tmp_path_factory.mktemp("grammar_tok"), vocab_size=32)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    return xgr.GrammarCompiler(info).compile_regex(REGEX), len(tokenizer)


def new_grammar(compiled, max_rollback: int):
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    ctx, vocab = compiled
    return XgrammarGrammar(matcher=xgr.GrammarMatcher(ctx, max_rollback_tokens=max_rollback), vocab_size=vocab, ctx=ctx)


def chain_row(compiled, path: list[int]):
    """The row after ``path``, or None if the grammar refuses a token of it."""
    grammar = new_grammar(compiled, 0)
    bitmask = xgr.allocate_token_bitmask(1, compiled[1])
    for token in path:
        if grammar.is_terminated() or not grammar.matcher.accept_token(token):
            return None
        grammar._is_terminated = grammar.matcher.is_terminated()
    if grammar.is_terminated():
        return torch.full_like(bitmask[0], -1)
    grammar.fill_bitmask(bitmask, 0)
    return bitmask[0]


@pytest.mark.parametrize("tree_text", ["2x3", "3x2", "1x5"])
@pytest.mark.parametrize("seed", range(4))
def test_each_node_row_is_the_grammar_after_its_path(compiled, tree_text, seed):
    tree = TreeSpec.parse(tree_text)
    rng = random.Random(seed)
    vocab = compiled[1]
    prefix = [3, 16]  # "an": the committed output so far
    grammar = new_grammar(compiled, tree.num_nodes)
    for token in prefix:
        assert grammar.accept_tokens("r", [token])
    # Node tokens: mostly ones the grammar allows on the node's path, some not, EOS (2) now and then.
    tokens = []
    for node in range(1, tree.num_nodes + 1):
        path = [tokens[a - 1] for a in tree.ancestors[node].tolist() if 0 < a != node]
        row = chain_row(compiled, prefix + path)
        allowed = [t for t in range(vocab) if row is not None and _allows(row, t)]
        valid = allowed and (node == 1 or rng.random() < 0.75)
        tokens.append(rng.choice(allowed) if valid else rng.randrange(vocab))
    scheduled = rng.choice([tree.num_nodes, max(1, tree.num_nodes - 3)])  # a breadth-first prefix, too
    first_row = 2
    bitmask = xgr.allocate_token_bitmask(first_row + tree.num_nodes + 1, vocab)
    bitmask.fill_(7)
    rows = TreeGrammarBitmask(tree).fill(grammar, "r", tokens[:scheduled], bitmask, first_row, -1)

    assert rows == scheduled + 1
    assert grammar.num_processed_tokens == len(prefix)  # the grammar is left where it was
    assert torch.equal(bitmask[first_row], chain_row(compiled, prefix))
    assert (bitmask[:first_row] == 7).all() and (bitmask[first_row + scheduled + 1 :] == 7).all()
    reachable_rows = 0
    for node in range(1, scheduled + 1):
        path_nodes = [a for a in tree.ancestors[node].tolist() if a > 0]  # root excluded, node included
        expected = chain_row(compiled, prefix + [tokens[v - 1] for v in path_nodes])
        if expected is None:  # unreachable: the row of the deepest node whose path the grammar allows
            reachable = max(
                v
                for v in [0] + path_nodes
                if v == 0 or chain_row(compiled, prefix + [tokens[a - 1] for a in path_nodes if a <= v]) is not None
            )
            expected = bitmask[first_row + reachable]
        else:
            reachable_rows += 1
        assert torch.equal(bitmask[first_row + node], expected), (node, tokens)
    assert reachable_rows > 0


def test_rows_below_the_end_of_the_grammar_allow_everything(compiled):
    """After a path accepts the stop token the grammar is terminated: its rows are
    all-allowed (as vLLM fills a terminated grammar's rows), and the grammar is
    rolled back to the committed state."""
    tree = TreeSpec.parse("1x3")
    grammar = new_grammar(compiled, tree.num_nodes)
    assert grammar.accept_tokens("r", [3, 16])  # "an": complete, so the stop token is allowed next
    bitmask = xgr.allocate_token_bitmask(tree.num_nodes + 1, compiled[1])
    TreeGrammarBitmask(tree).fill(grammar, "r", [2, 5, 6], bitmask, 0, -1)
    assert _allows(bitmask[0], 2)
    assert (bitmask[1:] == -1).all()
    assert not grammar.is_terminated() and grammar.num_processed_tokens == 2
