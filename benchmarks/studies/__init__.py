"""One-off studies behind a design decision (univer_wor's pair and three-child
stages, the LP headroom over traversal): each answered its question once, its
result is in ``benchmarks/results/``; rerun as ``python -m benchmarks.studies.NAME``."""
