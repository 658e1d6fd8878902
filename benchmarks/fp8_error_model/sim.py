"""FP8 (e4m3) FlashAttention-3-style forward simulator (CPU, numpy).

Usage: import sim; sim.run(d, seed, **opts)  -> dict(rmse, rel, per-row sq err ...)
"""
import numpy as np
import ml_dtypes

LOG2E = 1.4426950408889634
N_SEQ, N_HEAD = 2048, 8

FMT = {  # mantissa bits, min normal exponent, max finite
    'e4m3': (3, -6, 448.0),
    'e5m2': (2, -14, 57344.0),
    'bf16': (7, -126, 3.3895e38),
    'fp16': (10, -14, 65504.0),
}


def fpq(x, fmt='e4m3', mode='rne', rng=None, sat=True):
    """Round x to a floating format (incl. subnormals), RNE / stochastic / truncation, saturating."""
    mb, emin, maxv = FMT[fmt] if isinstance(fmt, str) else fmt
    x = np.asarray(x)
    ax = np.abs(x)
    _, e = np.frexp(ax)                  # ax = m*2^e, m in [0.5,1)
    e = np.maximum(e - 1, emin)           # floor(log2 ax), clamped at subnormal range
    ulp = np.ldexp(np.ones_like(ax), e - mb)
    r = ax / ulp
    if mode == 'rne':
        q = np.rint(r)
    elif mode == 'sr':
        fl = np.floor(r)
        q = fl + (rng.random(r.shape, dtype=np.float32 if r.dtype == np.float32 else np.float64) < (r - fl))
    elif mode == 'trunc':
        q = np.floor(r)
    else:
        raise ValueError(mode)
    q = q * ulp
    if sat:
        q = np.minimum(q, maxv)
    return (np.sign(x) * q).astype(x.dtype)


def round_bits(x, nbits, mode='rne'):
    """Round to nbits significand bits (incl. implicit), no exponent limits (accumulator model)."""
    ax = np.abs(x)
    _, e = np.frexp(ax)
    ulp = np.ldexp(np.ones_like(ax), e - nbits)
    r = ax / ulp
    q = np.rint(r) if mode == 'rne' else np.floor(r)
    return (np.sign(x) * q * ulp).astype(x.dtype)


def to_bf16(x):
    return x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def gen(d, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(3):
        x = rng.standard_normal((N_HEAD, N_SEQ, d))
        x = x + (rng.random((N_HEAD, N_SEQ, d)) < 0.001) * 10 * rng.standard_normal((N_HEAD, N_SEQ, d))
        out.append(to_bf16(x))
    return out


def reference(Q, K, V):
    d = Q.shape[-1]
    S = np.einsum('hqd,hkd->hqk', Q, K) / np.sqrt(d)
    S -= S.max(-1, keepdims=True)
    P = np.exp(S)
    P /= P.sum(-1, keepdims=True)
    return np.einsum('hqk,hkd->hqd', P, V), P


def hadamard(d, seed=12345):
    H = np.array([[1.0]])
    while H.shape[0] < d:
        H = np.block([[H, H], [H, -H]])
    D = np.random.default_rng(seed).choice([-1.0, 1.0], size=d)
    return H * D[None, :] / np.sqrt(d)   # M = H D / sqrt(d); row x -> M x  i.e. x @ M.T


def quant_blocks(X, rows_per_block, fmt='e4m3', per_tensor=False, col_scale=False, pow2=False, margin=1.0):
    """X (H,N,d). Returns (Xq as float64 'code' values, scale array broadcastable to (H,nblk,1,1 or d))."""
    Hh, N, d = X.shape
    maxv = FMT[fmt][2]
    if per_tensor:
        amax = np.abs(X).max()
        s = amax / maxv * margin
        if pow2:
            s = 2.0 ** np.ceil(np.log2(s))
        s = np.float32(s)
        return fpq(X / s, fmt), np.full((Hh, N, 1), s)
    nb = -(-N // rows_per_block)
    s_rows = np.empty((Hh, N, d if col_scale else 1))
    for b in range(nb):
        sl = slice(b * rows_per_block, min(N, (b + 1) * rows_per_block))
        if col_scale:
            amax = np.abs(X[:, sl, :]).max(1, keepdims=True)
        else:
            amax = np.abs(X[:, sl, :]).max((1, 2), keepdims=True)
        s = amax / maxv * margin
        if pow2:
            s = 2.0 ** np.ceil(np.log2(s))
        s_rows[:, sl, :] = s.astype(np.float32)
    return fpq(X / s_rows, fmt), s_rows


def run(Q, K, V, ref, *, gran='tensor', had=False, qk='fp8', pq='fp8', vq='fp8',
        p_off=8.0, rowsum='p32', v_had=False, v_blk=None, v_col=False, p_mode='rne',
        p_two=False, v_two=False, q_two=False, acc_qk=None, acc_pv=None, acc_mode='rne',
        fmt_qk='e4m3', fmt_v='e4m3', fmt_p='e4m3', pscale_blk=False, kblk=None, out='bf16',
        seed=0, return_rows=False, pow2=False, top1fix=False, topfix_parts='sv'):
    """Simulate the blockwise FP8 forward. qk/pq/vq in {'fp8','exact'}."""
    Hh, N, d = Q.shape
    rng = np.random.default_rng(seed + 999)
    kb = kblk or (256 if d == 128 else 128)
    Q0, K0, V0 = Q, K, V
    if had:
        M = hadamard(d)
        Q = Q @ M.T
        K = K @ M.T
    if v_had:
        Mv = hadamard(d, seed=777)
        V = V @ Mv.T
    per_t = gran == 'tensor'
    # --- quantize Q, K
    if qk == 'fp8':
        q8, sq = quant_blocks(Q, 128, fmt_qk, per_t, pow2=pow2)
        k8, sk = quant_blocks(K, kb, fmt_qk, per_t, pow2=pow2)
        if q_two:  # X = s*(hi + lo/16): residual in a second e4m3 tensor; 'q','k' or 'qk'
            if 'q' in q_two:
                q8 = q8 + fpq((Q / sq - q8) * 16, fmt_qk) / 16
            if 'k' in q_two:
                k8 = k8 + fpq((K / sk - k8) * 16, fmt_qk) / 16
    else:
        q8, sq = Q, np.ones((Hh, N, 1))
        k8, sk = K, np.ones((Hh, N, 1))
    # --- quantize V
    if vq == 'fp8':
        vb = v_blk or kb
        v8, sv = quant_blocks(V, vb, fmt_v, per_t and v_blk is None, col_scale=v_col, pow2=pow2)
        if v_two:
            rv = (V / sv - v8) * 16
            v8 = v8 + fpq(rv, fmt_v) / 16
    else:
        v8, sv = V, np.ones((Hh, N, 1))
    scale = np.float32(1.0 / np.sqrt(d) * LOG2E)
    m = np.full((Hh, N, 1), -np.inf, np.float32)
    l = np.zeros((Hh, N, 1), np.float32)
    O = np.zeros((Hh, N, d), np.float32)
    for j0 in range(0, N, kb):
        j1 = min(N, j0 + kb)
        kk = k8[:, j0:j1]
        if acc_qk is None:
            S = np.einsum('hqd,hkd->hqk', q8, kk).astype(np.float32)
        else:  # limited-precision tensor-core accumulation, 32-wide k-chunks
            S = np.zeros((Hh, N, j1 - j0))
            for c in range(0, d, 32):
                S = round_bits(S + np.einsum('hqd,hkd->hqk', q8[..., c:c + 32], kk[..., c:c + 32]), acc_qk, acc_mode)
            S = S.astype(np.float32)
        # descale: per q row scale * per key scale (key-block scalar) * softmax scale in exp2 domain
        sqk = (sq[:, :, :1].astype(np.float32) * sk[:, j0:j1, 0][:, None, :].astype(np.float32) * scale)
        S = S * sqk.astype(np.float32)
        if top1fix:
            bmax = S.max(-1, keepdims=True)
            barg = S.argmax(-1)[..., None] + j0
            if j0 == 0:
                best, bidx = bmax, barg
            else:
                upd = bmax > best
                best = np.where(upd, bmax, best); bidx = np.where(upd, barg, bidx)
        m_new = np.maximum(m, S.max(-1, keepdims=True))
        alpha = np.exp2(m - m_new).astype(np.float32)
        P = np.exp2(S - m_new + np.float32(p_off)).astype(np.float32)
        if pq == 'fp8':
            if p_two:
                hi = fpq(P, fmt_p, p_mode, rng)
                lo = fpq((P - hi) * 16, fmt_p, 'rne') / 16
                P8 = hi + lo
            else:
                P8 = fpq(P, fmt_p, p_mode, rng)
        elif pq == 'bf16':
            P8 = fpq(P, 'bf16')
        elif pq == 'fp16':
            P8 = fpq(P, 'fp16')
        else:
            P8 = P
        rs = P8 if rowsum == 'p8' else P
        l = l * alpha + rs.astype(np.float64).sum(-1, keepdims=True).astype(np.float32)
        vv = v8[:, j0:j1]
        svb = sv[:, j0:j1]
        if v_col or svb.shape[-1] == d:
            svb = svb[:, 0:1, :]   # per-column scale of this block
        else:
            svb = svb[:, 0:1, :1]
        if acc_pv is None:
            # general: per-key (and per-column) V scale; equals (P8.v8)*s_v when s_v is constant in the block,
            # and per-sub-block GEMMs (or P pre-multiplied by s_v sub-block ratio) otherwise
            pv = np.einsum('hqk,hkd->hqd', P8.astype(np.float64), vv * sv[:, j0:j1])
            O = (O * alpha + pv.astype(np.float32)).astype(np.float32)
        else:  # accumulate into O inside the tensor core (rescaled O_acc is the accumulator input)
            if per_t:
                acc = (O * alpha).astype(np.float64)
                for c in range(0, j1 - j0, 32):
                    acc = round_bits(acc + np.einsum('hqk,hkd->hqd', P8[..., c:c + 32].astype(np.float64), vv[:, c:c + 32]), acc_pv, acc_mode)
                O = acc.astype(np.float32)
            else:
                acc = np.zeros((Hh, N, d))
                for c in range(0, j1 - j0, 32):
                    acc = round_bits(acc + np.einsum('hqk,hkd->hqd', P8[..., c:c + 32].astype(np.float64), vv[:, c:c + 32]), acc_pv, acc_mode)
                O = (O * alpha + (acc * svb).astype(np.float32)).astype(np.float32)
        m = m_new
    if per_t and acc_pv is not None:
        O = O * sv[:, :1, :1].astype(np.float32)
    if top1fix:
        # epilogue: replace the (quantized) contribution of the row-argmax key by an exact bf16 one.
        # Its kernel P is exactly 2^p_off (it is the running max when seen); kernel value s_v*v8.
        idx = bidx[..., 0]
        hi = np.arange(Hh)[:, None]
        kst = K0[hi, idx]                        # (H,N,d) bf16 key rows (gather)
        vst = V0[hi, idx]
        vq_st = (v8[hi, idx] * (sv[hi, idx] if (v_col or sv.shape[-1] == d) else sv[hi, idx][..., :1]))
        if v_had:
            vq_st = vq_st @ Mv                   # bring back to original basis
        S_ex = (np.einsum('hnd,hnd->hn', Q0, kst) / np.sqrt(d) * LOG2E)[..., None]
        if 's' not in topfix_parts:
            S_ex = m.astype(np.float64)
        if 'v' not in topfix_parts:
            vst = vq_st
        delta = S_ex - m.astype(np.float64)      # exact exponent relative to kernel max
        Pk = 2.0 ** p_off
        Pn = 2.0 ** (delta + p_off)
        Oa = O.astype(np.float64)
        if v_had:
            Oa = Oa @ Mv
        Oa = Oa - Pk * vq_st + Pn * vst
        l = l.astype(np.float64) - Pk + Pn
        Of = Oa / l
        if v_had:
            Of = Of @ Mv.T                       # undone again below
    else:
        Of = O.astype(np.float64) / l
    if v_had:
        Of = Of @ Mv          # inverse of x @ Mv.T
    if out == 'bf16':
        Of = to_bf16(Of)
    elif out == 'fp16':
        Of = fpq(Of, 'fp16')
    err = Of - ref
    res = dict(rmse=float(np.sqrt(np.mean(err ** 2))), rel=float(np.linalg.norm(err) / np.linalg.norm(ref)))
    if return_rows:
        res['row_sq'] = (err ** 2).sum(-1)
        res['O'] = Of
    return res
