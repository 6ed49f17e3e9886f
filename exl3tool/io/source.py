"""Where a checkpoint's files are: a local folder, or a Hugging Face repo id resolved through huggingface_hub.

Hub downloads fetch only `*.json` and `*.safetensors`, go through the user's hub cache, and honour
`revision` and offline mode (HF_HUB_OFFLINE=1 resolves from the cache alone).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from exl3tool.errors import UnreadableInputError, UsageError
from exl3tool.io.reading import kind_of

HUB_PATTERNS = ["*.json", "*.safetensors"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def looks_like_repo_id(source: str) -> bool:
    return bool(_REPO_ID.match(source)) and ".." not in source and not source.endswith((".", "-"))


def snapshot_download(**kwargs) -> str:
    """huggingface_hub.snapshot_download, imported late so that local use never imports the hub client."""
    from huggingface_hub import snapshot_download as download

    return download(**kwargs)


def resolve_source(source: str | Path, revision: str | None = None) -> Path:
    """The local folder holding the checkpoint `source` (a folder path, or a hub repo id to download)."""
    text = str(source)
    if "\x00" in text:
        raise UnreadableInputError("not a valid path (it holds a NUL byte)", path=text)
    local = Path(source).expanduser()
    if os.path.lexists(local):  # a symlink loop "exists" too: it must not be taken for a repo id
        if revision is not None:
            raise UsageError("--revision applies to Hugging Face repo ids, not to a local folder", path=source)
        if not local.is_dir():
            kind = kind_of(local)
            what = "a file" if kind is None else kind.removesuffix(", not a regular file")
            raise UnreadableInputError(f"{what}, not a folder: point exl3tool at the checkpoint folder", path=source)
        return local
    if not looks_like_repo_id(text):
        raise UnreadableInputError("no such folder, and not a Hugging Face repo id", path=text)
    return _download(text, revision)


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import errors as hub_errors

    try:
        return Path(snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=HUB_PATTERNS))
    except hub_errors.RevisionNotFoundError:
        raise UnreadableInputError(f"revision {revision!r} not found on the Hugging Face hub", path=repo_id) from None
    except hub_errors.RepositoryNotFoundError:
        raise UnreadableInputError("no such folder, and no such Hugging Face repo (or no access)",
                                   path=repo_id) from None
    except hub_errors.LocalEntryNotFoundError:
        raise UnreadableInputError("not in the local Hugging Face cache, and the hub cannot be reached "
                                   "(offline mode or no network)", path=repo_id) from None
    except (hub_errors.HfHubHTTPError, OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnreadableInputError(f"Hugging Face hub download failed: {first_line}", path=repo_id) from None
