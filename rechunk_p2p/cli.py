"""The ``rechunk-p2p`` command line: rechunk a zarr store, show a plan, run the demo.

Where it runs: client (the main thread of the ``rechunk-p2p`` process). It starts or
connects to a cluster and calls :mod:`rechunk_p2p.integrations.zarr`; the demo's data
generation and verification run as dask tasks on that cluster.

Usage::

    rechunk-p2p SOURCE TARGET --chunks time=-1,lat=90,lon=180 [options]
    rechunk-p2p plan SOURCE --chunks time=-1,lat=90,lon=180
    rechunk-p2p demo [--size 256MiB] [--workers N]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

from dask.utils import format_bytes, parse_bytes, parse_timedelta

from rechunk_p2p.errors import ClusterError, RechunkInputError, RechunkP2PError

PROG = "rechunk-p2p"
EXIT_USAGE = 2
EXIT_FAILED = 1
#: How long closing waits for a registration still under way (the workers' set-up).
_REGISTER_SECONDS = 30.0
_NAME = re.compile(r"^[^\s=,]+$")
_INT = re.compile(r"^-?\d+$")


class UsageError(RechunkInputError):
    """The command line itself is wrong (exit status 2)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rechunk-p2p`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # stop as on Ctrl-C: cleanly, one line
    try:
        command, args = parse_args(argv)
        return command(args)
    except UsageError as e:
        _fail(f"{e} (see {PROG} --help)")
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        _fail(_with_note("interrupted", e))
        return 130
    except (RechunkP2PError, OSError) as e:
        _fail(_with_note(str(e) or type(e).__name__, e))
        return EXIT_FAILED


def entry() -> NoReturn:
    """The ``rechunk-p2p`` program: :func:`main`, then exit without tearing the interpreter
    down. Once the exit handlers ran (distributed's, zarr's, logging's) and the output is
    flushed, nothing of the process is left to keep; freeing every object of dask, pandas,
    xarray and bokeh one by one took 0.45 s of a 5 s command."""
    status = main()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def parse_args(argv: list[str]) -> tuple[Any, argparse.Namespace]:
    """Pick the sub-command from ``argv`` and parse the rest: ``(function, namespace)``.

    Raises
    ------
    UsageError
        Unknown options, missing arguments or a malformed chunk specification.
    """
    if argv and argv[0] in ("plan", "demo"):
        name, rest = argv[0], argv[1:]
    else:
        name, rest = "run", argv
    parser = _PARSERS[name]()
    args = parser.parse_args(rest)
    for option in ("chunks", "shards"):
        if getattr(args, option, None) is not None:
            setattr(args, option, parse_chunks(getattr(args, option), option=option))
    if getattr(args, "scheduler", None) and args.workers is not None:
        raise UsageError("--scheduler and --workers exclude each other")
    if getattr(args, "resume", False) and getattr(args, "overwrite", False):
        raise UsageError("--resume and --overwrite exclude each other")
    return _COMMANDS[name], args


def parse_chunks(text: str, *, option: str = "chunks") -> Any:
    """Parse a ``--chunks`` value.

    ``time=-1,lat=90`` (dimension names or axis numbers) gives a dict, ``365,90,180`` a
    tuple, a single value (``auto``, ``-1``, ``100``, ``64MiB``) applies to every axis.

    Examples
    --------
    >>> parse_chunks("time=-1,lat=90")
    {'time': -1, 'lat': 90}
    >>> parse_chunks("0=auto,2=10")
    {0: 'auto', 2: 10}
    >>> parse_chunks("365,90,180")
    (365, 90, 180)
    >>> parse_chunks("auto")
    'auto'
    """
    items = [item.strip() for item in text.split(",")]
    bad = f"malformed --{option} {text!r}"
    if not text.strip() or any(not item for item in items):
        raise UsageError(f"{bad}: expected e.g. time=-1,lat=90 or 365,90,180")
    named = ["=" in item for item in items]
    if any(named) and not all(named):
        raise UsageError(f"{bad}: give every axis as NAME=SIZE, or none")
    if not any(named):
        if len(items) == 1:
            return _whole_spec(items[0], bad)
        return tuple(_chunk_value(item, bad) for item in items)
    spec: dict[Any, Any] = {}
    for item in items:
        key_text, _, value_text = item.partition("=")
        key = int(key_text) if _INT.match(key_text) else key_text
        if not key_text or not _NAME.match(key_text) or key in spec:
            raise UsageError(f"{bad}: bad or repeated name {key_text!r}")
        spec[key] = _chunk_value(value_text, bad)
    return spec


def _chunk_value(text: str, bad: str) -> int | str:
    """One axis: a positive size, ``-1`` (whole axis) or ``auto``."""
    if text == "auto":
        return text
    if _INT.match(text) and (int(text) > 0 or int(text) == -1):
        return int(text)
    raise UsageError(f"{bad}: {text!r} is not a positive size, -1 or auto")


def _whole_spec(text: str, bad: str) -> int | str:
    """A single value for every axis; also a byte size with its unit (``64MiB``), as dask's
    ``rechunk`` accepts. A bare number is a chunk size, never bytes: ``0``, ``2.5`` or
    ``-3`` are refused, not read as a size in bytes."""
    with contextlib.suppress(UsageError):
        return _chunk_value(text, bad)
    if not any(c.isalpha() for c in text):
        raise UsageError(f"{bad}: {text!r} is not a positive size, -1, auto or a byte size")
    try:
        nbytes = parse_bytes(text)
    except ValueError:
        raise UsageError(f"{bad}: {text!r} is not a size, -1, auto or a byte size") from None
    if nbytes <= 0:
        raise UsageError(f"{bad}: the byte size {text!r} is not positive")
    return text


# --- argument parsers --------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line and raise :class:`UsageError`."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _run_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Rechunk a zarr array or group into a new zarr store, peer to peer. "
        f"Other commands: '{PROG} plan SOURCE --chunks ...' shows what a rechunk would do; "
        f"'{PROG} demo' generates a dataset, rechunks it and checks the result.",
    )
    p.add_argument("source", help="zarr array or group (path or URL)")
    p.add_argument("target", help="path or URL of the new zarr store")
    _add_layout(p)
    p.add_argument("--zarr-format", type=int, choices=(2, 3), help="default: as the source")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing target (or an unfinished run there)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="finish an interrupted run into TARGET: same source, chunks and format; the "
        "chunks it completed are kept",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--dashboard",
        action="store_true",
        help="serve the local cluster's dashboard and print the address of its rechunk page "
        "(with --scheduler: print that cluster's)",
    )
    _add_cluster(p, scheduler=True)
    p.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    return p


def _plan_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"{PROG} plan", description="Show what a rechunk would do; run nothing.")
    p.add_argument("source", help="zarr array or group (path or URL)")
    _add_layout(p)
    p.add_argument("--workers", type=_positive, help="workers to estimate for")
    return p


def _demo_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=f"{PROG} demo",
        description="Generate a climate-like dataset (time, lat, lon) in a temporary zarr "
        "store, rechunk it from one chunk per time step to time series on a local cluster, "
        "verify every element and remove the data.",
    )
    p.add_argument("--size", default="256MiB", type=_bytes, help="data size (default 256MiB)")
    _add_cluster(p, scheduler=False)
    return p


def _json_object(text: str) -> dict:
    """``--storage-options``: a JSON object."""
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("give a JSON object, like '{\"anon\": true}'")
    return value


def _add_layout(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chunks",
        required=True,
        help="new chunks: time=-1,lat=90,lon=180 (dimension names or axis numbers), "
        "365,90,180 for an array, or one value for every axis",
    )
    p.add_argument("--shards", help="shard shape of the target (zarr format 3), like --chunks")
    p.add_argument(
        "--storage-options",
        type=_json_object,
        help="fsspec options for s3://, gs://, ... URLs, as JSON: '{\"anon\": true}'",
    )
    p.add_argument(
        "--include-coords",
        action="store_true",
        help="rechunk dimension coordinates (1-D arrays named after their dimension) too; "
        "by default they keep their layout",
    )


def _add_cluster(p: argparse.ArgumentParser, *, scheduler: bool) -> None:
    g = p.add_argument_group("cluster")
    if scheduler:
        g.add_argument("--scheduler", metavar="ADDRESS", help="use this running cluster")
        g.add_argument(
            "--connect-timeout",
            default=10.0,
            type=_seconds,
            help="for --scheduler (default 10s)",
        )
    g.add_argument("--workers", type=_positive, help="local workers (default: by CPU count)")
    g.add_argument("--threads-per-worker", type=_positive, help="default: by CPU count")
    g.add_argument("--memory-limit", default="auto", type=_memory, help="per worker, e.g. 4GiB")
    g.add_argument(
        "--storage",
        choices=("disk", "memory", "auto"),
        help="where workers keep the pieces they receive",
    )


def _positive(text: str) -> int:
    if not _INT.match(text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _bytes(text: str) -> int:
    try:
        return int(parse_bytes(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 256MiB") from None


def _seconds(text: str) -> float:
    try:
        seconds = float(parse_timedelta(text, default="s"))
    except (ValueError, KeyError):
        seconds = -1.0
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 10s")
    return seconds


def _memory(text: str) -> str:
    if text != "auto":
        _bytes(text)
    return text


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rechunk_p2p")
    except PackageNotFoundError:
        return "(not installed)"


# --- commands ----------------------------------------------------------------------------


def run_command(args: argparse.Namespace) -> int:
    """``rechunk-p2p SOURCE TARGET``: rechunk, then print a summary."""
    options = {
        "shards": args.shards,
        "zarr_format": args.zarr_format,
        "overwrite": args.overwrite,
        "resume": args.resume,
        "storage": args.storage,
        "coordinates": args.include_coords,
        "storage_options": args.storage_options,
    }

    def check() -> None:  # before any data moves; a local cluster starts meanwhile
        from rechunk_p2p.integrations.zarr import check_zarr_rechunk

        check_zarr_rechunk(args.source, args.target, args.chunks, **options)

    with cluster(args, meanwhile=check) as client:
        from rechunk_p2p.integrations.zarr import rechunk_zarr

        if args.dashboard:
            _print_dashboard(client)
        report = rechunk_zarr(
            args.source, args.target, args.chunks, progress=not args.no_progress, **options
        )
    print(report)  # its last line is the event-loop lag over the run
    return 0


def plan_command(args: argparse.Namespace) -> int:
    """``rechunk-p2p plan SOURCE``: print the plan of every array; run nothing."""
    from distributed.deploy.utils import nprocesses_nthreads

    from rechunk_p2p.integrations.zarr import open_source, plan_zarr

    n_workers = args.workers or nprocesses_nthreads()[0]
    plans = plan_zarr(
        args.source,
        args.chunks,
        shards=args.shards,
        n_workers=n_workers,
        coordinates=args.include_coords,
        storage_options=args.storage_options,
    )
    root = open_source(args.source, args.storage_options)
    print(f"{args.source}: zarr format {root.metadata.zarr_format}, {len(plans)} array(s)")
    for name, (layout, plan) in plans.items():
        src = layout.source
        dims = ", ".join(str(d) for d in layout.dims) if layout.dims else "no dimension names"
        shards = f", shards {layout.shards}" if layout.shards else ""
        head = f"{name or '(array)'} ({dims}) {src.dtype} {format_bytes(layout.nbytes)}"
        if plan is None:
            print(f"\n{head}: copied as it is (chunks {layout.chunks}{shards})")
            continue
        print(f"\n{head}: chunks {tuple(src.chunks)} -> {layout.chunks}{shards}")
        print("  " + repr(plan).replace("\n", "\n  "))
    return 0


def demo_command(args: argparse.Namespace) -> int:
    """``rechunk-p2p demo``: generate, rechunk, verify, clean up."""
    from rechunk_p2p.integrations import demo

    with demo.workspace() as work, cluster(args) as client:
        _print_dashboard(client)
        source = demo.generate(work, args.size)
        print(f"generated {source.describe()}")
        report = demo.rechunk(source, work, storage=args.storage)
        demo.verify(source, report.target)
        print(f"verified: all {source.n_elements:,} temperature values equal the source")
    print(report)  # its last line is the event-loop lag over the rechunk
    return 0


_PARSERS = {"run": _run_parser, "plan": _plan_parser, "demo": _demo_parser}
_COMMANDS = {"run": run_command, "plan": plan_command, "demo": demo_command}


# --- cluster, probe, output --------------------------------------------------------------


@contextlib.contextmanager
def cluster(
    args: argparse.Namespace, meanwhile: Callable[[], None] = lambda: None
) -> Iterator[Any]:
    """A client for ``--scheduler``, else for a LocalCluster shaped by the options, after
    ``meanwhile()``: before connecting to a scheduler, while a local cluster starts (its
    workers start in about a second, the time the command takes to import dask.array and
    zarr for its checks); if it raises, the local cluster is closed and nothing runs.

    Raises
    ------
    ClusterError
        The scheduler cannot be reached within ``--connect-timeout``.
    """
    import distributed

    from rechunk_p2p.cluster import register_in_background

    address = getattr(args, "scheduler", None)
    if address:
        from rechunk_p2p.integrations.local_client import scheduler_problem

        meanwhile()

        problem = scheduler_problem(address, args.connect_timeout)
        if problem is not None:  # within the timeout, in one line
            raise ClusterError(f"cannot reach the scheduler at {address!r}: {problem}")
        try:
            client = distributed.Client(address, timeout=args.connect_timeout)
        except (OSError, ValueError, TypeError) as e:
            raise ClusterError(f"cannot reach the scheduler at {address!r}: {e}") from None
        with client:
            registering = register_in_background(client)
            try:
                yield client
            finally:
                registering.join(_REGISTER_SECONDS)
        return
    from rechunk_p2p.integrations.local_client import workers_ignore_interrupts

    with (
        workers_ignore_interrupts(),  # Ctrl-C stops the run here, not the workers
        ThreadPoolExecutor(1, thread_name_prefix="rechunk-p2p-cluster") as pool,
    ):
        starting = pool.submit(_local_cluster, args)
        try:
            _import_engine()
            meanwhile()
        except BaseException:
            with contextlib.suppress(Exception):
                starting.result().close()
            raise
        local = starting.result()
    with local, distributed.Client(local) as client:
        registering = register_in_background(client)  # the workers set up the engine meanwhile
        try:
            yield client
        finally:
            # a stop during the set-up (Ctrl-C at once) must not close the workers under the
            # scheduler's broadcast of the plugin: it would log its failure to each of them
            registering.join(_REGISTER_SECONDS)
            with contextlib.suppress(Exception):
                client.run(_quiet_shutdown)


def _import_engine() -> None:
    """Import, in this thread, the engine's modules that the scheduler of the command's own
    cluster imports when the engine registers in the background (on its loop's thread)
    while this thread rechunks: two threads importing one package's modules at once can
    each find the other's half-imported (Python breaks the wait with a partly initialised
    module: "cannot import name ... (most likely due to a circular import)")."""
    import rechunk_p2p.integrations.zarr
    import rechunk_p2p.scheduler
    import rechunk_p2p.store  # noqa: F401


def _local_cluster(args: argparse.Namespace) -> Any:
    import distributed

    return distributed.LocalCluster(
        n_workers=args.workers,
        threads_per_worker=args.threads_per_worker,
        memory_limit=args.memory_limit,
        dashboard_address=":0",  # its http server (/metrics, /health) on a free port
        # bokeh's import alone takes 0.4 s of a command's start: only where it is shown
        scheduler_kwargs={"dashboard": getattr(args, "dashboard", True)},
        silence_logs=logging.ERROR,
    )


def _print_dashboard(client: Any) -> None:
    """The address of the engine's dashboard page, where the cluster serves one."""
    import importlib.util

    link = getattr(client, "dashboard_link", None)
    if link and importlib.util.find_spec("bokeh") is not None:
        print(f"watch it at {link.rsplit('/', 1)[0]}/rechunk-p2p")


def _quiet_shutdown() -> None:
    """On each worker of the CLI's own cluster, as it shuts down: a heartbeat racing the
    scheduler's close logs a traceback (distributed's "Failed to communicate with scheduler
    during heartbeat"), which is noise once the work is done."""
    logging.getLogger("distributed.worker").setLevel(logging.CRITICAL)


def _with_note(message: str, error: BaseException) -> str:
    """``message`` and the first note added to ``error`` (what became of a zarr target)."""
    notes = getattr(error, "__notes__", None)
    return f"{message}; {notes[0]}" if notes else message


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
