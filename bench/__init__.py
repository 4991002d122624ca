"""Benchmarks of the figures the README quotes; run each from the repository root as
``python -m bench.<name>`` (``--help`` lists its options)."""
