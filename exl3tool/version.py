"""exl3tool's version, as installed (pyproject.toml is its one source), and the digest of the sources that run. The
bottom of the module graph, so the CLI, the prepared manifest, bench reports and the kernel cache can name the code
without importing the package's public API."""

import hashlib
import importlib.util
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

try:
    __version__ = version("exl3tool")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


def source_digest(roots: list[Path] | None = None) -> str:
    """The first 12 hex digits of a SHA-256 over the Python sources that ran (exl3tool and its kernels: relative
    paths and bytes, in path order): it names the code of a report also where git's metadata is stale or absent."""
    if roots is None:
        # found, not imported: the kernels are a higher layer (an editable install keeps them in the top-level kernels/)
        kernels = importlib.util.find_spec("exl3tool.kernels").submodule_search_locations[0]
        roots = [Path(__file__).parent, Path(kernels)]
    h = hashlib.sha256()
    for root in roots:
        for path in sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts):
            h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]
