"""The user-facing ``--speculative-config`` fields of ``method: "univer"``.

    {"method": "univer", "model": DRAFT, "tree": "2x5", "verifier": "univer"}
    {"method": "univer", "model": DRAFT, "tree": "auto", "max_tree": "2x5"}
    {"method": "univer", "model": DRAFT, "tree": "dynamic", "max_nodes": 32}
    {"method": "univer", "model": DRAFT, "tree": "auto", "max_nodes": 16}
    {"method": "univer", "model": DRAFT, "tree": "2x3", "cuda_graphs": "full"}

``"tree": "auto"`` drafts, each step, the cut of ``max_tree`` (default
``DEFAULT_TREE``): one of its width cuts (``1x5`` or ``2x5`` for ``2x5``) to
a depth (0 = no speculation), the one the measured cost and acceptance models
expect to give the most tokens per second (``vllm_univer.sizing``).

With ``"tree": "auto"``, budget fields (any of them) add context-aware trees of
that budget to the candidates (cut to any depth like the others; max_nodes and
max_depth default to ``max_tree``'s where the dynamic defaults are larger, and
must fit in it).

``"tree": "dynamic"`` grows each request's tree per step where the draft is
confident (``core.dynamic_tree``, ``docs/dynamic-trees.md``) under a budget:
``max_nodes`` (what one target forward verifies), ``max_depth``, ``expand``
(nodes expanded per level) and ``max_children`` (child slots per expanded
node); the defaults are ``DynamicTreeBudget``'s. Verified by univer, greedy or
target_only (the verifiers that run on per-request shapes).

Validated with pydantic before vLLM sees anything, so a bad tree or verifier
fails at config time with a message that names the field. No vLLM import here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from ..core.dynamic_tree import DynamicTreeBudget, level_sizes
from ..core.tree import TreeSpec
from ..core.tree_batch import TREE_BATCH_METHODS, LevelLayout
from ..core.verifiers import METHODS, get_verifier

METHOD_NAME = "univer"
DEFAULT_TREE = "2x5"
DEFAULT_VERIFIER = "univer"
AUTO_TREE = "auto"
DYNAMIC_TREE = "dynamic"
BUDGET_KEYS = ("max_nodes", "max_depth", "expand", "max_children")


class UniverConfig(BaseModel):
    """Tree speculation settings carried next to vLLM's SpeculativeConfig."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    tree: str | list[list[int]] = DEFAULT_TREE
    verifier: str = DEFAULT_VERIFIER
    max_tree: str | list[list[int]] | None = None
    max_nodes: int | None = None
    max_depth: int | None = None
    expand: int | None = None
    max_children: int | None = None
    # "full": vLLM's full CUDA graphs for batches of whole trees (FULL_AND_PIECEWISE),
    # tree attention over persistent buffers; "piecewise" (default): attention, and
    # with it the tree, runs eagerly between graph pieces. Opt-in until a GPU run
    # has passed greedy identity and the T = 1 law under full graphs (issue 49).
    cuda_graphs: Literal["piecewise", "full"] = "piecewise"

    @field_validator("verifier")
    @classmethod
    def _known_verifier(cls, value: str) -> str:
        get_verifier(value)  # ValueError naming the choices
        return value

    @field_validator("tree")
    @classmethod
    def _valid_tree(cls, value):
        if value not in (AUTO_TREE, DYNAMIC_TREE):
            TreeSpec.parse(value)  # ValueError saying what is malformed
        return value

    @field_validator("max_tree")
    @classmethod
    def _valid_max_tree(cls, value):
        if value is not None:
            TreeSpec.parse(value)
        return value

    @model_validator(mode="after")
    def _tree_fits_verifier(self) -> UniverConfig:
        if self.max_tree is not None and not self.auto:
            raise ValueError(f"max_tree applies to tree 'auto' (got tree {self.tree!r}); drop one of them")
        given = [key for key in BUDGET_KEYS if getattr(self, key) is not None]
        if given and not (self.dynamic or self.auto):
            raise ValueError(
                f"{', '.join(given)} apply to tree 'dynamic' or 'auto' (got tree {self.tree!r}); drop them"
            )
        verifier = get_verifier(self.verifier)
        if self.dynamic or self.auto_dynamic:
            if self.verifier not in TREE_BATCH_METHODS:
                raise ValueError(
                    f"verifier {self.verifier!r} does not run on context-aware trees (tree 'dynamic', or "
                    f"'auto' with a budget); "
                    f"use one of {', '.join(TREE_BATCH_METHODS)}"
                )
            layout = self.dynamic_layout  # ValueError naming a bad budget field
            if self.auto:  # the dynamic candidate must fit in what vLLM schedules: max_tree
                largest = self.tree_spec
                if layout.num_nodes > largest.num_nodes or layout.max_depth > largest.max_depth:
                    raise ValueError(
                        f"tree 'auto': the dynamic trees ({layout.num_nodes} nodes, depth {layout.max_depth}) must "
                        f"fit in max_tree ({largest.num_nodes} nodes, depth {largest.max_depth}): what one target "
                        "forward is scheduled for"
                    )
            return self
        if verifier.chain_only and not self.tree_spec.is_chain:
            raise ValueError(
                f"verifier {self.verifier!r} verifies a single chain; use a chain tree such as "
                f"'1x{self.tree_spec.max_depth}' (got tree {self.tree!r})"
            )
        return self

    @property
    def auto(self) -> bool:
        return self.tree == AUTO_TREE

    @property
    def dynamic(self) -> bool:
        return self.tree == DYNAMIC_TREE

    @property
    def auto_dynamic(self) -> bool:
        """``tree: auto`` with a budget: dynamic trees are one more candidate."""
        return self.auto and any(getattr(self, key) is not None for key in BUDGET_KEYS)

    @property
    def dynamic_budget(self) -> DynamicTreeBudget:
        """The budget of ``tree: dynamic`` (the fields given, else the defaults); with
        ``tree: auto``, max_nodes and max_depth default to ``max_tree``'s when larger."""
        given = {key: getattr(self, key) for key in BUDGET_KEYS if getattr(self, key) is not None}
        if self.auto:
            largest, default = self.tree_spec, DynamicTreeBudget()
            given.setdefault("max_nodes", min(default.max_nodes, largest.num_nodes))
            given.setdefault("max_depth", min(default.max_depth, largest.max_depth))
        return DynamicTreeBudget(**given)

    @property
    def dynamic_layout(self) -> LevelLayout:
        """The levels dynamic trees are laid on (``tree: dynamic``, or a candidate of ``auto``)."""
        budget = self.dynamic_budget
        return LevelLayout(level_sizes(budget), budget.max_children)

    @property
    def drafted_tree(self) -> TreeSpec | LevelLayout:
        """What a step drafts: the tree (``auto``: the largest), or for ``dynamic``
        the levels every request's own tree is laid on."""
        if self.dynamic:
            return self.dynamic_layout
        return self.tree_spec

    @property
    def tree_spec(self) -> TreeSpec:
        """The tree drafted (with ``auto``: the largest, cut per step)."""
        if self.dynamic:
            raise ValueError("tree 'dynamic' has no single shape: each request has its own (drafted_tree)")
        if self.auto:
            return TreeSpec.parse(self.max_tree if self.max_tree is not None else DEFAULT_TREE)
        return TreeSpec.parse(self.tree)

    @property
    def grammar_tree(self) -> TreeSpec:
        """The tree vLLM's scheduler fills a structured-output request's grammar rows
        for, from its draft tokens alone (``tree_grammar``): the tree (``auto``:
        max_tree, which a step with such a request drafts whole); for ``dynamic``,
        the static tree on its levels (``LevelLayout.static_tree``), which such a
        step drafts instead of per-request trees."""
        return self.dynamic_layout.static_tree if self.dynamic else self.tree_spec

    @property
    def tree_shapes(self) -> list[TreeSpec | LevelLayout]:
        """The trees a step may draft (each cut to any depth with ``auto``): with
        ``auto``, the width cuts of ``max_tree`` (for ``2x5``: the chain ``1x5``
        and ``2x5``), narrowest first, and with a budget the dynamic trees' levels
        before the last; else the tree alone."""
        if self.dynamic:
            return [self.drafted_tree]
        if not self.auto:
            return [self.tree_spec]
        cuts = self.tree_spec.width_cuts()
        # A budget adds dynamic trees, before max_tree (the last shape: the full tree the sizer falls back on).
        return cuts[:-1] + [self.dynamic_layout] + cuts[-1:] if self.auto_dynamic else cuts

    @property
    def scheme(self) -> str:
        return get_verifier(self.verifier).scheme

    @property
    def num_speculative_tokens(self) -> int:
        return self.drafted_tree.num_nodes


# Keys of the user's dict that belong to us, not to vLLM's SpeculativeConfig.
OWN_KEYS = ("tree", "verifier", "max_tree", *BUDGET_KEYS, "cuda_graphs")


def split_user_config(spec: dict[str, Any]) -> tuple[UniverConfig, dict[str, Any]]:
    """Split a ``method: "univer"`` speculative config into (ours, vLLM's).

    vLLM's part becomes a ``draft_model`` config with num_speculative_tokens = N
    (the tree's draft nodes, what one target forward verifies beside the last token).
    """
    ours = UniverConfig(**{k: spec[k] for k in OWN_KEYS if k in spec})
    theirs = {k: v for k, v in spec.items() if k not in OWN_KEYS}
    if not theirs.get("model"):
        raise ValueError('method "univer" needs a draft model: add "model": "<draft model>" to --speculative-config')
    requested = theirs.get("num_speculative_tokens")
    if requested is not None and requested != ours.num_speculative_tokens:
        raise ValueError(
            f"num_speculative_tokens={requested} disagrees with tree {ours.tree!r}, which has "
            f"{ours.num_speculative_tokens} draft nodes; leave num_speculative_tokens out"
        )
    theirs["method"] = "draft_model"
    theirs["num_speculative_tokens"] = ours.num_speculative_tokens
    # The verifier needs the exact q each node's children were drawn from.
    theirs["draft_sample_method"] = "probabilistic"
    return ours, theirs


__all__ = [
    "AUTO_TREE",
    "DYNAMIC_TREE",
    "DEFAULT_TREE",
    "DEFAULT_VERIFIER",
    "METHOD_NAME",
    "METHODS",
    "UniverConfig",
    "split_user_config",
]
