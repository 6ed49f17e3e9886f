"""exl3tool's version, as installed (pyproject.toml is its one source). The bottom of the module graph, so the
CLI and the prepared manifest can name it without importing the package's public API."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("exl3tool")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
