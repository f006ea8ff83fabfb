"""vLLM's speculative-decoding counters of an in-process ``LLM``."""

from __future__ import annotations


def spec_counters(llm, prefixes: tuple[str, ...] = ("vllm:spec_decode",)) -> dict:
    """{metric name: value (counters) or values (vectors, e.g. accepted per position)}
    of every metric of ``llm.get_metrics()`` whose name starts with one of ``prefixes``."""
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(prefixes):
            counters[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    return counters
