"""``GraphDiscipline`` finds what CUDA-graph capture breaks on, on CPU: each kind
of violation once, none in a region that is capturable, and the storages read
from outside (the same in two steps only for persistent buffers)."""

from __future__ import annotations

import pytest
import torch

from vllm_univer.tools.graph_discipline import GraphDiscipline

X = torch.randn(4, 5)


@pytest.mark.parametrize(
    "region, found",
    [
        (lambda: X.sum().item(), "aten._local_scalar_dense: reads a device value"),
        (lambda: X.nonzero(), "aten.nonzero: reads a device value"),
        (lambda: X[X > 0], "aten.index: reads a device value"),
        (lambda: torch.arange(5), "aten.arange: creates a tensor"),
        (lambda: torch.zeros(3), "aten.zeros: creates a tensor"),
        (lambda: X.new_full((2,), 1.0), "aten.new_full: creates a tensor"),
        (lambda: torch.tensor([1, 2]), "aten.lift_fresh: creates a tensor"),
        (lambda: X.to("meta"), "aten._to_copy: copies between devices"),
    ],
)
def test_each_violation_is_found(region, found):
    with GraphDiscipline() as checked:
        region()
    assert any(v.startswith(found) for v in checked.violations), checked.violations


def test_a_capturable_region_passes_and_names_its_persistent_inputs():
    out = torch.empty(4, 5)
    index = torch.tensor([2, 0, 1, 3])

    def step():
        torch.mul(X.index_select(0, index), 2.0, out=out)
        out.clamp_(min=0.0)

    reads = []
    for values in ([2, 0, 1, 3], [3, 1, 0, 2]):  # new data, same buffers
        index.copy_(torch.tensor(values))
        with GraphDiscipline() as checked:
            step()
        assert checked.violations == []
        reads.append(checked.inputs)
    assert reads[0] == reads[1]
    assert {p for p, _ in reads[0]} == {t.untyped_storage().data_ptr() for t in (X, index, out)}

    # An index built anew for each step (outside the region) is another input each time.
    fresh = [torch.tensor(values) for values in ([2, 0, 1, 3], [3, 1, 0, 2])]
    seen = []
    for index in fresh:
        with GraphDiscipline() as checked:
            torch.mul(X.index_select(0, index), 2.0, out=out)
        seen.append(checked.inputs)
    assert seen[0] != seen[1]


def test_writing_boolean_values_by_integer_index_is_no_sync():
    target = torch.zeros(3, 2, dtype=torch.bool)
    with GraphDiscipline() as checked:
        target[torch.tensor([0, 2])] = torch.ones(2, 2, dtype=torch.bool)
    assert not [v for v in checked.violations if "host" in v], checked.violations
    with GraphDiscipline() as checked:
        target[target[:, 0]] = False
    assert any(v.startswith("aten.index_put") for v in checked.violations), checked.violations


def test_a_scalar_assigned_by_indexing_is_a_constant_fill():
    """``x[:, -1] = False`` lifts the scalar to a 0-dim host tensor and fills with it:
    allowed with ``constant_fills`` (and its host tensor, new every run, is no input);
    a tensor lifted from a list is not."""
    target = torch.ones(3, 4, dtype=torch.bool)
    reads = []
    for _ in range(2):
        with GraphDiscipline(constant_fills=True) as checked:
            target[:, -1] = False
        assert checked.violations == [] and not target[:, -1].any()
        reads.append(checked.inputs)
    assert reads[0] == reads[1] == [(target.untyped_storage().data_ptr(), target.untyped_storage().nbytes())]
    with GraphDiscipline() as checked:
        target[:, -1] = False
    assert any(v.startswith("aten.lift_fresh") for v in checked.violations), checked.violations
    with GraphDiscipline(constant_fills=True) as checked:
        torch.tensor([1, 2])
    assert any(v.startswith("aten.lift_fresh") for v in checked.violations), checked.violations
    # Tensors whose values follow from host constants (the sizes a graph is keyed on).
    with GraphDiscipline(constant_fills=True) as checked:
        torch.arange(4), torch.ones(2, 2, dtype=torch.bool).tril(), torch.full((3,), -1)
    assert checked.violations == [], checked.violations
