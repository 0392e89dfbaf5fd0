"""The memory report's page: one self-contained HTML file drawn from ``report.json``.

Everything the page shows is in the report dict (:func:`harness.commands.report.run` writes it as
``report.json`` beside the page): plots are matplotlib figures inlined as SVG (text kept as text, no
fonts or scripts loaded), tables are HTML, the flame graphs are :mod:`harness.report.flame`'s SVG.
The page loads nothing: no CDN, no stylesheet, no image file; the links to the memray captures
(``.bin``, next to the page) are plain links, never fetched while rendering.

Size: ``render`` lays the sections out in the order a reviewer reads them, one short block each; the
figures are one function each.
"""

from __future__ import annotations

import html
import io
import json
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

__all__ = ["SECTIONS", "numbered", "render", "section", "svg_of"]

plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "axes.grid": True, "grid.alpha": 0.3})

COLORS = {"master": "#c0392b", "shared": "#2471a3"}
LAYER_TITLES = {
    "model": "model ledger",
    "llama": "libllama under memray",
    "server": "llama-server VmHWM",
}
# the sections in the order the page shows them; their numbers come from this order, never from the titles
_ORDER = (
    ("summary", "Summary"),
    ("peak-count", "Transient peak of one save vs number of checkpoints"),
    ("peak-size", "Transient peak of one save vs checkpoint size"),
    ("charge", "Logical --cache-ram charge vs physical bytes"),
    ("limit", "Under a memory limit: big checkpoints saved at baseline + S + C/2"),
    ("update-cost", "The PR's cost: a fresh buffer per checkpoint update"),
    ("breakdown", "Where measurement and theory disagree: the server's peak, broken down"),
    ("flame", "memray captures of the saves"),
    ("sweep", "Allocation-failure sweep"),
    ("mutants", "Mutation matrix"),
    ("findings", "Known findings and their reproducers"),
    ("environment", "Environment and how to rerun"),
)


def numbered(order: Sequence[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """(key, "N. title") for each section, N its place in ``order`` from 1: each number once, in order."""
    return tuple((key, f"{n}. {title}") for n, (key, title) in enumerate(order, 1))


SECTIONS = numbered(_ORDER)  # (key, numbered title): the page's headings and its table of contents
_NUMBER = {key: n for n, (key, _title) in enumerate(_ORDER, 1)}


def section(key: str) -> str:
    """How the page's text refers to a section: "section N", N the section's number on the page."""
    return f"section {_NUMBER[key]}"


def svg_of(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.find("<svg") :]


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.2f} MiB"


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f} MB"


def _mean(rows: Sequence[dict[str, Any]], key: str) -> float:
    vals = [float(r[key]) for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def _grouped(rows: Sequence[dict[str, Any]], x: str) -> dict[float, list[dict[str, Any]]]:
    out: dict[float, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(float(r[x]), []).append(r)
    return dict(sorted(out.items()))


def fig_curve(rows: Sequence[dict[str, Any]], x: str, xlabel: str, log: bool) -> str:
    """One panel per layer: measured peak (points, mean of reps) and the theory line, master vs shared."""
    layers = [la for la in LAYER_TITLES if any(r["layer"] == la for r in rows)]
    fig, axes = plt.subplots(1, max(len(layers), 1), figsize=(4.2 * max(len(layers), 1), 3.3), squeeze=False)
    for ax, layer in zip(axes[0], layers, strict=False):
        for sem in ("master", "shared"):
            sel = [r for r in rows if r["layer"] == layer and r["semantics"] == sem]
            if not sel:
                continue
            g = _grouped(sel, x)
            xs = [k / (1 << 20) if x == "checkpoint_size" else k for k in g]
            ax.plot(xs, [_mean(v, "peak_bytes") / (1 << 20) for v in g.values()], "o", color=COLORS[sem],
                    label=f"{sem} measured")  # fmt: skip
            ax.plot(xs, [_mean(v, "theory_bytes") / (1 << 20) for v in g.values()], "--", color=COLORS[sem],
                    label=f"{sem} theory ({'S + C' if sem == 'master' else 'S'}"
                    + (" + 2S harness copies)" if layer == "llama" else ")"))  # fmt: skip
            if layer == "server":
                ax.plot(xs, [_mean(v, "predicted_request_bytes") / (1 << 20) for v in g.values()], ":",
                        color=COLORS[sem], label=f"{sem} model, whole request")  # fmt: skip
        ax.set_title(LAYER_TITLES[layer])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("transient peak (MiB)")
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    return svg_of(fig)


def fig_charge(charge: dict[str, list[dict[str, Any]]]) -> str:
    sems = [s for s in ("master", "shared") if charge.get(s)]
    fig, axes = plt.subplots(1, max(len(sems), 1), figsize=(6 * max(len(sems), 1), 3.3), squeeze=False, sharey=True)
    for ax, sem in zip(axes[0], sems, strict=False):
        rows = charge[sem]
        xs = [r["request"] + 1 for r in rows]
        ax.step(xs, [r["logical_bytes"] / (1 << 20) for r in rows], where="post", label="logical charge (cache.size())")
        ax.step(xs, [r["unique_bytes"] / (1 << 20) for r in rows], where="post", linestyle="--",
                label="physical unique bytes of the cache")  # fmt: skip
        ax.plot(xs, [r["peak_live_bytes"] / (1 << 20) for r in rows], "^-",
                label="model: peak live bytes in the request")  # fmt: skip
        if rows and "llama_heap_bytes" in rows[0]:
            ax.plot(xs, [r["llama_heap_bytes"] / (1 << 20) for r in rows], "o-.",
                    label="libllama: malloc heap in use over the first")  # fmt: skip
        if rows and "server_hwm_bytes" in rows[0]:
            ax.plot(xs, [r["server_hwm_bytes"] / (1 << 20) for r in rows], "s:", label="server VmHWM over first VmRSS")
            ax.plot(xs, [r["server_rss_bytes"] / (1 << 20) for r in rows], "x:", label="server VmRSS over first VmRSS")
        prev = 0
        for r in rows:
            if r["evictions"] > prev:
                ax.axvline(r["request"] + 1, color="grey", alpha=0.4, linewidth=3)
                ax.annotate(f"-{r['evictions'] - prev}", (r["request"] + 1, 0), fontsize=7, color="grey")
            prev = r["evictions"]
        ax.set_title(f"{sem}: grey bars = requests that evicted")
        ax.set_xlabel("request")
        ax.set_ylabel("MiB")
        ax.legend(fontsize=7)
    return svg_of(fig)


def fig_breakdown(rows: Sequence[dict[str, Any]]) -> str:
    """Stacked bars: S, the checkpoint copy (master), the request's new checkpoints, the residual."""
    labels, parts = [], []
    for r in rows:
        s = r["state_bytes"]
        copy = r["predicted_bytes"] - s
        req = r["request_checkpoint_bytes"]
        resid = r["peak_bytes"] - r["predicted_request_bytes"]
        labels.append(f"{r['semantics']}\n{r['n_diverging']}-tok prompt")
        parts.append((s, copy, req, resid))
    fig, ax = plt.subplots(figsize=(7.5, 3.3))
    names = ("S: the saved state", "C: checkpoints copied (master)", "checkpoints the request creates", "unmodelled")
    colors = ("#5d6d7e", "#c0392b", "#f5b041", "#17a589")
    bottom = [0.0] * len(parts)
    for i, (name, color) in enumerate(zip(names, colors, strict=True)):
        vals = [p[i] / 1e6 for p in parts]
        ax.bar(range(len(parts)), vals, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.scatter(range(len(rows)), [r["peak_bytes"] / 1e6 for r in rows], color="black", zorder=3, label="measured VmHWM")
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("MB")
    ax.legend(fontsize=7)
    return svg_of(fig)


def fig_update(cost: dict[str, dict[str, Any]]) -> str:
    metrics = [
        ("model_allocations_per_update", "payload allocations\nper update (model)"),
        ("memray_large_allocations_per_update", "large allocations\nper update (memray)"),
        ("minflt_per_update", "minor faults per\nupdate (libllama)"),
        ("seconds_per_update", "ms per update\n(libllama)"),
        ("server_minflt_per_token", "minor faults per\ntoken (server)"),
        ("server_hwm_growth_bytes", "VmHWM growth MiB\n(server)"),
    ]
    metrics = [m for m in metrics if any(m[0] in v for v in cost.values())]
    fig, axes = plt.subplots(1, len(metrics), figsize=(2.1 * len(metrics), 2.6), squeeze=False)
    for ax, (key, title) in zip(axes[0], metrics, strict=True):
        sems = [s for s in ("master", "shared") if key in cost.get(s, {})]
        scale = {"seconds_per_update": 1e3, "server_hwm_growth_bytes": 1 / (1 << 20)}.get(key, 1)
        vals = [cost[s][key] * scale for s in sems]
        ax.bar(sems, vals, color=[COLORS[s] for s in sems])
        ax.set_title(title, fontsize=8)
    return svg_of(fig)


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    h = "".join(f"<th>{html.escape(str(c))}</th>" for c in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>'


def _section(key: str, body: str) -> str:
    title = dict(SECTIONS)[key]
    return f'<section id="{key}"><h2>{html.escape(title)}</h2>{body}</section>'


CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1300px;color:#222;line-height:1.4}
h1{font-size:1.5em}h2{font-size:1.15em;border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;font-size:.82em;margin:.5em 0}
td,th{border:1px solid #ddd;padding:2px 6px;text-align:right}
th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}p.note{color:#555;font-size:.9em}
code{background:#f4f4f4;padding:0 3px}svg{max-width:100%;height:auto}.bad{color:#c0392b;font-weight:bold}
nav a{margin-right:1em;font-size:.85em}
"""


def _curve_table(rows: Sequence[dict[str, Any]], x: str) -> str:
    head = ["layer", "semantics", x, "C", "S", "theory", "model, whole request", "measured (mean)",
            "measured / model", "save time (mean)"]  # fmt: skip
    out = []
    for la in LAYER_TITLES:
        for sem in ("master", "shared"):
            for k, v in _grouped([r for r in rows if r["layer"] == la and r["semantics"] == sem], x).items():
                peak, theory = _mean(v, "peak_bytes"), _mean(v, "theory_bytes")
                req = _mean(v, "predicted_request_bytes") if la == "server" else float("nan")
                ref = req if req == req else theory  # the server's request model, else the layer's theory
                t = _mean(v, "save_seconds")
                out.append([la, sem, _mib(k) if x == "checkpoint_size" else int(k), _mib(_mean(v, "checkpoint_bytes")),
                            _mib(_mean(v, "state_bytes")), _mib(theory), _mib(req) if req == req else "-", _mib(peak),
                            f"{peak / ref:.3f}" if ref else "-",
                            "-" if t != t else f"{t * 1e3:.2f} ms"])  # fmt: skip
    return _table(head, out) + (
        "<p class='note'>theory: S + C (master) or S (shared); libllama adds the harness's two copies of S. "
        "'model, whole request': the model's peak over the server request that saves, which goes on to process "
        f"a 300-token prompt ({section('breakdown')}). Save time: model and libllama in this process (libllama "
        "under memray), the server's from its log (slot selection to the cache lookup). Not explained yet: master "
        "with one or two checkpoints measures one checkpoint (about 1.1 MB) above the model when the request goes "
        "on to create checkpoints (it matches with a 3-token prompt, and with 8 or more checkpoints); suspected "
        "glibc not reusing the freed slot checkpoint for the new one, not isolated.</p>"
    )


def _breakdown_body(b: dict[str, Any]) -> str:
    rows = b.get("rows", [])
    if not rows:
        return "<p>not measured in this run</p>"
    head = ["semantics", "prompt after the save", "S", "C copied", "new checkpoints (model)", "model, whole request",
            "measured VmHWM", "unmodelled", "model, save only", "minor faults", "save time"]  # fmt: skip
    body = [
        [r["semantics"], f"{r['n_diverging']} tokens", _mb(r["state_bytes"]),
         _mb(r["predicted_bytes"] - r["state_bytes"]),
         f"{r['request_checkpoints']} = {_mb(r['request_checkpoint_bytes'])}", _mb(r["predicted_request_bytes"]),
         _mb(r["peak_bytes"]), _mb(r["peak_bytes"] - r["predicted_request_bytes"]), _mb(r["predicted_bytes"]),
         r["minflt"], "-" if r["save_seconds"] is None else f"{r['save_seconds'] * 1e3:.2f} ms"]
        for r in rows
    ]  # fmt: skip
    alloc = b.get("allocator") or {}
    alloc_rows = [
        [sem, _mb(a["checkpoint_size"]), f"{a['default_residual_checkpoints']:+.2f} c",
         f"{a['fixed_mmap_threshold_residual_checkpoints']:+.2f} c"]
        for sem, a in alloc.items()
    ]  # fmt: skip
    alloc_head = ["semantics", "c (one checkpoint)", "unmodelled, glibc default",
                  "unmodelled, MALLOC_MMAP_THRESHOLD_=65536"]  # fmt: skip
    return (
        "".join(f"<p>{html.escape(p)}</p>" for p in b.get("explanation", []))
        + fig_breakdown(rows)
        + _table(head, body)
        + (_table(alloc_head, alloc_rows) if alloc_rows else "")
    )


def _limit_body(lim: dict[str, Any]) -> str:
    """One row per build, mode and size: the limit and its derivation, the peak against it, what happened."""
    rows = lim.get("rows", [])
    if not rows:
        return "<p>not measured in this run</p>"
    head = ["build", "limit kind", "checkpoints", "S", "C", "baseline", "limit", "peak (of the limit)", "outcome",
            "signal / oom_kill", "bad_alloc", "next request", "save time", "as PR #27451 says"]  # fmt: skip
    body = []
    for r in rows:
        kind = "memory cgroup" if r["mode"] == "cgroup" else "RLIMIT_AS"
        if r["mode"] == "cgroup" and r.get("peak_bytes") is not None:
            share = r["peak_bytes"] / r["limit_bytes"]
            peak = f"{_mib(r['peak_bytes'])} ({share:.0%}), +{_mib(r['peak_above_baseline'])}"
        elif r.get("vmhwm_above_rss") is not None:
            peak = f"VmHWM +{_mib(r['vmhwm_above_rss'])}"
        else:
            peak = "-"
        sig = (r.get("exit_signal") or "alive") + ("" if r.get("oom_kills") is None else f" / {r['oom_kills']}")
        nxt = "-" if r.get("resumed") is None else ("resumed, cache_n " if r["resumed"] else "not resumed, cache_n ")
        nxt += "" if r.get("resumed") is None else str(r.get("cache_n"))
        ok = r["outcome"] == r["expected"] and (r["semantics"] != "shared" or bool(r.get("resumed")))
        body.append([r["semantics"], kind, f"{r['n_checkpoints']} x {r['checkpoint_mib_log']:.1f} MiB",
                     _mib(r.get("s_log_bytes") or r["s_bytes"]), _mib(r["c_bytes"]), _mib(r["baseline_bytes"]),
                     _mib(r["limit_bytes"]), peak, r["outcome"], sig, r["bad_alloc"], nxt,
                     "-" if r.get("save_wall_s") is None else f"{r['save_wall_s']:.2f} s",
                     "yes" if ok else f"NO (expected {r['expected']})"])  # fmt: skip
    derivations = sorted({r["derivation"] for r in rows if r["mode"] == "cgroup"})[:1] + sorted(
        {r["derivation"] for r in rows if r["mode"] == "rlimit"})[:1]  # fmt: skip
    cgroup = "" if lim.get("cgroup", True) else " No memory cgroup could be made here: RLIMIT_AS only."
    return (
        "<p class='note'>One slot of a mamba-2 model whose one checkpoint is 64 MiB or more builds up its checkpoints "
        "(their size C1 and total C read from the server's log), then a prompt sharing nothing makes the server save "
        "the slot's prompt into the RAM cache, and a next request extends the saved prompt. The limit is set right "
        "before the save to baseline + S + C/2, the baseline measured in the same server (a memory cgroup: its usage "
        "without page cache; RLIMIT_AS: the server's VmSize): the PR's save needs S more, master's S + C. In the "
        "cgroup the peak is the group's during the save; what happened is observed: the group's oom_kill counter "
        "and the exit signal, a std::bad_alloc caught or escaping in the log, the next request's cache_n. "
        f"The same scenario runs alone as python -m harness oom.{cgroup}</p>"
        + "".join(f"<p class='note'>{html.escape(d)}</p>" for d in derivations)
        + _table(head, body)
    )


def render(report: dict[str, Any]) -> str:
    """The whole page as one HTML string."""
    env = report.get("environment", {})
    saves = report.get("saves", {})
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<title>Prompt-cache memory report</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>Prompt-cache memory report: master vs PR #27451 (shared checkpoints)</h1>",
        "<nav>" + "".join(f'<a href="#{k}">{html.escape(t)}</a>' for k, t in SECTIONS) + "</nav>",
    ]
    summary = report.get("summary", [])
    parts.append(_section("summary", "<ul>" + "".join(f"<li>{html.escape(s)}</li>" for s in summary) + "</ul>"
                          + _table(["stage", "status", "seconds", "note"],
                                   [[s["name"], s["status"], f"{s['seconds']:.1f}", s.get("note", "")]
                                    for s in report.get("stages", [])])))  # fmt: skip
    for key, x, label, log in (
        ("peak-count", "n_checkpoints", "number of checkpoints", False),
        ("peak-size", "checkpoint_size", "checkpoint size (MiB)", True),
    ):
        rows = saves.get("counts" if key == "peak-count" else "sizes", [])
        parts.append(_section(key, (fig_curve(rows, x, label, log) + _curve_table(rows, x)) if rows else
                              "<p>not measured in this run</p>"))  # fmt: skip
    charge = report.get("charge", {})
    parts.append(_section("charge", (
        "<p class='note'>One slot, --cache-ram 8 MiB, 200-token prompts of distinct families (entries of about "
        "3 MiB: S and two checkpoints). The logical charge is the same in both semantics, and so are the bytes "
        "at rest. Here the peaks are the same too: each request saves a slot holding two checkpoints and then "
        "creates two new ones for its own prompt, so the PR's saving on the save (C) is spent again by the "
        f"request ({section('breakdown')} shows the same effect on the gate's save). The PR lowers a request's "
        "peak by C minus the checkpoints the request creates, when that is positive. Physical bytes at rest, measured: "
        "libllama (this process runs the model's server logic on real contexts; its malloc heap in use after "
        "each request, over the first) and the server's VmRSS.</p>" + fig_charge(charge)
        + _table(["semantics", "request", "entries", "evictions", "logical", "unique", "peak live (model)",
                  "libllama heap", "server VmHWM", "server VmRSS"],
                 [[s, r["request"] + 1, r["entries"], r["evictions"], _mib(r["logical_bytes"]),
                   _mib(r["unique_bytes"]), _mib(r["peak_live_bytes"]), _mib(r.get("llama_heap_bytes")),
                   _mib(r.get("server_hwm_bytes")),
                   _mib(r.get("server_rss_bytes"))] for s in ("master", "shared") for r in charge.get(s, [])])
    ) if charge else "<p>not measured in this run</p>"))  # fmt: skip
    parts.append(_section("limit", _limit_body(report.get("limit", {}))))
    cost = report.get("update_cost", {})
    keys = sorted({k for v in cost.values() for k in v if k not in ("semantics", "model", "capture")})
    parts.append(_section("update-cost", (
        "<p class='note'>" + html.escape(report.get("update_note", "")) + "</p>" + fig_update(cost)
        + _table(["figure", *cost], [[k, *(f"{cost[s].get(k, '-'):.4g}" if isinstance(cost[s].get(k), float)
                                          else cost[s].get(k, "-") for s in cost)] for k in keys])
    ) if cost else "<p>not measured in this run</p>"))  # fmt: skip
    parts.append(_section("breakdown", _breakdown_body(report.get("breakdown", {}))))
    flames = report.get("flames", [])
    parts.append(_section("flame", "".join(
        f"<h3>{html.escape(f['title'])}</h3><p class='note'>capture: <a href='{html.escape(f['capture'])}'>"
        f"{html.escape(f['capture'])}</a> (open with <code>memray flamegraph</code> or <code>memray stats</code>)</p>"
        + f["svg"] for f in flames) or "<p>no captures in this run</p>"))  # fmt: skip
    sweep = report.get("sweep", {})
    parts.append(_section("sweep", "".join(
        f"<h3>{html.escape(sem)}</h3>" + _table(["scenario", "points", "trials", "outcomes"],
            [[n, v["points"], v["trials"], ", ".join(f"{c} {o}" for o, c in sorted(v["outcomes"].items()))]
             for n, v in s.get("scenarios", {}).items()])
        + f"<p>{html.escape(s.get('line', ''))}</p>" for sem, s in sweep.items()) or "<p>not run</p>"))  # fmt: skip
    mut = report.get("mutants", {})
    parts.append(_section("mutants", f"<p class='note'>{html.escape(mut.get('source', ''))}</p>" + _table(
        ["mutant", "killed", "by", "expected", "seconds", "steps"],
        [[r["name"], "yes" if r["killed"] else "SURVIVED", r.get("by") or "-", r.get("expected"), r.get("seconds"),
          r.get("steps")] for r in mut.get("rows", [])])))  # fmt: skip
    parts.append(_section("findings", _table(
        ["id", "backend", "property", "title", "reproducer", "on upstream's builds"],
        [[f["id"], f["backend"], f["property"], f["title"], f.get("reproducer") or "-", f.get("history") or "-"]
         for f in report.get("findings", [])], "findings")))  # fmt: skip
    parts.append(_section("environment", _table(["", ""], [[k, v if isinstance(v, str) else json.dumps(v)]
                                                           for k, v in env.items()])))  # fmt: skip
    parts.append("</body></html>\n")
    return "".join(parts)
