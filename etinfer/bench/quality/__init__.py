"""Benchmarks of what a model computes: perplexity on shipped human text."""
