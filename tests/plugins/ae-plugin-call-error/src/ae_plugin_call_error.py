def register():
    raise RuntimeError("ae_call_error fails when called, on purpose")
