"""The load generator: real HTTP against an OpenAI-compatible endpoint, timed at every received event.

``client`` sends one streaming request and times it; ``runner`` drives one load plan's levels (closed loop,
open loop from a schedule fixed in advance, trace replay); ``monitor`` measures the client's own loop lag and
CPU, so a run says when the client was the bottleneck; ``bench`` assembles a run (probe, manifest, workers,
telemetry, summary). It writes run directories through ``kvcap.rundir`` and may import ``kvcap.workload``,
``kvcap.specs``, ``kvcap.telemetry``, ``kvcap.analysis`` (the summary), ``kvcap.rundir``, ``kvcap.aio``,
``kvcap.units`` and ``kvcap.errors`` — never the simulator, the report, the CLI or the test peers.
"""
