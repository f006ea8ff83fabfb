"""Benchmarks: entry points run from the repository root as ``python -m benchmarks.NAME``
(each writes its results, with the command and machine, under ``benchmarks/results/``).
What they share with each other, the tests and the main job lives in the package
(``vllm_univer.tools``: real models and prompts, local servers, serving defaults,
the exact-law oracle); one-off studies are in ``benchmarks/studies/``."""
