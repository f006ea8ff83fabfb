"""Exact losslessness: every verifier with its draft scheme, every tree of the
scheme enumerated with its probability, float64, max error <= 1e-12."""

import pytest

from vllm_univer import TreeSpec
from vllm_univer.tools.law_oracle import PathModel, string_law_error

pytestmark = pytest.mark.quick

IRREGULAR = TreeSpec.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0)])
IRREGULAR_DEEP = TreeSpec.from_paths([(0,), (1,), (0, 0), (0, 0, 0), (0, 0, 1)])

# (method, scheme, tree, vocab): every tree of the scheme is enumerated, so the
# sizes keep the enumeration in the thousands.
CASES = [
    *[("token", "chain", TreeSpec.parse(f"1x{d}"), v) for d, v in [(1, 6), (2, 5), (3, 4)]],
    *[("block", "chain", TreeSpec.parse(f"1x{d}"), v) for d, v in [(1, 6), (2, 5), (3, 4)]],
    ("rrs", "iid", TreeSpec.parse("2x1"), 6),
    ("rrs", "iid", TreeSpec.parse("3x1"), 4),
    ("rrs", "iid", TreeSpec.parse("2x2"), 3),
    ("rrs", "iid", IRREGULAR, 3),
    ("rrsw", "wor", TreeSpec.parse("3x1"), 5),
    ("rrsw", "wor", TreeSpec.parse("2x2"), 4),
    ("rrsw", "wor", IRREGULAR, 4),
    ("traversal", "wor", TreeSpec.parse("3x1"), 5),
    ("traversal", "wor", TreeSpec.parse("2x2"), 4),
    ("traversal", "wor", IRREGULAR, 4),
    ("traversal", "wor", IRREGULAR_DEEP, 3),
    ("traversal", "wor", TreeSpec.parse("1x3"), 4),
    ("greedy", "topk1", TreeSpec.parse("3x1"), 5),
    ("greedy", "topk1", TreeSpec.parse("2x3"), 4),
    ("greedy", "topk1", TreeSpec.parse("3x2"), 5),
    ("greedy", "topk1", IRREGULAR_DEEP, 4),
    ("univer", "topk1", TreeSpec.parse("1x3"), 4),
    ("univer", "topk1", TreeSpec.parse("3x1"), 5),
    ("univer", "topk1", TreeSpec.parse("2x3"), 4),
    ("univer", "topk1", TreeSpec.parse("3x2"), 5),
    ("univer", "topk1", IRREGULAR, 6),
    ("univer", "topk1", IRREGULAR_DEEP, 4),
    ("univer_wor", "wor", TreeSpec.parse("2x1"), 6),
    ("univer_wor", "wor", TreeSpec.parse("3x1"), 5),
    ("univer_wor", "wor", TreeSpec.parse("4x1"), 5),
    ("univer_wor", "wor", TreeSpec.parse("2x2"), 4),
    ("univer_wor", "wor", TreeSpec.parse("2x3"), 3),
    ("univer_wor", "wor", TreeSpec.parse("3x2"), 4),
    ("univer_wor", "wor", TreeSpec.parse("1x3"), 4),
    ("univer_wor", "wor", IRREGULAR, 4),
    ("univer_wor", "wor", IRREGULAR_DEEP, 3),
    # target_only is lossless with any scheme.
    ("target_only", "topk1", TreeSpec.parse("2x3"), 4),
    ("target_only", "iid", TreeSpec.parse("2x2"), 3),
    ("target_only", "wor", IRREGULAR, 4),
    ("target_only", "chain", TreeSpec.parse("1x3"), 4),
]


def _id(case):
    method, scheme, tree, vocab = case
    return f"{method}-{scheme}-{len(tree.paths) - 1}n-d{tree.max_depth}-V{vocab}"


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_lossless(case, seed):
    method, scheme, tree, vocab = case
    target = PathModel(vocab, seed=100 + seed)
    draft = PathModel(vocab, seed=200 + seed, base=target)
    assert string_law_error(method, scheme, tree, target, draft) <= 1e-12


@pytest.mark.parametrize(
    "method,scheme,tree,vocab",
    [
        ("univer", "topk1", TreeSpec.parse("2x2"), 4),
        ("traversal", "wor", TreeSpec.parse("2x2"), 4),
        ("rrsw", "wor", TreeSpec.parse("2x2"), 4),
        ("univer_wor", "wor", TreeSpec.parse("2x2"), 4),
        ("univer_wor", "wor", TreeSpec.parse("4x1"), 5),
        ("greedy", "topk1", TreeSpec.parse("3x1"), 3),
    ],
)
def test_exact_lossless_draft_far_from_target(method, scheme, tree, vocab):
    """A draft unrelated to the target (many zero-probability drafted tokens)."""
    target = PathModel(vocab, seed=7)
    draft = PathModel(vocab, seed=8)
    assert string_law_error(method, scheme, tree, target, draft) <= 1e-12


@pytest.mark.parametrize(
    "method,scheme",
    [
        ("univer", "topk1"),
        ("greedy", "topk1"),
        ("traversal", "wor"),
        ("rrsw", "wor"),
        ("univer_wor", "wor"),
        ("target_only", "topk1"),
    ],
)
def test_exact_lossless_topk_covers_support(method, scheme):
    """The draft's support fits in the top set: topk1 slot 0 is missing (-1), wor runs dry."""
    tree = TreeSpec.parse("3x2")
    target = PathModel(4, seed=11)

    class TwoTokenDraft(PathModel):
        def __call__(self, prefix):
            row = super().__call__(prefix).copy()
            row[2:] = 0.0
            return row / row.sum()

    draft = TwoTokenDraft(4, seed=12, zeros=False)
    assert string_law_error(method, scheme, tree, target, draft) <= 1e-12


@pytest.mark.parametrize("classes_per_octave", [32, 1])
@pytest.mark.parametrize(
    "tree,vocab",
    [
        (TreeSpec.parse("2x2"), 4),
        (TreeSpec.parse("3x1"), 5),
        (TreeSpec.parse("4x1"), 5),
        (IRREGULAR, 4),
        (IRREGULAR_DEEP, 3),
    ],
    ids=["2x2", "3x1", "4x1", "irregular", "irregular-deep"],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_univer_wor_exact_with_log_ratio_classes(monkeypatch, tree, vocab, classes_per_octave, seed):
    """The ratio classes large vocabularies use (log scale), forced onto a small one:
    32 classes per octave (what runs on a real vocabulary) and 1 (most pairs share a
    class and are settled by the coin). Exact either way, on laws with zeros and ties."""
    from vllm_univer.core.verifiers import univer_wor

    monkeypatch.setattr(univer_wor, "EXACT_RANK_VOCAB", 0)
    monkeypatch.setattr(univer_wor, "_CLASSES_PER_OCTAVE", classes_per_octave)
    monkeypatch.setattr(univer_wor, "_LOG_CLASSES", classes_per_octave * univer_wor._OCTAVES + 2)
    target = PathModel(vocab, seed=300 + seed)
    draft = PathModel(vocab, seed=400 + seed, base=target)
    assert string_law_error("univer_wor", "wor", tree, target, draft) <= 1e-12
