/// @brief The block-row recurrent kernel (SPEC §2): decode, and the forward when state rows move 16 bytes at a time.
///
/// Decode is bound by the state traffic (K x V float32 read and written per value head) at large
/// batch and by latency at batch 1; the forward by the float32 arithmetic of the recurrence. Thread
/// c of a block owns key channel c for the L2 norms and the diagonal preconditioner statistics.
#pragma once

#include "kernels/recurrent_warp.cuh"

namespace dgps::cuda::kernels {

constexpr int kRowThreads = 128;

/// The raw inputs of one group of TG tokens as one thread loads them (prefetched into registers
/// while the previous group runs): key channel c of k, q (and g for Diagonal decay), NV values
/// of v, and the scalar gates of token `tid` when tid < TG.
template <int TG, int NV>
struct RawGroup {
  float k[TG], q[TG], g[TG], v[NV];
  float dec, beta, gp, bp;
};

/// The block-row recurrent kernel (SPEC §2), for forward (varlen, optional h0/hT) and decode (state
/// pool through slots, in place). One 128-thread block per (sequence, value head, 4*NCG columns):
/// NCG column groups of 4 value columns; the 128 state rows are split over NP = 128 / NCG parts, so
/// thread (part, cg) keeps R = 128 / NP rows x 4 columns in registers and moves them with 16-byte
/// accesses. Partial sums over rows are combined across parts through shared memory. Tokens are
/// staged TG at a time; the loads of the next group are issued before the current group runs.
/// With 128 columns per block (128 state floats per thread) the kernel asks for 2 blocks per SM,
/// so its registers do not spill; otherwise 3, or 4 with one token staged (one-token decode).
/// GROUPED (one-token decode): one block per (sequence, key head) instead, walking the units of its
/// group (value head, block of VT columns) one after another; the key side (q, k, their norms, the
/// preconditioner's statistics and squash) is staged once for all of them, and the block owns its
/// statistics a0 / aT, so it reads and updates them in place with no copy or cluster barrier.
template <class Tin, int NCG, int TG, bool GROUPED = false>
__global__ void __launch_bounds__(kRowThreads, NCG >= 32 ? 2 : (TG == 1 ? 4 : 3)) rowblock_kernel(const RecArgs a) {
  static_assert(!GROUPED || TG == 1, "grouped blocks stage one token");
  constexpr int KT = 128;                     // K <= 128, masked
  constexpr int NP = kRowThreads / NCG;       // parts (row blocks)
  constexpr int R = KT / NP;                  // rows per thread
  constexpr int VT = 4 * NCG;                 // value columns per block
  constexpr int NV = (TG * VT + kRowThreads - 1) / kRowThreads;  // v values per thread and group
  constexpr int NW = kRowThreads / 32;
  __shared__ __align__(16) float s_k[TG][KT], s_kw[TG][KT], s_q[TG][KT], s_dg[TG][KT];
  __shared__ __align__(16) float s_red[3][NP][VT];  // [0]: dot, [1 + token parity]: output
  __shared__ __align__(16) float s_v[TG][VT];
  __shared__ float s_dec[TG], s_beta[TG], s_gp[TG], s_bp[TG], s_ss[TG][2][NW];

  grid_dependency_sync();  // a programmatic dependent launch (decode) waits here for the previous kernel
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int part = tid / NCG, cg = tid % NCG;
  const int n = blockIdx.z;
  const int xblocks = (a.V + VT - 1) / VT, units = GROUPED ? a.group * xblocks : 1;
  // The unit (value head, column block) being run; GROUPED blocks move on to the next in the loop below.
  int hv = GROUPED ? blockIdx.y * a.group : blockIdx.y, bx = GROUPED ? 0 : blockIdx.x;
  const int h = GROUPED ? blockIdx.y : hv / a.group;
  int v0 = bx * VT + 4 * cg;  // first of this thread's 4 columns
  bool vok = v0 < a.V;        // V % 4 == 0: all 4 or none
  bool keys = true;           // this pass stages the key side (always but for a GROUPED block's later units)
  const int K = a.K;
  const int64_t sidx = a.slots ? a.slots[n] : n;
  const bool has_p = a.precond != kPrecondIdentity;
  const bool atk = a.precond == kPrecondATK;
  const bool diag = a.decay == kDecayDiagonal;
  int64_t bos = 0, len = a.T, b = n;
  if (a.cu_seqlens) {
    bos = a.cu_seqlens[n];
    len = a.cu_seqlens[n + 1] - bos;
    b = 0;
  }

  float4 S[R];
  auto load_state = [&] {
    const float* h0 = a.h0 ? a.h0 + sidx * a.sh0[0] + hv * a.sh0[1] + v0 : nullptr;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int c = part * R + i;
      S[i] = (h0 && vok && c < K) ? *reinterpret_cast<const float4*>(h0 + c * a.sh0[2]) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  load_state();
  const int c = tid;  // this thread's key channel in the staging phase
  float A = 0.f;
  if (has_p && a.a0 && c < K) A = a.a0[(a.a0_by_sequence ? n : sidx) * a.sa0[0] + h * a.sa0[1] + c];
  const bool cl = has_p && a.cluster_a;  // (uniform) A read: the cluster's writer may go ahead
  if (cl) cluster_arrive();
  const float center = has_p ? load_gate(a.center, h, a.gate_dtype) : 0.f;

  const Tin* q = static_cast<const Tin*>(a.q);
  const Tin* k = static_cast<const Tin*>(a.k);
  const Tin* v = static_cast<const Tin*>(a.v);
  Tin* o = static_cast<Tin*>(a.o);

  // Prefetching keeps the raw group alive across the token loop: worth it for long sequences
  // (forward). Decode's single group is loaded straight into shared memory instead (fewer live
  // registers next to the 128 of the state).
  constexpr bool kPrefetch = TG > kDecodeGroup;
  auto load_group = [&](int64_t t0, RawGroup<TG, NV>& r) {
    const int nt = static_cast<int>(len - t0 < TG ? len - t0 : TG);
#pragma unroll
    for (int tt = 0; tt < TG; ++tt) {
      const int64_t tok = bos + t0 + tt;
      const bool ok = tt < nt && c < K;
      if (keys) {
        r.k[tt] = ok ? to_float(k[b * a.sk[0] + tok * a.sk[1] + h * a.sk[2] + c]) : 0.f;
        r.q[tt] = ok ? to_float(q[b * a.sq[0] + tok * a.sq[1] + h * a.sq[2] + c]) : 0.f;
      }
      const float g = (diag && ok) ? load_gate(a.g, b * a.sg[0] + tok * a.sg[1] + hv * a.sg[2] + c, a.gate_dtype) : 0.f;
      if (kPrefetch)
        r.g[tt] = g;
      else if (diag)
        s_dg[tt][c] = expf(g);
    }
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int e = tid + j * kRowThreads, tt = e / VT, vc = bx * VT + e % VT;
      const float x =
          (tt < nt && vc < a.V) ? to_float(v[b * a.sv[0] + (bos + t0 + tt) * a.sv[1] + hv * a.sv[2] + vc]) : 0.f;
      if (kPrefetch)
        r.v[j] = x;
      else if (e < TG * VT)
        s_v[tt][e % VT] = x;
    }
    float dec = 0.f, beta = 1.f, gp = 0.f, bp = 0.f;
    if (tid < nt) {
      const int64_t tok = bos + t0 + tid;
      if (a.decay == kDecayScalar) dec = load_gate(a.g, b * a.sg[0] + tok * a.sg[1] + hv * a.sg[2], a.gate_dtype);
      if (a.beta) beta = load_gate(a.beta, b * a.sbeta[0] + tok * a.sbeta[1] + hv * a.sbeta[2], a.gate_dtype);
      if (has_p && keys) {
        gp = load_gate(a.g_p, b * a.sgp[0] + tok * a.sgp[1] + h * a.sgp[2], a.gate_dtype);
        bp = load_gate(a.beta_p, b * a.sbp[0] + tok * a.sbp[1] + h * a.sbp[2], a.gate_dtype);
      }
    }
    if (kPrefetch) {
      r.dec = dec, r.beta = beta, r.gp = gp, r.bp = bp;
    } else if (tid < TG) {
      s_dec[tid] = expf(dec), s_beta[tid] = beta, s_gp[tid] = expf(gp), s_bp[tid] = bp;
    }
  };

  RawGroup<TG, NV> raw;
  if (kPrefetch && len > 0) load_group(0, raw);
#pragma unroll 1
  for (int u = 0; u < units; ++u) {
    if (GROUPED && u > 0) {
      hv = h * a.group + u / xblocks, bx = u % xblocks;
      v0 = bx * VT + 4 * cg, vok = v0 < a.V;
      keys = false;
      load_state();
    }
#pragma unroll 1
    for (int64_t t0 = 0; t0 < len; t0 += TG) {
      const int nt = static_cast<int>(len - t0 < TG ? len - t0 : TG);
      if (!kPrefetch) load_group(t0, raw);
      // Stage this group: raw values to shared memory, L2 norms (SPEC §1) by warp sums.
#pragma unroll
      for (int tt = 0; tt < TG && keys; ++tt) {
        const float sk = warp_sum(raw.k[tt] * raw.k[tt]);
        const float sq = warp_sum(raw.q[tt] * raw.q[tt]);
        if (lane == 0) s_ss[tt][0][warp] = sk, s_ss[tt][1][warp] = sq;
        s_k[tt][c] = raw.k[tt];
        s_q[tt][c] = raw.q[tt];
        if (kPrefetch && diag) s_dg[tt][c] = expf(raw.g[tt]);
      }
      if (kPrefetch) {
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          const int e = tid + j * kRowThreads;
          if (e < TG * VT) s_v[e / VT][e % VT] = raw.v[j];
        }
        if (tid < TG) {
          s_dec[tid] = expf(raw.dec);  // exp(0) = 1 for no decay
          s_beta[tid] = raw.beta;
          s_gp[tid] = expf(raw.gp);
          s_bp[tid] = raw.bp;
        }
      }
      __syncthreads();
#pragma unroll 1
      for (int tt = 0; tt < nt && keys; ++tt) {
        float sk = 0.f, sq = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) sk += s_ss[tt][0][w], sq += s_ss[tt][1][w];
        const float kn = s_k[tt][c] * (a.l2norm ? rsqrtf(sk + 1e-6f) : 1.f);
        float qn = s_q[tt][c] * (a.l2norm ? rsqrtf(sq + 1e-6f) : 1.f) * a.scale;
        float kw = kn;
        if (has_p) {  // SPEC §2: A = exp(g_p) A + beta_p k^2, M = squash(A)
          A = maths::stats_step(A, s_gp[tt], s_bp[tt], kn);
          const float M = maths::squash(A, center, a.log_x, a.eps);
          if (atk)
            kw = kn * M;
          else
            qn *= M;
        }
        s_k[tt][c] = kn;
        s_kw[tt][c] = kw;
        s_q[tt][c] = qn;
      }
      __syncthreads();
      if (kPrefetch && t0 + TG < len) load_group(t0 + TG, raw);  // in flight while this group runs
      // The recurrence (SPEC §2) for this thread's R rows x 4 columns.
#pragma unroll 1
      for (int tt = 0; tt < nt; ++tt) {
        const float* kr = &s_k[tt][part * R];
        const float* kw = &s_kw[tt][part * R];
        const float* qr = &s_q[tt][part * R];
        const float dec = s_dec[tt];
        if (diag) {
          const float* dg = &s_dg[tt][part * R];
#pragma unroll
          for (int i = 0; i < R; ++i) {
            const float d = dg[i];
            S[i].x *= d, S[i].y *= d, S[i].z *= d, S[i].w *= d;
          }
        }
        const float bt = s_beta[tt];
        const float4 vv = *reinterpret_cast<const float4*>(&s_v[tt][4 * cg]);
        float4 delta = make_float4(bt * vv.x, bt * vv.y, bt * vv.z, bt * vv.w);
        if (a.online) {
          float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
          for (int i = 0; i < R; ++i) {
            const float kk = kr[i];
            r.x = fmaf(S[i].x, kk, r.x), r.y = fmaf(S[i].y, kk, r.y);
            r.z = fmaf(S[i].z, kk, r.z), r.w = fmaf(S[i].w, kk, r.w);
          }
          *reinterpret_cast<float4*>(&s_red[0][part][4 * cg]) = r;
          __syncthreads();
          r = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
          for (int p = 0; p < NP; ++p) {
            const float4 x = *reinterpret_cast<const float4*>(&s_red[0][p][4 * cg]);
            r.x += x.x, r.y += x.y, r.z += x.z, r.w += x.w;
          }
          delta = make_float4(bt * (vv.x - dec * r.x), bt * (vv.y - dec * r.y), bt * (vv.z - dec * r.z),
                              bt * (vv.w - dec * r.w));
        }
        float4 out = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int i = 0; i < R; ++i) {
          const float w = kw[i], qq = qr[i];
          S[i].x = fmaf(S[i].x, dec, w * delta.x), S[i].y = fmaf(S[i].y, dec, w * delta.y);
          S[i].z = fmaf(S[i].z, dec, w * delta.z), S[i].w = fmaf(S[i].w, dec, w * delta.w);
          out.x = fmaf(S[i].x, qq, out.x), out.y = fmaf(S[i].y, qq, out.y);
          out.z = fmaf(S[i].z, qq, out.z), out.w = fmaf(S[i].w, qq, out.w);
        }
        float(*red)[VT] = s_red[1 + (tt & 1)];
        *reinterpret_cast<float4*>(&red[part][4 * cg]) = out;
        __syncthreads();
        if (part == 0 && vok) {
          out = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
          for (int p = 0; p < NP; ++p) {
            const float4 x = *reinterpret_cast<const float4*>(&red[p][4 * cg]);
            out.x += x.x, out.y += x.y, out.z += x.z, out.w += x.w;
          }
          Tin* op = o + b * a.so[0] + (bos + t0 + tt) * a.so[1] + hv * a.so[2] + v0;
          op[0] = from_float<Tin>(out.x), op[1] = from_float<Tin>(out.y);
          op[2] = from_float<Tin>(out.z), op[3] = from_float<Tin>(out.w);
        }
      }
      __syncthreads();
    }

    if (a.hT) {
      float* hT = a.hT + sidx * a.shT[0] + hv * a.shT[1] + v0;
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int cc = part * R + i;
        if (vok && cc < K) *reinterpret_cast<float4*>(hT + cc * a.shT[2]) = S[i];
      }
    }
  }  // units
  if (cl) cluster_wait();  // every block of the cluster has read a0 = aT
  const bool writer = GROUPED || (hv % a.group == 0 && blockIdx.x == 0);
  if (has_p && a.aT && writer && c < K) a.aT[sidx * a.saT[0] + h * a.saT[1] + c] = A;
}

/// Launches rowblock_kernel<Tin, NCG, TG>; `dependent`: as a programmatic dependent launch (decode
/// on Hopper, see sm90_kernels), so its blocks are scheduled while the previous kernel in the stream finishes.
template <class Tin, int NCG, int TG, bool GROUPED = false>
cudaError_t launch_rowblock_variant(const RecArgs& a, cudaStream_t stream, bool dependent = false) {
  constexpr int VT = 4 * NCG;
  const dim3 grid = GROUPED ? dim3(1, a.H, a.N) : dim3((a.V + VT - 1) / VT, a.HV, a.N);
  // a.cluster_a: one cluster per (key head, sequence), all its column blocks and value heads.
  const dim3 cluster = a.cluster_a ? dim3(grid.x, a.group, 1) : dim3(1, 1, 1);
  return launch_ex(rowblock_kernel<Tin, NCG, TG, GROUPED>, grid, dim3(kRowThreads), 0, stream, dependent, cluster, a);
}

/// One-token decode for small batches: a warp per 8 value columns of one (sequence, value head),
/// kDecodeWarps warps per block, and no shared memory or block barrier on the way. Lane l holds the
/// 4 columns 4 (l % 2) .. + 3 of the warp's 8 and the state rows l / 2 + 16 i (i < 8), so each load
/// or store of the state moves whole 32-byte sectors, and each row sum (the norms, S^T k, S^T q) is
/// 4 butterfly steps over the 16 lanes of a column half (reduce_parts<16>). The lane's key channels are its state rows:
/// q, k and their decays come straight from global memory, every load of the call is issued before
/// the first value is used (the gates' element type G is a template argument, so no branch separates
/// the loads). No preconditioner (launch_decode keeps those on rowblock_kernel).
template <class Tin, class G>
__global__ void __launch_bounds__(32 * kDecodeWarps) decode_warp_kernel(const RecArgs a) {
  grid_dependency_sync();  // a programmatic dependent launch waits here for the previous kernel
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, half = lane & 1, rg = lane >> 1;
  const int n = blockIdx.z, hv = blockIdx.y, h = hv / a.group, K = a.K;
  const int v0 = (blockIdx.x * kDecodeWarps + warp) * 8 + 4 * half;  // the lane's first column (4 or none valid)
  const bool vok = v0 < a.V;
  const int64_t sidx = a.slots ? a.slots[n] : n, b = n;  // one token: the inputs' row is b * s[0]
  const bool diag = a.decay == kDecayDiagonal, scalar = a.decay == kDecayScalar;
  const Tin* q = static_cast<const Tin*>(a.q) + b * a.sq[0] + h * a.sq[2];
  const Tin* k = static_cast<const Tin*>(a.k) + b * a.sk[0] + h * a.sk[2];
  const Tin* v = static_cast<const Tin*>(a.v) + b * a.sv[0] + hv * a.sv[2] + (vok ? v0 : 0);
  const G* gd = static_cast<const G*>(a.g) + b * a.sg[0] + hv * a.sg[2];
  const float* h0 = a.h0 + sidx * a.sh0[0] + hv * a.sh0[1] + (vok ? v0 : 0);
  // Every load first (masked rows and columns read row 0 / column 0 and are zeroed after).
  float4 S[8];
  Tin kr[8], qr[8], vr[4];
  G gr[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int c = rg + 16 * i < K ? rg + 16 * i : 0;
    S[i] = *reinterpret_cast<const float4*>(h0 + c * a.sh0[2]);
    kr[i] = k[c], qr[i] = q[c];
    if (diag) gr[i] = gd[c];
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) vr[j] = v[j];
  const G g_s = scalar ? gd[0] : G{},
          g_beta = a.beta ? static_cast<const G*>(a.beta)[b * a.sbeta[0] + hv * a.sbeta[2]] : G{};
  const float dec = scalar ? expf(to_float(g_s)) : 1.f, beta = a.beta ? to_float(g_beta) : 1.f;
  // Sums over the 16 lanes of this column half (each key channel once): the warp kernel's reduction
  // over 16 parts (lane bits 1..4).
  auto half_sum = [](float x) { return reduce_parts<16>(x); };
  float kn[8], qn[8], sk = 0.f, sq = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const bool ok = rg + 16 * i < K;
    kn[i] = ok ? to_float(kr[i]) : 0.f, qn[i] = ok ? to_float(qr[i]) : 0.f;
    if (!ok || !vok) S[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    sk = fmaf(kn[i], kn[i], sk), sq = fmaf(qn[i], qn[i], sq);
  }
  sk = half_sum(sk), sq = half_sum(sq);
  const float rk = a.l2norm ? rsqrtf(sk + 1e-6f) : 1.f, rq = (a.l2norm ? rsqrtf(sq + 1e-6f) : 1.f) * a.scale;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    kn[i] *= rk, qn[i] *= rq;
    if (diag) {
      const float d = expf(to_float(gr[i]));
      S[i].x *= d, S[i].y *= d, S[i].z *= d, S[i].w *= d;
    }
  }
  float vv[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) vv[j] = vok ? to_float(vr[j]) : 0.f;
  float4 delta = make_float4(beta * vv[0], beta * vv[1], beta * vv[2], beta * vv[3]);
  if (a.online) {
    float r[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      r[0] = fmaf(S[i].x, kn[i], r[0]), r[1] = fmaf(S[i].y, kn[i], r[1]);
      r[2] = fmaf(S[i].z, kn[i], r[2]), r[3] = fmaf(S[i].w, kn[i], r[3]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) r[j] = half_sum(r[j]);
    delta = make_float4(beta * (vv[0] - dec * r[0]), beta * (vv[1] - dec * r[1]), beta * (vv[2] - dec * r[2]),
                        beta * (vv[3] - dec * r[3]));
  }
  float out[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float w = kn[i], qq = qn[i];
    S[i].x = fmaf(S[i].x, dec, w * delta.x), S[i].y = fmaf(S[i].y, dec, w * delta.y);
    S[i].z = fmaf(S[i].z, dec, w * delta.z), S[i].w = fmaf(S[i].w, dec, w * delta.w);
    out[0] = fmaf(S[i].x, qq, out[0]), out[1] = fmaf(S[i].y, qq, out[1]);
    out[2] = fmaf(S[i].z, qq, out[2]), out[3] = fmaf(S[i].w, qq, out[3]);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) out[j] = half_sum(out[j]);
  if (rg == 0 && vok) {
    Tin* op = static_cast<Tin*>(a.o) + b * a.so[0] + hv * a.so[2] + v0;
#pragma unroll
    for (int j = 0; j < 4; ++j) op[j] = from_float<Tin>(out[j]);
  }
  float* hT = a.hT + sidx * a.shT[0] + hv * a.shT[1] + v0;
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (vok && rg + 16 * i < K) *reinterpret_cast<float4*>(hT + (rg + 16 * i) * a.shT[2]) = S[i];
}

/// Decode as `plan` (plan_decode) has it, as programmatic dependent launches where Plan::pdl: each call's
/// blocks are resident and waiting when the previous kernel ends instead of being launched after it. With
/// a diagonal preconditioner the blocks of a key head form a cluster (Plan::cluster_a) or read a private
/// copy of the statistics (Plan::private_copy), which a small kernel gathers first.
template <class Tin>
cudaError_t launch_decode(const RecArgs& args, const Plan& plan, cudaStream_t stream) {
  RecArgs a = args;
  a.cluster_a = plan.cluster_a;
  const bool dependent = plan.pdl;
  if (plan.private_copy) {
    const cudaError_t e = launch_gather_precond_state(a.a0, a.sa0, a.slots, a.N, a.H, a.K, a.a_copy, stream, dependent);
    if (e != cudaSuccess) return e;
    a.a0 = a.a_copy;
    a.sa0[0] = int64_t(a.H) * a.K, a.sa0[1] = a.K, a.sa0[2] = 1;
    a.a0_by_sequence = true;
  }
  switch (plan.kernel) {
    case Plan::Kernel::decode_columns: {
      constexpr int bcols = 8 * kDecodeWarps;
      const dim3 grid((a.V + bcols - 1) / bcols, a.HV, a.N), block(32 * kDecodeWarps), cluster(1, 1, 1);
      if (a.gate_dtype == 1)
        return launch_ex(decode_warp_kernel<Tin, __nv_bfloat16>, grid, block, 0, stream, dependent, cluster, a);
      if (a.gate_dtype == 2)
        return launch_ex(decode_warp_kernel<Tin, __half>, grid, block, 0, stream, dependent, cluster, a);
      return launch_ex(decode_warp_kernel<Tin, float>, grid, block, 0, stream, dependent, cluster, a);
    }
    case Plan::Kernel::decode_grouped:
      return launch_rowblock_variant<Tin, 16, 1, true>(a, stream, dependent);
    case Plan::Kernel::decode_rowblock:
      if (plan.tokens == 1)
        return plan.cols == 32 ? launch_rowblock_variant<Tin, 8, 1>(a, stream, dependent)
                               : launch_rowblock_variant<Tin, 16, 1>(a, stream, dependent);
      return plan.cols == 128 ? launch_rowblock_variant<Tin, 32, kDecodeGroup>(a, stream, dependent)
                              : launch_rowblock_variant<Tin, 8, kDecodeGroup>(a, stream, dependent);
    default:
      break;
  }
  return launch_warp<Tin>(a, plan, stream);  // states whose rows cannot move 16 bytes at a time
}

/// The recurrent forward of `plan` (plan_forward): the block-row kernel (16-byte state rows; Plan::cols
/// columns per block) or the warp kernel.
template <class Tin>
cudaError_t launch_forward(const RecArgs& a, const Plan& plan, cudaStream_t stream) {
  if (plan.kernel != Plan::Kernel::rowblock) return launch_warp<Tin>(a, plan, stream);
  return plan.cols == 64 ? launch_rowblock_variant<Tin, 16, 8>(a, stream)
                         : launch_rowblock_variant<Tin, 8, 8>(a, stream);
}

}  // namespace dgps::cuda::kernels
