"""The plugin runtime: the six entry-point groups loaded as ordered, traced start-up phases in every
process, the allow-list, the start-up report, and the manifest that catches a registry key one
process has and another lacks."""
