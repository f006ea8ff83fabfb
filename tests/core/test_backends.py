"""``choose_backend``: one decision per ``verify`` call, with a clear error for a
backend asked for where it cannot run."""

import pytest
import torch

from vllm_univer import TreeSpec
from vllm_univer.core.backends import Backend, choose_backend
from vllm_univer.core.compiled_rules import COMPILE_ENV

pytestmark = pytest.mark.quick


def _rows(vocab=100):
    return torch.full((1, 7, vocab), 1.0 / vocab), torch.full((1, 7, vocab), 1.0 / vocab)


def test_cpu_rows_run_the_pytorch_rules(monkeypatch):
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    p, q = _rows()
    for method in ("univer", "traversal", "univer_wor"):
        assert choose_backend(method, TreeSpec.parse("2x2"), p, q) is Backend.TORCH
    assert choose_backend("token", TreeSpec.parse("1x6"), p, q) is Backend.TORCH


def test_compiled_rules_where_asked_for(monkeypatch):
    p, q = _rows()
    tree = TreeSpec.parse("2x2")
    assert choose_backend("univer_wor", tree, p, q, compiled=True) is Backend.COMPILED
    monkeypatch.setenv(COMPILE_ENV, "1")
    assert choose_backend("univer_wor", tree, p, q) is Backend.COMPILED
    assert choose_backend("univer", tree, p, q) is Backend.TORCH  # no compiled rule of its own
    assert choose_backend("univer_wor", tree, p, q, compiled=False) is Backend.TORCH


def test_fused_requests_pick_the_kernels_of_the_method():
    p, q = _rows()
    assert choose_backend("univer", TreeSpec.parse("2x2"), p, q, fused=True) is Backend.FUSED_TREE
    assert choose_backend("rrsw", TreeSpec.parse("2x2"), p, q, fused=True) is Backend.FUSED_TREE
    assert choose_backend("block", TreeSpec.parse("1x6"), p, q, fused=True) is Backend.FUSED_CHAIN
    assert choose_backend("univer_wor", TreeSpec.parse("3x2"), p, q, fused=True) is Backend.FUSED_WOR
    assert Backend.FUSED_WOR.fused and not Backend.COMPILED.fused


def test_impossible_requests_say_why():
    p, q = _rows()
    with pytest.raises(ValueError, match="at most four children"):
        choose_backend("univer_wor", TreeSpec.parse("5x1"), p, q, fused=True)
    small_p, small_q = _rows(vocab=16)
    with pytest.raises(ValueError, match="vocabularies above"):
        choose_backend("univer_wor", TreeSpec.parse("2x2"), small_p, small_q, fused=True)
    with pytest.raises(ValueError, match="fused=False"):
        choose_backend("univer_wor", TreeSpec.parse("2x2"), p, q, fused=True, compiled=True)
