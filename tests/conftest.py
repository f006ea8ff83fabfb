"""Shared fixtures: tiny random models built once per test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target, draft) folders: a 2-layer random Llama (512-token vocabulary) and a
    perturbed copy of it as the draft (same tokenizer; drafts often accepted)."""
    from tiny_models import build_perturbed_draft, build_tiny_llama

    root = tmp_path_factory.mktemp("tiny_pair")
    target = build_tiny_llama(root / "target", vocab_size=512, seed=0, logit_scale=8.0)
    draft = build_perturbed_draft(target, root / "draft", noise=0.5)
    return str(target), str(draft)
