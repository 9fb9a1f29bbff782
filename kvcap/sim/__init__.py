"""The simulated cluster: what a serving cluster nobody can borrow would do under the same load as ``bench``.

It answers "what if" questions (more VRAM, a KV tier in host RAM or a remote pool, a faster NIC, another model)
with the same records, run directory and judgement as a real benchmark. Layers, bottom up:

* per-iteration time — ``cost`` (the calibrated roofline summed over a step), with ``batch_shape`` (a step's
  totals), ``roofline`` (operator kinds, achieved rates, all-reduce), ``model_shape`` (a model's operators)
  and ``calibration_io`` (the fitted numbers in ``calibration/*.yaml``);
* one replica — ``request`` (a request's record), ``kv`` (HBM blocks, prefix cache, tiers' bytes), ``replica``
  (queues, steps, decode spans, KV copies), ``policy`` (the scheduling seam) and ``policy_vllm`` (vLLM's rules);
* the cluster — ``links`` (shared PCIe/NIC links), ``engine`` (the event loop: routing, tiers, events),
  ``cluster`` (a scenario → replicas, tiers, links);
* drivers — ``run`` (``kvcap sim``: load plans → run directory) and ``server`` (``kvcap serve-sim``).

May import: :mod:`kvcap.plan`, :mod:`kvcap.specs`, :mod:`kvcap.workload`, :mod:`kvcap.rundir`,
:mod:`kvcap.analysis` (the summary), :mod:`kvcap.serve` (serve-sim's front end), :mod:`kvcap.units`,
:mod:`kvcap.errors`, :mod:`kvcap.aio` and the package root (``__version__``). Never :mod:`kvcap.testing`,
``loadgen``, ``report``, ``cli`` or ``experiment``: they sit above the simulator (``experiment`` and ``cli``
drive it), and test doubles must not leak into it.

``native`` picks the build: the modules compiled by ``setup.py`` (mypyc) when they match these sources, else the
sources (``NATIVE`` says which runs).
"""

from kvcap.sim.native import choose

NATIVE = choose()
"""The compiled simulator runs (False: the ``.py`` sources, e.g. ``KVCAP_PURE=1`` or an edited source)."""
