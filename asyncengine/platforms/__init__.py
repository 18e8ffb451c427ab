"""The built-in platforms (cpu, cuda) and the helpers that ask a platform questions on the engine's behalf.

The Platform interface is the floor's (asyncengine.interfaces.platform). The platform is resolved in the
first start-up phase of every process, never at import time (asyncengine.plugin_runtime.platform_resolution),
and `current_platform()` there raises until then.
"""
