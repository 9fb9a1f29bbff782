"""From records to judgement: per-level statistics, SLO checks, capacities, verdict, diagnosis."""
