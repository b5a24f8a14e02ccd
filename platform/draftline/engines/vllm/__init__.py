"""vLLM as an engine: the server subprocess (engine.py) and the checks of its speculative config (preflight.py)."""
