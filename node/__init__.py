"""swarmd node: daemon lifecycle, CLI, configuration, HTTP status."""

__version__ = "0.2.0"
