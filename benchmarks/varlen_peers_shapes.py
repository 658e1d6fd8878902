"""The varlen peers' names, their shapes (from the mixes file), result rows, inputs and set-up."""

import json
import math
import os
import sys

PEERS = {
    "torch-flash-varlen": "aten._flash_attention_forward/_flash_attention_backward with cu_seqlens "
                          "(FA2 varlen; the kernels of torch.nn.attention.varlen.varlen_attn)",
    "torch-flash-njt": "F.scaled_dot_product_attention on jagged NJT (B,H,j,D), sdpa_kernel(FLASH_ATTENTION)",
    "torch-cudnn-varlen": "aten._cudnn_attention_forward/_cudnn_attention_backward with cu_seqlens",
    "torch-cudnn-njt": "F.scaled_dot_product_attention on jagged NJT (B,H,j,D), sdpa_kernel(CUDNN_ATTENTION), "
                       "TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1",
    "cudnn-varlen": "cuDNN frontend pygraph.sdpa/sdpa_backward, THD ragged offsets + padding mask",
    "torch-sdpa-loop": "one dense F.scaled_dot_product_attention call per sequence (default backend)",
}
# Safest first: a peer that takes the process down (without isolation) costs only the ones after it.
DEFAULT_PEERS = ["torch-flash-varlen", "torch-flash-njt", "torch-cudnn-varlen", "torch-cudnn-njt",
                 "cudnn-varlen"]


# ----------------------------------------------------------------------------- the mixes

class MixesError(Exception):
    pass


def attn_flops_fwd_varlen(lengths, heads, d, causal):
    f = sum(4.0 * s * s * heads * d for s in lengths)
    return f / 2 if causal else f


def load_mixes(path, dims=None, mix_names=None):
    """Read and check the mixes file; returns (info, shapes) in measuring order (mix, then d)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise MixesError(f"cannot read mixes file {path}: {e}")
    if not isinstance(doc, dict) or not isinstance(doc.get("mixes"), list) or not doc["mixes"]:
        raise MixesError(f"{path}: expected an object with a non-empty 'mixes' list")
    hidden = doc.get("hidden", 2048)
    causal = doc.get("causal", True)
    file_dims = doc.get("head_dims", [64, 128])
    if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden <= 0:
        raise MixesError(f"{path}: 'hidden' must be a positive integer, got {hidden!r}")
    if not isinstance(causal, bool):
        raise MixesError(f"{path}: 'causal' must be true or false, got {causal!r}")
    if (not isinstance(file_dims, list) or not file_dims
            or any(not isinstance(x, int) or isinstance(x, bool) or x <= 0 for x in file_dims)):
        raise MixesError(f"{path}: 'head_dims' must be a list of positive integers, got {file_dims!r}")
    mixes = []
    for i, m in enumerate(doc["mixes"]):
        if not isinstance(m, dict):
            raise MixesError(f"{path}: mixes[{i}] is not an object")
        name, lengths = m.get("name"), m.get("lengths")
        if not isinstance(name, str) or not name:
            raise MixesError(f"{path}: mixes[{i}] has no name")
        if (not isinstance(lengths, list) or not lengths
                or any(not isinstance(x, int) or isinstance(x, bool) or x <= 0 for x in lengths)):
            raise MixesError(f"{path}: mix {name!r}: 'lengths' must be a non-empty list of positive integers")
        mixes.append((name, lengths))
    names = [n for n, _ in mixes]
    if len(set(names)) != len(names):
        raise MixesError(f"{path}: mix names repeat: {names}")
    if mix_names:
        unknown = [n for n in mix_names if n not in names]
        if unknown:
            raise MixesError(f"--mix-names {', '.join(unknown)} not in {path} (has {', '.join(names)})")
        mixes = [m for m in mixes if m[0] in mix_names]
    shapes = []
    for name, lengths in mixes:
        for d in (dims or file_dims):
            if hidden % d:
                print(f"note: skipping d={d}: hidden {hidden} is not a multiple of it", file=sys.stderr)
                continue
            heads = hidden // d
            shapes.append(dict(
                mix=name, d=d, heads=heads, heads_kv=heads, batch=len(lengths),
                total_tokens=sum(lengths), max_seqlen=max(lengths), causal=causal,
                lengths=list(lengths),
                flops_fwd=attn_flops_fwd_varlen(lengths, heads, d, causal)))
    info = dict(mixes_file=os.path.abspath(path), hidden=hidden, causal=causal,
                head_dims=dims or file_dims,
                mixes=[dict(name=n, batch=len(l), total_tokens=sum(l), max_seqlen=max(l),
                            min_seqlen=min(l)) for n, l in mixes])
    return info, shapes


def base_row(impl, shp):
    return dict(impl=impl, varlen=True, mix=shp["mix"], d=shp["d"], heads=shp["heads"],
                heads_kv=shp["heads_kv"], batch=shp["batch"], total_tokens=shp["total_tokens"],
                max_seqlen=shp["max_seqlen"], causal=shp["causal"], dtype="bf16",
                fwd_ms=None, fwd_tflops=None, bwd_ms=None, bwd_tflops=None,
                max_abs_err=None, bwd_max_abs_err=None, note=PEERS[impl],
                flops_fwd=shp["flops_fwd"])


def error_row(impl, shp, error):
    row = base_row(impl, shp)
    row["error"] = error
    return row


# ----------------------------------------------------------------------------- statistics

def tflops(flops, ms):
    return round(flops / (ms * 1e-3) / 1e12, 2) if ms and ms > 0 else None


def max_finite(errs):
    """max of errs rounded, or NaN if any is NaN/inf (Python's max() would skip a NaN)."""
    if any(not math.isfinite(e) for e in errs):
        return float("nan")
    return round(max(errs), 6) if errs else None


def record_error(row, key, value, what):
    """Store a check result; a non-finite one is stored as null with a note (JSON has no NaN)."""
    if value is not None and not math.isfinite(value):
        add_note(row, f"non-finite values in {what} (first two sequences)")
        value = None
    row[key] = value


def add_note(row, text):
    row["note"] = (row.get("note") + "; " if row.get("note") else "") + text


# ----------------------------------------------------------------------------- inputs

class Inputs:
    """Packed inputs of one shape: (T, H, D) views of buffers with spare rows at the end."""

    def __init__(self, torch, dev, shp, seed):
        self.shp = shp
        self.lengths = shp["lengths"]
        self.batch = len(self.lengths)
        self.T = shp["total_tokens"]
        self.H = shp["heads"]
        self.D = shp["d"]
        self.max_s = shp["max_seqlen"]
        self.causal = shp["causal"]
        self.scale = 1.0 / math.sqrt(self.D)
        self.cu_list = [0]
        for s in self.lengths:
            self.cu_list.append(self.cu_list[-1] + s)
        # Spare rows: the cuDNN frontend may bound the ragged token axis by the buffer extent or
        # by max_total_seq_len rounded up to 64; the torch peers see only the first T rows.
        self.T_alloc = (self.T + 63) // 64 * 64 + 64
        torch.manual_seed(seed)
        mk = lambda: torch.randn(self.T_alloc, self.H, self.D, device=dev, dtype=torch.bfloat16)
        self.q_buf, self.k_buf, self.v_buf, self.do_buf = mk(), mk(), mk(), mk()
        self.q, self.k, self.v, self.do = (x[:self.T] for x in
                                           (self.q_buf, self.k_buf, self.v_buf, self.do_buf))
        self.cu = torch.tensor(self.cu_list, dtype=torch.int32, device=dev)


class Impl:
    """A peer set up on one shape: fwd() and bwd() are what is timed."""

    def __init__(self, fwd, out, bwd=None, note=""):
        self.fwd = fwd          # callable, one forward
        self.out = out          # (T, H, D) forward output of the first call (for the check)
        self.bwd = bwd          # callable returning (dq, dk, dv) packed (T, H, D), or None
        self.note = note
        self.late_notes = []    # notes the backward adds once it has run

