"""Example configurations. ``default.toml`` is embedded in the package and is the base every config overrides."""
