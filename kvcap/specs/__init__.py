"""Typed, validated specs: model, hardware, scenario (cluster, serving, workload, load plan, SLO)."""
