"""pffs: LLM KV caches as files on a content-addressed blob store."""

__version__ = "0.1.0"
