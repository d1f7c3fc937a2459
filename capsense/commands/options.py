"""Options shared by several commands, declared once.

Each factory returns a click decorator; commands stack them like ``@click.option``. The
values they accept are the library's (``DTYPES`` here is the one list of dtype names).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from capsense.core.ablation import ABLATION_MODES
from capsense.core.batching import CPU_BATCH_SIZE, check_batch_size
from capsense.core.models import DTYPES
from capsense.errors import CapsenseError

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def dtype_option(default: str | None = "float32", *, auto: bool = False, help: str | None = None,
                 name: str = "--dtype", choices: tuple[str, ...] | None = None) -> Decorator:
    """``--dtype``: float32, bfloat16, float16 (and ``auto`` where the command can choose), or ``choices``."""
    choices = choices or (DTYPES if auto else DTYPES[1:])
    return click.option(name, type=click.Choice(choices), default=default, show_default=default is not None,
                        help=help or "Dtype to load the model in.")


def device_option(default: str = "cpu") -> Decorator:
    """``--device``: a torch device string (cpu, cuda, cuda:1, mps)."""
    return click.option("--device", default=default, show_default=True, help="Torch device: cpu, cuda, cuda:1, mps.")


def device_map_option() -> Decorator:
    """``--device-map`` and ``--parallelize`` (lm-eval's spelling of ``--device-map auto``); read both
    with :func:`device_map_from`."""
    def decorate(f):
        f = click.option("--parallelize", is_flag=True, help="lm-eval's spelling of --device-map auto.")(f)
        return click.option(
            "--device-map", default=None,
            help="Spread a model larger than one device: auto (GPUs, then CPU, then disk), balanced, sequential, "
                 "or a JSON map of module -> device (text or a .json file). Instead of --device (not both).")(f)
    return decorate


def device_map_from(device_map: str | None, parallelize: bool) -> str | None:
    """The one device map that ``--device-map`` and ``--parallelize`` ask for."""
    from capsense.errors import CapsenseError

    if parallelize and device_map not in (None, "auto"):
        raise CapsenseError("give --parallelize or --device-map, not both")
    return "auto" if parallelize else device_map


def revision_option(located: bool = False) -> Decorator:
    """``--revision`` of a Hub model; ``located``: a command given a heads file, whose run's revision is the default
    (:func:`capsense.core.heads.located_revision`)."""
    return click.option("--revision", default=None, help="Revision (branch, tag or commit) of a Hub model" + (
        " (default: the one the heads file's run loaded, where MODEL is its model)." if located else "."))


def revision_from(heads: Any, model: str, revision: str | None) -> str | None:
    """``--revision``, else the one the heads file's run loaded (:func:`capsense.core.heads.located_revision`), said on
    stderr where it comes from the file: the command loads it without being told on its command line."""
    from capsense.core.heads import located_revision

    resolved = located_revision(heads, model, revision)
    if resolved and not revision:
        click.echo(f"{model}: loading revision {resolved}, the one the heads file's run located on "
                   "(--revision to load another)", err=True)
    return resolved


def limit_option(default: int | None, help: str) -> Decorator:
    """``--limit``: documents per task."""
    return click.option("--limit", type=int, default=default, show_default=default is not None, help=help)


class _BatchSize(click.ParamType):
    """A positive number of requests, or ``auto`` (:func:`capsense.core.batching.check_batch_size`)."""

    name = "N|auto"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        try:
            return check_batch_size(value)
        except CapsenseError as e:
            self.fail(str(e), param, ctx)


def batch_size_option(default: int = 16, help: str | None = None, *, auto: bool = False) -> Decorator:
    """``--batch-size``: requests per forward pass (and ``auto`` where the command sizes it from free memory)."""
    if not auto:
        return click.option("--batch-size", type=click.IntRange(min=1), default=default, show_default=True,
                            help=help or "Requests per forward pass.")
    return click.option("--batch-size", type=_BatchSize(), default=default, show_default=True,
                        help=help or "Requests per forward pass, or auto: sized from the GPU's free memory "
                                     f"({CPU_BATCH_SIZE} on a CPU).")


def no_progress_option() -> Decorator:
    """``--no-progress`` (into ``quiet``): no progress bar, for logs (every command that shows one: locate,
    run, validate, evaluate, grid, measure, compress, distill)."""
    return click.option("--no-progress", "quiet", is_flag=True, help="No progress bar.")


def overwrite_option() -> Decorator:
    """``--overwrite`` an existing non-empty output folder."""
    return click.option("--overwrite", is_flag=True, help="Replace an existing non-empty output folder.")


def out_option(help: str, *, required: bool = True, file: bool = False) -> Decorator:
    """``--out``: a folder (or, with ``file``, a file) the command writes."""
    kind = click.Path(dir_okay=not file, file_okay=file, path_type=Path)
    return click.option("--out", required=required, type=kind, help=help)


def include_path_option() -> Decorator:
    """``--include-path``: extra folders of lm-eval task YAMLs (repeatable)."""
    return click.option("--include-path", multiple=True, type=click.Path(exists=True, file_okay=False),
                        help="Extra folder of lm-eval task YAMLs (repeatable).")


def heads_option(required: bool, help: str | None = None) -> Decorator:
    """``--heads``: a head spec (L3H1+L5H0) or a heads JSON file."""
    return click.option("--heads", required=required,
                        help=help or "Heads to ablate: a spec (L3H1+L5H0) or a heads JSON file.")


def top_k_option(default: int | None = None, help: str | None = None) -> Decorator:
    """``--top-k``: the first K heads of a ranked heads file."""
    return click.option("--top-k", type=int, default=default, show_default=default is not None,
                        help=help or "Keep the first K heads of a ranked heads file (default: the set its run chose).")


def ablation_option(default: str | None, help: str) -> Decorator:
    """``--ablation``: what a knocked-out head's output becomes (:data:`capsense.core.ablation.ABLATION_MODES`)."""
    return click.option("--ablation", type=click.Choice(ABLATION_MODES), default=default,
                        show_default=default is not None, help=help)


def mean_reference_option(help: str = "") -> Decorator:
    """``--mean-reference``: the texts head means are taken over for ``--ablation mean``."""
    return click.option("--mean-reference", type=click.Path(exists=True, dir_okay=False),
                        help="Reference texts for --ablation mean (a passage per line, or JSONL with 'text'); "
                             "default: capsense's neutral prose." + (" " + help if help else ""))


def unsafe_code_option() -> Decorator:
    """``--confirm-run-unsafe-code``, as lm-eval requires for tasks that run model-written code."""
    return click.option("--confirm-run-unsafe-code", is_flag=True,
                        help="Allow tasks that execute model-written code (HumanEval, MBPP), as lm-eval requires.")


def csv_list(value: str | None) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [v.strip() for v in (value or "").split(",") if v.strip()]


class RegistryHelpOption(click.Option):
    """An option whose help lists the names of a :class:`capsense.core.registry.Registry`
    (``{names}`` in its help), read from the registry only when ``--help`` is shown: the
    registries' modules import numpy, which a plain command run need not load this early."""

    def __init__(self, *args: Any, registry: str, **kwargs: Any) -> None:
        self.registry = registry  # "module:ATTRIBUTE"
        super().__init__(*args, **kwargs)

    def get_help_record(self, ctx: click.Context):
        import importlib

        if self.help and "{names}" in self.help:
            module, _, attr = self.registry.partition(":")
            self.help = self.help.replace("{names}", getattr(importlib.import_module(module), attr).help())
        return super().get_help_record(ctx)


def registry_option(*decls: str, registry: str, help: str, **kwargs: Any) -> Decorator:
    """``click.option`` whose help's ``{names}`` lists ``registry``'s names (``"module:ATTRIBUTE"``)."""
    return click.option(*decls, cls=RegistryHelpOption, registry=registry, help=help, **kwargs)


def old_name(old: str, new: str, dest: str, **kwargs: Any) -> Decorator:
    """A hidden ``old`` flag kept for one release as an alias of option ``new`` (parameter ``dest``).

    Its value reaches the command through :func:`with_old_name`, with a deprecation note on
    stderr; ``kwargs`` (type, is_flag) as for ``new``.
    """

    def note(ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        if value is not None and value is not False:
            click.echo(f"Note: {old} is deprecated and will be removed in the next release: use {new}", err=True)
            ctx.meta[f"old_name:{dest}"] = (old, value)
        return value

    return click.option(old, f"_old_{dest}", hidden=True, default=None, expose_value=False, callback=note,
                        **kwargs)


def with_old_name(dest: str, value: Any, new: str) -> Any:
    """``value`` of option ``new``, or what its old name gave (both at once is an error)."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    given = ctx.meta.get(f"old_name:{dest}")
    if given is None:
        return value
    if ctx.get_parameter_source(dest) == ParameterSource.COMMANDLINE:
        raise click.UsageError(f"give {new} or its old name {given[0]}, not both")
    return given[1]
