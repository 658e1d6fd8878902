#!/usr/bin/env python3
"""TFLOP/s against sequence length, ours beside the peers, from results JSON files (the format of
docs/ARCHITECTURE.md) into one SVG with a forward and a backward panel. Stdlib only.

    python3 benchmarks/plot.py --d 128 [--causal] --out docs/perf-d128.svg RESULTS.json...
"""
import argparse
import json
import math

IMPLS = [  # (impl, label, colour)
    ("flashattn-sm90", "flashattn (Hopper kernels)", "#d62728"),
    ("flashattn-sm80", "flashattn (FA2-style kernels)", "#ff9896"),
    ("torch-cudnn", "cuDNN (torch SDPA)", "#1f77b4"),
    ("torch-flash", "FlashAttention-2 (torch SDPA)", "#7f7f7f"),
]

W, H = 420, 300  # one panel
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 34, 46


def series(rows, impl, d, causal, key):
    points = sorted(
        (r["seqlen_q"], r[key])
        for r in rows
        if r.get("impl") == impl and r.get("d") == d and bool(r.get("causal")) == causal
        and r.get(key) and not r.get("sustained")
    )
    return points


def panel(rows, d, causal, key, title, x0):
    seqlens = sorted({s for impl, _, _ in IMPLS for s, _ in series(rows, impl, d, causal, key)})
    if not seqlens:
        return "", []
    top = max(v for impl, _, _ in IMPLS for _, v in series(rows, impl, d, causal, key))
    top = math.ceil(top / 100) * 100
    lo, hi = math.log2(seqlens[0]), math.log2(seqlens[-1])
    px = lambda s: x0 + LEFT + (math.log2(s) - lo) / max(hi - lo, 1) * (W - LEFT - RIGHT)
    py = lambda v: TOP + (1 - v / top) * (H - TOP - BOTTOM)
    out = [f'<text x="{x0 + W / 2}" y="20" text-anchor="middle" font-weight="bold">{title}</text>']
    for v in range(0, top + 1, 100):
        y = py(v)
        out.append(f'<line x1="{x0 + LEFT}" x2="{x0 + W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{x0 + LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{v}</text>')
    for s in seqlens:
        label = f"{s // 1024}k" if s >= 1024 else str(s)
        out.append(f'<text x="{px(s):.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{label}</text>')
    out.append(f'<text x="{x0 + W / 2}" y="{H - 8}" text-anchor="middle">sequence length</text>')
    out.append(f'<text x="{x0 + 14}" y="{H / 2}" text-anchor="middle" '
               f'transform="rotate(-90 {x0 + 14} {H / 2})">TFLOP/s</text>')
    shown = []
    for impl, label, colour in IMPLS:
        pts = series(rows, impl, d, causal, key)
        if not pts:
            continue
        shown.append((label, colour))
        path = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for s, v in pts:
            out.append(f'<circle cx="{px(s):.1f}" cy="{py(v):.1f}" r="2.5" fill="{colour}"/>')
    return "\n".join(out), shown


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    rows, sources = [], []
    for f in args.files:
        data = json.load(open(f))
        rows += data["rows"]
        sources.append(f"{f.split('/')[-1]} ({data.get('device', '?')}, {data.get('commit', '?')})")
    mask = "causal" if args.causal else "no mask"
    fwd, shown_f = panel(rows, args.d, args.causal, "fwd_tflops", f"forward, d{args.d}, {mask}", 0)
    bwd, shown_b = panel(rows, args.d, args.causal, "bwd_tflops", f"backward, d{args.d}, {mask}", W)
    legend = []
    shown = list(dict.fromkeys(shown_f + shown_b))
    for i, (label, colour) in enumerate(shown):
        x = 20 + (i % 3) * 270
        y = H + 12 + (i // 3) * 18
        legend.append(f'<rect x="{x}" y="{y - 9}" width="14" height="4" fill="{colour}"/>')
        legend.append(f'<text x="{x + 20}" y="{y - 4}">{label}</text>')
    height = H + 20 + 18 * ((len(shown) + 2) // 3) + 16
    note = "; ".join(sources)
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{height}" '
        f'font-family="sans-serif" font-size="11">\n<rect width="100%" height="100%" fill="white"/>\n'
        f"{fwd}\n{bwd}\n" + "\n".join(legend)
        + f'\n<text x="8" y="{height - 6}" font-size="9" fill="#555">16k tokens per call, hidden 2048; '
        f"{note}</text>\n</svg>\n"
    )
    open(args.out, "w").write(svg)


if __name__ == "__main__":
    main()
