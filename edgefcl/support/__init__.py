"""Ground-floor plumbing: the user-facing error types (`errors`), logging set-up and formatters
(`logs`), atomic state files (`statefiles`) and the typed TOML field helpers the configuration
is read with (`tomlfields`). The standard library and numpy only, and from edgefcl nothing but
`config` (statefiles raises its `ConfigError`): nothing here imports above the ground floor
(`tests/test_import_rule.py`). Nothing is re-exported: import a module by its full path."""
