#!/usr/bin/env python3
"""Print ours beside theirs: read results JSON files (docs/ARCHITECTURE.md) and print, per shape,
each implementation's forward and backward TFLOP/s and the ratio of our best to the best peer.

    python3 benchmarks/table.py benchmarks/results/2026-11-29-h200-peers.json \\
                                benchmarks/results/2026-11-29-h200-sm90.json
    python3 benchmarks/table.py --markdown results/*.json     # a table to paste into README.md

Rows are grouped by (dtype, d, seqlen_q, seqlen_k, causal), and further by the GQA ratio
heads/heads_kv and a row's "variant" (window, softcap, ...) when those are present, so unlike
problems never share a line. "ours" is every impl whose name starts with "flashattn"
(flashattn-sm90, flashattn-sm90-fp8, flashattn-sm80, flashattn-cpu); every other attention impl
(torch-cudnn, torch-flash, ...) is a peer. Ceiling rows (impl cublas-gemm, copy) are listed
above the table. When files hold the same (shape, impl) twice, the later file wins.

Cells: TFLOP/s; "err" = the row recorded an error for that direction; "-" = not measured;
a trailing "!" = that row of ours failed its correctness check ("pass": false).
Ratio cells: our best / best peer, and which peer that is (a row of ours that failed its
correctness check does not count as our best; FP8 rows of ours have no peer of
their dtype here, so their ratio is "-").

Stdlib only (python >= 3.8).
"""

import argparse
import json
import sys

OURS_ORDER = ["flashattn-sm90", "flashattn-sm90-fp8", "flashattn-sm80", "flashattn-cpu"]
PEERS_ORDER = ["torch-cudnn", "torch-flash"]
CEILING_IMPLS = {"cublas-gemm", "copy"}
# Optional fields that make two rows different problems even with equal shapes.
VARIANT_FIELDS = ["variant", "window", "window_left", "window_right", "softcap", "alibi",
                  "varlen", "paged_kv", "page_size", "dropout", "deterministic"]


def is_ours(impl):
    return impl.startswith("flashattn")


def short(impl):
    for p in ("flashattn-", "torch-"):
        if impl.startswith(p):
            return impl[len(p):]
    return impl


def fmt_tflops(x):
    if x is None:
        return "-"
    x = float(x)
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def fmt_ratio(x):
    return f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def load(paths):
    """Returns (sources, attention rows keyed, ceiling rows keyed, notes)."""
    sources, attn, ceil, notes = [], {}, {}, []
    replaced = sustained = 0
    for path in paths:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"table.py: cannot read {path}: {e}")
        if isinstance(doc, list):  # tolerate a bare list of rows
            doc = {"rows": doc}
        rows = doc.get("rows")
        if not isinstance(rows, list):
            raise SystemExit(f"table.py: {path} has no 'rows' list")
        sources.append((path, doc.get("device", "?"), doc.get("commit", "?"), doc.get("date", "?"),
                        sorted({r.get("impl", "?") for r in rows if isinstance(r, dict)})))
        for i, r in enumerate(rows):
            if not isinstance(r, dict) or "impl" not in r:
                notes.append(f"{path}: row {i} has no impl; skipped")
                continue
            impl = r["impl"]
            if r.get("sustained"):
                # A sustained row (--sustained of peers_fa3_fp8.py, bench_table, bench_fp8)
                # shares its cold row's shape: it would replace that row, and the table compares
                # cold medians.
                sustained += 1
                continue
            if impl in CEILING_IMPLS or "seqlen_q" not in r:
                label = ceiling_label(r)
                if label is not None:
                    ceil[label] = r
                continue
            try:
                key = shape_key(r)
            except (KeyError, TypeError, ValueError) as e:
                notes.append(f"{path}: row {i} ({impl}) lacks a shape field ({e}); skipped")
                continue
            slot = attn.setdefault(key, {})
            if impl in slot:
                replaced += 1
            slot[impl] = r
    if replaced:
        notes.append(f"{replaced} duplicate (shape, impl) rows: the later one was kept")
    if sustained:
        notes.append(f"{sustained} sustained rows not tabled (see their JSON)")
    return sources, attn, ceil, notes


def shape_key(r):
    d = int(r["d"])
    sq = int(r["seqlen_q"])
    sk = int(r.get("seqlen_k", sq))
    causal = bool(r.get("causal", False))
    dtype = str(r.get("dtype", "?"))
    heads, heads_kv = r.get("heads"), r.get("heads_kv")
    gqa = int(heads) // int(heads_kv) if heads and heads_kv else 1
    variant = ",".join(f"{f}={r[f]}" for f in VARIANT_FIELDS
                       if f in r and r[f] not in (None, False, "", "none"))
    return (dtype, d, causal, sq, sk, gqa, variant)


def ceiling_label(r):
    impl = r["impl"]
    if impl == "copy":
        return "copy"
    if impl == "cublas-gemm":
        lab = f"{r.get('dtype', '?')} GEMM"
        if r.get("fast_accum") is True:
            lab += " (fast accum)"
        return lab
    return None


def ceiling_text(ceil):
    parts = []
    for label in sorted(ceil, key=lambda l: (l == "copy", l)):
        r = ceil[label]
        if label == "copy":
            val = r.get("gbps")
            parts.append(f"copy {val:.0f} GB/s" if val is not None else f"copy err")
        else:
            val = r.get("tflops")
            size = f" {r['m']}x{r['n']}x{r['k']}" if all(k in r for k in "mnk") else ""
            parts.append(f"{label}{size} {fmt_tflops(val)} TFLOP/s" if val is not None
                         else f"{label} err")
    return "; ".join(parts)


def impl_order(impls):
    ours = [i for i in OURS_ORDER if i in impls] + sorted(i for i in impls
                                                           if is_ours(i) and i not in OURS_ORDER)
    peers = [i for i in PEERS_ORDER if i in impls] + sorted(i for i in impls
                                                            if not is_ours(i) and i not in PEERS_ORDER)
    return ours, peers


def cell(r, direction):
    if r is None:
        return "-", None
    v = r.get(f"{direction}_tflops")
    if v is None:
        err = r.get("error")
        if err and (direction == "bwd" or not str(err).startswith("bwd")):
            return "err", None
        return "-", None
    txt = fmt_tflops(v)
    if r.get("pass") is False:
        txt += "!"
    return txt, float(v)


def best(slot, impls, direction):
    """Fastest (TFLOP/s, impl) among impls; rows that failed correctness do not count."""
    vals = [(cell(slot.get(i), direction)[1], i) for i in impls
            if slot.get(i) is None or slot[i].get("pass") is not False]
    vals = [(v, i) for v, i in vals if v is not None]
    return max(vals) if vals else (None, None)


def build(attn):
    impls = set()
    for slot in attn.values():
        impls.update(slot)
    ours, peers = impl_order(impls)
    show_gqa = any(k[5] != 1 for k in attn)
    show_var = any(k[6] for k in attn)
    show_sk = any(k[3] != k[4] for k in attn)
    header = ["dtype", "d", "seqlen" if not show_sk else "s_q", ]
    if show_sk:
        header.append("s_k")
    header += ["causal"]
    if show_gqa:
        header.append("gqa")
    if show_var:
        header.append("variant")
    header.append("b x h")
    for i in ours + peers:
        header += [f"{short(i)} fwd", f"{short(i)} bwd"]
    if ours and peers:
        header += ["fwd ours/peer", "bwd ours/peer"]
    lines = []
    for key in sorted(attn, key=lambda k: tuple(str(x) if isinstance(x, str) else x for x in k)):
        dtype, d, causal, sq, sk, gqa, variant = key
        slot = attn[key]
        any_row = next(iter(slot.values()))
        line = [dtype, str(d), str(sq)]
        if show_sk:
            line.append(str(sk))
        line.append("yes" if causal else "no")
        if show_gqa:
            line.append(str(gqa))
        if show_var:
            line.append(variant or "-")
        b, h = any_row.get("batch"), any_row.get("heads")
        line.append(f"{b}x{h}" if b is not None and h is not None else "-")
        for i in ours + peers:
            line += [cell(slot.get(i), "fwd")[0], cell(slot.get(i), "bwd")[0]]
        if ours and peers:
            for direction in ("fwd", "bwd"):
                o, _ = best(slot, ours, direction)
                p, who = best(slot, peers, direction)
                line.append(f"{fmt_ratio(o / p)} {short(who)}" if o is not None and p else "-")
        lines.append(line)
    return header, lines, ours, peers


def render_plain(header, lines):
    widths = [max(len(h), *(len(l[c]) for l in lines)) if lines else len(h)
              for c, h in enumerate(header)]
    left = {0}  # dtype left-aligned; numbers right-aligned
    def row(cells):
        return "  ".join(c.ljust(w) if j in left else c.rjust(w)
                         for j, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out = [row(header), "  ".join("-" * w for w in widths)]
    out += [row(l) for l in lines]
    return "\n".join(out)


def render_markdown(header, lines):
    def row(cells):
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
    align = ["---"] + ["---:"] * (len(header) - 1)
    return "\n".join([row(header), "|" + "|".join(align) + "|"] + [row(l) for l in lines])


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Print flashattn's TFLOP/s beside the peers' from results JSON files "
                    "(docs/ARCHITECTURE.md).")
    ap.add_argument("files", nargs="+", metavar="FILE", help="results JSON files (ours and peers)")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table (for README.md)")
    ap.add_argument("--no-ceilings", action="store_true", help="leave out the GEMM/copy ceilings")
    ap.add_argument("--no-sources", action="store_true", help="leave out the list of input files")
    ap.add_argument("--impls", default=None,
                    help="comma list of impls to show, full or short names "
                         "(e.g. sm90,cudnn,flash); default: every impl in the files")
    ap.add_argument("--common", action="store_true",
                    help="only shapes where one of ours and one peer both have a number")
    args = ap.parse_args(argv)

    sources, attn, ceil, notes = load(args.files)
    if args.impls:
        keep = {x.strip() for x in args.impls.split(",") if x.strip()}
        for key in list(attn):
            attn[key] = {i: r for i, r in attn[key].items() if i in keep or short(i) in keep}
            if not attn[key]:
                del attn[key]
    if args.common:
        def has(slot, pred):
            return any(pred(i) and (cell(r, "fwd")[1] is not None or cell(r, "bwd")[1] is not None)
                       for i, r in slot.items())
        attn = {k: s for k, s in attn.items()
                if has(s, is_ours) and has(s, lambda i: not is_ours(i))}
    md = args.markdown
    out = []
    if not args.no_sources:
        for path, device, commit, date, impls in sources:
            text = f"{path}: {device}, commit {commit}, {date} ({', '.join(impls)})"
            out.append(("- " if md else "") + text)
    if ceil and not args.no_ceilings:
        out.append(("" if not md else "\n") + "Ceilings: " + ceiling_text(ceil))
    if attn:
        header, lines, ours, peers = build(attn)
        out.append("")
        out.append(render_markdown(header, lines) if md else render_plain(header, lines))
        legend = "TFLOP/s; fwd 4*b*s_q*s_k*h*d (/2 causal), bwd 2.5x fwd."
        if ours and peers:
            legend += " ours/peer = our best / best peer (named)."
        if any(r.get("pass") is False for slot in attn.values() for r in slot.values()):
            legend += " '!' = failed correctness."
        if any("error" in r for slot in attn.values() for r in slot.values()):
            legend += " err = that run failed."
        out.append(("\n" if md else "") + legend)
    else:
        out.append("(no attention rows)")
    print("\n".join(out))
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
