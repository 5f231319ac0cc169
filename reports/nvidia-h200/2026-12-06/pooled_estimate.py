#!/usr/bin/env python3
"""Estimate (no GPU) today's pooled model-vs-tune figure from the tunes' own trials.

For each pooled set (FILES of reports/nvidia-h200/2026-12-05/pooled_model_vs_tune.py) and each
shape whose pick moved since the counted A/B (a moved-shapes CSV, as pooled_moved_shapes.py
writes it), today's ratio to the tune winner is estimated from that seed's tune_seed<N>_trials.csv.gz
(rows whose `specs` is the shape):

  * "retime": both today's config and the winner among the tune's re-timed finalists:
              median(re-time rounds of today's) / median(re-time rounds of the winner);
  * "trial":  otherwise, both timed once in the search: trial time / winner's trial time;
  * "same":   today's config is the winner: 1.0.

Config match = same block_n, block_m, num_kv_splits, num_warps, num_stages.
Unmoved shapes keep their counted A/B ratio.

An estimate, not a measurement: only a same-run A/B of the moved shapes against each set's tune
(``pooled_moved_shapes.py``'s loop) measures them. Writes ``pooled_estimate_rows_<LABEL>.csv`` and
``pooled_estimate_crosscheck_<LABEL>.csv`` beside this file and prints the summary (kept as
``pooled_estimate_<LABEL>.txt``).

usage: python3 reports/nvidia-h200/2026-12-06/pooled_estimate.py \
         reports/nvidia-h200/2026-12-06/pooled_moved_shapes.csv [LABEL]
"""
import csv
import importlib.util
import re
import statistics
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[3]
R = ROOT / "reports/nvidia-h200"
KEY = ["block_n", "block_m", "num_kv_splits", "num_warps", "num_stages"]

# The counted A/Bs: FILES of the pooled script itself (it reads its root from argv when loaded).
_spec = importlib.util.spec_from_file_location("pooled", R / "2026-12-05/pooled_model_vs_tune.py")
_pooled = importlib.util.module_from_spec(_spec)
_argv, sys.argv = sys.argv, [sys.argv[0], str(ROOT)]
_spec.loader.exec_module(_pooled)
sys.argv = _argv
FILES = _pooled.FILES


def ckey(text):
    """KernelConfig(...) string -> (block_n, block_m, num_kv_splits, num_warps, num_stages)."""
    d = dict(re.findall(r"(\w+)=(\d+)", text))
    return tuple(int(d[k]) for k in KEY)


def short(k):
    return f"n{k[0]} m{k[1]} s{k[2]} w{k[3]} st{k[4]}"


def tune_times(seed):
    """{shape: (trial time per config, re-time median per config)} from the seed's trials CSV."""
    (path,) = sorted(R.glob(f"*/tune_seed{seed}_trials.csv.gz"))
    t = pd.read_csv(path)
    out = {}
    for shape, g in t.groupby("specs"):
        tr = g[(g.kind == "trial") & (g.state == "COMPLETE") & g.time_us.notna()]
        trial = {}
        for r in tr.itertuples():
            k = tuple(int(getattr(r, c)) for c in KEY)
            # a duplicate carries its original's time; keep the first (measured) one
            trial.setdefault(k, float(r.time_us))
        rt = g[g.kind == "retime"]
        retime = {tuple(int(x) for x in k): statistics.median(v.time_us)
                  for k, v in rt.groupby(KEY)}
        out[shape] = (trial, retime)
    return out


NEAR = 1.15  # secondary estimate: same block_n/block_m/warps/stages, splits within this factor


def near(trial, cfg, win):
    """Secondary (not an exact match): t at today's splits from the timed configs that differ only in
    num_kv_splits by at most NEAR (log-interpolated between bracketing splits, else the nearest one),
    over the winner's trial time."""
    if win not in trial:
        return None
    same = sorted((k[2], t) for k, t in trial.items() if k[:2] + k[3:] == cfg[:2] + cfg[3:]
                  and max(k[2], cfg[2]) <= NEAR * min(k[2], cfg[2]))
    if not same:
        return None
    lo = [x for x in same if x[0] <= cfg[2]]
    hi = [x for x in same if x[0] >= cfg[2]]
    if lo and hi and lo[-1][0] != hi[0][0]:
        import math
        (s0, t0), (s1, t1) = lo[-1], hi[0]
        f = math.log(cfg[2] / s0) / math.log(s1 / s0)
        t = t0 + f * (t1 - t0)
    else:
        t = min(same, key=lambda x: abs(x[0] - cfg[2]))[1]
    return t / trial[win]


def ratio(times, cfg, win, trial_only=False):
    """(estimated t(cfg)/t(win), source) or (None, why)."""
    if times is None:
        return None, "shape not in trials"
    trial, retime = times
    if cfg == win:
        return 1.0, "same"
    if cfg in retime and win in retime and not trial_only:
        return retime[cfg] / retime[win], "retime"
    if cfg in trial and win in trial:
        return trial[cfg] / trial[win], "trial"
    if cfg not in trial and cfg not in retime:
        return None, "not timed"
    return None, "winner not timed"


def main():
    moved_csv = Path(sys.argv[1])
    label = sys.argv[2] if len(sys.argv) > 2 else moved_csv.stem
    with open(moved_csv, newline="") as f:
        moved = {(int(r["seed"]), r["shape"]): r for r in csv.DictReader(f)}
    rows, xcheck = [], []
    for seed, rel in sorted(FILES.items()):
        d = pd.read_csv(R / rel)
        d = d[d.suite == "random"]
        tt = tune_times(seed)
        for r in d.itertuples():
            win = ckey(r.tuned_config)
            times = tt.get(r.shape)
            ab = float(r.b_over_tuned)
            old = ckey(r.b_config)
            o_est, o_src = ratio(times, old, win)
            m = moved.get((seed, r.shape))
            if o_est is not None and o_src != "same":
                t_est, _ = ratio(times, old, win, trial_only=True)
                xcheck.append(dict(seed=seed, shape=r.shape, moved=m is not None, ab=ab, est=o_est, src=o_src,
                                   est_trial=t_est))
            row = dict(seed=seed, shape=r.shape, ab=ab, pick=short(old), est=ab, src="unmoved", moved=False)
            if m is not None:
                assert m["ab_config"] == r.b_config, (seed, r.shape)
                new = ckey(m["today_config"])
                e, src = ratio(times, new, win)
                row.update(moved=True, pick=short(new), src=src, est=e)
                if e is None and times is not None:
                    row["near"] = near(times[0], new, win)
            rows.append(row)
    df = pd.DataFrame(rows)
    x = pd.DataFrame(xcheck)
    mv = df[df.moved]
    has = mv[mv.est.notna()]
    out = []
    p = out.append
    p(f"## {label}: {len(mv)} moved shapes of {len(df)}")
    p(f"- today's pick timed by the tune (incl. = winner): {len(has)} "
      f"({', '.join(f'{k} {v}' for k, v in has.src.value_counts().items())}); "
      f"no estimate: {len(mv) - len(has)} "
      f"({', '.join(f'{k} {v}' for k, v in mv[mv.est.isna()].src.value_counts().items())})")

    def counts(sub, col):
        return int((sub[col] <= 1.05).sum()), int((sub[col] <= 1.10).sum()), len(sub)

    base = counts(df, "ab")
    p(f"- counted A/Bs (baseline): within 5% {base[0]}/{base[2]}, within 10% {base[1]}/{base[2]}")
    df["est_u"] = df.est.fillna(df.ab)  # moved w/o estimate: A/B ratio assumed unchanged
    u = counts(df, "est_u")
    ex = df[df.est.notna()]
    e = counts(ex, "est")
    p(f"- estimate, unestimated moved shapes unchanged: within 5% {u[0]}/{u[2]} ({100*u[0]/u[2]:.1f}%), "
      f"within 10% {u[1]}/{u[2]} ({100*u[1]/u[2]:.1f}%)")
    p(f"- estimate, unestimated moved shapes excluded: within 5% {e[0]}/{e[2]} ({100*e[0]/e[2]:.1f}%), "
      f"within 10% {e[1]}/{e[2]} ({100*e[1]/e[2]:.1f}%)")
    p(f"- moved shapes with an estimate: A/B ratio within 5%/10% {counts(has, 'ab')[:2]} -> "
      f"estimate {counts(has, 'est')[:2]} of {len(has)}")

    def sets_ok(frame, col):
        ok = []
        for seed, g in frame.groupby("seed"):
            w5, w10, n = counts(g, col)
            if w5 >= 0.9 * n and w10 == n:
                ok.append(seed)
        return ok

    ok_base, ok_u, ok_x = sets_ok(df, "ab"), sets_ok(df, "est_u"), sets_ok(ex, "est")
    p(f"- sets meeting >=90% within 5% AND 100% within 10% (of 22): baseline {len(ok_base)}; "
      f"estimate (unchanged) {len(ok_u)} {ok_u}; estimate (excluded) {len(ok_x)} {ok_x}")
    if "near" not in df:
        df["near"] = None
    df["est_n"] = df.est.fillna(df.near.astype(float))
    nn = df[df.moved & df.est.isna() & df.near.notna()]
    df["est_nu"] = df.est_n.fillna(df.ab)
    nu, nx = counts(df, "est_nu"), counts(df[df.est_n.notna()], "est_n")
    p(f"- secondary (approximate): +{len(nn)} moved shapes whose pick differs from a timed config only in "
      f"num_kv_splits within x{NEAR} (trial-time interpolation); their A/B ratio within 5%/10% "
      f"{counts(nn, 'ab')[:2]} -> estimate {counts(nn, 'near')[:2]} of {len(nn)}. Pooled with them: "
      f"unchanged {nu[0]}/{nu[2]} & {nu[1]}/{nu[2]}, sets meeting target {len(sets_ok(df, 'est_nu'))}; "
      f"excluded {nx[0]}/{nx[2]} & {nx[1]}/{nx[2]}, sets {len(sets_ok(df[df.est_n.notna()], 'est_n'))}")
    beyond = df[df.est_u > 1.10].sort_values("est_u", ascending=False)
    p(f"- beyond 10% under the estimate (unchanged assumption), {len(beyond)}: " + "; ".join(
        f"{r.seed} {r.shape} [{r.pick}] {r.est_u:.3f} ({r.src}{'' if r.src == 'unmoved' else f', A/B {r.ab:.3f}'})"
        for r in beyond.itertuples()))
    # cross-check: tune-internal ratio of the counted A/B's own pick against its measured A/B ratio
    for name, sub in [("moved shapes' old pick", x[x.moved]), ("all shapes' A/B pick", x)]:
        if not len(sub):
            continue
        diff = (sub.est / sub.ab)
        agree5 = int(((sub.est <= 1.05) == (sub.ab <= 1.05)).sum())
        agree10 = int(((sub.est <= 1.10) == (sub.ab <= 1.10)).sum())
        p(f"- cross-check, {name} timed by the tune (pick != winner), n={len(sub)} "
          f"({', '.join(f'{k} {v}' for k, v in sub.src.value_counts().items())}): tune/AB ratio median "
          f"{diff.median():.3f}, IQR {diff.quantile(.25):.3f}-{diff.quantile(.75):.3f}, |log| median "
          f"{(abs(diff - 1)).median():.3f}, within 3% of A/B {int((abs(diff - 1) <= .03).sum())}; same side of 5%: "
          f"{agree5}, of 10%: {agree10}; A/B>1.05 but est<=1.05: {int(((sub.ab > 1.05) & (sub.est <= 1.05)).sum())}, "
          f"reverse {int(((sub.ab <= 1.05) & (sub.est > 1.05)).sum())}")
        for src, s2 in sub.groupby("src"):
            d2 = s2.est / s2.ab
            p(f"  - {src}: n={len(s2)}, median {d2.median():.3f}, |dev| median {(abs(d2 - 1)).median():.3f}, "
              f"same side of 5% {int(((s2.est <= 1.05) == (s2.ab <= 1.05)).sum())}")
    tx = x[x.est_trial.notna()]
    if len(tx):
        d3 = tx.est_trial / tx.ab
        p(f"- cross-check with search (single-shot trial) times only, all shapes' A/B pick, n={len(tx)}: "
          f"median {d3.median():.3f}, IQR {d3.quantile(.25):.3f}-{d3.quantile(.75):.3f}, |dev| median "
          f"{abs(d3 - 1).median():.3f}, within 3% {int((abs(d3 - 1) <= .03).sum())}, same side of 5% "
          f"{int(((tx.est_trial <= 1.05) == (tx.ab <= 1.05)).sum())}, of 10% "
          f"{int(((tx.est_trial <= 1.10) == (tx.ab <= 1.10)).sum())}")
    df.to_csv(Path(__file__).with_name(f"pooled_estimate_rows_{label}.csv"), index=False)
    x.to_csv(Path(__file__).with_name(f"pooled_estimate_crosscheck_{label}.csv"), index=False)
    print("\n".join(out))


if __name__ == "__main__":
    main()
