"""One sub-command per lab: ``creditlab lab <name>`` for every name of :func:`creditlab.labs.lab_names`.

:func:`lab_command` registers a lab with the options every lab has (``--quick --out --seeds --updates
--workers --executor --ray-address -e/--experiment --fresh --dump``; ``--quick``'s help is the lab's
``quick_help``, its measured times, when it has one) plus the lab's own
:class:`~creditlab.lab.protocol.LabOption` s; :func:`register_lab_commands` does it for every lab. The
CLI is the edge that reads the environment: a config with a ``cache_dir`` field gets
``CREDITLAB_CACHE`` (default: the user cache directory), and a lab's ``threads`` sets torch's
intra-op threads of this process.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from creditlab.cli._apps import lab_app
from creditlab.errors import ConfigError

__all__ = ["lab_command", "register_lab_commands"]


def _common_parameters(lab) -> list[inspect.Parameter]:
    cfg_type = lab.config_type
    exps = ", ".join(cfg_type.EXPERIMENTS) or "none: this lab has one experiment"
    P = inspect.Parameter
    opts = {
        "quick": typer.Option(False, "--quick", help=getattr(lab, "quick_help", None) or
                              "Reduced run: the same shapes at a fraction of the full run's cost."),
        "out": typer.Option(Path(f"runs/{lab.name}"), "--out",
                            help="Output directory (results store, tables, plots, report.md). A rerun with the same "
                                 "options resumes; one with other options refuses unless --fresh. Locked while a run "
                                 "writes it (<out>.lock): a second run into it is refused, --fresh or not."),
        "seeds": typer.Option(None, "--seeds", help="Paired seeds per arm (default: the lab's, see --quick)."),
        "updates": typer.Option(None, "--updates", help="Policy updates per training run (default: the lab's)."),
        "workers": typer.Option(1, "--workers", help="Worker processes for the cells (process executor; with "
                                                     "--executor ray, the CPUs of a local Ray instance)."),
        "executor": typer.Option(None, "--executor",
                                 help="Where cells run: serial, process, ray (default: process when --workers > 1; "
                                      "serial takes no --workers). "
                                      'ray needs pip install "creditlab\\[ray]".'),
        "ray_address": typer.Option(None, "--ray-address", metavar="ADDR",
                                    help="Ray cluster of --executor ray (auto, HOST:PORT, ray://HOST:PORT); default: "
                                         "a local Ray instance for this run."),
        "experiment": typer.Option(None, "--experiment", "-e", help=f"Run only these experiments ({exps})."),
        "fresh": typer.Option(False, "--fresh", help="Discard a previous run in --out (its store and outputs)."),
        "keep_cells": typer.Option(False, "--keep-cells",
                                   help="Resume an --out whose stored cells were computed by other creditlab code "
                                        "(refused otherwise); report.md then lists the modules that changed."),
        "dump": typer.Option(None, "--dump", metavar="DIR",
                             help="Write the training rollouts in the `creditlab diagnose` schema into DIR (labs with "
                                  "token-level rollouts; the cells this run computes)."),
    }
    if cfg_type.PROTOCOLS:
        opts["protocol"] = typer.Option(None, "--protocol", metavar="NAME",
                                        help="Start from a registered protocol instead of the default: "
                                             f"{', '.join(cfg_type.PROTOCOLS)} (see the lab's docs page).")
    types = {"protocol": str | None, "quick": bool, "out": Path, "seeds": int | None, "updates": int | None,
             "workers": int,
             "executor": str | None, "ray_address": str | None, "experiment": list[str] | None, "fresh": bool,
             "keep_cells": bool,
             "dump": Path | None}
    return [P(name, P.KEYWORD_ONLY, default=default, annotation=types[name]) for name, default in opts.items()]


def _flagged(err: ConfigError, cfg_type: type, names: list[str]) -> ConfigError:
    """``err`` renamed to the CLI flag when it names the field behind one of the options ``names``."""
    param = getattr(err, "parameter", "")
    message = str(err)[len(param) + 2:] if str(err).startswith(f"{param}: ") else str(err)
    for name in names:
        path = cfg_type.OPTIONS.get(name, name)
        if param in (name, path, path.rsplit(".", 1)[-1]):
            flag = "--experiment" if name == "experiments" else "--" + name.replace("_", "-")
            return ConfigError(flag, message)
    return err


def _own_parameters(lab) -> list[inspect.Parameter]:
    params = []
    for opt in getattr(lab, "options", ()):
        flag = "--" + opt.name.replace("_", "-")
        if opt.type is bool:
            default = typer.Option(False, flag, help=opt.help)
            annotation: Any = bool
        else:
            default = typer.Option(None, flag, help=opt.help, metavar=opt.metavar)
            annotation = opt.type | None
        params.append(inspect.Parameter(opt.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=annotation))
    return params


def _configure(lab, kw: dict[str, Any]):
    """The config of one invocation from the parsed options (popped from ``kw``)."""
    cfg_type = lab.config_type
    quick, protocol = kw.pop("quick"), kw.pop("protocol", None)
    if protocol is not None:
        if quick:
            raise ConfigError("--protocol", "choose --quick or --protocol, not both")
        if protocol not in cfg_type.PROTOCOLS:
            raise ConfigError("--protocol", f"unknown protocol {protocol!r}; valid: {', '.join(cfg_type.PROTOCOLS)}")
        cfg = getattr(cfg_type, cfg_type.PROTOCOLS[protocol])()
    else:
        cfg = cfg_type.quick() if quick else cfg_type()
    experiments = kw.pop("experiment")
    if experiments:
        if not cfg_type.EXPERIMENTS:
            raise ConfigError("--experiment", f"the {lab.name} lab has a single experiment")
        cfg = cfg.with_options(experiments=tuple(experiments))
    cfg = cfg.with_options(seeds=kw.pop("seeds"), updates=kw.pop("updates"))
    dump = kw.pop("dump")
    fields = {f.name for f in dataclasses.fields(cfg)}
    if dump is not None:
        if "dump_dir" not in fields:
            raise ConfigError("--dump", f"the {lab.name} lab has no token-level rollouts to dump")
        if dump.exists() and not dump.is_dir():
            raise ConfigError("--dump", f"{dump} exists and is not a directory")
        cfg = cfg.with_options(dump_dir=str(dump))
    if "cache_dir" in fields:
        from creditlab.train.toolshop_base import default_cache_dir

        cfg = cfg.with_options(cache_dir=str(default_cache_dir(os.environ.get("CREDITLAB_CACHE"))))
    own = {opt.name: kw.pop(opt.name) for opt in getattr(lab, "options", ())}
    try:
        cfg = cfg.with_options(**{n: (v or None) if isinstance(v, bool) else v for n, v in own.items()})
        cfg.validate()
    except ConfigError as err:
        raise _flagged(err, cfg_type, [*own, "seeds", "updates", "experiments"]) from None
    return cfg


def lab_command(lab) -> Callable[..., None]:
    """Register ``creditlab lab <lab.name>`` (module doc) and return the command function."""
    own = _own_parameters(lab)
    common = _common_parameters(lab)
    clash = {p.name for p in own} & {p.name for p in common}
    if clash:
        raise TypeError(f"lab {lab.name}: options {sorted(clash)} are common to every lab")

    def command(**kw: Any) -> None:
        from creditlab.lab.protocol import run_lab
        from creditlab.lab.report import to_markdown
        from creditlab.lab.runner import make_executor

        threads = getattr(lab, "threads", None)
        if threads:
            import torch

            torch.set_num_threads(threads)
        out, workers, executor, fresh = kw.pop("out"), kw.pop("workers"), kw.pop("executor"), kw.pop("fresh")
        keep_cells = kw.pop("keep_cells")
        ray_address = kw.pop("ray_address")
        cfg = _configure(lab, kw)
        console = Console()
        ex = make_executor(workers, executor, ray_address,
                           warn=lambda m: console.print(f"[yellow]warning:[/] {escape(m)}", highlight=False))
        t0 = time.perf_counter()
        res = run_lab(lab, cfg, out, ex, fresh=fresh, keep_cells=keep_cells,
                      status=lambda m: console.print(m, highlight=False, markup=False, soft_wrap=True))
        for t in res.tables.values():
            if t.console:
                console.print(f"[bold]{t.title}[/]")
                console.print(to_markdown(t.frame, t.floatfmt), markup=False, highlight=False)
        console.print(f"wrote {out}/report.md, parquet/markdown tables and PNG plots in "
                      f"{time.perf_counter() - t0:.1f} s", highlight=False)

    command.__signature__ = inspect.Signature(common + own)  # typer reads the options from here
    command.__name__ = f"lab_{lab.name}"
    command.__doc__ = getattr(lab, "help", None) or lab.summary
    lab_app.command(lab.name, help=command.__doc__, short_help=lab.summary)(command)
    return command


def register_lab_commands() -> None:
    """One sub-command per lab of :func:`creditlab.labs.lab_names` (built-ins and entry points)."""
    from creditlab.labs import get_lab, lab_names

    for name in lab_names():
        lab_command(get_lab(name))
