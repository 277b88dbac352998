"""The HTML report of ``tracejudge replay compare --html``: one page that works offline.

Everything is in the page: the styles, and every plot as inline SVG drawn by
matplotlib (its SVG backend, text drawn as paths, so no font, script, CDN or
other resource is fetched). Each distribution is a pair of histograms side by
side, simulated left and real right, on the same bins and the same scale (the
share of values in each bin), with the median marked. matplotlib is imported
here only, when a report is written: it is an extra (``tracejudge[plots]``),
and ``require_plots`` says how to install it.
"""

from __future__ import annotations

import html
import io
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from collector.errors import UserError

from .compare import DISTRIBUTIONS, number_text, rows

SIM_COLOR, REAL_COLOR = "#4c72b0", "#dd8452"
MAX_CATEGORIES = 10
"""Categories of a mix plotted; the rest are summed as ``other``."""


PLOTS_MISSING = ("the HTML report draws its plots with matplotlib, which is not installed: "
                 "pip install 'tracejudge[plots]'")


def require_plots() -> None:
    """Check that matplotlib can be imported.

    Raises:
        UserError: it cannot; the message gives the install command.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError(PLOTS_MISSING) from None


def _svg(fig: Any, salt: str) -> str:
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": salt}):  # stable ids, different in each figure
        fig.savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight")
    text = buf.getvalue()
    # The XML prolog has no place inside HTML, nor the RDF block naming the tool and its licence.
    return re.sub(r"\s*<metadata>.*?</metadata>", "", text[text.index("<svg"):], count=1, flags=re.DOTALL)


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure  # no pyplot: no global figure manager, no GUI backend

    return Figure(figsize=(width, height), layout="constrained")


def histogram_svg(key: str, label: str, counts_metric: bool, result: dict[str, Any]) -> str:
    """The two histograms of one distribution, side by side, as an SVG element."""
    fig = _figure(11, 2.8)
    axes = fig.subplots(1, 2, sharey=True)
    for ax, name, color in ((axes[0], "sim", SIM_COLOR), (axes[1], "real", REAL_COLOR)):
        d = result[name][key]
        edges, counts = d["histogram"]["edges"], d["histogram"]["counts"]
        total = sum(counts) or 1
        shares = [100 * n / total for n in counts]
        if counts_metric:
            xs = [e for e in edges[:-1]]
            ax.bar(xs, shares, width=0.8, color=color)
            ticks = xs if len(xs) <= 13 else xs[::2]
            ax.set_xticks(ticks, [f"{t:g}" + ("+" if t == xs[-1] and len(xs) > 1 else "") for t in ticks])
        else:
            widths = [b - a for a, b in zip(edges, edges[1:])]
            ax.bar(edges[:-1], shares, width=widths, align="edge", color=color, edgecolor="white", linewidth=0.5)
        if d["median"] is not None:
            ax.axvline(d["median"], color="#333333", linestyle="--", linewidth=1)
        who = "simulated" if name == "sim" else "real"
        ax.set_title(f"{who}: n = {d['count']:,}, median {number_text(d['median'])}", fontsize=10)
        ax.set_xlabel(label + ("" if counts_metric else " (last bin: and longer)"), fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(axis="y", color="#e5e5e5", linewidth=0.6)
        ax.set_axisbelow(True)
    axes[0].set_ylabel("% of values", fontsize=9)
    return _svg(fig, f"tracejudge-{key}")


def mix_svg(key: str, title: str, result: dict[str, Any]) -> str:
    """A mix (``ended_by``, languages) as horizontal bars, simulated beside real, same categories in order."""
    sim, real = result["sim"][key], result["real"][key]
    names = sorted(set(sim) | set(real), key=lambda k: (-(sim.get(k, {}).get("share", 0) + real.get(k, {}).get(
        "share", 0)), k))
    shown, rest = names[:MAX_CATEGORIES], names[MAX_CATEGORIES:]

    def shares(mix: dict[str, Any]) -> list[float]:
        out = [100 * mix.get(k, {}).get("share", 0) for k in shown]
        if rest:
            out.append(100 * sum(mix.get(k, {}).get("share", 0) for k in rest))
        return out

    labels = shown + (["other"] if rest else [])
    fig = _figure(11, 0.7 + 0.3 * max(len(labels), 1))
    axes = fig.subplots(1, 2, sharey=True, sharex=True)
    for ax, name, mix, color in ((axes[0], "simulated", sim, SIM_COLOR), (axes[1], "real", real, REAL_COLOR)):
        ys = list(range(len(labels)))
        ax.barh(ys, shares(mix), color=color)
        ax.set_yticks(ys, labels)
        ax.invert_yaxis()
        ax.set_title(f"{name}: {title}", fontsize=10)
        ax.set_xlabel("%", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(axis="x", color="#e5e5e5", linewidth=0.6)
        ax.set_axisbelow(True)
    return _svg(fig, f"tracejudge-{key}")


_STYLE = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 1100px;
       padding: 0 16px; color: #1f2328; }
h1 { font-size: 22px; margin-bottom: 4px; }
h2 { font-size: 17px; margin: 28px 0 6px; }
p.note { color: #57606a; margin-top: 4px; }
table { border-collapse: collapse; margin: 12px 0; font-size: 14px; }
th, td { text-align: left; padding: 4px 12px 4px 0; border-bottom: 1px solid #eaeef2; vertical-align: top; }
th.sim { color: #4c72b0; } th.real { color: #dd8452; }
figure { margin: 8px 0 18px; }
figure svg { max-width: 100%; height: auto; display: block; }
"""


def render(result: dict[str, Any]) -> str:
    """The report page for a ``compare`` result."""
    esc = html.escape
    table_rows = rows(result)
    head = table_rows[0]
    body = "".join(f"<tr><th>{esc(a)}</th><td>{esc(b)}</td><td>{esc(c)}</td></tr>" for a, b, c in table_rows[1:])
    figures = []
    for key, label, counts_metric in DISTRIBUTIONS:
        figures.append(f'<h2>{esc(label[:1].upper() + label[1:])}</h2>\n<figure class="histogram" '
                       f'data-key="{esc(key)}">{histogram_svg(key, label, counts_metric, result)}</figure>')
    for key, title in (("ended_by", "ended_by"), ("languages", "languages of user messages")):
        figures.append(f'<h2>{esc(title[:1].upper() + title[1:])}</h2>\n<figure class="mix" data-key="{esc(key)}">'
                       f"{mix_svg(key, title, result)}</figure>")
    sim, real = result["sim"], result["real"]
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Simulated vs real conversations</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>Simulated vs real conversations</h1>
<p class="note">{esc(sim['file'])} ({sim['conversations']:,} conversations) beside {esc(real['file'])}
({real['conversations']:,} conversations). Descriptive, never a gate. Languages by
{esc(result['language_detector'])} (<code>und</code>: too short or unsure); facts by the
{esc(result['fact_heuristic'])} heuristic: clauses with a number, a date, a capitalised name or a statement of
state or symptom.</p>
<table>
<tr><th></th><th class="sim">{esc(head[1])}</th><th class="real">{esc(head[2])}</th></tr>
{body}
</table>
{chr(10).join(figures)}
</body>
</html>
"""


def write_html(result: dict[str, Any], path: str | Path) -> None:
    """Write the report to ``path`` (whole or not at all: a temporary file renamed over it).

    Raises:
        UserError: matplotlib is not installed (``require_plots``).
    """
    require_plots()
    given = Path(path)
    text = render(result)
    if given.exists() and not given.is_file():  # a device or a pipe: written as a stream, never replaced
        given.write_text(text, encoding="utf-8")
        return
    target = given.resolve()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() would have made it (mkstemp makes it private)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
