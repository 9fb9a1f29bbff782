"""Output for people: terminal tables and live progress (rich), the self-contained HTML report, the Markdown
summary.

Everything here presents what the analysis computed (summaries, compare results, telemetry series); the judging
stays in ``kvcap.analysis``. The package may import ``kvcap.analysis``, ``kvcap.rundir``, ``kvcap.plan``,
``kvcap.units`` and ``kvcap.errors`` — never the load generator, the simulator, the CLI or ``kvcap.ab``
(they call into it, not the other way round).

- ``console.py``: terminal tables; ``live.py``: progress bars while a benchmark runs.
- ``html.py``: the HTML report's page assembly and entry points (``render_html``, ``write_html``, ``*_single``).
- ``plots.py`` / ``tables.py``: its plotted and tabular sections; ``data.py``: what they read out of results,
  summaries and run directories.
- ``charts.py``: a small pure inline-SVG line-chart library.
- ``format.py``: escaping, number formatting and wording shared by the HTML and Markdown reports.
- ``markdown.py``: the Markdown summary for tickets and pull requests.
"""
