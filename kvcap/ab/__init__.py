"""`kvcap ab`: a same-caliber A/B of two arms from one experiment file — `experiment` (the file: real arms with
URLs or server commands, or two simulated arms of one scenario), `real` (interleaved repeats on real endpoints,
managed server commands), `simulated` (both arms through the simulator). Both end in `analysis.verdict.compare`."""
