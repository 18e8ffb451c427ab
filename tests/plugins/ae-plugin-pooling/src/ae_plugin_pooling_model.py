"""The plugin's embedding architecture: the built-in BERT encoder under a name of its own."""

from asyncengine.plugins_api import BertModel


class AeTinyEmbedding(BertModel):
    is_pooling_model = True  # `--runner auto` picks pooling for it (its name does not say so)
