raise ImportError("ae_plugin_import_error is broken on purpose")
