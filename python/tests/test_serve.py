"""Serving through a state pool (CPU): vLLM's ssm_state_indices / num_accepted_tokens, SGLang's initial_state_indices,
dgps_torch.pool_recurrence. Each sequence is checked against the float64 token-by-token reference (reference.py).
Tolerances: float64 1e-10, float32 1e-4 (max|x - ref| / max|ref|)."""
import pytest
import torch
import torch.nn.functional as F

import dgps_torch as dt
from reference import l2n, recurrent

H, HV, K, V = 2, 4, 16, 8


def packed(lens, dtype, seed):
    """Random GDN inputs of a packed batch (B = 1) with sequence lengths `lens`; cu_seqlens (int32 like vLLM)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(1, T, H, K, generator=g, dtype=torch.float64)
    k = torch.randn(1, T, H, K, generator=g, dtype=torch.float64)
    v = torch.randn(1, T, HV, V, generator=g, dtype=torch.float64)
    gate = F.logsigmoid(torch.randn(1, T, HV, generator=g, dtype=torch.float64)) * 0.3
    beta = torch.rand(1, T, HV, generator=g, dtype=torch.float64)
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    return [t.to(dtype) for t in (q, k, v, gate, beta)], cu


def pool_of(P, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    sd = torch.float64 if dtype == torch.float64 else torch.float32
    return (0.5 * torch.randn(P, HV, K, V, generator=g, dtype=torch.float64)).to(sd)


def ref_seq(ins, cu, n, h0, upto=None):
    """Reference o rows and final state of sequence n (its first `upto` tokens), starting from h0 (None: zero)."""
    q, k, v, g, beta = (t.double() for t in ins)
    s0 = int(cu[n])
    s1 = int(cu[n + 1]) if upto is None else s0 + upto
    sl = lambda t: t[:, s0:s1]
    if s1 == s0:  # an empty sequence keeps its state
        return q.new_zeros(0, HV, V), (q.new_zeros(HV, K, V) if h0 is None else h0.double())
    o, hT, _ = recurrent(l2n(sl(q)), l2n(sl(k)), sl(v), g=sl(g), beta=sl(beta),
                         h0=None if h0 is None else h0.double().unsqueeze(0))
    return o[0], hT[0]


def err(x, ref):
    den = ref.abs().max().item()
    return (x.double() - ref).abs().max().item() / (den if den > 0 else 1.0)


TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("fixed", [True, False])
def test_vllm_decode_and_prefill_through_pool(dtype, fixed):
    """[N] ssm_state_indices, in place: padding (-1) leaves the pool untouched and gives zero outputs."""
    lens = [1, 1, 1, 1] if fixed else [3, 20, 0, 7]
    ins, cu = packed(lens, dtype, 11)
    q, k, v, g, beta = ins
    if fixed:  # B = N sequences of one token (vLLM's decode batch)
        q, k, v, g, beta = (t.reshape(len(lens), 1, *t.shape[2:]) for t in ins)
    pool = pool_of(8, dtype, 12)
    before = pool.clone()
    idx = torch.tensor([3, -1, 5, 0], dtype=torch.int32)
    o, fs = dt.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=pool,
                                                inplace_final_state=True, cu_seqlens=None if fixed else cu,
                                                ssm_state_indices=idx, use_qk_l2norm_in_kernel=True)
    assert fs is pool
    o = o.reshape(1, -1, HV, V)
    for n, s in enumerate(idx.tolist()):
        rows = o[0, int(cu[n]):int(cu[n + 1])]
        if s < 0:
            assert rows.abs().max().item() == 0 if rows.numel() else True
            continue
        ro, rh = ref_seq(ins, cu, n, before[s])
        if rows.numel():
            assert err(rows, ro) < TOL[dtype]
        assert err(pool[s], rh) < TOL[dtype]
    for s in (1, 2, 4, 6, 7):
        assert torch.equal(pool[s], before[s])


def test_vllm_not_inplace_gives_new_states():
    ins, cu = packed([4, 2, 5], torch.float64, 21)
    pool = pool_of(6, torch.float64, 22)
    before = pool.clone()
    idx = torch.tensor([4, 1, -1])
    o, fs = dt.fused_recurrent_gated_delta_rule(*ins[:4], beta=ins[4], initial_state=pool, inplace_final_state=False,
                                                cu_seqlens=cu, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True)
    assert torch.equal(pool, before) and fs.shape == (3, HV, K, V)
    for n, s in enumerate([4, 1]):
        ro, rh = ref_seq(ins, cu, n, before[s])
        assert err(o[0, int(cu[n]):int(cu[n + 1])], ro) < 1e-10
        assert err(fs[n], rh) < 1e-10
    assert o[0, int(cu[2]):].abs().max().item() == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_vllm_speculative_verification(dtype):
    """[N, D] indices with num_accepted_tokens, ragged drafts: the start is the slot of the last accepted token,
    the state after every token goes to its slot (the start slot itself is overwritten: aliasing); a sequence whose
    start slot is -1 is padding."""
    lens = [4, 2, 3, 1]
    ins, cu = packed(lens, dtype, 31)
    pool = pool_of(12, dtype, 32)
    before = pool.clone()
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1], [6, 7, 8, -1], [-1, 9, -1, -1]], dtype=torch.int32)
    acc = torch.tensor([2, 2, 3, 1], dtype=torch.int32)
    o, fs = dt.fused_recurrent_gated_delta_rule(*ins[:4], beta=ins[4], initial_state=pool, cu_seqlens=cu,
                                                ssm_state_indices=idx, num_accepted_tokens=acc,
                                                use_qk_l2norm_in_kernel=True)
    assert fs is pool
    written = set()
    for n in range(len(lens)):
        start = int(idx[n, int(acc[n]) - 1])
        rows = o[0, int(cu[n]):int(cu[n + 1])]
        if start < 0:
            assert rows.abs().max().item() == 0
            continue
        ro, _ = ref_seq(ins, cu, n, before[start])
        assert err(rows, ro) < TOL[dtype]
        for t in range(lens[n]):
            slot = int(idx[n, t])
            _, rh = ref_seq(ins, cu, n, before[start], upto=t + 1)  # the accepted prefix, token by token
            assert err(pool[slot], rh) < TOL[dtype], (n, t)
            written.add(slot)
    for s in set(range(12)) - written:
        assert torch.equal(pool[s], before[s])


def test_sglang_chunk_prefill_with_initial_state_indices():
    """SGLang's chunk_gated_delta_rule(initial_state=pool, initial_state_indices=idx): long packed prefill (the
    chunkwise kernels), has_initial_state False starts from zero."""
    lens = [70, 5, 33]
    ins, cu = packed(lens, torch.float32, 41)
    pool = pool_of(5, torch.float32, 42)
    before = pool.clone()
    idx = torch.tensor([2, 4, 0])
    has = torch.tensor([True, False, True])
    o, fs = dt.chunk_gated_delta_rule(*ins, initial_state=pool, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                      initial_state_indices=idx, has_initial_state=has)
    assert fs is pool
    for n, s in enumerate(idx.tolist()):
        ro, rh = ref_seq(ins, cu, n, before[s] if has[n] else None)
        assert err(o[0, int(cu[n]):int(cu[n + 1])], ro) < 1e-4
        assert err(pool[s], rh) < 1e-4
    assert torch.equal(pool[1], before[1]) and torch.equal(pool[3], before[3])


def test_k_last_pools_equal_k_major_bit_for_bit():
    """state_v_first pools [P, HV, V, K] (FlashInfer's / SGLang's K-last layout) through vLLM's decode and
    verification and SGLang's prefill, updated in place: o and the pool (transposed back) equal the K-major call's
    bit for bit where the chunkwise kernels run (a prefill longer than 16 tokens), within 2e-6 of its largest
    value where the decode kernel's K-last row sweep runs (verification: the same products summed in another
    order)."""
    lens = [3, 20, 1, 7]
    ins, cu = packed(lens, torch.float32, 61)
    idx = torch.tensor([3, -1, 5, 0], dtype=torch.int32)
    ver = torch.tensor([[0, 1, 2, -1], [4, 6, 7, -1], [-1, -1, -1, -1], [8, -1, -1, -1]], dtype=torch.int32)
    calls = [
        lambda pool, vf: dt.fused_recurrent_gated_delta_rule(
            *ins[:4], beta=ins[4], initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx,
            use_qk_l2norm_in_kernel=True, state_v_first=vf),
        lambda pool, vf: dt.chunk_gated_delta_rule(
            *ins, initial_state=pool, cu_seqlens=cu, initial_state_indices=torch.tensor([4, 2, 6, 1]),
            use_qk_l2norm_in_kernel=True, state_v_first=vf),
    ]
    for call in calls:
        k_major = pool_of(10, torch.float32, 62)
        k_last = k_major.transpose(-1, -2).contiguous()
        before = k_last.clone()
        o1, f1 = call(k_major, False)
        o2, f2 = call(k_last, True)
        assert f2 is k_last and f1 is k_major
        assert not torch.equal(k_last, before)
        assert torch.equal(o1, o2)
        assert torch.equal(k_last.transpose(-1, -2), k_major)
    lens = [3, 2, 1, 1]
    ins, cu = packed(lens, torch.float32, 63)
    acc = torch.tensor([1, 2, 1, 1], dtype=torch.int32)
    k_major = pool_of(10, torch.float32, 64)
    k_last = k_major.transpose(-1, -2).contiguous()
    outs = [dt.fused_recurrent_gated_delta_rule(*ins[:4], beta=ins[4], initial_state=pool, cu_seqlens=cu,
                                                ssm_state_indices=ver, num_accepted_tokens=acc,
                                                use_qk_l2norm_in_kernel=True, state_v_first=vf)[0]
            for pool, vf in ((k_major, False), (k_last, True))]
    close = lambda x, y: (x - y).abs().max().item() <= 2e-6 * y.abs().max().item()
    assert close(outs[1], outs[0])
    assert close(k_last.transpose(-1, -2), k_major) and not torch.equal(k_major, pool_of(10, torch.float32, 64))


def test_pool_recurrence_separate_out_slots_and_pgdn():
    """dgps_torch.pool_recurrence with out_slots (read one slot, write another) on a preconditioned model."""
    g = torch.Generator().manual_seed(51)
    lens = [3, 6]
    T = sum(lens)
    q, k = (torch.randn(1, T, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, HV, V, generator=g, dtype=torch.float64)
    gate = F.logsigmoid(torch.randn(1, T, HV, generator=g, dtype=torch.float64))
    beta = torch.rand(1, T, HV, generator=g, dtype=torch.float64)
    g_p = F.logsigmoid(torch.randn(1, T, H, generator=g, dtype=torch.float64))
    beta_p = torch.rand(1, T, H, generator=g, dtype=torch.float64)
    center = torch.full((H,), -0.2, dtype=torch.float64)
    cu = torch.tensor([0, 3, 9])
    hp = 0.5 * torch.randn(4, HV, K, V, generator=g, dtype=torch.float64)
    ap = torch.rand(4, H, K, generator=g, dtype=torch.float64)
    hb, ab = hp.clone(), ap.clone()
    o = dt.pool_recurrence("pgdn", q, k, v, hp, g=gate, beta=beta, g_p=g_p, beta_p=beta_p, center=center,
                           precond_pool=ap, slots=[1, 2], out_slots=[3, 2], cu_seqlens=cu, l2norm_qk=False)
    for n, (si, so) in enumerate([(1, 3), (2, 2)]):
        s0, s1 = int(cu[n]), int(cu[n + 1])
        ro, rh, ra = recurrent(q[:, s0:s1], k[:, s0:s1], v[:, s0:s1], g=gate[:, s0:s1], beta=beta[:, s0:s1],
                               g_p=g_p[:, s0:s1], beta_p=beta_p[:, s0:s1], center=center, h0=hb[si:si + 1],
                               a0=ab[si:si + 1])
        assert err(o[0, s0:s1], ro[0]) < 1e-10
        assert err(hp[so], rh[0]) < 1e-10 and err(ap[so], ra[0]) < 1e-10
    assert torch.equal(hp[0], hb[0]) and torch.equal(hp[1], hb[1]) and torch.equal(ap[1], ab[1])


def test_errors_name_the_index_and_write_nothing():
    ins, cu = packed([2, 2], torch.float32, 61)
    pool = pool_of(3, torch.float32, 62)
    before = pool.clone()
    call = lambda **kw: dt.fused_recurrent_gated_delta_rule(*ins[:4], beta=ins[4], initial_state=pool, cu_seqlens=cu,
                                                            **kw)
    with pytest.raises((ValueError, RuntimeError), match=r"slots\[1\] = 3 is outside the state pool \[0, 3\)"):
        call(ssm_state_indices=torch.tensor([0, 3]))
    with pytest.raises((ValueError, RuntimeError), match="written by two sequences"):
        call(ssm_state_indices=torch.tensor([1, 1]))
    with pytest.raises((ValueError, RuntimeError), match=r"num_accepted\[0\] = 3"):
        call(ssm_state_indices=torch.tensor([[0, 1], [2, -1]]), num_accepted_tokens=torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="num_accepted_tokens needs ssm_state_indices"):
        call(num_accepted_tokens=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="state pool must be a CPU"):
        dt.fused_recurrent_gated_delta_rule(*ins[:4], beta=ins[4], initial_state=pool.double(), cu_seqlens=cu,
                                            ssm_state_indices=torch.tensor([0, 1]))
    assert torch.equal(pool, before)


def test_fla_signature_unchanged():
    """Without the new keyword-only arguments the FLA functions behave as before (final state returned, h0 read)."""
    ins, cu = packed([5, 4], torch.float64, 71)
    h0 = pool_of(2, torch.float64, 72)
    o, ht = dt.fused_recurrent_gated_delta_rule(*ins[:4], None, None, ins[4], None, h0, True, True, cu_seqlens=cu)
    for n in range(2):
        ro, rh = ref_seq(ins, cu, n, h0[n])
        assert err(o[0, int(cu[n]):int(cu[n + 1])], ro) < 1e-10 and err(ht[n], rh) < 1e-10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_cuda_pool_raises():
    ins, cu = packed([2], torch.float32, 81)
    ins = [t.cuda() for t in ins]
    with pytest.raises(NotImplementedError, match="CPU"):
        dt.fused_recurrent_gated_delta_rule(*ins[:4], beta=ins[4], initial_state=pool_of(2, torch.float32, 1).cuda(),
                                            ssm_state_indices=torch.tensor([0]).cuda())
