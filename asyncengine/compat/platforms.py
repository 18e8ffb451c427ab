"""vLLM's `vllm.platforms` names that its platform tests read besides `current_platform`.

`_init_trace`: in vLLM, where `current_platform` was first resolved (a stack, for a test's failure
message). Here the platform is resolved in each process's platform phase, never by the first read,
and the start-up report records which platform was chosen and why (`chosen: NAME`); the text says so.
"""

_init_trace = ("asyncengine resolves the platform in the platform phase of each process's start-up, not at the "
               "first read of current_platform: the start-up report (startup_trace, `asyncengine plugins "
               "timeline`) records the platform chosen and why (its 'chosen: NAME' record)")
