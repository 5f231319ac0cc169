"""Candidate measurement for the tuner: check one kernel config against the reference, then time it.

``Measurer`` does the work in the process that owns the device: for each shape it builds the
input sets once (``measure.make_inputs`` with ``num_copies(spec)`` sets over disjoint pages), a
float64 reference of the first ``check_requests`` requests, and per candidate one wrapper plan
per input set with the candidate's config. A candidate counts only if its output, written over a
NaN-poisoned buffer, is finite everywhere and matches the reference within ``measure.tolerance``
(checked before and after timing). Time: one CUDA graph of all input sets
(``measure.graph_time_us``); on the CPU (Triton interpreter) wall-clock time of one call, which
means nothing.

A CUDA illegal-address error poisons the process's CUDA context, so the tuner runs the Measurer in
a worker subprocess (``WorkerClient``) and restarts it when it dies, hangs or reports a poisoned
context; the candidate that did it is pruned with the reason. ``CompilePool`` precompiles
candidates in parallel processes (``plan`` compiles without launching; the kernels land in
Triton's on-disk cache, from which the worker loads them).

Fault injection (tests): a hook ``hook(stage, spec, config, out=None)`` is called at stage
"compile" (compile pool), "plan" (before the worker plans a candidate), "output" (after the
checked run, ``out`` is the output and may be modified in place) and "time" (a number returned
there replaces the measured time in us: a deterministic timing for tests that compare winners).
Raising fails the candidate. A hook module is imported in every process that measures or
compiles, so one that calls ``tsdecode.device.set_override`` at import makes those processes
report another device (how the tests make a worker of another GPU model).

The worker and compile processes end themselves when the process that started them dies (a
killed tuning worker leaves no orphans holding a GPU).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import multiprocessing
import os
import signal
import sys
import time
import traceback
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from tsdecode import BatchDecodePagedTSWrapper, KernelConfig
from tsdecode.device import INTERPRETER, device_properties

from . import measure
from .grids import DTYPES, ShapeSpec
from .measure import decode_call, geomean, plan_wrapper

Hook = Callable[..., Any]

# Error texts after which a CUDA context is unusable (sticky errors); the worker exits on them.
_STICKY_CUDA_ERRORS = (
    "illegal memory access", "illegal address", "unspecified launch failure", "misaligned address",
    "illegal instruction", "device-side assert", "an illegal", "launch timed out", "uncorrectable",
    "CUDA_ERROR_ILLEGAL", "cudaErrorIllegal", "context is destroyed",
)


class CandidateFailed(Exception):
    """A candidate config failed; ``reason`` is recorded as the trial's prune reason.

    fatal: the measuring process is unusable afterwards (poisoned CUDA context, dead worker,
    timeout) and was (or must be) restarted. timeout: the limit in seconds the request ran past
    (None: it failed otherwise); a larger limit may let it finish.
    """

    def __init__(self, reason: str, fatal: bool = False, timeout: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fatal = fatal
        self.timeout = timeout


class WorkerUnavailable(RuntimeError):
    """The measuring process cannot be (re)started: the run stops (measured trials are kept)."""


def describe_exception(e: BaseException, limit: int = 400) -> str:
    """One line: the exception type and the first non-empty line of its message (and the last:
    triton's compile errors put the useful line there)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    msg = lines[0] if lines else ""
    if len(lines) > 1 and lines[-1] != msg:
        msg += " ... " + lines[-1]
    return (f"{type(e).__name__}: {msg}" if msg else type(e).__name__)[:limit]


def load_hook(spec: str | None) -> Hook | None:
    """``"package.module:function"`` or ``"path/to/file.py:function"`` -> the function."""
    if not spec:
        return None
    if ":" not in spec:
        raise ValueError(f"a hook must be 'module:function' or 'file.py:function', got {spec!r}")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        mod_name = "_tsdecode_tune_hook_" + os.path.basename(where)[:-3]
        module = sys.modules.get(mod_name)
        if module is None:
            file_spec = importlib.util.spec_from_file_location(mod_name, where)
            if file_spec is None or file_spec.loader is None:
                raise ValueError(f"cannot load hook file {where!r}")
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[mod_name] = module
            file_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    hook = getattr(module, name, None)
    if not callable(hook):
        raise ValueError(f"hook {spec!r}: {name!r} is not a function of {where!r}")
    return hook


def _cuda_poisoned(error: BaseException) -> bool:
    if any(s.lower() in str(error).lower() for s in _STICKY_CUDA_ERRORS):
        return True
    try:
        torch.cuda.synchronize()
        return float((torch.ones(1, device="cuda") + 1).item()) != 2.0
    except Exception:
        return True


@dataclass
class _Prepared:
    """Inputs and the reference of one spec, built once per spec."""

    sets: list[measure.DecodeInputs]
    reference: torch.Tensor  # float64 rows of the first n requests
    rows: slice  # those rows in the output's first dim
    bytes: int  # measure.bytes_moved for the drawn lengths
    tol: float


class Measurer:
    """Checks and times candidates on one device (the worker's whole job)."""

    def __init__(self, device: str = "cuda", *, hook: Hook | str | None = None,
                 check_requests: int = 2, replay_ms: float = 80.0) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.hook = load_hook(hook) if isinstance(hook, str) else hook
        self.check_requests = check_requests
        self.replay_ms = replay_ms
        self._prepared: dict[ShapeSpec, _Prepared] = {}
        if not self.cuda and not INTERPRETER:
            raise RuntimeError("a CPU device needs TRITON_INTERPRET=1 set before triton is imported")

    # -- setup --------------------------------------------------------------------------------

    def hello(self, measure_bandwidth: bool = True) -> dict[str, Any]:
        """Device properties (all fields, for the heuristic) and, optionally, copy bandwidth."""
        if self.cuda and self.device.index is not None:
            torch.cuda.set_device(self.device)
        bw = measure.copy_bandwidth_gbs(self.device) if measure_bandwidth else None
        import triton

        return {"device": dataclasses.asdict(device_properties(self.device)), "copy_bandwidth_gbs": bw,
                "triton": triton.__version__, "torch": torch.__version__, "pid": os.getpid()}

    def _prepare(self, spec: ShapeSpec) -> _Prepared:
        prep = self._prepared.get(spec)
        if prep is not None:
            return prep
        copies = measure.num_copies(spec) if self.cuda else 1
        sets = measure.make_inputs(spec, self.device, copies=copies, seed=0)
        s0 = sets[0]
        ref, stop, _ = measure.reference_rows(spec, s0, self.check_requests if self.cuda else spec.batch_size)
        total_q = int(s0.qo_indptr[-1]) if s0.qo_indptr is not None else None
        nbytes = measure.bytes_moved(spec, s0.seq_lens.tolist(), total_q, measure.input_q_lens(s0))
        prep = _Prepared(sets, ref, slice(0, stop), nbytes, measure.tolerance(spec))
        self._prepared[spec] = prep
        return prep

    def _keep_only(self, specs: Sequence[ShapeSpec]) -> None:
        """Free the inputs of other shapes (a 16 GiB cache must not outlive its bucket)."""
        stale = [s for s in self._prepared if s not in specs]
        for s in stale:
            del self._prepared[s]
        if stale and self.cuda:
            torch.cuda.empty_cache()

    def _prepared_for(self, spec: ShapeSpec) -> _Prepared:
        try:
            return self._prepare(spec)
        except Exception as e:
            raise self._fail(f"preparing inputs/reference for {spec.name} failed", e) from None

    # -- failure handling -----------------------------------------------------------------------

    def context_poisoned(self, error: BaseException | None = None) -> bool:
        """True if the CUDA context is unusable (a sticky error): the process must be restarted."""
        return self.cuda and _cuda_poisoned(error if error is not None else Exception(""))

    def _fail(self, what: str, e: BaseException) -> CandidateFailed:
        if isinstance(e, CandidateFailed):
            return e
        fatal = self.context_poisoned(e)
        reason = f"{what}: {describe_exception(e)}" + (" (CUDA context poisoned; measuring process restarted)" if fatal else "")
        return CandidateFailed(reason, fatal=fatal)

    def _call_hook(self, stage: str, spec: ShapeSpec, config: KernelConfig, **kw) -> None:
        if self.hook is not None:
            self.hook(stage, spec, config, **kw)

    # -- one candidate -----------------------------------------------------------------------

    def _check(self, prep: _Prepared, out: torch.Tensor, when: str) -> float:
        if not bool(torch.isfinite(out).all()):
            bad = int((~torch.isfinite(out)).sum())
            raise CandidateFailed(f"wrong result {when}: {bad} non-finite output values "
                                  "(NaN-poisoned output not fully written, or overflow)")
        err = measure.relative_error(out[prep.rows], prep.reference)
        if not err <= prep.tol:
            raise CandidateFailed(f"wrong result {when}: relative error {err:.3g} > tolerance "
                                  f"{prep.tol:g} vs the float64 reference")
        return err

    def _wrappers(self, spec: ShapeSpec, prep: _Prepared, config: KernelConfig) -> list[BatchDecodePagedTSWrapper]:
        try:
            self._call_hook("plan", spec, config)
            return [plan_wrapper(spec, s, config) for s in prep.sets]
        except Exception as e:
            raise self._fail("plan/compile failed", e) from None

    def _time_once(self, prep: _Prepared, wrappers, spec: ShapeSpec | None = None,
                   config: KernelConfig | None = None) -> float:
        if self.hook is not None and spec is not None:
            fake = self.hook("time", spec, config)
            if fake is not None:
                return float(fake)
        calls = [decode_call(w, s) for w, s in zip(wrappers, prep.sets)]
        if self.cuda:
            return measure.graph_time_us(calls, replay_ms=self.replay_ms)
        return measure.wall_times_us(calls[0])[0]

    def prepare(self, specs: Sequence[ShapeSpec]) -> dict[str, Any]:
        """Build the inputs and references of a bucket's specs (freeing other shapes')."""
        specs = list(specs)
        self._keep_only(specs)
        t0 = time.perf_counter()
        for spec in specs:
            self._prepared_for(spec)
        return {"seconds": time.perf_counter() - t0, "copies": [len(self._prepared[s].sets) for s in specs]}

    def measure(self, specs: Sequence[ShapeSpec], config: KernelConfig) -> dict[str, Any]:
        """Check and time ``config`` on every spec of a bucket. Raises CandidateFailed.

        Returns time_us (geometric mean over specs), per-spec time/bytes/bandwidth, the largest
        relative error, and the seconds spent planning (compiling) and measuring.
        """
        specs = list(specs)
        self._keep_only(specs)
        per_spec, plan_s, max_err, t_start = [], 0.0, 0.0, time.perf_counter()
        for spec in specs:
            prep = self._prepared_for(spec)
            t0 = time.perf_counter()
            wrappers = self._wrappers(spec, prep, config)
            plan_s += time.perf_counter() - t0
            s0 = prep.sets[0]
            try:
                s0.out.fill_(float("nan"))
                decode_call(wrappers[0], s0, validate=True)()  # the metadata checked once
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                self._call_hook("output", spec, config, out=s0.out)
            except Exception as e:
                raise self._fail("run failed", e) from None
            max_err = max(max_err, self._check(prep, s0.out, "before timing"))
            try:
                t_us = self._time_once(prep, wrappers, spec, config)
                if self.cuda:
                    torch.cuda.synchronize(self.device)
            except Exception as e:
                raise self._fail("timing failed", e) from None
            if self.cuda:  # the graph's last replay wrote s0.out: it must still be right
                max_err = max(max_err, self._check(prep, s0.out, "after graph replay"))
            if not (t_us > 0 and math.isfinite(t_us)):
                raise CandidateFailed(f"timing failed: non-positive time {t_us}")
            per_spec.append({"spec": spec.name, "time_us": t_us, "bytes": prep.bytes,
                             "bandwidth_gbs": prep.bytes / (t_us * 1e-6) / 1e9,
                             "adjustments": list(wrappers[0].config.adjustments)})
        return {
            "time_us": geomean(p["time_us"] for p in per_spec),
            "bandwidth_gbs": geomean(p["bandwidth_gbs"] for p in per_spec),
            "per_spec": per_spec, "rel_error": max_err, "plan_s": plan_s,
            "measure_s": time.perf_counter() - t_start,
        }

    def retime(self, specs: Sequence[ShapeSpec], configs: Sequence[KernelConfig], rounds: int) -> dict[str, Any]:
        """Re-time ``configs`` interleaved: ``rounds`` rounds, each timing every config once (the
        order rotates per round). Returns per-config lists of per-round times (geometric mean over
        specs) and the failure reason of configs that failed."""
        specs, configs = list(specs), list(configs)
        self._keep_only(specs)
        wrappers: dict[tuple[int, int], list] = {}
        failed: dict[int, str] = {}
        for si, spec in enumerate(specs):
            prep = self._prepare(spec)
            for ci, config in enumerate(configs):
                if ci not in failed:
                    try:
                        wrappers[si, ci] = self._wrappers(spec, prep, config)
                    except CandidateFailed as e:
                        if e.fatal:
                            raise
                        failed[ci] = e.reason
        times: dict[int, list[float]] = {ci: [] for ci in range(len(configs)) if ci not in failed}
        order = list(times)
        for r in range(rounds):
            for ci in order[r % len(order):] + order[: r % len(order)] if order else []:
                if ci in failed:
                    continue
                try:
                    per = [self._time_once(self._prepared[spec], wrappers[si, ci], spec, configs[ci])
                           for si, spec in enumerate(specs)]
                except Exception as e:
                    err = self._fail("re-timing failed", e)
                    if err.fatal:
                        raise err from None
                    failed[ci] = err.reason
                    continue
                times[ci].append(geomean(per))
        return {"times_us": {ci: t for ci, t in times.items() if ci not in failed}, "failed": failed,
                "bytes": geomean(self._prepared[s].bytes for s in specs)}


# ---------------------------------------------------------------------------------------------
# Clients: the Measurer in this process (inline) or in a restartable worker subprocess
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerOptions:
    device: str = "cuda"
    hook: str | None = None
    check_requests: int = 2
    replay_ms: float = 80.0

    def measurer(self) -> Measurer:
        return Measurer(self.device, hook=self.hook, check_requests=self.check_requests, replay_ms=self.replay_ms)


def exit_with_parent(parent: int | None = None) -> None:
    """End this process (within a second) when its parent dies: a thread polls the parent's PID.
    Used by the measuring process (which only notices a dead parent between requests) and the
    compile processes (which never do). ``parent``: the PID of the process that started this one
    (passed, so that a parent that died while this one was starting is noticed too)."""
    import threading

    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _reply(conn, reply: dict[str, Any]) -> None:
    """Send ``reply`` to the parent; a parent that is gone (killed, or stopped by a signal) ends
    this process at once and quietly: nobody is left to read a traceback."""
    try:
        conn.send(reply)
    except OSError:  # BrokenPipeError, ConnectionResetError
        os._exit(0)


def _worker_main(conn, options: WorkerOptions, parent: int | None = None) -> None:
    """Worker loop: requests {"op", "args"} -> replies {"ok", "result"} or {"ok": False,
    "reason", "fatal"}. Exits on EOF (the parent died), on "stop" and after a fatal error, and
    when its parent (PID ``parent``) dies mid-request. Ctrl-C in the terminal is the parent's to
    handle: it stops this process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(parent)
    try:
        measurer = options.measurer()
    except BaseException as e:  # report why startup failed, then exit
        _reply(conn, {"ok": False, "reason": f"worker start failed: {describe_exception(e)}",
                      "fatal": True, "startup": True})
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg.get("op") == "stop":
            return
        try:
            result = getattr(measurer, msg["op"])(**msg.get("args", {}))
        except CandidateFailed as e:
            fatal = e.fatal
            _reply(conn, {"ok": False, "reason": e.reason, "fatal": fatal})
        except BaseException as e:  # a bug or an unexpected error: report it with its traceback
            fatal = measurer.context_poisoned(e)
            _reply(conn, {"ok": False, "reason": f"{msg.get('op')} failed: {describe_exception(e)}",
                          "fatal": fatal, "traceback": traceback.format_exc()})
        else:
            _reply(conn, {"ok": True, "result": result})
            continue
        if fatal:
            conn.close()
            os._exit(3)


class InlineClient:
    """The Measurer in this process: no isolation (a poisoned CUDA context ends the run)."""

    def __init__(self, options: WorkerOptions) -> None:
        self.measurer = options.measurer()

    def start(self) -> dict[str, Any]:
        return self.measurer.hello()

    def call(self, op: str, timeout: float | None = None, **args) -> Any:
        try:
            return getattr(self.measurer, op)(**args)
        except CandidateFailed as e:
            if e.fatal:
                raise WorkerUnavailable(
                    f"{e.reason}; the CUDA context of this process is unusable (run with "
                    "--isolation process to survive this); rerun to resume") from None
            raise

    def close(self, wait: bool = True) -> None:
        pass


class WorkerClient:
    """The Measurer in a spawned subprocess, restarted after a crash, a hang or a fatal error.

    ``call`` raises CandidateFailed(fatal=True) for a worker that died or timed out while working
    on a request (the candidate is pruned with that reason) and WorkerUnavailable after
    ``max_restarts`` consecutive failed restarts.
    """

    def __init__(self, options: WorkerOptions, *, max_restarts: int = 5, start_timeout: float = 600.0) -> None:
        self.options = options
        self.max_restarts = max_restarts
        self.start_timeout = start_timeout
        self.ctx = multiprocessing.get_context("spawn")
        self.proc = self.conn = None
        self._consecutive = 0
        self.hello: dict[str, Any] | None = None

    def _kill(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=30)
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None

    def _ensure(self) -> None:
        while self.proc is None or not self.proc.is_alive():
            self._kill()
            if self._consecutive >= self.max_restarts:
                raise WorkerUnavailable(
                    f"the measuring process failed {self._consecutive} times in a row without "
                    "finishing a request; stopping (trials so far are saved; rerun to resume)")
            parent, child = self.ctx.Pipe()
            self.proc = self.ctx.Process(target=_worker_main, args=(child, self.options, os.getpid()),
                                         name="tsdecode-tune-worker", daemon=True)
            self.proc.start()
            child.close()
            self.conn = parent
            self._consecutive += 1
            try:  # bandwidth is measured once per run, by the first worker
                reply = self._request({"op": "hello", "args": {"measure_bandwidth": self.hello is None}},
                                      self.start_timeout)
            except CandidateFailed as e:
                self._kill()
                if self._consecutive >= self.max_restarts:
                    raise WorkerUnavailable(f"the measuring process cannot start: {e.reason}") from None
                continue
            if self.hello is None:
                self.hello = reply

    def _request(self, msg: dict, timeout: float | None) -> Any:
        try:
            self.conn.send(msg)
            if not self.conn.poll(timeout):
                self._kill()
                raise CandidateFailed(f"timeout: no result after {timeout:.0f} s (worker killed)", fatal=True,
                                      timeout=timeout)
            reply = self.conn.recv()
        except (EOFError, OSError):
            if self.proc is not None:
                self.proc.join(timeout=10)
            code = self.proc.exitcode if self.proc is not None else None
            self._kill()
            raise CandidateFailed(
                f"worker process died (exit code {code}) while working on this candidate "
                "(crash, illegal memory access or out of memory)", fatal=True) from None
        if reply.get("ok"):
            self._consecutive = 0
            return reply["result"]
        if reply.get("fatal"):
            self._kill()
        if reply.get("startup"):
            raise WorkerUnavailable(reply["reason"])
        if reply.get("traceback"):
            sys.stderr.write(reply["traceback"])
        raise CandidateFailed(reply["reason"], fatal=bool(reply.get("fatal")))

    def start(self) -> dict[str, Any]:
        self._ensure()
        return self.hello

    def call(self, op: str, timeout: float | None = None, **args) -> Any:
        self._ensure()
        return self._request({"op": op, "args": args}, timeout)

    def close(self, wait: bool = True) -> None:
        """Stop the measuring process: ask it to finish its request and exit, or, without
        ``wait`` (an interrupted run), kill it at once (its trial is queued again by the next run)."""
        if wait and self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send({"op": "stop"})
                self.proc.join(timeout=10)
            except OSError:
                pass
        self._kill()


# ---------------------------------------------------------------------------------------------
# Parallel precompilation
# ---------------------------------------------------------------------------------------------


def compile_candidate(specs: Sequence[ShapeSpec], config: KernelConfig, device: str,
                      hook: str | None = None) -> dict[str, Any]:
    """Plan ``config`` for each spec; on CUDA ``plan`` compiles both kernels (no launch) for the
    layout ``measure.make_inputs`` builds, into Triton's on-disk cache. Never raises: returns
    {"ok", "reason", "seconds"}."""
    t0 = time.perf_counter()
    dev = torch.device(device)
    try:
        hook_fn = load_hook(hook)
        for spec in specs:
            if hook_fn is not None:
                hook_fn("compile", spec, config)
            BatchDecodePagedTSWrapper().plan(
                dev, spec.batch_size, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size,
                spec.kv_len, max_seq_len_q=spec.seq_len_q, packed_query=spec.packed,
                q_data_type=DTYPES[spec.q_dtype], kv_data_type=DTYPES[spec.kv_dtype],
                o_data_type=DTYPES[spec.o_dtype], mask_type=spec.mask_type, window_left=spec.window_left,
                config=config)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as e:
        if dev.type == "cuda" and _cuda_poisoned(e):
            # This process's context is unusable: end it (the pool reports the candidate as not
            # precompiled and the isolated measuring process finds out what it does).
            os._exit(3)
        return {"ok": False, "reason": f"compile failed: {describe_exception(e)}",
                "seconds": time.perf_counter() - t0}
    return {"ok": True, "reason": None, "seconds": time.perf_counter() - t0}


def _compile_init(device: str, parent: int | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it ends the pool
    exit_with_parent(parent)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)


class CompilePool:
    """Processes that precompile candidates while the worker measures others.

    A process that dies (BrokenProcessPool) is replaced; the affected candidates are reported as
    not precompiled ({"ok": None}) and the worker compiles them itself.
    """

    def __init__(self, workers: int, device: str, hook: str | None = None) -> None:
        self.workers, self.device, self.hook = workers, device, hook
        self.ctx = multiprocessing.get_context("spawn")
        self.pool: ProcessPoolExecutor | None = None
        self.compiled = 0
        self.busy_s = 0.0  # sum of per-candidate compile seconds

    def _ensure(self) -> ProcessPoolExecutor:
        if self.pool is None:
            self.pool = ProcessPoolExecutor(self.workers, mp_context=self.ctx, initializer=_compile_init,
                                            initargs=(self.device, os.getpid()))
        return self.pool

    def submit(self, specs: Sequence[ShapeSpec], config: KernelConfig) -> Future:
        try:
            return self._ensure().submit(compile_candidate, list(specs), config, self.device, self.hook)
        except (BrokenProcessPool, RuntimeError):
            self.pool = None
            return self._ensure().submit(compile_candidate, list(specs), config, self.device, self.hook)

    def result(self, future: Future) -> dict[str, Any]:
        try:
            res = future.result()
        except BrokenProcessPool:
            self.close(wait=False)
            return {"ok": None, "reason": "compile process died", "seconds": 0.0}
        except Exception as e:  # pickling problems etc.: let the worker compile
            return {"ok": None, "reason": describe_exception(e), "seconds": 0.0}
        self.compiled += 1
        self.busy_s += res.get("seconds", 0.0)
        return res

    def close(self, wait: bool = True) -> None:
        """Shut the pool down; without ``wait``, also end its processes (a compile still running
        is abandoned)."""
        if self.pool is None:
            return
        procs = list((getattr(self.pool, "_processes", None) or {}).values())
        self.pool.shutdown(wait=wait, cancel_futures=True)
        self.pool = None
        if not wait:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
            for proc in procs:
                proc.join(timeout=10)
