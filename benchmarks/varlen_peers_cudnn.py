"""The cuDNN frontend peer (cudnn-varlen), and the frontend's version for the results JSON."""

import subprocess
import sys

from peers_common import short_error
from varlen_peers_shapes import Impl


def cudnn_frontend_info(timeout_s=120):
    """(version, None) of the cuDNN frontend Python package, or (None, why it does not import).
    Asked in a child process, so that a crashing import cannot end this run."""
    code = ("import cudnn\nv = getattr(cudnn, '__version__', '?')\ntry:\n"
            "    v += ' (backend %s)' % cudnn.backend_version()\nexcept Exception:\n    pass\nprint(v)\n")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as e:
        return None, short_error(e)
    if r.returncode == 0 and r.stdout.strip():
        return r.stdout.strip().splitlines()[-1], None
    return None, " ".join((r.stderr or "").split())[-300:] or f"exit code {r.returncode}"


def peer_cudnn_frontend(runner, inp):
    """The cudnn-varlen peer set up on `inp` by `runner` (its device, handle and context check)."""
    torch = runner.torch
    import cudnn
    if runner.cudnn_handle is None:
        runner.cudnn_handle = cudnn.create_handle()
    handle = runner.cudnn_handle
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(runner.dev).cuda_stream)
    B, H, S, D, T = inp.batch, inp.H, inp.max_s, inp.D, inp.T
    bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    # Packed THD tensors declared as (B, H, S_max, D) with BSHD strides; the ragged offsets
    # (in elements, one per sequence start, B + 1 of them) place each sequence.
    dim, stride = [B, H, S, D], [S * H * D, D, H * D, 1]
    backend = cudnn.backend_version()
    off_dtype = torch.int64 if backend >= 90600 else torch.int32
    seq_len = torch.tensor(inp.lengths, dtype=torch.int32, device=runner.dev).view(B, 1, 1, 1)
    ragged = (inp.cu.to(torch.int64) * (H * D)).to(off_dtype).view(B + 1, 1, 1, 1)
    o_buf = torch.empty_like(inp.q_buf)
    stats = torch.empty(B, H, S, 1, dtype=torch.float32, device=runner.dev)
    T64 = (T + 63) // 64 * 64
    fwd_doc, bwd_doc = fe_doc(cudnn, "sdpa"), fe_doc(cudnn, "sdpa_backward")
    modern_mask = "diagonal_band_right_bound" in fwd_doc or not fwd_doc

    def causal_kw(style):
        if not inp.causal:
            return {}
        if style == "band":   # the preferred form: TOP_LEFT diagonal, right bound 0
            return dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                        diagonal_band_right_bound=0)
        return dict(use_causal_mask=True)   # the deprecated form, for old frontends

    def tensors(g, names):
        ts = {n: g.tensor(name=n, dim=dim, stride=stride, data_type=bf16) for n in names}
        offs = {n: g.tensor_like(ragged, name=f"ragged_{n}") for n in ("q", "k", "v", "o")}
        sq, skv = g.tensor_like(seq_len, name="seq_len_q"), g.tensor_like(seq_len, name="seq_len_kv")
        return ts, offs, sq, skv

    def build(g):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return torch.empty(max(1, g.get_workspace_size()), device=runner.dev, dtype=torch.uint8)

    def engine(g):
        # frontend >= 1.3x: a python engine serves the plan, or None for the cuDNN backend
        if not hasattr(type(g), "selected_engine"):
            return ""
        try:
            e = g.selected_engine
            return f"engine {getattr(e, 'name', e) if e is not None else 'cuDNN backend'}"
        except Exception as ex:  # noqa: BLE001
            return f"engine unknown ({short_error(ex)[:80]})"

    # ---- forward: try the modern spelling first, then older ones; note which one ran
    attempts = []
    for style in (["band", "flag"] if modern_mask else ["flag"]):
        for total in ([True, False] if "max_total_seq_len_q" in fwd_doc else [False]):
            attempts.append((style, total))
    fails, fwd_graph = [], None
    for style, total in attempts:
        try:
            g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=f32,
                              compute_data_type=f32, handle=handle)
            ts, offs, sq, skv = tensors(g, ("q", "k", "v"))
            for n in ("q", "k", "v"):
                ts[n].set_ragged_offset(offs[n])
            kw = dict(name="sdpa", q=ts["q"], k=ts["k"], v=ts["v"], attn_scale=inp.scale,
                      use_padding_mask=True, seq_len_q=sq, seq_len_kv=skv)
            if "generate_stats" in fwd_doc or not fwd_doc:
                kw["generate_stats"] = True
            else:
                kw["is_inference"] = False
            if total:
                kw.update(max_total_seq_len_q=T, max_total_seq_len_kv=T)
            kw.update(causal_kw(style))
            o, st = g.sdpa(**kw)
            o.set_output(True).set_dim(dim).set_stride(stride)
            o.set_ragged_offset(offs["o"])
            st.set_output(True).set_data_type(f32)
            ws = build(g)
            pack = {ts["q"]: inp.q_buf, ts["k"]: inp.k_buf, ts["v"]: inp.v_buf, o: o_buf,
                    st: stats, sq: seq_len, skv: seq_len}
            pack.update({offs[n]: ragged for n in offs})
            g.execute(pack, ws, handle=handle)
            torch.cuda.synchronize()
            fwd_graph = (g, pack, ws)
            break
        except Exception as e:  # noqa: BLE001
            fails.append(f"[mask={style}, max_total={total}] {short_error(e)[:300]}")
            runner.check_context()
    if fwd_graph is None:
        raise RuntimeError("cudnn frontend forward: " + " || ".join(fails))
    fg, fpack, fws = fwd_graph
    note = (f"cudnn frontend {getattr(cudnn, '__version__', '?')}, backend {backend}; "
            f"causal mask as {'diagonal band (TOP_LEFT, right bound 0)' if style == 'band' else 'use_causal_mask'}"
            f"{', fwd max_total_seq_len=T' if total else ''}; offsets {str(off_dtype)[6:]}")
    if engine(fg):
        note += f"; fwd {engine(fg)}"
    if fails:
        note += "; earlier fwd attempts failed: " + " || ".join(fails)

    def fwd():
        fg.execute(fpack, fws, handle=handle)

    # ---- backward graph, built lazily (only when the backward is measured)
    def make_bwd():
        dq, dk, dv = (torch.empty_like(inp.q_buf) for _ in range(3))
        g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=f32,
                          compute_data_type=f32, handle=handle)
        ts, offs, sq, skv = tensors(g, ("q", "k", "v", "o", "dO"))
        for n, off in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o"), ("dO", "o")):
            ts[n].set_ragged_offset(offs[off])
        st = g.tensor_like(stats, name="stats")
        kw = dict(name="sdpa_backward", q=ts["q"], k=ts["k"], v=ts["v"], o=ts["o"],
                  dO=ts["dO"], stats=st, attn_scale=inp.scale, use_padding_mask=True,
                  seq_len_q=sq, seq_len_kv=skv)
        if "max_total_seq_len_q" in bwd_doc or not bwd_doc:
            kw.update(max_total_seq_len_q=T64, max_total_seq_len_kv=T64)
        kw.update(causal_kw(style))
        gq, gk, gv = g.sdpa_backward(**kw)
        for t, off in ((gq, "q"), (gk, "k"), (gv, "v")):
            t.set_output(True).set_dim(dim).set_stride(stride)
            t.set_ragged_offset(offs[off])
        ws = build(g)
        if engine(g):
            impl.late_notes.append(f"bwd {engine(g)}")
        pack = {ts["q"]: inp.q_buf, ts["k"]: inp.k_buf, ts["v"]: inp.v_buf, ts["o"]: o_buf,
                ts["dO"]: inp.do_buf, st: stats, gq: dq, gk: dk, gv: dv, sq: seq_len,
                skv: seq_len}
        pack.update({offs[n]: ragged for n in offs})

        def bwd():
            g.execute(pack, ws, handle=handle)
            return dq[:T], dk[:T], dv[:T]
        return bwd

    state = {}

    def bwd():
        if "fn" not in state:
            state["fn"] = make_bwd()
        return state["fn"]()
    impl = Impl(fwd, o_buf[:T], bwd, note)
    return impl


def fe_doc(cudnn, op):
    """The docstrings of the frontend's `op` (pybind signature in classic and 1.3x packages);
    used to pick the keyword spelling this version understands. '' when none is found."""
    owners = [cudnn.pygraph]
    for mod in ("_pybind_module", "_compiled_module"):
        m = getattr(cudnn, mod, None)
        for cls in ("backend_graph", "pygraph"):
            c = getattr(m, cls, None) if m is not None else None
            if c is not None:
                owners.append(c)
    docs = []
    for o in owners:
        d = getattr(getattr(o, op, None), "__doc__", None) or ""
        if d and "generic kwarg capture" not in d:
            docs.append(d)
    return "\n".join(docs)

