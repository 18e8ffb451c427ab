"""Messages that cross process boundaries, all msgspec Structs (never pickle).

`engine_core` holds what the frontend and the engine core exchange; `worker` holds what the engine core
and its workers exchange. In-process, the same Structs travel over memory streams.
"""
