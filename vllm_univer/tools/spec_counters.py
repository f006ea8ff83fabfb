"""vLLM's speculative-decoding counters of an in-process ``LLM``."""

from __future__ import annotations


def spec_counters(llm, prefixes: tuple[str, ...] = ("vllm:spec_decode",)) -> dict:
    """{metric name: value (counters), values (vectors, e.g. accepted per position)
    or {"buckets": {le: count}, "count", "sum"} (histograms)} of every metric of
    ``llm.get_metrics()`` whose name starts with one of ``prefixes``."""
    from vllm.v1.metrics.reader import Histogram

    counters = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith(prefixes):
            continue
        if isinstance(metric, Histogram):
            counters[metric.name] = {"buckets": metric.buckets, "count": metric.count, "sum": metric.sum}
        else:
            counters[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    return counters
