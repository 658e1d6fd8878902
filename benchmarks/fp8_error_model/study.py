import sys, json, time, numpy as np
from sim import *
SEEDS = [0, 1, 2]
_cache = {}
def data(d, seed):
    if (d, seed) not in _cache:
        Q, K, V = gen(d, seed); ref, P = reference(Q, K, V)
        _cache[(d, seed)] = (Q, K, V, ref)
        del P
    return _cache[(d, seed)]
A = dict(gran='tensor'); B = dict(gran='block'); C = dict(gran='block', had=True)
def ev(d, tag, **kw):
    t = time.time()
    r = [run(*data(d, s), seed=s, **kw) for s in SEEDS]
    out = dict(tag=tag, d=d, rmse=float(np.mean([x['rmse'] for x in r])), rmse_sd=float(np.std([x['rmse'] for x in r])),
               rel=float(np.mean([x['rel'] for x in r])), kw={k: str(v) for k, v in kw.items()}, t=round(time.time() - t, 1))
    print(json.dumps(out), flush=True)
    with open(f'results_{sys.argv[1]}.jsonl', 'a') as f: f.write(json.dumps(out) + '\n')
    return out['rmse']
sec = sys.argv[1]
dims = [128, 256]
for d in dims:
    if sec == 'repro':
        for nm, kw in [('a', A), ('b', B), ('c', C)]:
            ev(d, nm, **kw)
            for bits, mode in [(14, 'rne'), (14, 'trunc'), (13, 'trunc')]:
                ev(d, f'{nm}_acc{bits}{mode}_qk', acc_qk=bits, acc_mode=mode, **kw)
                ev(d, f'{nm}_acc{bits}{mode}_qkpv', acc_qk=bits, acc_pv=bits, acc_mode=mode, **kw)
        ev(d, 'bf16kernel', qk='exact', vq='exact', pq='bf16', p_off=0)
    if sec == 'budget':
        for nm, kw in [('a', A), ('c', C)]:
            for src in ['qk', 'p', 'v', 'qk+p', 'qk+v', 'p+v', 'qk+p+v']:
                ss = src.split('+')
                ev(d, f'{nm}:{src}', qk='fp8' if 'qk' in ss else 'exact', pq='fp8' if 'p' in ss else 'exact',
                   vq='fp8' if 'v' in ss else 'exact', **kw)
    if sec == 'cand':
        cands = [('base', {}), ('off0', dict(p_off=0)), ('off4', dict(p_off=4)), ('off8.807', dict(p_off=np.log2(448))),
                 ('off16', dict(p_off=16)), ('rowsum_p8', dict(rowsum='p8')), ('v_had', dict(v_had=True)),
                 ('v_blk64', dict(v_blk=64)), ('v_colscale', dict(v_col=True)), ('p_sr', dict(p_mode='sr')),
                 ('p_two', dict(p_two=True)), ('v_two', dict(v_two=True)), ('q_two', dict(q_two='q')),
                 ('qk_two', dict(q_two='qk')), ('top1fix', dict(top1fix=True)), ('pv_bf16', dict(pq='bf16', vq='exact'))]
        for nm, kw in cands:
            ev(d, 'c:' + nm, **{**C, **kw})
            if nm not in ('v_blk64', 'v_colscale'):
                ev(d, 'a:' + nm, **{**A, **kw})
    if sec == 'extra':
        cands = [('v_blk64', dict(v_blk=64)), ('v_blk1(per-key)', dict(v_blk=1)),
                 ('top1fix_S_only', dict(top1fix=True, topfix_parts='s')), ('top1fix_V_only', dict(top1fix=True, topfix_parts='v')),
                 ('top1fix+v_two', dict(top1fix=True, v_two=True)), ('top1fix+p_two', dict(top1fix=True, p_two=True)),
                 ('top1fix+q_two', dict(top1fix=True, q_two='q')), ('qk_two+v_two', dict(q_two='qk', v_two=True)),
                 ('top1fix:qk_only', dict(top1fix=True, pq='exact', vq='exact')),
                 ('top1fix:p_only', dict(top1fix=True, qk='exact', vq='exact')),
                 ('top1fix:v_only', dict(top1fix=True, qk='exact', pq='exact'))]
        for nm, kw in cands:
            ev(d, 'c:' + nm, **{**C, **kw})
            if nm in ('top1fix_S_only', 'top1fix_V_only', 'top1fix+v_two', 'qk_two+v_two'):
                ev(d, 'a:' + nm, **{**A, **kw})
        ev(d, 'b:top1fix', **{**B, 'top1fix': True})
