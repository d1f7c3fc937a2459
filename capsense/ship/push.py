"""Push an export folder to the Hugging Face Hub.

:func:`push_folder` uses ``huggingface_hub`` (``create_repo(exist_ok=True)``,
``upload_folder``). The token comes from ``HF_TOKEN`` or the saved login; it is handed to
``HfApi`` and nowhere else: never printed, logged or written.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, get_token

from capsense.core.files import atomic_write_json, atomic_write_text
from capsense.core.models import hub_offline
from capsense.errors import HubError
from capsense.ship.card import build_model_card

# Hidden files and folders (.git, .cache, editor droppings) are never uploaded.
IGNORE_PATTERNS = [".*", "*/.*"]
DEFAULT_COMMIT_MESSAGE = "Upload capability-ablated model (capsense)"


@dataclass
class PushResult:
    """What a push did (or, for a dry run, would do)."""

    repo_id: str
    files: list[str]
    private: bool
    revision: str | None
    commit_message: str
    create_pr: bool
    dry_run: bool
    url: str | None = None
    card_rendered: bool = False
    notes: list[str] = field(default_factory=list)


def check_repo_id(repo_id: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise HubError(f"invalid repo id {repo_id!r}: {e}") from None
    if "/" not in repo_id:
        raise HubError(f"invalid repo id {repo_id!r}: expected 'namespace/name', e.g. 'my-user/{repo_id}'")


def require_token() -> str:
    """The Hub token (``HF_TOKEN`` or saved login), or a clear error; never shown anywhere."""
    token = get_token()
    if not token:
        raise HubError(
            "no Hugging Face token: set the HF_TOKEN environment variable or log in once with "
            "`hf auth login` (a token with write access)"
        )
    return token


def check_push_ready(repo_id: str) -> str:
    """Everything a push needs before any network call: a valid repo id, online, a token."""
    check_repo_id(repo_id)
    if hub_offline():
        raise HubError(
            "HF_HUB_OFFLINE is set, so nothing can be pushed to the Hugging Face Hub: unset it "
            "(HF_HUB_OFFLINE=0) when you are online, or use `dry_run` to see what would be uploaded"
        )
    return require_token()


def list_upload_files(folder: Path) -> list[str]:
    """The files ``upload_folder`` will send, relative to ``folder`` (hidden ones skipped)."""
    files = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and not any(fnmatch(rel, pat) for pat in IGNORE_PATTERNS):
            files.append(rel)
    return files


def check_model_folder(folder: Path, files: list[str]) -> None:
    """A model repo's folder: a model (``config.json`` and weights) or a PEFT adapter (``adapter_config.json`` and its
    weights) at its top. Any folder was uploaded as it was: ``capsense push runs me/model`` sent every run folder and
    log under it to a public repo."""
    top = {f for f in files if "/" not in f}
    weights = any(f.endswith((".safetensors", ".bin")) for f in top)
    if weights and ("config.json" in top or "adapter_config.json" in top):
        return
    raise HubError(f"{str(folder)!r} holds no model at its top (config.json or adapter_config.json beside .safetensors "
                   "weights): give the folder `capsense export`, `compress` or `distill` wrote")


def _card_is_ours(folder: Path) -> dict[str, Any] | None:
    """The export metadata if README.md is still exactly the card capsense wrote."""
    meta_path, readme = folder / "capsense.json", folder / "README.md"
    if not (meta_path.is_file() and readme.is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    digest = hashlib.sha256(readme.read_text(encoding="utf-8").encode("utf-8")).hexdigest()
    return meta if meta.get("card_sha256") == digest else None


def _render_card_for(folder: Path, repo_id: str) -> bool:
    """Point the card's snippets at ``repo_id`` (only if it is capsense's unedited card)."""
    meta = _card_is_ours(folder)
    if meta is None or meta.get("card_repo_id") == repo_id:
        return False
    text = str(build_model_card(meta, repo_id=repo_id))
    meta["card_sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    meta["card_repo_id"] = repo_id
    atomic_write_text(folder / "README.md", text)
    atomic_write_json(folder / "capsense.json", meta)
    return True


def _scrub(text: str, token: str | None) -> str:
    return text.replace(token, "***") if token else text


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    dry_run: bool = False,
    api: Any = None,
) -> PushResult:
    """Upload ``folder`` to the model repo ``repo_id`` (created if missing).

    ``api`` is an ``HfApi``-like object (tests pass a fake); by default an ``HfApi`` holding
    the token. A dry run needs neither network nor token. Before a real push, a card that
    capsense wrote and nobody edited is re-rendered so its snippets name ``repo_id``.
    """
    root = Path(folder)
    if not root.is_dir():
        raise HubError(f"{str(root)!r} is not a folder")
    check_repo_id(repo_id)
    files = list_upload_files(root)
    if not files:
        raise HubError(f"{str(root)!r} has no files to upload")
    check_model_folder(root, files)
    message = commit_message or DEFAULT_COMMIT_MESSAGE
    result = PushResult(repo_id, files, private, revision, message, create_pr, dry_run)
    ours = _card_is_ours(root)
    if dry_run:
        if ours is not None and ours.get("card_repo_id") != repo_id:
            result.notes.append(f"README.md would be re-rendered to load from {repo_id}")
        return result

    token = check_push_ready(repo_id)
    hf = api if api is not None else HfApi(token=token)
    try:
        result.card_rendered = _render_card_for(root, repo_id)
        hf.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
        if revision and not create_pr:
            hf.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        info = hf.upload_folder(
            repo_id=repo_id,
            folder_path=str(root),
            repo_type="model",
            commit_message=message,
            revision=revision,
            create_pr=create_pr,
            ignore_patterns=IGNORE_PATTERNS,
        )
    except HubError:
        raise
    except Exception as e:  # HfHubHTTPError, network errors: one clean line, token scrubbed
        raise HubError(_scrub(f"push to {repo_id} failed: {type(e).__name__}: {e}", token)) from None
    result.url = getattr(info, "pr_url", None) or getattr(info, "commit_url", None) or (
        info if isinstance(info, str) else None
    )
    return result
