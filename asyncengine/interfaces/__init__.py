"""The floor: every class a plugin subclasses or implements, the registry tables, `import_by_path`
and the role names.

Everything above it (the plugin runtime, the roles' code, the server and the CLI) imports these from
here; this package imports only asyncengine.config and asyncengine.errors, and no torch (the one
torch-based module, interfaces.torch_bases, is imported only by who asks for it). Plugins keep
importing from asyncengine.plugins_api, the public face, which re-exports what is here.
"""
