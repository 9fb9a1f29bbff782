"""`kvcap audit`: a capacity table someone publishes, judged by the same rules as a run — against its own
arithmetic and, given a model and GPU, against VRAM.

`table` reads the CSV (one spelling per column, one unit per cell, bounds kept; it judges nothing),
`level_checks` checks each level by itself (implied TPOT, latency vs SLO, Little's law), and `across_levels`
(``audit_table``, the entry point) checks scaling and the VRAM claim across levels and gives the effective capacity
the table supports. It sits above `analysis`, whose SLO and capacity rules it applies.
"""
