"""`asyncengine plugins port`: rewrite a vLLM plugin's names to asyncengine's (docs/porting.md)."""
