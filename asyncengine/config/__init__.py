"""Configuration shared by every process: the engine options and the resolved model description."""
