"""Candidate measurement for the tuner: check one kernel config against the reference, then time it.

``Measurer`` does the work in the process that owns the device: for each shape it builds the
anchors' input sets once (``measure.make_inputs`` with ``num_copies(spec)`` sets over disjoint
pages), a float64 reference of the first ``check_requests`` requests once, and per candidate one
wrapper plan per input set with the candidate's config. A candidate counts only if its output,
written over a NaN-poisoned buffer, is finite everywhere and matches the reference within
``measure.tolerance`` (checked before and after timing). Time: CUDA events over one captured CUDA
graph of all input sets (``measure.graph_time_us``); on CPU (Triton interpreter) wall-clock time of
one call, which means nothing.

A CUDA illegal-address error poisons the process's CUDA context, so the tuner runs the Measurer in
a worker subprocess (``WorkerClient``) and restarts it when it dies, hangs or reports a poisoned
context; the candidate that did it is pruned with the reason. ``CompilePool`` precompiles
candidates in parallel processes (``plan`` compiles without launching; the kernels land in
Triton's on-disk cache, from which the worker loads them).

Fault injection (tests): a hook ``hook(stage, spec, config, out=None)`` is called at stage
"compile" (compile pool), "plan" (before the worker plans a candidate) and "output" (after the
checked run, ``out`` is the output and may be modified in place). Raising fails the candidate.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from tsdecode import BatchDecodePagedTSWrapper
from tsdecode.configs import KernelConfig
from tsdecode.reference import reference_decode

from . import measure
from .grids import DTYPES, ShapeSpec

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
    timeout) and was (or must be) restarted.
    """

    def __init__(self, reason: str, fatal: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fatal = fatal


class WorkerUnavailable(RuntimeError):
    """The measuring worker cannot be (re)started: the run stops (measured trials are kept)."""


def describe_exception(e: BaseException, limit: int = 400) -> str:
    """One line: the exception type and the first non-empty line of its message."""
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # Triton's compile errors put the useful line last; keep the first and last.
    msg = lines[0] if lines else ""
    if len(lines) > 1 and lines[-1] != msg:
        msg += " ... " + lines[-1]
    out = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return out[:limit]


def config_key(config: KernelConfig) -> str:
    """Compact, stable name of a config: ``n64_m16_s8_w4_st2``."""
    return (f"n{config.block_n}_m{config.block_m}_s{config.num_kv_splits}_"
            f"w{config.num_warps}_st{config.num_stages}")


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


def plan_kwargs(spec: ShapeSpec) -> dict[str, Any]:
    """Plan keyword arguments of a spec (the packed capacity is pinned to spec.seq_len_q so the
    compile pool and the worker compile the same kernel)."""
    kw: dict[str, Any] = dict(
        q_data_type=DTYPES[spec.q_dtype], kv_data_type=DTYPES[spec.kv_dtype],
        o_data_type=DTYPES[spec.o_dtype], mask_type=spec.mask_type, window_left=spec.window_left,
    )
    if spec.packed:
        kw["max_seq_len_q"] = spec.seq_len_q
    else:
        kw["seq_len_q"] = spec.seq_len_q
    return kw


def plan_wrapper(spec: ShapeSpec, inputs: measure.DecodeInputs, config: KernelConfig) -> BatchDecodePagedTSWrapper:
    w = BatchDecodePagedTSWrapper()
    w.plan(inputs.block_tables, inputs.seq_lens, spec.num_qo_heads, spec.num_kv_heads,
           spec.head_dim, spec.page_size, qo_indptr=inputs.qo_indptr, config=config,
           **plan_kwargs(spec))
    return w


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def cpu_copy_bandwidth_gbs(nbytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """Host memory copy bandwidth (bytes read + written); the CPU mode's stand-in reference."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    us = statistics.median(measure.wall_times_us(lambda: dst.copy_(src), repeats=repeats))
    return 2 * nbytes / (us * 1e-6) / 1e9


def cpu_device_info() -> dict[str, Any]:
    """DeviceInfo fields for CPU (interpreter) runs: the nominal SM count the runtime's heuristic
    uses on CPU, so tables and heuristic agree."""
    from tsdecode.configs import device_num_sms

    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    return {"name": "CPU Triton interpreter", "sm_count": device_num_sms(torch.device("cpu")),
            "compute_capability": [0, 0], "total_memory": int(memory)}


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
                 check_requests: int = 2, replay_ms: float = 80.0, cpu_copies: int = 1) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.hook = load_hook(hook) if isinstance(hook, str) else hook
        self.check_requests = check_requests
        self.replay_ms = replay_ms
        self.cpu_copies = cpu_copies
        self._prepared: dict[ShapeSpec, _Prepared] = {}
        if not self.cuda:
            from tsdecode.kernels.decode import interpreter_active

            if not interpreter_active():
                raise RuntimeError("a CPU device needs TRITON_INTERPRET=1 set before triton is imported")

    # -- setup --------------------------------------------------------------------------------

    def hello(self, measure_bandwidth: bool = True) -> dict[str, Any]:
        """Device identity and (optionally) its copy bandwidth in GB/s."""
        if self.cuda:
            if self.device.index is not None:
                torch.cuda.set_device(self.device)
            from tsdecode.tables import DeviceInfo

            info = DeviceInfo.from_torch(self.device).to_dict()
            bw = measure.copy_bandwidth_gbs(self.device) if measure_bandwidth else None
        else:
            info = cpu_device_info()
            bw = cpu_copy_bandwidth_gbs() if measure_bandwidth else None
        import triton

        from tsdecode.configs import device_shared_memory_per_sm

        return {"device": info, "copy_bandwidth_gbs": bw, "interpreter": not self.cuda,
                "shared_memory_per_sm": device_shared_memory_per_sm(self.device),
                "triton": triton.__version__, "torch": torch.__version__, "pid": os.getpid()}

    def _prepare(self, spec: ShapeSpec) -> _Prepared:
        prep = self._prepared.get(spec)
        if prep is not None:
            return prep
        copies = measure.num_copies(spec) if self.cuda else self.cpu_copies
        sets = measure.make_inputs(spec, self.device, copies=copies, seed=0)
        s0 = sets[0]
        lens = s0.seq_lens.tolist()
        total_q = int(s0.qo_indptr[-1]) if s0.qo_indptr is not None else None
        n = spec.batch_size if not self.cuda else min(self.check_requests, spec.batch_size)
        if s0.qo_indptr is not None:
            q_end = int(s0.qo_indptr[n])
            rows, indptr = slice(0, q_end), s0.qo_indptr[: n + 1]
        else:
            rows, indptr = slice(0, n), None
        with torch.no_grad():
            ref = reference_decode(
                s0.q[rows], s0.cache, s0.block_tables[:n], s0.seq_lens[:n],
                seq_len_q=spec.seq_len_q, qo_indptr=indptr, mask_type=spec.mask_type,
                window_left=spec.window_left, compute_dtype=torch.float64,
            )
        prep = _Prepared(sets, ref, rows, measure.bytes_moved(spec, lens, total_q, measure.input_q_lens(s0)),
                         measure.tolerance(spec))
        self._prepared[spec] = prep
        return prep

    def _keep_only(self, specs: Sequence[ShapeSpec]) -> None:
        """Free the inputs of other shapes (a 16 GiB cache must not outlive its bucket)."""
        stale = [s for s in self._prepared if s not in specs]
        for s in stale:
            del self._prepared[s]
        if stale and self.cuda:
            torch.cuda.empty_cache()

    # -- failure handling -----------------------------------------------------------------------

    def context_poisoned(self, error: BaseException | None = None) -> bool:
        """True if the CUDA context is unusable (a sticky error): the process must be restarted."""
        return self.cuda and _cuda_poisoned(error if error is not None else Exception(""))

    def _fail(self, what: str, e: BaseException) -> CandidateFailed:
        if isinstance(e, CandidateFailed):
            return e
        fatal = self.context_poisoned(e)
        reason = f"{what}: {describe_exception(e)}"
        if fatal:
            reason += " (CUDA context poisoned; worker restarted)"
        return CandidateFailed(reason, fatal=fatal)

    def _call_hook(self, stage: str, spec: ShapeSpec, config: KernelConfig, **kw) -> None:
        if self.hook is not None:
            self.hook(stage, spec, config, **kw)

    # -- one candidate -----------------------------------------------------------------------

    def _check(self, spec: ShapeSpec, prep: _Prepared, out: torch.Tensor, when: str) -> float:
        if not bool(torch.isfinite(out).all()):
            bad = int((~torch.isfinite(out)).sum())
            raise CandidateFailed(f"wrong result {when}: {bad} non-finite output values "
                                  "(NaN-poisoned output not fully written, or overflow)")
        err = measure.relative_error(out[prep.rows], prep.reference)
        if not err <= prep.tol:
            raise CandidateFailed(f"wrong result {when}: relative error {err:.3g} > tolerance "
                                  f"{prep.tol:g} vs the float64 reference")
        return err

    def _wrappers(self, spec: ShapeSpec, prep: _Prepared, config: KernelConfig):
        try:
            self._call_hook("plan", spec, config)
            wrappers = [plan_wrapper(spec, s, config) for s in prep.sets]
        except Exception as e:
            raise self._fail("plan/compile failed", e) from None
        return wrappers

    def _timed_calls(self, prep: _Prepared, wrappers) -> list[Callable[[], object]]:
        return [
            (lambda w=w, s=s: w.run(s.q, s.cache, out=s.out)) for w, s in zip(wrappers, prep.sets)
        ]

    def _time_once(self, prep: _Prepared, wrappers, replay_ms: float) -> float:
        calls = self._timed_calls(prep, wrappers)
        if self.cuda:
            return measure.graph_time_us(calls, replay_ms=replay_ms)
        return measure.wall_time_us(calls[0], repeats=1)

    def prepare(self, specs: Sequence[ShapeSpec]) -> dict[str, Any]:
        """Build the inputs and references of a bucket's specs (freeing other shapes')."""
        specs = list(specs)
        self._keep_only(specs)
        t0 = time.perf_counter()
        for spec in specs:
            try:
                self._prepare(spec)
            except Exception as e:
                raise self._fail(f"preparing inputs/reference for {spec.name} failed", e) from None
        return {"seconds": time.perf_counter() - t0,
                "copies": [len(self._prepared[s].sets) for s in specs]}

    def measure(self, specs: Sequence[ShapeSpec], config: KernelConfig) -> dict[str, Any]:
        """Check and time ``config`` on every spec of a bucket. Raises CandidateFailed.

        Returns time_us (geometric mean over specs), per-spec time/bytes/bandwidth, the largest
        relative error, and the seconds spent planning (compiling) and measuring.
        """
        specs = list(specs)
        self._keep_only(specs)
        per_spec, plan_s, t_start = [], 0.0, time.perf_counter()
        max_err = 0.0
        for spec in specs:
            try:
                prep = self._prepare(spec)
            except Exception as e:
                raise self._fail(f"preparing inputs/reference for {spec.name} failed", e) from None
            t0 = time.perf_counter()
            wrappers = self._wrappers(spec, prep, config)
            plan_s += time.perf_counter() - t0
            adjusted = wrappers[0].config.adjustments
            s0 = prep.sets[0]
            try:
                s0.out.fill_(float("nan"))
                wrappers[0].run(s0.q, s0.cache, out=s0.out)
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                self._call_hook("output", spec, config, out=s0.out)
            except Exception as e:
                raise self._fail("run failed", e) from None
            max_err = max(max_err, self._check(spec, prep, s0.out, "before timing"))
            try:
                t_us = self._time_once(prep, wrappers, self.replay_ms)
                if self.cuda:
                    torch.cuda.synchronize(self.device)
            except Exception as e:
                raise self._fail("timing failed", e) from None
            if self.cuda:  # the graph's last replay wrote s0.out: it must still be right
                max_err = max(max_err, self._check(spec, prep, s0.out, "after graph replay"))
            if not (t_us > 0 and math.isfinite(t_us)):
                raise CandidateFailed(f"timing failed: non-positive time {t_us}")
            per_spec.append({"spec": spec.name, "time_us": t_us, "bytes": prep.bytes,
                             "bandwidth_gbs": prep.bytes / (t_us * 1e-6) / 1e9,
                             "adjustments": list(adjusted)})
            del wrappers
        return {
            "time_us": _geomean([p["time_us"] for p in per_spec]),
            "bandwidth_gbs": _geomean([p["bandwidth_gbs"] for p in per_spec]),
            "per_spec": per_spec, "rel_err": max_err, "plan_s": plan_s,
            "measure_s": time.perf_counter() - t_start,
        }

    def retime(self, specs: Sequence[ShapeSpec], configs: Sequence[KernelConfig],
               rounds: int) -> dict[str, Any]:
        """Re-time ``configs`` interleaved: ``rounds`` rounds, each timing every config once (the
        order rotates per round). Returns per-config lists of per-round times (geometric mean over
        specs) and the failure reason of configs that failed."""
        specs = list(specs)
        self._keep_only(specs)
        configs = list(configs)
        wrappers: dict[tuple[int, int], list] = {}
        failed: dict[int, str] = {}
        bytes_per_spec = []
        for si, spec in enumerate(specs):
            prep = self._prepare(spec)
            bytes_per_spec.append(prep.bytes)
            for ci, config in enumerate(configs):
                if ci in failed:
                    continue
                try:
                    wrappers[si, ci] = self._wrappers(spec, prep, config)
                except CandidateFailed as e:
                    if e.fatal:
                        raise
                    failed[ci] = e.reason
        times: dict[int, list[float]] = {ci: [] for ci in range(len(configs)) if ci not in failed}
        for r in range(rounds):
            order = list(times)
            order = order[r % len(order):] + order[: r % len(order)] if order else order
            for ci in order:
                if ci in failed:
                    continue
                per = []
                try:
                    for si, spec in enumerate(specs):
                        per.append(self._time_once(self._prepared[spec], wrappers[si, ci], self.replay_ms))
                except Exception as e:
                    err = self._fail("re-timing failed", e)
                    if err.fatal:
                        raise err from None
                    failed[ci] = err.reason
                    continue
                times[ci].append(_geomean(per))
        return {
            "times_us": {ci: t for ci, t in times.items() if ci not in failed},
            "failed": failed,
            "bytes": _geomean(bytes_per_spec),
        }


# ---------------------------------------------------------------------------------------------
# Clients: the Measurer in this process (inline) or in a restartable worker subprocess
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerOptions:
    device: str = "cuda"
    hook: str | None = None
    check_requests: int = 2
    replay_ms: float = 80.0
    cpu_copies: int = 1


def _make_measurer(options: WorkerOptions) -> Measurer:
    return Measurer(options.device, hook=options.hook, check_requests=options.check_requests,
                    replay_ms=options.replay_ms, cpu_copies=options.cpu_copies)


def _worker_main(conn, options: WorkerOptions) -> None:
    """Worker loop: requests {"op", "args"} -> replies {"ok", "result"} or {"ok": False,
    "reason", "fatal"}. Exits on EOF (the parent died), on "stop" and after a fatal error."""
    try:
        measurer = _make_measurer(options)
    except BaseException as e:  # report why startup failed, then exit
        conn.send({"ok": False, "reason": f"worker start failed: {describe_exception(e)}",
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
            conn.send({"ok": True, "result": result})
        except CandidateFailed as e:
            conn.send({"ok": False, "reason": e.reason, "fatal": e.fatal})
            if e.fatal:
                conn.close()
                os._exit(3)
        except BaseException as e:  # a bug or an unexpected error: report it with its traceback
            fatal = measurer.context_poisoned(e)
            conn.send({"ok": False, "reason": f"{msg.get('op')} failed: {describe_exception(e)}",
                       "fatal": fatal, "traceback": traceback.format_exc()})
            if fatal:
                conn.close()
                os._exit(3)


class InlineClient:
    """The Measurer in this process: no isolation (a poisoned CUDA context ends the run)."""

    def __init__(self, options: WorkerOptions) -> None:
        self.options = options
        self.measurer = _make_measurer(options)
        self.restarts = 0

    def call(self, op: str, timeout: float | None = None, **args) -> Any:
        try:
            return getattr(self.measurer, op)(**args)
        except CandidateFailed as e:
            if e.fatal:
                raise WorkerUnavailable(
                    f"{e.reason}; the CUDA context of this process is unusable (run with "
                    "--isolation process to survive this); rerun to resume") from None
            raise

    def close(self) -> None:
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
        self.proc = None
        self.conn = None
        self.restarts = 0
        self._consecutive = 0
        self.hello: dict[str, Any] | None = None

    def _start(self) -> None:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker_main, args=(child, self.options),
                                name="tsdecode-tune-worker", daemon=True)
        proc.start()
        child.close()
        self.proc, self.conn = proc, parent

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
            if self.proc is not None:
                self._kill()
            if self.hello is not None:
                self.restarts += 1
            if self._consecutive >= self.max_restarts:
                raise WorkerUnavailable(
                    f"the measuring worker failed {self._consecutive} times in a row without "
                    "finishing a request; stopping (trials so far are saved; rerun to resume)")
            self._start()
            self._consecutive += 1
            try:
                # Bandwidth is measured once per run, by the first worker.
                reply = self._request({"op": "hello", "args": {"measure_bandwidth": self.hello is None}},
                                      self.start_timeout)
            except CandidateFailed as e:
                self._kill()
                if self._consecutive >= self.max_restarts:
                    raise WorkerUnavailable(f"the measuring worker cannot start: {e.reason}") from None
                continue
            if self.hello is None:
                self.hello = reply

    def _request(self, msg: dict, timeout: float | None) -> Any:
        try:
            self.conn.send(msg)
            if not self.conn.poll(timeout):
                self._kill()
                raise CandidateFailed(f"timeout: no result after {timeout:.0f} s (worker killed)", fatal=True)
            reply = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            code = self.proc.exitcode if self.proc is not None else None
            if self.proc is not None:
                self.proc.join(timeout=10)
                code = self.proc.exitcode
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

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send({"op": "stop"})
                self.proc.join(timeout=10)
            except (OSError, BrokenPipeError):
                pass
        self._kill()


# ---------------------------------------------------------------------------------------------
# Parallel precompilation
# ---------------------------------------------------------------------------------------------


def compile_candidate(specs: Sequence[ShapeSpec], config: KernelConfig, device: str,
                      hook: str | None = None) -> dict[str, Any]:
    """Plan ``config`` for each spec on small placeholder metadata (same constexprs and integer
    specialisations as the real inputs); on CUDA ``plan`` compiles both kernels (no launch)
    into Triton's on-disk cache. Never raises: returns {"ok", "reason", "seconds"}."""
    t0 = time.perf_counter()
    try:
        hook_fn = load_hook(hook)
        dev = torch.device(device)
        for spec in specs:
            if hook_fn is not None:
                hook_fn("compile", spec, config)
            cols = -(-spec.kv_len // spec.page_size)
            tables = torch.zeros((spec.batch_size, cols), dtype=torch.int32, device=dev)
            lens = torch.full((spec.batch_size,), spec.kv_len, dtype=torch.int32, device=dev)
            indptr = None
            if spec.packed:
                indptr = torch.arange(spec.batch_size + 1, dtype=torch.int32, device=dev) * spec.seq_len_q
            w = BatchDecodePagedTSWrapper()
            w.plan(tables, lens, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
                   spec.page_size, qo_indptr=indptr, config=config, **plan_kwargs(spec))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as e:
        if torch.device(device).type == "cuda" and _cuda_poisoned(e):
            # This process's context is unusable: end it (the pool reports the candidate as not
            # precompiled and the measuring worker, isolated, finds out what it does).
            os._exit(3)
        return {"ok": False, "reason": f"compile failed: {describe_exception(e)}",
                "seconds": time.perf_counter() - t0}
    return {"ok": True, "reason": None, "seconds": time.perf_counter() - t0}


def _cuda_poisoned(error: BaseException) -> bool:
    if any(s.lower() in str(error).lower() for s in _STICKY_CUDA_ERRORS):
        return True
    try:
        torch.cuda.synchronize()
        return float((torch.ones(1, device="cuda") + 1).item()) != 2.0
    except Exception:
        return True


def _compile_init(device: str) -> None:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)


class CompilePool:
    """Processes that precompile candidates while the worker measures others.

    A process that dies (BrokenProcessPool) is replaced; the affected candidates are reported as
    not precompiled ({"ok": None}) and the worker compiles them itself.
    """

    def __init__(self, workers: int, device: str, hook: str | None = None) -> None:
        self.workers = workers
        self.device = device
        self.hook = hook
        self.ctx = multiprocessing.get_context("spawn")
        self.pool: ProcessPoolExecutor | None = None
        self.compiled = 0
        self.busy_s = 0.0  # sum of per-candidate compile seconds

    def _ensure(self) -> ProcessPoolExecutor:
        if self.pool is None:
            self.pool = ProcessPoolExecutor(self.workers, mp_context=self.ctx,
                                            initializer=_compile_init, initargs=(self.device,))
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


def device_info_from_dict(data: dict[str, Any]):
    from tsdecode.tables import DeviceInfo

    cc = data["compute_capability"]
    return DeviceInfo(data["name"], int(data["sm_count"]), (int(cc[0]), int(cc[1])),
                      int(data["total_memory"]))


def as_config(data: dict[str, int] | KernelConfig) -> KernelConfig:
    return data if isinstance(data, KernelConfig) else KernelConfig(**data)


__all__ = [
    "CandidateFailed", "WorkerUnavailable", "Measurer", "WorkerOptions", "InlineClient",
    "WorkerClient", "CompilePool", "compile_candidate", "config_key", "load_hook",
    "describe_exception", "plan_kwargs", "plan_wrapper", "device_info_from_dict", "as_config",
]
