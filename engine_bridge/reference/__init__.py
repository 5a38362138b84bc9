"""The reference engine: a small Llama-style transformer on the bridge
(``reference_engine``), and its adapter as a live engine (``reference_live``)."""
