"""kvcap: does more memory buy more stable LLM-serving concurrency, or only more resident requests?"""

__version__ = "0.1.0"
