def detect():
    raise OSError("cannot probe the accelerator (on purpose)")
