"""The main job's built-in example runs and reports every verifier."""

import pytest

from vllm_univer import METHODS
from vllm_univer.demo import acceptance_table

pytestmark = pytest.mark.quick


def test_acceptance_table_covers_every_method():
    rows = acceptance_table(vocab=16, num_trees=20, temperature=1.0)
    assert sorted(method for _, method, _, _, _ in rows) == sorted(METHODS)
    for shape, method, _scheme, tau, stderr in rows:
        depth = int(shape.split("x")[1])
        assert 1.0 <= tau <= depth + 1 and stderr >= 0, (shape, method, tau)
