"""Benchmark scripts and the harness they share (``published``: published vLLM runs replayed and fitted).

A package only so that ``tests/integration/test_calibrate_published.py`` imports ``benchmarks.published`` by
that name (pytest puts the repository root on ``sys.path``; the scripts put it there themselves). It is not
shipped: the wheel takes ``kvcap*`` only.
"""
