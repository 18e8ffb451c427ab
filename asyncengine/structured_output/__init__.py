"""Structured outputs: constraining sampling to a JSON schema, a regex, a choice or a grammar.

`spec` holds what a request asks for, `backend` the interface backends implement, `registry` the
table plugins fill, `manager` the engine core's grammars, matchers and masks, `bitmask` the
worker's application of the masks to the logits.
"""
