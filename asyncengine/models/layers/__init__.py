"""Building blocks shared by the model files: linear layers, norm, rotary, activation, attention."""
