"""Where settings come from: a TOML or JSON file, ``KVWIRE_*`` environment variables, arguments.

:meth:`kvwire.BackendConfig.from_sources` is the entry point; docs/configuration.md has the rules.
"""
