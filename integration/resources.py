"""Sample worker memory (RSS) and local-directory disk use while a benchmark run goes on.

Where it runs: a daemon thread in the benchmark (client) process. The workers are local
processes, so ``psutil`` and ``os.scandir`` read them directly; nothing runs on the cluster.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class ResourcePeaks:
    """**Immutable.** Peaks seen during one run, per worker address.

    Attributes
    ----------
    rss_bytes
        Peak resident set size of each worker process.
    disk_bytes
        Peak bytes in each worker's local directory (spilled data, shuffle buffers).
    samples
        How many times memory was sampled.
    cpu_seconds
        CPU time (user + system, all threads) each worker process used from entering the
        sampler to :meth:`ResourceSampler.stop` (or to :meth:`ResourceSampler.peaks` if
        earlier).
    fds, connections
        Open file descriptors and TCP connections of each worker process when the window
        ended (read once: listing a process's connections parses the host's whole socket
        table, which sampled often took the scheduler's process, where the sampler runs,
        away from its loop; connections only close after a run, so the end is their peak).
    """

    rss_bytes: dict[str, int]
    disk_bytes: dict[str, int]
    samples: int
    cpu_seconds: dict[str, float]
    fds: dict[str, int]
    connections: dict[str, int]


def idle_cpu_blocking(pids: Mapping[str, int], seconds: float = 1.0) -> dict[str, float]:
    """Each process's CPU (cores: user + system seconds a second) over ``seconds`` of
    waiting here: what the workers take while nothing runs (heartbeats, the system
    monitor), which a run's CPU figure holds too, for as long as the run lasts."""
    procs = {a: psutil.Process(p) for a, p in pids.items()}
    before = {a: sum(p.cpu_times()[:2]) for a, p in procs.items()}
    start = time.monotonic()
    time.sleep(seconds)
    after = {a: sum(p.cpu_times()[:2]) for a, p in procs.items()}
    elapsed = time.monotonic() - start
    return {a: (after[a] - before[a]) / elapsed for a in before}


def directory_bytes_blocking(path: str) -> int:
    """Total size of the regular files under ``path`` (files vanishing meanwhile are skipped)."""
    total = 0
    stack = [path]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue
    return total


class ResourceSampler:
    """**Thread-safe (guarded by `_lock`).** Samples RSS and disk use until stopped, and
    counts the CPU time each worker process uses meanwhile. ``stop`` and leaving the block
    are called from the thread that entered it.

    Parameters
    ----------
    pids
        Worker address -> process id.
    directories
        Worker address -> local directory.
    rss_interval, disk_interval
        Seconds between memory samples and between directory scans.

    Examples
    --------
    >>> with ResourceSampler(pids, dirs) as sampler:  # doctest: +SKIP
    ...     run()
    >>> sampler.peaks().rss_bytes  # doctest: +SKIP
    """

    def __init__(
        self,
        pids: Mapping[str, int],
        directories: Mapping[str, str],
        rss_interval: float = 0.1,
        disk_interval: float = 0.5,
    ) -> None:
        self._lock = threading.Lock()
        self._procs = {a: psutil.Process(p) for a, p in pids.items()}
        self._dirs = dict(directories)
        self._rss = dict.fromkeys(pids, 0)
        self._disk = dict.fromkeys(directories, 0)
        self._fds = dict.fromkeys(pids, 0)
        self._connections = dict.fromkeys(pids, 0)
        self._samples = 0
        self._cpu_start: dict[str, float] = {}
        self._cpu_end: dict[str, float] = {}
        self._rss_interval = rss_interval
        self._disk_every = max(1, round(disk_interval / rss_interval))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run_blocking, name="bench-resources", daemon=True
        )

    def __enter__(self) -> ResourceSampler:
        self._cpu_start = self._cpu_blocking()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """End the measured window here (the first call counts; leaving the block calls it
        too): a last sample of memory and disk, and the CPU time so far. The benchmark
        calls it when its clock stops, before work that is not timed (checking the
        outputs)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._sample_blocking(disk=True, last=True)
        cpu = self._cpu_blocking()
        with self._lock:
            self._cpu_end = cpu

    def _cpu_blocking(self) -> dict[str, float]:
        """Each worker process's CPU seconds so far (user + system); gone ones left out."""
        out = {}
        for addr, proc in self._procs.items():
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            out[addr] = times.user + times.system
        return out

    def _run_blocking(self) -> None:
        i = 0
        while not self._stop.wait(self._rss_interval if i else 0):
            self._sample_blocking(disk=i % self._disk_every == 0)
            i += 1

    def _sample_blocking(self, disk: bool, last: bool = False) -> None:
        rss = {}
        for addr, proc in self._procs.items():
            try:
                rss[addr] = proc.memory_info().rss
            except psutil.Error:
                continue
        sizes = {a: directory_bytes_blocking(d) for a, d in self._dirs.items()} if disk else {}
        fds, connections = {}, {}
        if last:
            for addr, proc in self._procs.items():
                try:
                    fds[addr] = proc.num_fds()
                    connections[addr] = len(proc.net_connections(kind="tcp"))
                except psutil.Error:
                    continue
        with self._lock:
            self._samples += 1
            for a, v in rss.items():
                self._rss[a] = max(self._rss[a], v)
            for a, v in sizes.items():
                self._disk[a] = max(self._disk[a], v)
            for a, v in fds.items():
                self._fds[a] = max(self._fds[a], v)
            for a, v in connections.items():
                self._connections[a] = max(self._connections[a], v)

    def peaks(self) -> ResourcePeaks:
        """The peaks so far."""
        with self._lock:
            end = self._cpu_end
        end = end or self._cpu_blocking()  # (psutil reads outside the lock)
        with self._lock:
            cpu = {a: end[a] - t for a, t in self._cpu_start.items() if a in end}
            return ResourcePeaks(
                dict(self._rss),
                dict(self._disk),
                self._samples,
                cpu,
                dict(self._fds),
                dict(self._connections),
            )
