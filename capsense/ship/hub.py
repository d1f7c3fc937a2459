"""Model cards for exported models, and pushing an export folder to the Hugging Face Hub.

The card (:func:`build_model_card`) is rendered from an export's ``capsense.json`` alone, so
``capsense push`` can re-render it with the final repo id in the "how to load" snippets.

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

from huggingface_hub import HfApi, ModelCard, ModelCardData, get_token

from capsense.errors import CapsenseError
from capsense import __version__

CARD_TAGS = ["capsense", "head-ablation"]
PROJECT_URL = "https://github.com/capsense/capsense"
# Hidden files and folders (.git, .cache, editor droppings) are never uploaded.
IGNORE_PATTERNS = [".*", "*/.*"]
DEFAULT_COMMIT_MESSAGE = "Upload capability-ablated model (capsense)"


class HubError(CapsenseError, RuntimeError):
    """A push that cannot be done (offline, no token, bad repo id, Hub error)."""


# -- model card ------------------------------------------------------------------------


def markdown_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A GitHub-flavoured markdown table of ``rows`` (numbers right-aligned, 4 significant digits)."""
    if not rows:
        return ""
    if columns is None:
        columns = []
        for r in rows:
            columns += [k for k in r if k not in columns]

    def cell(v: Any) -> str:
        if v is None:
            return "—"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v).replace("|", "\\|").replace("\n", " ")

    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows) for c in columns]
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---:" if n else "---" for n in numeric) + "|",
    ]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _validation_rows(data: Any) -> list[dict[str, Any]] | None:
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        data = data["rows"]
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        return data
    if isinstance(data, dict) and data and all(isinstance(v, dict) for v in data.values()):
        return [{"task": k, **v} for k, v in data.items()]
    return None


def find_validation(run_dir: str | os.PathLike, heads_meta: dict[str, Any] | None = None) -> str | None:
    """The validation table of a run folder as markdown, or None if it has none.

    Looked for, in order: ``validation.md`` (used as is), ``validation.json`` (a list of
    row objects, ``{"rows": [...]}`` or ``{task: {metric: value}}``), and a ``validation``
    entry of the heads file itself.
    """
    run = Path(run_dir)
    md = run / "validation.md"
    if md.is_file():
        text = md.read_text(encoding="utf-8").strip()
        return text or None
    candidates = []
    js = run / "validation.json"
    if js.is_file():
        try:
            candidates.append(json.loads(js.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            pass
    if heads_meta and "validation" in heads_meta:
        candidates.append(heads_meta["validation"])
    for data in candidates:
        rows = _validation_rows(data)
        if rows:
            return markdown_table(rows)
    return None


def _load_ref(meta: dict[str, Any], repo_id: str | None) -> str:
    return repo_id or f"./{meta.get('folder', 'this-folder')}"


def _base_ref(meta: dict[str, Any]) -> str:
    base = meta.get("base_model", {})
    return base.get("hub_id") or base.get("path") or base.get("model", "BASE_MODEL")


def build_model_card(meta: dict[str, Any], repo_id: str | None = None) -> ModelCard:
    """The model card of an export, from its ``capsense.json`` metadata.

    ``repo_id`` (when known) is used in the "how to load" snippets; otherwise the local
    folder name is.
    """
    fmt = meta["format"]
    adapter = fmt == "adapter"
    base = meta.get("base_model", {})
    hub_id = base.get("hub_id")
    heads = meta["heads"]
    ablation = meta["ablation"]
    ref = _load_ref(meta, repo_id)
    base_ref = _base_ref(meta)
    spec = meta["heads_spec"]
    layers = sorted({h["layer"] for h in heads})

    card_data = ModelCardData(
        base_model=hub_id,
        library_name="peft" if adapter else "transformers",
        tags=CARD_TAGS + (["ia3", "peft"] if adapter else []),
        pipeline_tag="text-generation",
        base_model_relation=("adapter" if adapter else "finetune") if hub_id else None,
    )

    what = (
        "each ablated head's slice of the input to the attention output projection is multiplied by 0"
        if ablation == "zero"
        else "each ablated head's slice of the input to the attention output projection is replaced "
        f"by its mean over reference texts ({meta.get('mean_reference')})"
    )
    if adapter:
        how = (
            "This is a PEFT **IA3 adapter** on the output projections of the edited layers, with "
            "`feedforward_modules` set to the same modules so IA3 scales the projection's *input*. "
            "Each vector is 0 on the ablated heads' slices and 1 elsewhere. `merge_and_unload()` "
            "gives the same weights as the capsense checkpoint export."
        )
    elif ablation == "zero":
        how = (
            "This is a **full checkpoint**: the ablated heads' input columns of the output projection "
            "are set to zero (rows for GPT-2's Conv1D). Nothing else differs from the base model."
        )
    else:
        how = (
            "This is a **full checkpoint**: each ablated head's mean contribution `W[:, S] @ mean[S]` "
            "is added to the output projection's bias, then its input columns are set to zero."
        )

    lines = [
        f"# {base_ref.split('/')[-1]} without {len(heads)} attention head{'s' * (len(heads) != 1)}",
        "",
        f"[{base_ref}](https://huggingface.co/{hub_id})" if hub_id else f"`{base_ref}`",
        f"with **{len(heads)} attention heads in {len(layers)} layers removed** ({ablation} ablation: {what}), "
        f"made with [capsense]({PROJECT_URL}).",
        "",
        how,
    ]
    if base.get("note"):
        lines += ["", f"Base weights: {base['note']}."]
    lines += [
        "",
        "## Ablated heads",
        "",
        f"`{spec}`",
        "",
        markdown_table(
            [{"layer": h["layer"], "head": h["head"], "importance": h.get("importance")} for h in heads],
            ["layer", "head", "importance"],
        ),
        "",
        "Heads are query heads (under grouped-query attention, one key/value head serves several).",
    ]
    if meta.get("heads_source"):
        src = meta["heads_source"]
        top = f", top {src['top_k']}" if src.get("top_k") is not None else ""
        lines += [f"Importance comes from the heads file `{Path(src['file']).name}`{top}."]

    lines += ["", "## How to load", "", "```python"]
    if adapter:
        lines += [
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'base = AutoModelForCausalLM.from_pretrained("{base_ref}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{base_ref}")',
            f'model = PeftModel.from_pretrained(base, "{ref}")',
            "# or bake it in: model = model.merge_and_unload()",
        ]
    else:
        lines += [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{ref}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{ref}")',
        ]
    lines += ["```", "", "Evaluate it with the stock lm-evaluation-harness:", "", "```bash"]
    if adapter:
        lines.append(f"lm_eval --model hf --model_args pretrained={base_ref},peft={ref} --tasks TASK")
    else:
        lines.append(f"lm_eval --model hf --model_args pretrained={ref} --tasks TASK")
    masked = f"pretrained={base.get('capsense_name') or base_ref},heads={spec}" + (",ablation=mean" if ablation == "mean" else "")
    lines += [
        "# the same ablation on the unedited base model, with capsense's hooks:",
        f"lm_eval --model capsense-masked --model_args {masked} --tasks TASK",
        "```",
        "",
        "## How to reproduce",
        "",
        "```bash",
        "pip install capsense",
        meta["command"],
        "```",
    ]
    if meta.get("validation_markdown"):
        lines += ["", "## Validation", "", meta["validation_markdown"]]

    provenance = [
        f"- capsense version: {meta.get('capsense_version', __version__)}",
        f"- base model: `{base.get('model')}`"
        + (f" (Hub id `{hub_id}`)" if hub_id and hub_id != base.get("model") else ""),
    ]
    if base.get("revision_sha") or base.get("revision"):
        provenance.append(f"- base revision: `{base.get('revision_sha') or base.get('revision')}`")
    if base.get("content_sha256"):
        provenance.append(f"- base weights sha256 (config and weight files): `{base['content_sha256']}`")
    if adapter:
        provenance.append(f"- adapter vector dtype: {meta.get('adapter', {}).get('vector_dtype', 'float32')}")
    else:
        provenance.append(f"- dtype: {meta.get('torch_dtype') or meta.get('dtype')}")
    lines += ["", "## Provenance", "", *provenance, "", "All of this is also in `capsense.json`."]

    content = f"---\n{card_data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"
    return ModelCard(content)


# -- push ------------------------------------------------------------------------------


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


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set (read now, not at import)."""
    value = os.environ.get("HF_HUB_OFFLINE")
    if value is not None:
        return value.strip().upper() in {"1", "ON", "YES", "TRUE"}
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


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
            "(HF_HUB_OFFLINE=0) when you are online, or use --dry-run to see what would be uploaded"
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


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _render_card_for(folder: Path, repo_id: str) -> bool:
    """Point the card's snippets at ``repo_id`` (only if it is capsense's unedited card)."""
    meta = _card_is_ours(folder)
    if meta is None or meta.get("card_repo_id") == repo_id:
        return False
    text = str(build_model_card(meta, repo_id=repo_id))
    meta["card_sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    meta["card_repo_id"] = repo_id
    _atomic_write(folder / "README.md", text)
    _atomic_write(folder / "capsense.json", json.dumps(meta, indent=2) + "\n")
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
