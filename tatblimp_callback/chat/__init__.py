"""Forced choice for chat models: prompts, results, and OpenAI-compatible servers."""
