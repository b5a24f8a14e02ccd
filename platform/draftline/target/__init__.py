"""The target LLM: the embedded tiny bootstrap, loading, fingerprints and aux layer ids."""
