"""vLLM's names that plugin tests drive, over asyncengine's own engine: `EngineArgs` and the synchronous
`LLMEngine` (llm_engine.py), the older attention selector (attention_selector.py), and the plugin-loading
helpers of `vllm.plugins` (plugins.py: `load_general_plugins`, `load_plugins_by_group`, ...).
`asyncengine plugins port` maps vLLM's imports of them here (asyncengine/porting/table.py)."""
