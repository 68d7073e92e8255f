"""Measurement tools: perplexity, the serving load generator, the evaluation corpus."""
