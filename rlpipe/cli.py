"""``rlpipe`` command line: run, validate, stages, lineage, replay, runs, simulate, report, spool replay,
vllm-serve."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlpipe import cli_lineage, cli_report, cli_simulate
from rlpipe.errors import ConfigError, RlpipeError

console = Console(stderr=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlpipe", description="RL post-training as a declarative DAG of stages.")
    parser.add_argument("--version", action="version", version=f"rlpipe {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (("run", "run a pipeline"), ("validate", "check a pipeline without starting anything")):
        cmd = sub.add_parser(name, help=helptext)
        cmd.add_argument("pipeline", help="path of the pipeline YAML")
        cmd.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                         help="override a config value, e.g. -o trainer.total_steps=5 -o stages.update.params.clip_ratio=0.1")
    run = sub.choices["run"]
    run.add_argument("--resume", metavar="CHECKPOINT_DIR", default=None,
                     help="continue from <output_dir>/<run>/checkpoints/step_<N> (trainer.checkpoint_every), or "
                          "'latest': this pipeline's newest complete checkpoint")
    run.add_argument("--fork", action="store_true",
                     help="with --resume of a finished run: go on in a new run linked to it (tag rlpipe.forked_from)")
    run.add_argument("--extend", action="store_true",
                     help="with --resume of a finished run: add steps to it (raise trainer.total_steps); "
                          "its old final model is kept as final_step_<N>")
    run.add_argument("--inline", action="store_true",
                     help="run every stage in this process, without Ray (small runs, debugging)")
    run.add_argument("--log-every", type=int, default=1, metavar="N",
                     help="when stderr is not a terminal: one progress line every N steps (default 1)")
    stages = sub.add_parser("stages", help="every stage kind and its implementations; with KIND or KIND/IMPL: "
                                           "their columns and params with defaults")
    stages.add_argument("kind", nargs="?", default=None, metavar="KIND[/IMPL]",
                        help="a stage kind (advantage), one implementation (advantage/grpo) or a registry (dataset)")
    stages.add_argument("--plugin", action="append", default=[], metavar="FILE",
                        help="import a plugin file first (as a pipeline's plugins: do), so its kinds and impls show; "
                             "repeatable")
    cli_lineage.add_commands(sub)
    cli_simulate.add_commands(sub)
    cli_report.add_commands(sub)
    spool = sub.add_parser("spool", help="tracking calls a run could not deliver (tracking_spool.jsonl)")
    spool_sub = spool.add_subparsers(dest="spool_command", required=True)
    replay = spool_sub.add_parser("replay", help="send a run's spooled tracking calls to MLflow, into the same run")
    replay.add_argument("path", help="the spool file, <output_dir>/<run>/tracking_spool.jsonl")
    replay.add_argument("--tracking-uri", default=None,
                        help="send them to this store instead of the one the run used")
    serve = sub.add_parser("vllm-serve", help="start a vLLM server for a pipeline's model and keep it running "
                                              "(runs attach with -o stages.generate.params.server.urls=[URL])")
    serve.add_argument("pipeline", help="path of the pipeline YAML (its model, tokenizer and generate params)")
    serve.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    serve.add_argument("--port", type=int, default=None, help="loopback port (default: a free one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("RLPIPE_LOG_LEVEL", "WARNING"))
    where: dict[str, str] = {}  # the run's output_dir once its config is read: the error log goes there
    try:
        if args.command == "validate":
            return _validate(args.pipeline, args.override)
        if args.command == "run":
            if (args.fork or args.extend) and not args.resume:
                raise ConfigError("--fork and --extend go with --resume CHECKPOINT_DIR (the checkpoint to go on from)")
            return _run(args.pipeline, args.override, args.resume, args.inline, args.log_every, args.fork, args.extend,
                        where)
        if args.command in ("lineage", "replay", "runs"):
            return cli_lineage.run_command(args)
        if args.command == "simulate":
            return cli_simulate.run_command(args)
        if args.command == "report":
            return cli_report.run_command(args)
        if args.command == "spool":
            return _spool_replay(args.path, args.tracking_uri)
        if args.command == "vllm-serve":
            return _vllm_serve(args.pipeline, args.override, args.port)
        return _stages(args.kind, args.plugin)
    except RlpipeError as exc:
        if args.command != "run":  # validate and the readers: the whole message (a config's every bad field)
            # escaped: messages name fields like stages[reward], which Rich would take for markup and drop
            console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, markup=True, soft_wrap=True)
            return 2
        return _run_failed(exc, sys.argv[1:] if argv is None else argv, where.get("output_dir"))
    except KeyboardInterrupt as exc:  # rlpipe.engine.interrupt: SIGINT/SIGTERM, after the run stopped cleanly
        from rlpipe.engine import interrupt

        stop = interrupt.stop_of(exc)
        console.print(f"[bold yellow]interrupted[/]: {stop}; the run is marked KILLED and its "
                      "workers are closed", highlight=False, markup=True, soft_wrap=True)
        return stop.exit_code
    except Exception as exc:  # noqa: BLE001 - a run fails in one line, whatever broke; the traceback is in the log
        if args.command != "run":
            raise
        return _run_failed(exc, sys.argv[1:] if argv is None else argv, where.get("output_dir"))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rlpipe")
    except PackageNotFoundError:  # a source tree on sys.path without an install
        return "(not installed)"


def _run_failed(exc: BaseException, argv: list[str], output_dir: str | None) -> int:
    """One line on the terminal, the details (full text, traceback, causes) in the error log; exit status 2."""
    from rlpipe import error_log

    path = error_log.write(exc, argv, output_dir)
    kind = "" if isinstance(error_log.root(exc), RlpipeError) else f"{type(error_log.root(exc)).__name__}: "
    details = f" (details: {path})" if path else ""
    console.print(f"[bold red]error:[/] {escape(kind + error_log.one_line(exc) + details)}", highlight=False,
                  markup=True, soft_wrap=True)
    return 2


def _validate(path: str, overrides: list[str]) -> int:
    from rlpipe.engine.planning.config_io import load_pipeline
    from rlpipe.engine.planning.plan import build_plan

    config, _ = load_pipeline(path, overrides)
    plan = build_plan(config)
    table = Table(title=f"{path}: valid ({plan.mode_name} mode); the step DAG in run order")
    for column in ("node", "kind/impl", "runs on", "waits for", "writes"):
        table.add_column(column)
    order = {n.name: i for i, n in enumerate(plan.nodes)}
    for node in plan.nodes:
        where = node.spec.role if node.spec.placement == "worker" else node.spec.placement
        waits = sorted(node.depends_on, key=order.__getitem__)
        table.add_row(node.name, f"{node.kind}/{node.impl}", where, ", ".join(waits), ", ".join(sorted(node.writes)))
    Console().print(table)
    for line in plan.data_checked:
        print(line)
    from rlpipe.engine.execution.physical_plan import format_calls, physical_plan
    from rlpipe.engine.host import run_thread_budget

    roles, threads = run_thread_budget(config, plan, inline=False)
    print("calls on Ray, in order (resources.task_stages_in_workers, resources.concurrent_branches):")
    for part in physical_plan(config, plan, roles):
        print(f" {part['part']}:")
        print("\n".join(format_calls(part["calls"])))
    print(f"torch threads per worker process on Ray: {threads.threads} ({threads.reason})")
    return 0


LATEST = "latest"
"""``--resume latest``: the newest complete checkpoint of the pipeline (rlpipe.engine.resume.latest_checkpoint)."""


def _run(path: str, overrides: list[str], resume: str | None = None, inline: bool = False, log_every: int = 1,
         fork: bool = False, extend: bool = False, where: dict[str, str] | None = None) -> int:
    import time

    from rlpipe.engine import interrupt
    from rlpipe.engine.planning.config_io import load_pipeline
    from rlpipe.engine.runtime import run_pipeline
    from rlpipe.engine.tracking.runs import resolve_tracking_uri, ui_route
    from rlpipe.progress import RunEnd, reporter

    config, text = load_pipeline(path, overrides)
    if where is not None:
        where["output_dir"] = config.trainer.output_dir
    if resume is not None:
        from rlpipe.engine.resume import latest_checkpoint, resolve_checkpoint

        resolved = str(latest_checkpoint(config) if resume == LATEST else resolve_checkpoint(resume))
        if resolved != resume:  # a run folder, its checkpoints/ folder or `latest`: say which checkpoint
            console.print(f"resuming from {resolved}", highlight=False, markup=False, soft_wrap=True)
        resume = resolved
    interrupt.install()
    started = time.time()
    progress = reporter(config.name, config.trainer.total_steps, every=log_every)
    try:
        result = run_pipeline(config, text, on_step=progress.step, resume_from=resume, inline=inline,
                              on_phase=progress.phase, fork=fork, extend=extend)
    finally:
        progress.close()
    ui = route = None
    if config.tracking.enabled:
        ui = f"mlflow ui --backend-store-uri {resolve_tracking_uri(config.tracking.uri)}"
        try:
            route = ui_route(result.run_id, config.tracking.uri)
        except Exception:  # noqa: BLE001 - the summary must not fail on a store hiccup
            route = None
    progress.finish(RunEnd(steps=result.steps, wall_s=time.time() - started, model_dir=result.model_dir,
                           checkpoint_dir=result.checkpoint_dir, run_id=result.run_id if config.tracking.enabled else None,
                           ui_command=ui, reward=result.final_metrics.get("reward/mean"), ui_route=route))
    return 0


def _spool_replay(path: str, tracking_uri: str | None) -> int:
    from rlpipe.engine.tracking.spool import replay_spool

    run_id, calls = replay_spool(path, tracking_uri)
    Console().print(f"[bold green]replayed[/] {calls} tracking calls into MLflow run [bold]{run_id}[/]")
    return 0


def _vllm_serve(path: str, overrides: list[str], port: int | None) -> int:
    """Serve the pipeline's initial model with rlpipe's vLLM flags until interrupted (runs push their own weights)."""
    import time
    from pathlib import Path

    from rlpipe.backends.model import build_model, save_hf_model
    from rlpipe.backends.tokenizer import build_tokenizer
    from rlpipe.engine.planning.config_io import load_pipeline
    from rlpipe.inference.vllm_build import with_context_length
    from rlpipe.inference.vllm_server import VLLMParams, VLLMServer

    config, _ = load_pipeline(path, overrides)
    node = next((s for s in config.stages if s.kind == "generate"), None)
    if node is None or node.impl != "vllm":
        raise ConfigError(f"{path}: vllm-serve needs a generate stage with impl: vllm (found "
                          f"{node.impl if node else 'no generate stage'})")
    params = VLLMParams(**{**node.params.get("server", {}), "urls": []})
    tokenizer = build_tokenizer(config.tokenizer)
    model = build_model(config.model, tokenizer, config.seed)
    params = with_context_length(params, model)
    root = Path(config.trainer.output_dir) / config.name / "vllm-serve"
    lora = None
    if config.trainer.lora is not None:  # the runs that attach push adapters: serve them (rlpipe.inference.vllm_lora)
        from rlpipe.inference.vllm_lora import mode_params_of, server_lora

        lora = server_lora(config.trainer.lora, params.max_loras, mode_params_of(config))
    server = VLLMServer(save_hf_model(model, tokenizer, root / "model"), root, params, name=f"{config.name}-vllm",
                        port=port, lora=lora)
    Console().print(f"serving on [bold]{server.url}[/] (log {server.log_path}); attach a run with\n"
                    f"  rlpipe run {path} -o 'stages.generate.params.server.urls=[\"{server.url}\"]'\n"
                    "Ctrl-C stops it.", highlight=False)
    try:
        while True:
            server.check_alive()
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    finally:
        server.close()


def _stages(kind: str | None, plugins: list[str]) -> int:
    from pydantic import ValidationError

    from rlpipe import cli_stages
    from rlpipe.plugin_files import PluginFile, import_plugin_files

    try:
        files = [PluginFile.model_validate(path) for path in plugins]
    except ValidationError as exc:
        raise ConfigError(f"--plugin: {exc.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    import_plugin_files(files)
    text = cli_stages.detail(kind) if kind else cli_stages.overview()
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `rlpipe stages | head`: the reader stopped; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
