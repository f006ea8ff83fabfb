"""vLLM integration of tree speculation (in progress, see issue 3).

``config`` (the user-facing ``method: "univer"`` fields) is pure pydantic; the
pieces that patch vLLM itself will live next to it, each named after what it
patches, applied once from the plugin entry point.
"""
