"""``SpeculativeConfig`` for ``method: "univer"``, as vLLM's engine sees it.

vLLM's ``SpeculativeConfig`` forbids unknown fields and has a closed ``method``
list, so ``{"method": "univer", "model": D, "tree": T, "verifier": V}`` becomes a
``UniverSpeculativeConfig``: vLLM's own ``draft_model`` config (it loads the draft
model, allocates its KV cache beside the target's and schedules N speculative
tokens per request) plus the two tree fields. Being a real config field, the
tree travels with the VllmConfig to every engine process and worker.
"""

from __future__ import annotations

from typing import Any

from vllm.config import SpeculativeConfig
from vllm.config.utils import config

from .config import DEFAULT_TREE, DEFAULT_VERIFIER, METHOD_NAME, OWN_KEYS, UniverConfig, split_user_config


@config
class UniverSpeculativeConfig(SpeculativeConfig):
    """vLLM's draft-model speculation config plus the tree and its verifier."""

    tree: str | list[list[int]] = DEFAULT_TREE
    verifier: str = DEFAULT_VERIFIER
    max_tree: str | list[list[int]] | None = None
    # tree "dynamic"'s budget (None: DynamicTreeBudget's default)
    max_nodes: int | None = None
    max_depth: int | None = None
    expand: int | None = None
    max_children: int | None = None
    cuda_graphs: str = "piecewise"  # "full": full CUDA graphs for batches of whole trees

    @property
    def univer(self) -> UniverConfig:
        return UniverConfig(**{key: getattr(self, key) for key in OWN_KEYS})


def is_univer(speculative_config: Any) -> bool:
    return isinstance(speculative_config, UniverSpeculativeConfig)


def check_engine_options(engine_args) -> None:
    """Engine-wide options tree speculation needs, set on vLLM's ``EngineArgs``
    before it builds the ``VllmConfig``.

    * The V1 model runner: trees live in ``GPUModelRunner`` (vLLM falls back to
      it by itself, see ``patches.patch_vllm_config_v2_model_runner``); an explicit
      ``VLLM_USE_V2_MODEL_RUNNER=1`` is refused.
    * CUDA graphs: by default none of the full kind (a captured attention call
      would replay without the step's tree plan): unset ``cudagraph_mode`` becomes
      PIECEWISE (attention runs eagerly between graph pieces) and a full mode is
      refused. With ``"cuda_graphs": "full"`` (opt-in) it becomes
      FULL_AND_PIECEWISE: batches of whole trees replay one graph, their tree
      attention over persistent buffers (``attention.tree_graph_plans``); a mode
      that captures mixed batches whole is refused.
    * No pipeline parallelism: the accepted path is known on the last stage only,
      and every stage must keep that path's keys and values in its own layers'
      cache (a chain's accepted tokens are a prefix of its slots; a tree path's
      are not). vLLM 0.32's own draft-model speculation does not start under
      pipeline parallelism either: ``GPUModelRunner._dummy_run`` reads
      ``self.drafter``, which only the last stage has (AttributeError).
    """
    from vllm import envs
    from vllm.config import CUDAGraphMode

    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise ValueError(f'method "{METHOD_NAME}" runs in the V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER')
    if engine_args.pipeline_parallel_size > 1:
        raise ValueError(
            f'method "{METHOD_NAME}" does not support pipeline parallelism (pipeline_parallel_size='
            f"{engine_args.pipeline_parallel_size}): only the last stage learns which tree path was accepted, "
            "and every stage would have to keep that path's KV. Use tensor parallelism "
            "(--tensor-parallel-size), across nodes too."
        )
    compilation = engine_args.compilation_config
    mode = compilation.cudagraph_mode
    spec = engine_args.speculative_config
    full = isinstance(spec, dict) and spec.get("cuda_graphs", spec.get("cuda-graphs")) == "full"
    if mode is None:
        compilation.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE if full else CUDAGraphMode.PIECEWISE
    elif mode.has_full_cudagraphs() and not full:
        raise ValueError(
            f'method "{METHOD_NAME}" computes tree attention outside CUDA graphs; cudagraph_mode {mode.name} '
            'captures attention. Use -cc.cudagraph_mode=PIECEWISE (or NONE), or add "cuda_graphs": "full" to '
            "--speculative-config (full graphs for batches of whole trees)."
        )
    elif full and mode.mixed_mode() == CUDAGraphMode.FULL:
        raise ValueError(
            f'"cuda_graphs": "full" captures batches of whole trees only; cudagraph_mode {mode.name} also '
            "captures mixed batches (prompts, cut trees) whole. Use FULL_AND_PIECEWISE or FULL_DECODE_ONLY."
        )


def create_univer_speculative_config(spec: dict[str, Any], **engine_fields) -> UniverSpeculativeConfig:
    """Build the engine config from the user's dict (``method`` already "univer").

    ``engine_fields`` are the ones vLLM adds itself (target model and parallel configs).
    """
    ours, theirs = split_user_config({k: v for k, v in spec.items() if k != "method"})
    return UniverSpeculativeConfig(**theirs, **engine_fields, **{key: getattr(ours, key) for key in OWN_KEYS})


__all__ = [
    "METHOD_NAME",
    "UniverSpeculativeConfig",
    "check_engine_options",
    "create_univer_speculative_config",
    "is_univer",
]
