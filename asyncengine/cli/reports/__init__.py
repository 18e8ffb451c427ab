"""The reports `asyncengine plugins` prints: `check` (start every role without a model), `timeline` (the
start-up plan, and the rules the docs page computes it from) and `map` (where each extension point is read).

They sit with the CLI, above the roles, because they draw on all of them (the timeline asks where the
worker runs, the check starts the engine core, the map reads every module that reads a registry); the
plugin runtime below stays ignorant of the roles.
"""
