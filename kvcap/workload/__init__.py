"""Which requests, and when: deterministic prompts (exact lengths with a tokenizer), shared prefixes, datasets,
traces (Mooncake, Azure/Splitwise, kvcap; gzipped too), arrival processes and the load plan that ``bench`` and
``sim`` both follow (``loadplan.LoadPlan.from_spec``).

``words`` is the lowest module (the word list and prefix-block text), so ``prompts`` and ``trace`` never import
each other. The package may import ``kvcap.specs``, ``kvcap.units`` and ``kvcap.errors`` only.
"""
