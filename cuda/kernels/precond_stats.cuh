/// @brief The chunkwise preconditioner statistics (SPEC §2, §4): fast squash, chunk list, look-back, sums and scan.
#pragma once

#include <cstdint>
#include <type_traits>

#include "launch/chunk.cuh"
#include "ptx/ptx.cuh"
#include "kernels/recurrent_warp.cuh"
#include "kernels/tiles.cuh"

// Internal linkage: each input type's translation unit has its own copy of the non-template kernels.
namespace dgps::cuda::kernels::chunk {
namespace {

/// The squash of SPEC §2 with the approximate instructions and no branch or select (the chunkwise
/// kernels' results carry 16-bit rounding); log2_x = log2(x). log2(M) = -log2(x) r / (1 + |r|) is formed
/// as -sign(r) v with v = log2(x) (1 - 1 / (1 + |r|)) (one multiply-add, then r's sign by one logic
/// operation), which is log2(x) exactly at r = -inf: where A + eps is not positive (or below the smallest
/// normal float, flushed by lg2), lg2 gives -inf and M = x, the limit SPEC §2 asks for.
__device__ __forceinline__ float squash_fast(float A, float center, float log2_x, float eps) {
  constexpr float kLn2 = 0.69314718056f;
  const float r = fmaf(lg2_ftz(fmaxf(A + eps, 0.f)), kLn2, -center);
  const float v = fmaf(-log2_x, rcp_ftz(1.f + fabsf(r)), log2_x);
  return ex2_ftz(__int_as_float(__float_as_int(v) ^ (~__float_as_int(r) & int(0x80000000u))));
}

/// One row's step of a channel's diagonal statistics (SPEC §2), A <- e^g_p A + beta_p kn^2, with the
/// row's e^g_p and beta_p and the channel's normalised key kn: the intra-chunk kernel and the warpgroup
/// state pass (ChunkArgs::kw_state) both form the write keys through it, so that theirs agree bit for bit.
__device__ __forceinline__ float stat_step(float A, float egp, float bp, float kn) {
  return fmaf(egp, A, bp * kn * kn);
}

/// Sequence n's diagonal statistics on entry for key head h, channel c: a0's, or 0 without a0 or past K.
__device__ __forceinline__ float stats_entry(const RecArgs& a, int64_t n, int h, int c) {
  return a.a0 && c < a.K ? a.a0[n * a.sa0[0] + h * a.sa0[1] + c] : 0.f;
}
/// Writes sequence n's final diagonal statistics A for key head h, channel c to aT (where given, c < K).
__device__ __forceinline__ void stats_final(const RecArgs& a, int64_t n, int h, int c, float A) {
  if (a.aT && c < a.K) a.aT[n * a.saT[0] + h * a.saT[1] + c] = A;
}

/// The chunk list of a packed batch: first[n] (prefix of ceil(len_n / C)) and map[gc] = (n, c).
__global__ void chunk_map_kernel(const ChunkArgs ca) {
  const int N = ca.a.N;
  if (threadIdx.x == 0) {
    int64_t s = 0;
    for (int n = 0; n < N; ++n) {
      ca.first[n] = s;
      s += (ca.a.cu_seqlens[n + 1] - ca.a.cu_seqlens[n] + C - 1) / C;
    }
    ca.first[N] = s;
  }
  __syncthreads();
  for (int n = threadIdx.x; n < N; n += blockDim.x)
    for (int64_t c = 0, e = ca.first[n + 1] - ca.first[n]; c < e; ++c)
      ca.map[ca.first[n] + c] = make_int2(n, static_cast<int>(c));
  for (int64_t gc = ca.first[N] + threadIdx.x; gc < ca.chunk_bound; gc += blockDim.x) ca.map[gc] = make_int2(-1, 0);
  // The look-back (ChunkArgs::lookback) writes aT in a sequence's last chunk: an empty sequence's here.
  const RecArgs& a = ca.a;
  if (!ca.lookback || !a.aT) return;
  for (int64_t e = threadIdx.x; e < int64_t(N) * a.H * a.K; e += blockDim.x) {
    const int n = static_cast<int>(e / (int64_t(a.H) * a.K)), h = static_cast<int>(e / a.K % a.H),
              c = static_cast<int>(e % a.K);
    if (ca.first[n + 1] == ca.first[n]) stats_final(a, n, h, c, stats_entry(a, n, h, c));
  }
}

/// Chunks whose own sums a block folds in its look-back (ChunkArgs::lookback): chunk c starts from the
/// statistics leaving chunk c - kLookback - 1 (or from a0), so that a sequence's chain of waits has a
/// link per kLookback + 1 chunks. (4: half the word loads and folds per thread of 8; 2 makes the chain of
/// waits too long on long sequences.)
constexpr int kLookback = 4;

/// Block blockIdx.x of the look-back's one-dimensional grid (ChunkArgs::lookback): its global chunk and
/// value head, a chunk's predecessors at smaller indices (value heads fastest, then sequences, then the
/// chunk index with equal-length sequences; value heads, then the global chunk with packed ones).
__device__ __forceinline__ void lookback_item(const ChunkArgs& ca, int64_t* gc, int* hv) {
  const int64_t x = blockIdx.x, r = x / ca.a.HV;
  *hv = static_cast<int>(x % ca.a.HV);
  *gc = ca.a.cu_seqlens ? r : (r % ca.a.N) * ca.chunks_per_seq + r / ca.a.N;
}

/// One 64-bit word of the look-back (ChunkArgs::lb), written and read whole by single accesses (relaxed,
/// GPU scope: from L2, never a stale L1 line): x in the lower half, y (or 0) in the upper half with its
/// sign bit set, so that a word is either zero (not yet written in this call) or complete.
__device__ __forceinline__ void st_word(uint64_t* p, float x, float y = 0.f) {
  const uint64_t w = (uint64_t(__float_as_uint(y) | 0x80000000u) << 32) | __float_as_uint(x);
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}
__device__ __forceinline__ uint64_t ld_word(const uint64_t* p) {
  uint64_t w;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
  return w;
}
__device__ __forceinline__ bool word_written(uint64_t w) { return (w >> 63) != 0; }
__device__ __forceinline__ float word_x(uint64_t w) { return __uint_as_float(static_cast<uint32_t>(w)); }
__device__ __forceinline__ float word_y(uint64_t w) {
  return __uint_as_float(static_cast<uint32_t>(w >> 32) & 0x7fffffffu);
}

/// One warp (lane: its lane) forms the weights of a chunk's statistics from zero (ChunkArgs::lookback):
/// S[c] = sum_j w_j kn_j[c]^2 with w_j = beta_p,j prod_{l > j} e^g_p,l, from the rows' e^g_p and beta_p
/// (s_gp, s_bp; rows past the chunk's end: 1 and 0) into s_w[0 .. C - 1], and the chunk's product of
/// e^g_p into s_w[C] (suffix products over the lanes, two rows per lane).
__device__ __forceinline__ void lookback_weights(const float* s_gp, const float* s_bp, float* s_w, int lane) {
  static_assert(C == 64, "two rows per lane");
  const float a0 = s_gp[2 * lane], a1 = s_gp[2 * lane + 1];
  float x = a0 * a1;  // then the product over rows 2 lane .. C - 1
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const float up = __shfl_down_sync(0xffffffffu, x, d);
    if (lane + d < 32) x *= up;
  }
  float next = __shfl_down_sync(0xffffffffu, x, 1);  // the product over rows 2 lane + 2 ..
  if (lane == 31) next = 1.f;
  s_w[2 * lane] = a1 * next * s_bp[2 * lane];
  s_w[2 * lane + 1] = next * s_bp[2 * lane + 1];
  if (lane == 0) s_w[C] = x;
}

/// The diagonal statistics entering chunk gc (value head hv, key head h, position p) for channel
/// threadIdx.x, by the look-back of ChunkArgs::lookback, from the chunk's normalised k rows (sK, row stride
/// LDK) and the weights of lookback_weights (s_w). Publishes the chunk's own product and statistics from
/// zero, reads those of the kLookback chunks before it and the statistics leaving the one before them
/// (again until all are written), folds them in chunk order, publishes the statistics leaving the chunk,
/// and writes aT (the sequence's last chunk) and, with kw_state, Ain. Every thread publishes and reads its
/// channel's words by itself (no barrier, no fence).
template <class Op>
__device__ float lookback_ain(const ChunkArgs& ca, int64_t gc, int hv, int h, const ChunkPos& p, const Op* sK,
                              const float* s_w) {
  const RecArgs& a = ca.a;
  const int c = threadIdx.x;
  static_assert(kThreads == KP, "a thread per channel");
  // Chunks s .. ci - 1 of the sequence (global g0 ..) are folded onto a0 (s = 0) or onto the statistics
  // leaving chunk s - 1. Their words are read first, so that the loads' latency passes under the chunk's
  // own sums; the words past m (and the entry word with s = 0) are read from valid places and ignored.
  const int64_t e = gc * a.HV + hv, tiles = ca.chunk_bound * a.HV, stride = int64_t(a.HV) * KP;
  uint64_t *lbS = ca.lb, *lbI = ca.lb + tiles * KP;
  const int64_t ci = p.c, s = ci > kLookback ? ci - kLookback : 0, g0 = gc - ci + s;
  const int m = static_cast<int>(ci - s);
  const uint64_t* pS = lbS + (g0 * a.HV + hv) * KP + c;
  const uint64_t* pI = s > 0 ? lbI + ((g0 - 1) * a.HV + hv) * KP + c : pS;
  uint64_t w[kLookback], wi;
  auto load_words = [&] {  // (word u >= m: word m - 1's place again, a pointer step and a select per word)
    wi = ld_word(pI);
    const uint64_t* q = pS;
#pragma unroll
    for (int u = 0; u < kLookback; ++u) {
      if (u > 0) q = u < m ? q + stride : q;
      w[u] = ld_word(q);
    }
  };
  auto all_written = [&] {
    bool ok = s == 0 || word_written(wi);
#pragma unroll
    for (int u = 0; u < kLookback; ++u) ok &= u >= m || word_written(w[u]);
    return ok;
  };
  load_words();
  // The chunk's own statistics from zero: 64 independent products.
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
  for (int r = 0; r < C; r += 4) {
    const float4 wv = *reinterpret_cast<const float4*>(s_w + r);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float x = to_float(sK[(r + u) * LDK + c]);
      acc[u] = fmaf(f4_at(wv, u) * x, x, acc[u]);
    }
  }
  const float S = (acc[0] + acc[1]) + (acc[2] + acc[3]), P = s_w[C];
  st_word(lbS + e * KP + c, S, P);
  while (!all_written()) load_words();
  float X = s > 0 ? word_x(wi) : stats_entry(a, p.n, h, c);
#pragma unroll
  for (int u = 0; u < kLookback; ++u) X = u < m ? fmaf(word_y(w[u]), X, word_x(w[u])) : X;
  const float A_out = fmaf(P, X, S);
  st_word(lbI + e * KP + c, A_out);
  if (hv == h * a.group) {
    if (ca.kw_state) ca.Ain[(gc * a.H + h) * KP + c] = X;  // (only the warpgroup pass's write keys read it)
    if (a.aT) {
      int64_t first, count, len;
      seq_chunks(ca, p.n, &first, &count, &len);
      if (ci == count - 1) stats_final(a, p.n, h, c, A_out);
    }
  }
  return X;
}

/// Inclusive prefix sums over a chunk's C = 64 values held two per lane (values 2 lane and 2 lane + 1
/// in g0, g1) by one warp: on return g0 and g1 are the sums through those positions.
__device__ __forceinline__ void warp_scan_pairs(float& g0, float& g1, int lane) {
  static_assert(C == 64, "two values per lane");
  g1 += g0;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const float up = __shfl_up_sync(0xffffffffu, g1, d);
    if (lane >= d) g0 += up, g1 += up;
  }
}

/// Per (chunk, key head) work item, thread c = key channel: the chunk's effect on the diagonal
/// statistics, A_out = prod(a) A_in + sum_j prod_{l > j}(a_l) beta_p,j k_j[c]^2 (SPEC §4), as (prod, sum).
/// The weights prod_{l > j}(a_l) beta_p,j / |k_j|^2 do not depend on the channel: warp 0 forms them once
/// from the cumulative log decay (exponent differences, each at most 1), so each channel's sum is 64
/// independent products (a first-order recurrence per channel needs three times the instructions).
/// Persistent: block b takes items b, b + gridDim.x, ... (as many blocks as fit: precond_sums_blocks) and copies
/// the next item's k rows (cp.async, 16-bit rows of 128: the operand type itself) into its second
/// buffer while it sums the current one, so that the loads never wait for the sums (with one item per
/// block, loads then sums in step over the whole grid, the memory idles). Other inputs stage the next
/// item's rows synchronously. On Hopper the statistics' scan is its programmatic dependent.
template <class Tin, class Op>
__global__ void __launch_bounds__(kThreads) precond_sums_kernel(const ChunkArgs ca) {
  const RecArgs& a = ca.a;
  __shared__ __align__(16) Op sK[2][C * LDK];
  __shared__ __align__(16) float s_w[C];
  __shared__ float s_g[2][C], s_bp[2][C], s_rn[C], s_tot;
  grid_dependents_launch();  // the scan may be scheduled (it waits for this grid's sums)
  constexpr bool kAsync = sizeof(Tin) == 2 && std::is_same_v<Tin, Op>;
  const bool async = kAsync && ca.vec_qk && a.K == KP;
  const int64_t items = ca.chunk_bound * a.H;
  const int tid = threadIdx.x, lane = tid & 31;
  struct Item {
    int64_t gc = 0;  ///< global chunk
    int h = 0;       ///< key head
    ChunkPos p;      ///< the chunk's position (p.n < 0: none, past a packed batch's end)
  };
  // Item w (its chunk, head and position); starts its rows' copies into buffer b (rows past L zero) and
  // loads its gates (thread r < L: row r; rows past L: g_p = 0, beta_p = 0) into registers.
  auto fetch = [&](int64_t w, int b, float& gpv, float& bpv) {
    Item it;
    it.gc = w % ca.chunk_bound;
    it.h = static_cast<int>(w / ca.chunk_bound);
    it.p = chunk_pos(ca, it.gc);
    const ChunkPos& p = it.p;
    const int h = it.h;
    gpv = 0.f, bpv = 0.f;
    if (p.n < 0) return it;
    if (tid < p.L) {
      const int64_t t = p.t0 + tid;
      gpv = load_gate(a.g_p, p.b * a.sgp[0] + t * a.sgp[1] + h * a.sgp[2], a.gate_dtype);
      bpv = load_gate(a.beta_p, p.b * a.sbp[0] + t * a.sbp[1] + h * a.sbp[2], a.gate_dtype);
    }
    const Tin* k = static_cast<const Tin*>(a.k) + p.b * a.sk[0] + p.t0 * a.sk[1] + h * a.sk[2];
    if constexpr (kAsync) {
      if (async) {
        copy_rows_zfill_async<kThreads>(sK[b], LDK, k, a.sk[1], p.L);
        return it;
      }
    }
    stage_rows<Tin, Op, KP>(sK[b], LDK, k, a.sk[1], p.L, a.K, ca.vec_qk);
    return it;
  };
  int64_t w = blockIdx.x;
  float gpv = 0.f, bpv = 0.f;
  Item next;
  if (w < items) next = fetch(w, 0, gpv, bpv);
  cp_commit();
  for (int b = 0; w < items; w += gridDim.x, b ^= 1) {
    if (tid < C) s_g[b][tid] = gpv, s_bp[b][tid] = bpv;
    const Item cur = next;
    if (w + gridDim.x < items) next = fetch(w + gridDim.x, b ^ 1, gpv, bpv);
    cp_commit();
    cp_wait<1>();  // this item's rows have landed (the next item's stay in flight)
    __syncthreads();
    if (cur.p.n >= 0) {  // (uniform over the block)
      normalise_rows<Op, false>(sK[b], a.l2norm, 1.f, s_rn, 1, C);  // the rows' inverse norms only
      __syncthreads();
      if (tid < 32) {  // G_j = sum_{l <= j} g_p,l (two rows per lane), then w_j = e^(G_C - G_j) beta_p,j / |k_j|^2
        float g0 = s_g[b][2 * lane], g1 = s_g[b][2 * lane + 1];
        warp_scan_pairs(g0, g1, lane);
        const float tot = __shfl_sync(0xffffffffu, g1, 31);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int j = 2 * lane + u;
          s_w[j] = expf(tot - (u ? g1 : g0)) * s_bp[b][j] * s_rn[j] * s_rn[j];
        }
        if (lane == 0) s_tot = tot;
      }
      __syncthreads();
      const Op* kb = sK[b];
      const int c = tid;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int r = 0; r < C; r += 4) {
        const float4 wv = *reinterpret_cast<const float4*>(s_w + r);
        const float w4[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float x = to_float(kb[(r + u) * LDK + c]);
          acc[u] = fmaf(w4[u] * x, x, acc[u]);
        }
      }
      ca.sums[(cur.gc * a.H + cur.h) * KP + c] = make_float2(expf(s_tot), (acc[0] + acc[1]) + (acc[2] + acc[3]));
    }
    __syncthreads();  // buffer b, s_w and s_tot are free for the item after next
  }
}

/// Per (sequence, key head), thread c: the statistics entering each chunk (from a0 or 0), and aT.
__global__ void __launch_bounds__(kThreads) precond_scan_kernel(const ChunkArgs ca) {
  // The sums first (on Hopper this is their programmatic dependent), then the intra-chunk kernel may be
  // scheduled (it waits for Ain).
  grid_dependency_sync();
  const RecArgs& a = ca.a;
  const int n = blockIdx.x, h = blockIdx.y, c = threadIdx.x;
  int64_t first, count, len;
  seq_chunks(ca, n, &first, &count, &len);
  const int64_t e0 = (first * a.H + h) * KP + c;
  stats_final(a, n, h, c, scan_chunk_sums<false>(ca.sums + e0, ca.Ain + e0, int64_t(a.H) * KP, count,
                                                 stats_entry(a, n, h, c)));
}

}  // namespace
}  // namespace dgps::cuda::kernels::chunk
