"""The OpenAI-compatible HTTP server (sits on the frontend)."""
