"""Plot or tabulate sparse-MQA benchmark results (``results.json`` or ``results.csv``).

    python tools/bench/plot.py results.json --png time.png   # time and TFLOP/s per shape
    python tools/bench/plot.py --markdown results.json       # table for docs/performance.md
    python tools/bench/plot.py --markdown results.json --update docs/performance.md
        # replace what lies between the RESULTS_BEGIN/RESULTS_END markers in that file

matplotlib is imported only for ``--png`` (Agg backend, no display needed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

#: Plot order and colours of the variants (anything else is appended in grey tones).
VARIANT_ORDER = ("fwd", "bwd_atomic", "bwd_det", "ref_fwd", "ref_bwd")
_COLOURS = {"fwd": "#4C72B0", "bwd_atomic": "#DD8452", "bwd_det": "#55A868",
            "ref_fwd": "#8172B3", "ref_bwd": "#937860"}


def load_results(path: str) -> tuple[list[dict], dict]:
    """Rows and meta from a ``results.json`` (rows + meta) or a ``results.csv`` (rows only;
    meta is taken from the first row's meta columns)."""
    if path.endswith(".csv"):
        rows = harness.read_csv(path)
        meta = {k: rows[0].get(k) for k in harness.META_FIELDS} if rows else {}
        return rows, meta
    with open(path, encoding="utf-8") as f:
        payload = json.load(f)
    return payload["rows"], payload.get("meta", {})


def plot_results(rows: list[dict], meta: dict, png: str) -> str:
    """Grouped bars: median ms (p20-p80 as error bars, log scale) and TFLOP/s per shape and
    variant, with the measured matmul peak as a line.  Returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # attention rows only (the matmul row has no H)
    ok = [r for r in rows if r.get("status") == "ok" and r.get("H") is not None and r.get("ms")]
    shapes = list(dict.fromkeys(r["shape"] for r in ok))
    variants = [v for v in VARIANT_ORDER if any(r["variant"] == v for r in ok)]
    variants += sorted({r["variant"] for r in ok} - set(variants))
    by_key = {(r["shape"], r["variant"]): r for r in ok}

    fig, (ax_t, ax_f) = plt.subplots(2, 1, figsize=(max(6.0, 1.6 * len(shapes) + 2), 7.5),
                                     sharex=True)
    width = 0.8 / max(1, len(variants))
    for j, v in enumerate(variants):
        xs, ms, lo, hi, tf = [], [], [], [], []
        for i, s in enumerate(shapes):
            r = by_key.get((s, v))
            if r is None:
                continue
            x = i + (j - (len(variants) - 1) / 2) * width
            xs.append(x)
            ms.append(r["ms"])
            lo.append(r["ms"] - (r.get("ms_p20") or r["ms"]))
            hi.append((r.get("ms_p80") or r["ms"]) - r["ms"])
            tf.append(r.get("tflops") or 0.0)
        colour = _COLOURS.get(v, "0.6")
        ax_t.bar(xs, ms, width, yerr=[lo, hi], label=v, color=colour, capsize=2)
        ax_f.bar(xs, tf, width, label=v, color=colour)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("ms per call (median, p20-p80)")
    ax_t.legend(fontsize=8, ncol=min(5, len(variants)), loc="lower center",
                bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax_t.grid(axis="y", which="both", alpha=0.3)
    peak = meta.get("peak_tflops")
    if peak:
        ax_f.axhline(peak, color="k", ls="--", lw=1)
        ax_f.text(-0.45, peak, f"dense matmul {peak:.3g} TFLOP/s", va="bottom", ha="left",
                  fontsize=8)
    ax_f.set_ylabel("TFLOP/s")
    ax_f.grid(axis="y", alpha=0.3)
    labels = []
    for s in shapes:
        r = next(r for r in ok if r["shape"] == s)
        labels.append(f"{s}\nB{r['B']} S{r['S']} H{r['H']}\nS_kv{r['S_kv']} k{r['topk']}")
    ax_f.set_xticks(range(len(shapes)))
    ax_f.set_xticklabels(labels, fontsize=8)
    fig.suptitle(f"sparse MQA-latent attention, {meta.get('gpu', '?')} "
                 f"(tilelang {meta.get('tilelang', '?')}, {meta.get('timestamp', '')})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def markdown(rows: list[dict], meta: dict) -> str:
    """The "Results (H200)" section body: a run line, the table and the bars."""
    lines = [
        f"Run: {meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, "
        f"tilelang {meta.get('tilelang', '?')}, {meta.get('timestamp', '?')}, "
        f"commit {meta.get('git') or '?'}; peak {harness._fmt(meta.get('peak_tflops'), '.0f')} "
        f"TFLOP/s ({meta.get('peak_source', 'dense matmul measured in the same run')}), "
        f"copy {harness._fmt(meta.get('copy_tbs'), '.2f')} TB/s "
        f"({meta.get('copy_source', 'measured in the same run')}); x floor = median ms over "
        "max(FLOPs / peak, min bytes / copy rate).",
        "",
        harness.markdown_table(rows),
    ]
    bars = harness.check_bars(rows)
    if bars:
        lines += ["", "| bar (shape `%s`) | measured | verdict |" % harness.BAR_SHAPE,
                  "|---|---:|---|"]
        lines += [f"| {b['bar']} | {harness._fmt(b['value'], '.3g')} | {b['verdict']} |"
                  for b in bars]
    return "\n".join(lines)


#: Markers of the regenerated block in docs/performance.md.
BEGIN_MARK = "<!-- RESULTS_BEGIN (generated by tools/bench/plot.py --markdown; do not edit) -->"
END_MARK = "<!-- RESULTS_END -->"


def update_doc(path: str, body: str) -> None:
    """Replace the text between :data:`BEGIN_MARK` and :data:`END_MARK` in ``path``.

    Raises:
        ValueError: when the file does not hold both markers, in that order.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    i, j = text.find(BEGIN_MARK), text.find(END_MARK)
    if i < 0 or j < i:
        raise ValueError(f"{path}: expected the markers {BEGIN_MARK!r} ... {END_MARK!r}")
    text = text[: i + len(BEGIN_MARK)] + "\n" + body.rstrip() + "\n" + text[j:]
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("results", nargs="?", help="results.json or results.csv")
    p.add_argument("--markdown", metavar="RESULTS", help="print the markdown table of RESULTS")
    p.add_argument("--png", help="write the plot here (default: beside RESULTS)")
    p.add_argument("--update", metavar="DOC",
                   help="with --markdown: write the table between the markers in DOC")
    a = p.parse_args(argv)
    if a.markdown:
        rows, meta = load_results(a.markdown)
        body = markdown(rows, meta)
        if a.update:
            update_doc(a.update, body)
            print(f"updated {a.update}")
        else:
            print(body)
        return 0
    if not a.results:
        p.error("give RESULTS or --markdown RESULTS")
    rows, meta = load_results(a.results)
    png = a.png or os.path.join(os.path.dirname(os.path.abspath(a.results)), "time_per_shape.png")
    print(plot_results(rows, meta, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
