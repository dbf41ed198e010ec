"""Shared test helpers: eager references, comparisons, tiny models and losses,
the HF family registry, and the harness that runs a compiled loss."""
