"""The report's HTML pages: one run (``render_html``) and the comparison of two runs
(``render_compare``), drawn from ``results.csv`` rows with the primitives of ``html``."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Sequence

from tsdecode import KernelConfig

from ..measure import geomean
from ..space import config_text
from . import html as H
from .results import MEANINGLESS, RUNTIME, SPEC_FIELDS, Table, family_of, finite, ok, positive

GOOD_FRACTION = 0.8  # "near the roofline": 80% of the measured copy bandwidth
IMPL_COLORS = {RUNTIME: "#4e79a7", "tuned": "#4e79a7", "heuristic": "#a0cbe8",
               "torch_sdpa": "#f28e2b", "flex_attention": "#59a14f", "flashinfer": "#e15759",
               "flashinfer_tc": "#b07aa1"}


def _color(impl: str, i: int) -> str:
    return IMPL_COLORS.get(impl, H.PALETTE[(i + 4) % len(H.PALETTE)])


def _meta_html(t: Table, extra: Sequence[tuple[str, str]] = ()) -> str:
    m = t.meta
    items = [("device", m["description"]), ("driver", m["driver"]), ("CUDA (torch build)", m["cuda_version"]),
             ("torch", m["torch_version"]), ("triton", m["triton_version"]),
             ("tsdecode", m["tsdecode_version"]), ("date (UTC)", m["date"]),
             ("copy bandwidth", f"{H.fmt_num(m['copy_bandwidth_gbs'])} GB/s (device-to-device, read + write)"),
             ("timing", ", ".join(sorted({r.get('timing_method') or '' for r in t.rows} - {''})) or "n/a"),
             *extra]
    return '<div class="meta">' + "".join(f"<div><b>{H.esc(k)}:</b> {H.esc(v)}</div>" for k, v in items) + "</div>"


def _banner(interpreter: bool) -> str:
    if not interpreter:
        return ""
    return (f'<div class="banner">{H.esc(MEANINGLESS)}. This report only shows that the pipeline and '
            f"the correctness checks work; run it on a GPU for numbers.</div>")


def _card(value: str, label: str, bad: bool = False) -> str:
    return (f'<div class="card{" bad" if bad else ""}"><div class="v">{H.esc(value)}</div>'
            f'<div class="l">{H.esc(label)}</div></div>')


def summary(t: Table) -> dict:
    """Headline numbers: geomean speedups, bandwidth share, correctness."""
    shapes = list(t.specs)
    tuned_pairs = [t.time(s, "heuristic") / t.time(s, "tuned") for s in shapes
                   if t.time(s, "tuned") and t.time(s, "heuristic")]
    out = {"shapes": len(shapes), "tuned_shapes": len(tuned_pairs),
           "tuned_vs_heuristic": geomean(tuned_pairs), "vs": {}}
    for b in t.baselines:
        pairs = [t.time(s, b) / t.time(s, RUNTIME) for s in shapes if t.time(s, b) and t.time(s, RUNTIME)]
        out["vs"][b] = (geomean(pairs), len(pairs))
    fracs = [t.runtime(s).get("fraction_of_copy") for s in shapes if t.runtime(s)]
    fracs = [f for f in fracs if finite(f)]
    out["above"] = sum(1 for f in fracs if f >= GOOD_FRACTION)
    out["measured"] = len(fracs)
    checked = [r for r in t.rows if ok(r)]
    out["checked"] = len(checked)
    out["wrong"] = [r for r in checked if r.get("error_ok") is False]  # None: not checked
    out["wrong_tsdecode"] = [r for r in out["wrong"] if r.get("impl_kind") == "tsdecode"]
    out["failed"] = [r for r in t.rows if r.get("status") == "failed"]
    errs = [r["rel_error"] for r in checked if r.get("impl_kind") == "tsdecode" and r.get("rel_error") is not None]
    out["max_err_tsdecode"] = max(errs) if errs else None
    return out


def _summary_html(t: Table) -> str:
    s = summary(t)
    cards = []
    if s["tuned_vs_heuristic"] is not None:
        cards.append(_card(f"{s['tuned_vs_heuristic']:.2f}×",
                           f"tuned vs heuristic, geomean over {s['tuned_shapes']} of {s['shapes']} "
                           "shapes with a table entry"))
    else:
        cards.append(_card("no table", f"no shape has a tuned table entry: all {s['shapes']} "
                                        "use the heuristic config"))
    for b, (g, n) in s["vs"].items():
        if g is not None:
            cards.append(_card(f"{g:.2f}×", f"tsdecode vs {b}, geomean over {n} shapes (>1: tsdecode faster)"))
        else:
            cards.append(_card("n/a", f"{b}: did not run on any shape"))
    if s["measured"]:
        share = s["above"] / s["measured"]
        cards.append(_card(f"{100 * share:.0f}%", f"of shapes ({s['above']}/{s['measured']}) above "
                           f"{100 * GOOD_FRACTION:.0f}% of copy bandwidth"))
    bad = s["wrong_tsdecode"]
    err = s["max_err_tsdecode"]
    cards.append(_card("FAIL" if bad else "pass",
                       f"tsdecode correctness: {len(bad)} rows above tolerance" if bad else
                       f"tsdecode correctness: max rel. error {err:.1e}" if err is not None else "no tsdecode rows ran",
                       bad=bool(bad)))
    html = f'<div class="cards">{"".join(cards)}</div>'
    html += ('<p class="note">"tsdecode" = what the runtime runs for each shape: the tuned-table config '
             'where a table entry exists, else the heuristic. Speedup = other time / tsdecode time. '
             'Times: median per call; bandwidth = bytes moved (K/V read once + q + output) / time.</p>')
    notes = defaultdict(list)
    for r in t.rows:
        if r.get("status") in ("skipped", "failed"):
            notes[(r["impl"], r["status"], r.get("reason") or "")].append(r["shape"])
        elif r.get("status") == "ok" and not ok(r):
            why = f"time_us_median {r.get('time_us_median')} is not a positive finite number"
            notes[(r["impl"], "not plotted", why)].append(r["shape"])
    if notes:
        items = []
        for (impl, status, reason), shapes in notes.items():
            where = "all shapes" if len(shapes) == len(t.specs) else f"{len(shapes)} shape(s)"
            items.append(f"<li><b>{H.esc(impl)}</b> {status} on {where}: {H.esc(reason)}</li>")
        html += f'<h3>Not run</h3><ul class="skips">{"".join(items)}</ul>'
    return html


def _bw_chart(t: Table, shapes: Sequence[str], title: str, y_max: float | None = None) -> str:
    by_batch: dict[int, list] = defaultdict(list)
    for s in shapes:
        r = t.runtime(s)
        if r and positive(r.get("bandwidth_gbs")):
            by_batch[t.specs[s].batch_size].append((t.specs[s].kv_len, r["bandwidth_gbs"], s, r))
    series = []
    for i, (b, pts) in enumerate(sorted(by_batch.items())):
        tips = []
        for _, _, s, r in pts:
            frac = r.get("fraction_of_copy")
            copy = f", {100 * frac:.0f}% of copy" if finite(frac) else ""
            tips.append(f"{s} ({r['impl']}): {r['bandwidth_gbs']:.0f} GB/s{copy}, "
                        f"{r['time_us_median']:.1f} us")
        series.append(H.Series(f"B={b}", [(x, y) for x, y, _, _ in pts], H.PALETTE[i % len(H.PALETTE)],
                               tooltips=tips))
    peak = t.meta["copy_bandwidth_gbs"]
    hlines = [H.HLine(peak, f"copy bandwidth {H.fmt_num(peak)} GB/s"),
              H.HLine(GOOD_FRACTION * peak, f"{100 * GOOD_FRACTION:.0f}%", color="#888", dash="2 3")
              ] if positive(peak) else []
    return H.line_chart(series, title=title, x_label="K/V length per request (tokens, log2 scale)",
                        y_label="achieved bandwidth (GB/s)", hlines=hlines, legend_title="batch size",
                        y_max=y_max)


def _grid_axes(t: Table, shapes: Sequence[str]) -> tuple[list[int], list[int]]:
    batches = sorted({t.specs[s].batch_size for s in shapes})
    lens = sorted({t.specs[s].kv_len for s in shapes})
    return batches, lens


def _heatmap(t: Table, shapes: Sequence[str], title: str, cell_fn, legend: str) -> str:
    batches, lens = _grid_axes(t, shapes)
    cells = {}
    for s in shapes:
        spec = t.specs[s]
        cell = cell_fn(s)
        if cell is not None:
            cells[(batches.index(spec.batch_size), lens.index(spec.kv_len))] = cell
    return H.heatmap([f"B={b}" for b in batches], [H.fmt_tokens(n) for n in lens], cells, title=title,
                     row_title="batch size", col_title="K/V length (tokens)", legend=legend)


def _tuned_cell(t: Table, s: str) -> H.Cell | None:
    tuned, heur = t.time(s, "tuned"), t.time(s, "heuristic")
    if tuned and heur:
        r = heur / tuned
        return H.Cell(H.diverging_color(r), f"{r:.2f}×", f"{s}: heuristic {heur:.1f} us, tuned {tuned:.1f} us")
    if heur:
        return H.Cell("", "no entry", f"{s}: no tuned table entry (the runtime uses the heuristic)")
    return H.Cell("", "n/a", f"{s}: tsdecode did not run")


def _frac_cell(t: Table, s: str) -> H.Cell | None:
    r = t.runtime(s)
    if not r:
        return H.Cell("", "n/a", f"{s}: tsdecode did not run")
    f = r.get("fraction_of_copy")
    if not (finite(f) and finite(r.get("bandwidth_gbs"))):
        return H.Cell("", "n/a", f"{s}: no bandwidth recorded ({r['impl']})")
    return H.Cell(H.sequential_color(f), f"{100 * f:.0f}%",
                  f"{s}: {r['bandwidth_gbs']:.0f} GB/s, {r['time_us_median']:.1f} us ({r['impl']})")


def _latency_chart(t: Table, shapes: Sequence[str], title: str) -> str:
    order = sorted(shapes, key=lambda s: (t.specs[s].batch_size, t.specs[s].kv_len))
    labels = {s: f"B={t.specs[s].batch_size}  L={H.fmt_tokens(t.specs[s].kv_len)}" for s in order}
    # The heuristic gets its own bar only where a tuned entry replaced it.
    values = {(labels[s], n): t.time(s, n) for s in order for n in [RUNTIME] + t.baselines if t.time(s, n)}
    values.update({(labels[s], "heuristic"): t.time(s, "heuristic") for s in order if t.time(s, "tuned")
                   and t.time(s, "heuristic")})
    names = [n for n in [RUNTIME, "heuristic"] + t.baselines if any(k[1] == n for k in values)]
    series = [(n, _color(n, i)) for i, n in enumerate(names)]
    series = [("tsdecode (runtime)" if n == RUNTIME else n, c) for n, c in series]
    values = {(g, "tsdecode (runtime)" if n == RUNTIME else n): v for (g, n), v in values.items()}
    return H.hbar_chart([labels[s] for s in order], series, values, title=title,
                        x_label="time per call (µs, log scale; shorter is better)",
                        value_fmt=lambda v: f"{H.fmt_num(v)} µs")


def _fmt_f(digits: int, suffix: str = "", scale: float = 1.0):
    def f(v):
        return "" if v is None else f"{v * scale:.{digits}f}{suffix}"
    return f


def _fmt_err(v):
    return "" if v is None else f"{v:.1e}"


def _config_cell(v) -> str:
    """A row's config JSON in KernelConfig's field names, as the tuner prints configs."""
    if not v:
        return ""
    try:
        return config_text(KernelConfig.from_dict(json.loads(v)))
    except (TypeError, ValueError):
        return str(v)


def _table_html(t: Table) -> str:
    rows = []
    for r in t.rows:
        row = dict(r)
        lo, hi = r.get("time_us_min"), r.get("time_us_max")
        row["range"] = f"{lo:.1f}–{hi:.1f}" if ok(r) and finite(lo) and finite(hi) else ""
        row["cfg"] = _config_cell(r.get("config"))
        row["why"] = r.get("reason") or r.get("impl_note") or r.get("config_note") or ""
        rows.append(row)
    cols = [
        H.Column("shape", "shape"), H.Column("impl", "impl"), H.Column("status", "status"),
        H.Column("time_us_median", "median µs", True, _fmt_f(1)),
        H.Column("range", "min–max µs"),
        H.Column("bandwidth_gbs", "GB/s", True, _fmt_f(0)),
        H.Column("fraction_of_copy", "% copy", True, _fmt_f(1, "%", 100.0)),
        H.Column("speedup_vs_heuristic", "× heuristic", True, _fmt_f(2, "×"),
                 "heuristic time / this time"),
    ] + [H.Column(f"speedup_vs_{b}", f"× {b}", True, _fmt_f(2, "×"), f"{b} time / this time")
         for b in t.baselines] + [
        H.Column("rel_error", "rel. error", True, _fmt_err, "vs float64 reference, first requests"),
        H.Column("config_source", "config source"), H.Column("cfg", "config"),
        H.Column("why", "notes"),
    ]

    def cls(r):
        if r.get("status") != "ok":
            return r.get("status") or ""
        return "wrong" if r.get("error_ok") is False else ""

    return H.table(cols, rows, row_class=cls)


def render_html(rows: Sequence[dict], title: str | None = None, source: str = "") -> str:
    t = Table(rows)
    title = title or f"tsdecode decode attention: {t.meta['device']}"
    parts = [f"<h1>{H.esc(title)}</h1>", _banner(t.interpreter),
             _meta_html(t, [("shapes", len(t.specs)), ("implementations", ", ".join(t.impls))]
                        + ([("source", source)] if source else [])),
             "<h2>Summary</h2>", _summary_html(t)]
    fams = t.families()
    parts.append("<h2>Bandwidth</h2><div class='charts'>")
    for fam, shapes in fams.items():
        parts.append(_bw_chart(t, shapes, f"tsdecode bandwidth, {fam}"))
        parts.append(_heatmap(t, shapes, f"% of copy bandwidth, {fam}", lambda s: _frac_cell(t, s),
                              "tsdecode (runtime config) achieved GB/s / copy GB/s"))
    parts.append("</div><h2>Tuned vs heuristic</h2><div class='charts'>")
    for fam, shapes in fams.items():
        parts.append(_heatmap(t, shapes, f"tuned speedup over heuristic, {fam}", lambda s: _tuned_cell(t, s),
                              "heuristic time / tuned time; green: tuned faster, red: slower; grey: no table entry"))
    parts.append("</div><h2>Latency vs baselines</h2><div class='charts'>")
    for fam, shapes in fams.items():
        parts.append(_latency_chart(t, shapes, f"time per call, {fam}"))
    parts.append("</div><h2>All results</h2>")
    parts.append('<p class="note">Click a column header to sort. Red rows: failed or above the '
                 "error tolerance; grey rows: skipped (reason in notes).</p>")
    parts.append(_table_html(t))
    return H.page(title, "".join(parts))


# ---------------------------------------------------------------------------------------------
# HTML: comparison of two CSVs


def _key(row: dict) -> tuple:
    return tuple(row[f] for f in SPEC_FIELDS)


def render_compare(rows_a: Sequence[dict], rows_b: Sequence[dict], label_a: str, label_b: str,
                   title: str | None = None) -> str:
    a, b = Table(rows_a), Table(rows_b)
    key_a = {_key(r): r["shape"] for r in a.rows}
    key_b = {_key(r): r["shape"] for r in b.rows}
    common = [k for k in key_a if k in key_b]
    shapes = [key_a[k] for k in common]  # shape names are derived from the key, so equal in both
    impls = [RUNTIME] + [n for n in a.impls if n in b.impls]
    title = title or f"tsdecode comparison: {a.meta['device']} ({label_a}) vs {b.meta['device']} ({label_b})"

    def meta_line(t: Table, label: str) -> str:
        m = t.meta
        return (f"<div><b>{H.esc(label)}:</b> {H.esc(m['description'])}, {H.esc(m['date'])}, torch {H.esc(m['torch_version'])}, "
                f"triton {H.esc(m['triton_version'])}, copy {H.fmt_num(m['copy_bandwidth_gbs'])} GB/s</div>")

    parts = [f"<h1>{H.esc(title)}</h1>", _banner(a.interpreter or b.interpreter),
             f'<div class="meta" style="grid-template-columns: 1fr">{meta_line(a, "A " + label_a)}'
             f'{meta_line(b, "B " + label_b)}</div>',
             "<h2>Summary</h2>"]
    cards = []
    for n in impls:
        pairs = [a.time(s, n) / b.time(s, n) for s in shapes if a.time(s, n) and b.time(s, n)]
        g = geomean(pairs)
        if g is not None:
            cards.append(_card(f"{g:.2f}×", f"{n}: B speedup over A (time A / time B), geomean over "
                                            f"{len(pairs)} shapes"))
    only_a, only_b = len(key_a) - len(common), len(key_b) - len(common)
    cards.append(_card(str(len(common)), f"matching shapes ({only_a} only in A, {only_b} only in B)"))
    parts.append(f'<div class="cards">{"".join(cards)}</div>')
    parts.append('<p class="note">Ratio = time A / time B: above 1 means B is faster. "tsdecode" = '
                 "the runtime's config (tuned entry, else heuristic) in each run.</p>")

    fams: dict[str, list[str]] = defaultdict(list)
    for s in shapes:
        fams[family_of(a.specs[s])].append(s)
    parts.append("<h2>Bandwidth, side by side</h2>")
    for fam, fs in fams.items():
        tops = [v for v in [a.meta["copy_bandwidth_gbs"], b.meta["copy_bandwidth_gbs"]]
                + [t.runtime(s).get("bandwidth_gbs") for t in (a, b) for s in fs if t.runtime(s)]
                if positive(v)]
        top = max(tops) * 1.08 if tops else None
        parts.append("<div class='charts'>")
        parts.append(_bw_chart(a, fs, f"A ({label_a}), {fam}", y_max=top))
        parts.append(_bw_chart(b, fs, f"B ({label_b}), {fam}", y_max=top))
        parts.append("</div>")
    parts.append("<h2>Time ratio A / B (tsdecode)</h2><div class='charts'>")
    for fam, fs in fams.items():
        def cell(s, fam=fam):
            ta, tb = a.time(s, RUNTIME), b.time(s, RUNTIME)
            if not (ta and tb):
                return H.Cell("", "n/a", f"{s}: missing in one run")
            r = ta / tb
            return H.Cell(H.diverging_color(r), f"{r:.2f}×", f"{s}: A {ta:.1f} us, B {tb:.1f} us")
        parts.append(_heatmap(a, fs, f"time A / time B, {fam}", cell,
                              "green: B faster, red: B slower"))
    parts.append("</div><h2>All matching rows</h2>")
    rows = []
    for s in shapes:
        for n in impls:
            ra = a.runtime(s) if n == RUNTIME else a.by[s].get(n)
            rb = b.runtime(s) if n == RUNTIME else b.by[s].get(n)
            if not (ra or rb):
                continue
            ta, tb = a.time(s, n), b.time(s, n)
            rows.append({
                "shape": s, "impl": "tsdecode (runtime)" if n == RUNTIME else n, "time_a": ta, "time_b": tb,
                "ratio": ta / tb if ta and tb else None,
                "gbs_a": ra.get("bandwidth_gbs") if ok(ra) else None,
                "gbs_b": rb.get("bandwidth_gbs") if ok(rb) else None,
                "frac_a": ra.get("fraction_of_copy") if ok(ra) else None,
                "frac_b": rb.get("fraction_of_copy") if ok(rb) else None,
                "status": f"{(ra or {}).get('status', '—')} / {(rb or {}).get('status', '—')}",
            })
    cols = [H.Column("shape", "shape"), H.Column("impl", "impl"), H.Column("status", "status A / B"),
            H.Column("time_a", "µs A", True, _fmt_f(1)), H.Column("time_b", "µs B", True, _fmt_f(1)),
            H.Column("ratio", "A / B", True, _fmt_f(2, "×"), "time A / time B: >1 means B faster"),
            H.Column("gbs_a", "GB/s A", True, _fmt_f(0)), H.Column("gbs_b", "GB/s B", True, _fmt_f(0)),
            H.Column("frac_a", "% copy A", True, _fmt_f(1, "%", 100.0)),
            H.Column("frac_b", "% copy B", True, _fmt_f(1, "%", 100.0))]
    parts.append(H.table(cols, rows))
    return H.page(title, "".join(parts))
