"""Deterministic request generation: lengths, prompts, shared prefixes, datasets, traces, arrival processes."""
