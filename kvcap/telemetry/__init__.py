"""What the server, GPUs and network were doing: scraped (``scrape``: server ``/metrics``; ``prometheus``:
range queries; ``local``: /proc/net/dev and NVML), normalised to one vocabulary (``catalog.yaml`` + ``catalog``),
and put on the run's time axis as ``telemetry.jsonl`` rows.

The package may import ``kvcap.aio``, ``kvcap.units`` and ``kvcap.errors`` only: the analysis reads its rows,
it never reads the analysis.
"""
