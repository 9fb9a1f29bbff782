"""Peers with known behaviour for tests and benchmarks (a deterministic OpenAI-compatible server)."""
