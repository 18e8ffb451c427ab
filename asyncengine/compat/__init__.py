"""vLLM's engine-level names that plugin tests drive, over asyncengine's own engine: `EngineArgs` and
the synchronous `LLMEngine` (llm_engine.py), and the older attention selector (attention_selector.py).
`asyncengine plugins port` maps vLLM's imports of them here (asyncengine/porting/table.py)."""
