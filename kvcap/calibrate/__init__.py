"""``kvcap calibrate``: bench run directories → a scenario whose simulator reproduces that server.

``observe`` reads the runs (one analysis path: ``analysis.summary.build_summary``), ``fit`` finds the step cost
and the limits (closed form, then refined through the simulator), ``output`` writes the scenario and the table.
"""
