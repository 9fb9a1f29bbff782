"""The simulated cluster: per-iteration cost model (cost), and later the cluster, scheduler and event loop."""
