"""Typed, validated specs — the vocabulary every command shares: model shapes (HF ``config.json`` or bundled
presets), the GPU and link catalogs, length distributions, the load and workload (one spec for ``bench`` flags,
scenario files and experiment files: ``load``), and scenario files with ``--set`` overrides (``scenario``).

Specs are data: pydantic models or frozen dataclasses, validated once at the edge (bad input → ``InputError``,
one line, exit 2). The package may import ``kvcap.units`` and ``kvcap.errors`` only.
"""
