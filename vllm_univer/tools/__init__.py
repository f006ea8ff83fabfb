"""Helpers shared by the tests, the benchmarks and the scripts (not used while
serving): a local ``vllm serve`` process, vLLM's spec-decode counters, and the
goodness-of-fit test the statistical checks use."""
