"""vllm_shaped_loader: load_format "shaped_safetensors", a loader that reads a local folder's *.safetensors and
accounts for what it loaded."""


def register():
    import vllm_shaped_loader.loader  # noqa: F401  (its decorator registers the loader)
