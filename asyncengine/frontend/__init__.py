"""The frontend role: tokenizes and validates requests, detokenizes and streams outputs.

Hosts the blocking `LLM` and the engine clients; the HTTP server sits on top of it.
"""
