"""Several tuning workers on one host: ``--devices``, the compile processes per worker, and the
supervisor that runs one worker process per device.

``--devices all`` (every visible GPU), ``--devices 0,1,3`` (GPU indices as this process sees
them) or, without a GPU, ``--devices cpu:N`` (N worker processes in Triton's interpreter, for
tests and for trying the distributed mode anywhere). Each worker is a ``tsdecode-tune worker``
process pinned to its GPU with CUDA_VISIBLE_DEVICES; it has its own measuring process and
compile pool. The supervisor restarts a worker that dies (its trials are failed and queued again
at once: the supervisor knows the process is gone), refuses nothing itself (a worker of another
GPU model exits with status 2 and the message, and is not restarted), and prints one progress
line for the whole job. A worker ends with its supervisor (``stop_with_supervisor``): killed
outright, the supervisor leaves no worker timing on beside the workers of the next run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .arguments import PROG, UsageError

# A worker that dies is restarted this many times (per device) before the run goes on without it.
MAX_RESTARTS = 3
# Compile processes per worker: never more than this (what one measuring GPU keeps busy).
MAX_COMPILE_WORKERS = 8
# CPUs kept free: for the supervisor and, per worker, its own process and its measuring process.
RESERVED_CPUS, CPUS_PER_WORKER = 2, 2
PROGRESS_EVERY_S = 10.0
# A worker whose supervisor died stops as on SIGTERM; one still running this much later is ended.
ORPHAN_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class Slot:
    """One worker's device: ``label`` in messages and trial records ("cuda:3", "cpu:1"),
    ``device`` as the worker opens it ("cuda" or "cpu") and its environment."""

    label: str
    device: str
    env: dict[str, str]


def parse_devices(text: str) -> list[Slot]:
    """The slots of ``--devices``: "all", "0,1,3", "cpu" or "cpu:N" (UsageError otherwise)."""
    text = text.strip()
    if text == "cpu" or text.startswith("cpu:"):
        n = text[4:] or "1"
        if not n.isdigit() or int(n) < 1:
            raise UsageError(f"{PROG}: error: --devices {text}: cpu:N needs a worker count N >= 1")
        return [Slot(f"cpu:{i}", "cpu", {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}) for i in range(int(n))]
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if text == "all":
        if count == 0:
            raise UsageError(f"{PROG}: error: --devices all: no CUDA GPU is visible (without one, --devices cpu:N "
                             "runs N interpreter workers)")
        indices = list(range(count))
    else:
        try:
            indices = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"{PROG}: error: --devices {text}: expected all, GPU indices like 0,1,3, "
                             "or cpu:N") from None
        if not indices or len(set(indices)) != len(indices):
            raise UsageError(f"{PROG}: error: --devices {text}: expected distinct GPU indices like 0,1,3")
        bad = [i for i in indices if not 0 <= i < count]
        if bad:
            raise UsageError(f"{PROG}: error: --devices {text}: no GPU {bad[0]} ({count} visible)")
    # Indices as this process sees them; CUDA_VISIBLE_DEVICES already set maps them onward.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [x.strip() for x in visible.split(",")] if visible else [str(i) for i in range(count)]
    return [Slot(f"cuda:{i}", "cuda", {"CUDA_VISIBLE_DEVICES": names[i]}) for i in indices]


def compile_workers_per_device(workers: int, cpus: int | None = None, cpu_mode: bool = False) -> int:
    """Compile processes for each of ``workers`` GPU workers: the host's CPUs less RESERVED_CPUS
    and CPUS_PER_WORKER per worker, split evenly, between 1 and MAX_COMPILE_WORKERS (one GPU:
    min(8, CPUs - 4)). 0 in the interpreter, where there is nothing to precompile."""
    if cpu_mode:
        return 0
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(MAX_COMPILE_WORKERS, (cpus - RESERVED_CPUS - CPUS_PER_WORKER * workers) // workers))


_PROBE = (
    "import dataclasses, json, sys, torch\n"
    "from tsdecode.device import device_properties\n"
    "print(json.dumps([dataclasses.asdict(device_properties(torch.device('cuda', i)))"
    " for i in range(torch.cuda.device_count())]))\n"
)


def probe(slots: Sequence[Slot]):
    """The device properties of each slot, without a CUDA context in this process: one short
    subprocess sees the slots' GPUs (CPU slots are this machine's CPU)."""
    from tsdecode.device import DeviceProperties, device_properties

    if all(s.device == "cpu" for s in slots):
        return [device_properties("cpu") for _ in slots]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(s.env["CUDA_VISIBLE_DEVICES"] for s in slots),
           "PYTHONPATH": _pythonpath()}
    r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise UsageError(f"{PROG}: error: --devices: cannot read the GPUs' properties: "
                         f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return [DeviceProperties.from_dict(d) for d in json.loads(r.stdout.strip().splitlines()[-1])]


def _pythonpath() -> str:
    """This checkout first on the workers' path (they run ``python -m tuner``)."""
    root = str(Path(__file__).resolve().parent.parent)
    return os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def worker_command(slot: Slot, *, storage: str, job: str, work_dir: Path, compile_workers: int,
                   isolation: str, hook: str | None) -> list[str]:
    """The ``tsdecode-tune worker`` command of one slot (its environment pins the device)."""
    cmd = [sys.executable, "-m", "tuner", "worker", "--storage", storage, "--job", job, "--device", slot.device,
           "--label", slot.label, "--compile-workers", str(compile_workers), "--out", str(work_dir),
           "--isolation", isolation, "--no-progress", "--supervisor", str(os.getpid())]
    return cmd + (["--inject-hook", hook] if hook else [])


def stop_with_supervisor(pid: int) -> None:
    """In a worker that the supervisor ``pid`` started (``worker --supervisor PID``): when the
    supervisor dies, however it dies (kill -9 included), stop as on SIGTERM (its measuring and
    compile processes end with it), so that no orphaned worker goes on timing on the device beside
    the workers of the next run. On Linux the kernel sends the SIGTERM at once (prctl
    PR_SET_PDEATHSIG; the supervisor starts its workers from the thread that runs it); on every
    system a thread checks the parent each second, sends it too, and ends the process
    ORPHAN_GRACE_S later if it is still there. A worker started by hand has no supervisor and
    neither of them."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):  # the thread does it, a second later
            pass

    def watch() -> None:
        while os.getppid() == pid:  # checked first: the supervisor may have died before this process started
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_GRACE_S)
        os._exit(130)

    threading.Thread(target=watch, name="stop-with-supervisor", daemon=True).start()


class Supervisor:
    """Runs one worker process per slot until the job is done (every worker exits 0), restarts
    those that die, and reports progress.

    recover(): called when a worker died, to fail and queue again the trials it held (its
    process is gone, so no grace period is needed). progress(): the job's progress line.
    """

    def __init__(self, slots: Sequence[Slot], commands: Sequence[list[str]], *, echo: Callable[[str], None],
                 recover: Callable[[], None], progress: Callable[[], str] | None = None,
                 every_s: float = PROGRESS_EVERY_S) -> None:
        self.slots, self.commands = list(slots), list(commands)
        self.echo, self.recover, self.progress, self.every_s = echo, recover, progress, every_s
        self.procs: dict[int, subprocess.Popen] = {}
        self.restarts = [0] * len(self.slots)
        self.exit_codes: dict[int, int] = {}

    def _start(self, i: int) -> None:
        env = {**os.environ, **self.slots[i].env, "PYTHONPATH": _pythonpath()}
        self.procs[i] = subprocess.Popen(self.commands[i], env=env, stdin=subprocess.DEVNULL)

    def run(self) -> dict[int, int]:
        """Exit code of each slot's last worker (0: the job finished)."""
        for i in range(len(self.slots)):
            self._start(i)
        last = time.monotonic()
        try:
            while self.procs:
                time.sleep(0.5)
                for i, proc in list(self.procs.items()):
                    rc = proc.poll()
                    if rc is None:
                        continue
                    del self.procs[i]
                    self.exit_codes[i] = rc
                    if rc != 0:
                        self._died(i, proc, rc)
                if self.progress is not None and time.monotonic() - last >= self.every_s:
                    last = time.monotonic()
                    try:
                        self.echo(self.progress())
                    except Exception as e:  # the storage hiccuped: the next line will do
                        self.echo(f"progress: {e}")
        except BaseException:
            self.stop()
            raise
        return self.exit_codes

    def _died(self, i: int, proc: subprocess.Popen, rc: int) -> None:
        slot = self.slots[i]
        how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        if rc == 2:  # refused (another GPU model) or a usage error: it said why
            self.echo(f"worker {slot.label} (pid {proc.pid}) stopped ({how}); not restarting it")
            return
        self.echo(f"worker {slot.label} (pid {proc.pid}) died ({how}); its trials are queued again")
        try:
            self.recover()
        except Exception as e:  # the other workers recover them too, just later
            self.echo(f"  could not recover its trials now ({e}); the other workers will")
        if self.restarts[i] >= MAX_RESTARTS:
            self.echo(f"worker {slot.label}: died {self.restarts[i] + 1} times; the run goes on without it")
            return
        self.restarts[i] += 1
        self.echo(f"worker {slot.label}: restarting it ({self.restarts[i]}/{MAX_RESTARTS})")
        self._start(i)

    def stop(self) -> None:
        """End the workers (an interrupt): SIGINT first (they give their trials back), then kill.
        A second interrupt meanwhile is ignored (the caller restores the handlers)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
        if self.procs:
            self.echo(f"interrupted: stopping {len(self.procs)} worker(s)")
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
