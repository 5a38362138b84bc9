"""Hugging Face transformers' continuous batching on the bridge
(``transformers_adapter``), and as a live engine (``transformers_live``).
Import those modules by name: they need the pinned transformers release."""
