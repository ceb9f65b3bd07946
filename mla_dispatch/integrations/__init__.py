"""Serving-engine integrations (vLLM, SGLang); each imports its engine lazily."""
