"""The package's version: one place, read by the package, its telemetry and its build."""

__version__ = "0.1.0"
