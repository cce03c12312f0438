/// @brief Body of the CPU leaf kernels (chunkwise forward SPEC §4, decode SPEC §2), compiled once per ISA.
///
/// Included by kernel_<isa>.cpp with DGPS_ISA_NS set to the ISA's namespace. Everything except the
/// exported `table()` has internal linkage (anonymous namespace) and no standard-library inline code
/// is instantiated here, so the per-ISA copies never collide at link time (no ODR mixing of AVX-512
/// code into the generic path). Vectors are GCC/Clang vector extensions sized for the ISA.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>

#include "isa.hpp"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace dgps::cpu::kernels::DGPS_ISA_NS {
namespace {

// The GEMM register block: kMR rows by kNV vectors of accumulators (AVX-512: 24 of 32 registers,
// AVX2: 12 of 16).
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
constexpr int kMR = 6, kNV = 4;
#elif defined(__AVX2__)
constexpr int kVecBytes = 32;
constexpr int kMR = 6, kNV = 2;
#else
constexpr int kVecBytes = 16;
constexpr int kMR = 6, kNV = 2;
#endif

/// The ISA's vector of T, aligned and unaligned (may_alias) flavours.
template <class T>
struct Vec {
  typedef T type __attribute__((vector_size(kVecBytes)));
  typedef T utype __attribute__((vector_size(kVecBytes), aligned(sizeof(T)), may_alias));
  static constexpr int L = kVecBytes / int(sizeof(T));
};
typedef int32_t VI __attribute__((vector_size(kVecBytes)));
using VF = Vec<float>::type;

template <class T>
inline typename Vec<T>::type vload(const T* p) {
  return *reinterpret_cast<const typename Vec<T>::utype*>(p);
}
template <class T>
inline void vstore(T* p, typename Vec<T>::type x) {
  *reinterpret_cast<typename Vec<T>::utype*>(p) = x;
}
template <class T>
inline typename Vec<T>::type vsplat(T x) {
  return typename Vec<T>::type{} + x;
}

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

// Sequence geometry, computed here rather than through KernelParams' inline members so that no
// header inline function is instantiated with this ISA's flags.
inline int64_t seq_begin(const KernelParams& p, int64_t n) { return p.cu_seqlens ? p.cu_seqlens[n] : 0; }
inline int64_t seq_len(const KernelParams& p, int64_t n) {
  return p.cu_seqlens ? p.cu_seqlens[n + 1] - p.cu_seqlens[n] : p.T;
}
inline int64_t seq_batch(const KernelParams& p, int64_t n) { return p.cu_seqlens ? 0 : n; }
inline int64_t state_index(const KernelParams& p, int64_t n) { return p.slots ? p.slots[n] : n; }
inline int64_t round_up(int64_t a, int64_t m) { return (a + m - 1) / m * m; }

// ---------------------------------------------------------------------------------------------
// Vector exp / log for float (Cephes-style range reduction + minimax polynomials, ~1 ulp).

inline VF exp_v(VF x) {
  const VF xc = x < vsplat(-87.0f) ? vsplat(-87.0f) : (x > vsplat(88.0f) ? vsplat(88.0f) : x);
  const VF magic = vsplat(12582912.0f);  // 1.5 * 2^23: adding it rounds to the nearest integer
  const VF z = xc * 1.44269504088896341f + magic;
  const VF n = z - magic;
  const VI ni = (VI)z - (VI)magic;
  VF r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  VF p = vsplat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  VF y = p * r * r + r + 1.0f;
  y = y * (VF)((ni + 127) << 23);
  return x < vsplat(-87.0f) ? vsplat(0.0f) : y;
}

/// Natural log for x >= FLT_MIN (normal, positive) of N vectors, stage by stage across the N so that
/// their dependency chains interleave (the squash's log is on a latency-bound chain).
/// AVX-512: x = 2^e m with m in [1, 2) (getexp, getmant); the top 4 bits of m's fraction pick c_j =
/// 1 + (j + 1/2) / 16 from 16-entry tables held in a register each (vpermps), and log x = e log 2 +
/// log c_j + log1p(y), y = m / c_j - 1 in [-1/33, 1/33], log1p by its Taylor polynomial to y^5
/// (truncation below 2e-10; the float tables keep the absolute error below about 4e-8, 12
/// instructions a vector). Other ISAs: Cephes' range reduction and minimax polynomial in Estrin's
/// form (dependency depth 4 instead of Horner's 9), about 1 ulp.
template <int N>
inline void log_vn(const VF* x, VF* out) {
#if defined(__AVX512F__)
  // 1 / c_j rounded to float, and log c_j = -log of that float (so that y below is m / c_j - 1 exactly
  // up to one rounding).
  alignas(64) static constexpr float kInvC[16] = {
      0.9696969985961914f, 0.9142857193946838f, 0.8648648858070374f, 0.8205128312110901f,
      0.7804877758026123f, 0.7441860437393188f, 0.7111111283302307f, 0.6808510422706604f,
      0.6530612111091614f, 0.6274510025978088f, 0.6037735939025879f, 0.581818163394928f,
      0.5614035129547119f, 0.5423728823661804f, 0.5245901346206665f, 0.5079365372657776f};
  alignas(64) static constexpr float kLogC[16] = {
      0.03077162802219391f, 0.08961215615272522f, 0.14518198370933533f, 0.19782572984695435f,
      0.24783620238304138f, 0.2954642176628113f,  0.34092655777931213f, 0.3844117224216461f,
      0.42608442902565f,    0.4660896956920624f,  0.5045560002326965f,  0.541597306728363f,
      0.5773153305053711f,  0.6118015646934509f,  0.6451380252838135f,  0.6773987412452698f};
  // (The maskz forms: the unmasked intrinsics of GCC 12 trip -Wmaybe-uninitialized.)
  constexpr __mmask16 all = 0xffff;
  const __m512 inv_c = (__m512)vload(kInvC), log_c = (__m512)vload(kLogC);
  VF y[N], t[N];
  for (int n = 0; n < N; ++n) {
    const __m512 xv = (__m512)x[n];
    const __m512i j = (__m512i)((VI)x[n] >> 19);  // x > 0; vpermps reads the index's low 4 bits
    const VF m = (VF)_mm512_maskz_getmant_ps(all, xv, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
    y[n] = m * (VF)_mm512_maskz_permutexvar_ps(all, j, inv_c) - 1.0f;
    t[n] = (VF)_mm512_maskz_getexp_ps(all, xv) * 0.693147180559945309f +
           (VF)_mm512_maskz_permutexvar_ps(all, j, log_c);
  }
  for (int n = 0; n < N; ++n) {
    VF q = y[n] * 0.2f - 0.25f;
    q = q * y[n] + (1.0f / 3);
    q = q * y[n] - 0.5f;
    q = q * y[n] + 1.0f;
    out[n] = q * y[n] + t[n];
  }
#else
  VF m[N], ef[N], z[N], y[N];
  for (int n = 0; n < N; ++n) {  // x = 2^e m, m in [sqrt(1/2), sqrt(2))
    const VI bits = (VI)x[n];
    VI e = ((bits >> 23) & 0xff) - 126;
    const VF mm = (VF)((bits & 0x007fffff) | 0x3f000000);  // [0.5, 1)
    const VI small = mm < vsplat(0.707106781186547524f);
    e = e + small;  // small is -1 where true
    m[n] = small ? mm + mm - 1.0f : mm - 1.0f;
    ef[n] = __builtin_convertvector(e, VF);
  }
  for (int n = 0; n < N; ++n) z[n] = m[n] * m[n];
  for (int n = 0; n < N; ++n) {
    const VF q01 = m[n] * -2.4999993993e-1f + 3.3333331174e-1f, q23 = m[n] * -1.6668057665e-1f + 2.0000714765e-1f;
    y[n] = q23 * z[n] + q01;
  }
  for (int n = 0; n < N; ++n) {
    const VF q45 = m[n] * -1.2420140846e-1f + 1.4249322787e-1f, q67 = m[n] * -1.1514610310e-1f + 1.1676998740e-1f;
    const VF z2 = z[n] * z[n];
    y[n] = (q67 * z[n] + q45) * z2 + y[n] + (z2 * z2) * 7.0376836292e-2f;
  }
  for (int n = 0; n < N; ++n) {
    VF t = y[n] * m[n] * z[n] + ef[n] * -2.12194440e-4f;
    t = t - 0.5f * z[n];
    out[n] = m[n] + t + ef[n] * 0.693359375f;
  }
#endif
}

/// Natural log for x >= FLT_MIN (normal, positive).
inline VF log_v(VF x) {
  VF y;
  log_vn<1>(&x, &y);
  return y;
}

/// x[i] = exp(x[i]) for i < n (n a multiple of the vector length for float).
template <class T>
void exp_inplace(T* x, int64_t n) {
  if constexpr (sizeof(T) == 4) {
    for (int64_t i = 0; i < n; i += Vec<float>::L) vstore(x + i, exp_v(vload(x + i)));
  } else {
    for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
  }
}

/// The squash of SPEC §2 for one value: M = exp(-log(x) r / (1 + |r|)), r = log(A + eps) - center.
template <class T>
inline T squash1(T A, T center, T log_x, T eps) {
  const T ae = A + eps;
  if (!(ae > T(0))) return std::exp(log_x);
  const T r = std::log(ae) - center;
  return std::exp(-log_x * (r / (T(1) + std::fabs(r))));
}

/// True when every lane of the comparison mask `m` is set.
inline bool all_lanes(VI m) {
#if defined(__AVX512DQ__)
  return _mm512_movepi32_mask((__m512i)m) == 0xffff;
#elif defined(__AVX__)
  return _mm256_movemask_ps((__m256)m) == 0xff;
#else
  bool all = true;
  for (int l = 0; l < Vec<float>::L; ++l) all = all && m[l] != 0;
  return all;
#endif
}

/// 1 / d for normal d below 2^126: the hardware reciprocal estimate and one Newton step (about 1e-7
/// relative).
inline VF recip_v(VF d) {
#if defined(__AVX512F__)
  const VF y = (VF)_mm512_maskz_rcp14_ps(__mmask16(0xffff), (__m512)d);  // (rcp14_ps trips -Wmaybe-uninitialized)
#elif defined(__AVX__)
  const VF y = (VF)_mm256_rcp_ps((__m256)d);
#else
  return 1.0f / d;
#endif
#if defined(__AVX__)
  return y * (2.0f - d * y);
#endif
}

/// exp(u) for |u| <= 0.75 without range reduction, N vectors stage by stage: Taylor to degree 9 in
/// Estrin's form (relative error below 4e-8 there).
template <int N>
inline void exp_small_vn(const VF* u, VF* out) {
  VF u2[N], lo[N];
  for (int n = 0; n < N; ++n) {
    u2[n] = u[n] * u[n];
    lo[n] = (u[n] * (1.0f / 6) + 0.5f) * u2[n] + (u[n] + 1.0f);
  }
  for (int n = 0; n < N; ++n) {
    const VF v = u[n], v2 = u2[n], v4 = v2 * v2;
    const VF p45 = v * (1.0f / 120) + (1.0f / 24), p67 = v * (1.0f / 5040) + (1.0f / 720);
    const VF p89 = v * (1.0f / 362880) + (1.0f / 40320);
    out[n] = lo[n] + (p67 * v2 + p45) * v4 + p89 * (v4 * v4);
  }
}
inline VF exp_small_v(VF u) {
  VF y;
  exp_small_vn<1>(&u, &y);
  return y;
}

/// The squash of SPEC §2 on one vector of statistics A (lanes with A + eps below the normal range, or
/// NaN, one by one through squash1). Its exponent -log(x) r / (1 + |r|) lies within |log x|, so
/// for x in [0.47, 2.1] (the default is 1.5) exp needs no range reduction.
inline VF squash_v(VF A, float center, float log_x, float eps) {
  const VF ae = A + eps;
  if (!all_lanes(ae >= vsplat(1.17549435e-38f))) {
    VF m;
    for (int l = 0; l < Vec<float>::L; ++l) m[l] = squash1(A[l], center, log_x, eps);
    return m;
  }
  const VF r = log_v(ae) - center;
  const VF ar = r < vsplat(0.0f) ? -r : r;
  const VF u = (-log_x * r) * recip_v(1.0f + ar);
  return std::fabs(log_x) <= 0.75f ? exp_small_v(u) : exp_v(u);
}

/// squash_v on N vectors at once, stage by stage across the N (so the instruction stream interleaves N
/// independent chains: the squash's log, reciprocal and exp are long dependent chains that the
/// out-of-order core overlaps poorly when each vector's chain comes whole, about 95 cycles each).
/// With `iden`, also 1 / (1 + |r|) (for the squash's slope). Returns false, writing nothing, unless
/// every lane of A + eps is normal and |log x| <= 0.75 (then squash_v applies vector by vector).
template <int N>
inline bool squash_vn(const VF* A, VF* out, float center, float log_x, float eps, VF* iden = nullptr) {
  VF ae[N];
  VI ok = VI{} - 1;
  for (int n = 0; n < N; ++n) {
    ae[n] = A[n] + eps;
    ok &= ae[n] >= vsplat(1.17549435e-38f);
  }
  if (!all_lanes(ok) || !(std::fabs(log_x) <= 0.75f)) return false;
  VF r[N], d[N], u[N];
  log_vn<N>(ae, r);
  for (int n = 0; n < N; ++n) {  // u = -log(x) r / (1 + |r|), r = log(A + eps) - center
    r[n] = r[n] - center;
    d[n] = 1.0f + (r[n] < vsplat(0.0f) ? -r[n] : r[n]);
  }
  for (int n = 0; n < N; ++n) d[n] = recip_v(d[n]);
  if (iden)
    for (int n = 0; n < N; ++n) iden[n] = d[n];
  for (int n = 0; n < N; ++n) u[n] = (-log_x * r[n]) * d[n];
  exp_small_vn<N>(u, out);
  return true;
}

/// a[i] = squash(a[i]) for i < n (n a multiple of the vector length for float).
template <class T>
void squash_inplace(T* a, int64_t n, T center, T log_x, T eps) {
  if constexpr (sizeof(T) == 4) {
    constexpr int L = Vec<float>::L;
    // One check for the whole row first (the usual case: every A + eps normal), in vector lanes;
    // a NaN fails the comparison and sends the row to the per-vector checks.
    VI ok = VI{} - 1;
    for (int64_t i = 0; i < n; i += L) ok &= vload(a + i) + eps >= vsplat(1.17549435e-38f);
    bool all_normal = true;
    for (int l = 0; l < L; ++l) all_normal = all_normal && ok[l] != 0;
    for (int64_t i = 0; i < n; i += L) {
      const VF ae = vload(a + i) + eps;
      bool normal = all_normal;
      if (!normal) {
        normal = true;
        for (int l = 0; l < L; ++l) normal = normal && ae[l] >= 1.17549435e-38f;
      }
      if (normal) {
        const VF r = log_v(ae) - center;
        const VF ar = r < vsplat(0.0f) ? -r : r;
        vstore(a + i, exp_v(-log_x * (r / (1.0f + ar))));
      } else {
        for (int l = 0; l < L; ++l) a[i + l] = squash1(a[i + l], center, log_x, eps);
      }
    }
  } else {
    for (int64_t i = 0; i < n; ++i) a[i] = squash1(a[i], center, log_x, eps);
  }
}

// ---------------------------------------------------------------------------------------------
// Training cache (KernelParams::saved): written once by the forward, read back by the backward much
// later, so the forward writes it with non-temporal stores (no read for ownership, and the task's
// working set stays in the caches).

/// *p = x, non-temporal where the ISA has it; p aligned to the vector.
template <class T>
inline void stream_store(T* p, typename Vec<T>::type x) {
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4)
    _mm512_stream_ps(reinterpret_cast<float*>(p), (__m512)x);
  else
    _mm512_stream_pd(reinterpret_cast<double*>(p), (__m512d)x);
#elif defined(__AVX__)
  if constexpr (sizeof(T) == 4)
    _mm256_stream_ps(reinterpret_cast<float*>(p), (__m256)x);
  else
    _mm256_stream_pd(reinterpret_cast<double*>(p), (__m256d)x);
#else
  vstore(p, x);
#endif
}

/// Orders the non-temporal stores before the task ends (another thread reads them next).
inline void stream_fence() {
#if defined(__AVX__)
  _mm_sfence();
#endif
}

/// dst[r * ldd + j] = src[r * lds + j] for r < rows, j < n: n a multiple of the vector length, dst and
/// ldd aligned to the vector.
template <class T>
void stream_rows(T* dst, int64_t ldd, const T* src, int64_t lds, int64_t rows, int64_t n) {
  constexpr int L = Vec<T>::L;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; j += L) stream_store(dst + r * ldd + j, vload(src + r * lds + j));
}

/// Memory traffic spread over the arithmetic: prefetches of rows that a later step reads and copies
/// into the training cache (non-temporal) or into outputs, issued a bounded number of bytes at a time
/// by `step()`, which the main products call once per register block. Issued at once, either stalls
/// the core on its line fill buffers (each chunk's inputs and cache blocks are ~100-200 KB). Jobs run
/// in the order they were added; `drain(j)` finishes job j and those before it.
template <class T>
class Trickle {
 public:
  static constexpr int kMaxJobs = 16;
  /// Prefetches `rows` rows of `row_bytes` bytes, `stride` bytes apart, into L2; `write`: for writing
  /// (an output row: the store then finds the line owned instead of waiting for it).
  int prefetch(const void* base, int64_t stride, int64_t rows, int64_t row_bytes, bool write = false) {
    if (rows <= 0 || row_bytes <= 0 || n_ == kMaxJobs) return -1;
    jobs_[n_] = Job{static_cast<const char*>(base), nullptr, stride, 0, rows, row_bytes, 0, 0, false, write};
    pending_ += rows * round_up(row_bytes, 64);
    return n_++;
  }
  /// dst[r * ldd + j] = src[r * lds + j] for r < rows, j < n (a multiple of the vector length; dst
  /// and ldd aligned to the vector), with non-temporal stores.
  int copy(T* dst, int64_t ldd, const T* src, int64_t lds, int64_t rows, int64_t n) {
    if (rows <= 0 || n <= 0) return -1;
    if (n_ == kMaxJobs) {  // full: copy now
      stream_rows(dst, ldd, src, lds, rows, n);
      return -1;
    }
    jobs_[n_] = Job{reinterpret_cast<const char*>(src), dst, lds, ldd, rows, n, 0, 0, true, false};
    pending_ += rows * n * int64_t(sizeof(T));
    return n_++;
  }
  /// Starts a phase of about `steps` calls of step(): the bytes pending plus `extra` bytes of jobs
  /// still to come are spread over them.
  void plan(int64_t steps, int64_t extra = 0) {
    budget_ = imin(int64_t(8192), round_up((pending_ + extra) / (steps > 0 ? steps : 1) + 1, 64));
    steps_ = 0;
  }
  /// Calls of step() since plan().
  int64_t steps() const { return steps_; }
  /// Issues up to the budget's bytes of the pending jobs.
  void step() {
    ++steps_;
    int64_t left = budget_;
    while (left > 0 && head_ < n_) left -= advance(jobs_[head_], left);
  }
  /// Finishes job j (and every job before it); j < 0 does nothing.
  void drain(int j) {
    while (j >= 0 && head_ <= j && head_ < n_) advance(jobs_[head_], int64_t(1) << 60);
  }
  /// Finishes every job and forgets them.
  void drain_all() {
    drain(n_ - 1);
    head_ = n_ = 0;
    pending_ = 0;
  }

 private:
  struct Job {
    const char* src;
    T* dst;
    int64_t lds, ldd, rows, len;  // prefetch: lds in bytes, len = row bytes; copy: elements
    int64_t r, off;
    bool copy, write;
  };
  /// Works on the head job for up to `bytes` bytes; returns the bytes done (moves on when it is done).
  int64_t advance(Job& j, int64_t bytes) {
    int64_t done = 0;
    if (j.copy) {
      constexpr int L = Vec<T>::L;
      const T* src = reinterpret_cast<const T*>(j.src);
      while (done < bytes && j.r < j.rows) {
        stream_store(j.dst + j.r * j.ldd + j.off, vload(src + j.r * j.lds + j.off));
        done += L * int64_t(sizeof(T));
        if ((j.off += L) >= j.len) j.off = 0, ++j.r;
      }
    } else {
      while (done < bytes && j.r < j.rows) {
        if (j.write)
          __builtin_prefetch(j.src + j.r * j.lds + j.off, 1, 2);
        else
          __builtin_prefetch(j.src + j.r * j.lds + j.off, 0, 2);
        done += 64;
        if ((j.off += 64) >= j.len) j.off = 0, ++j.r;
      }
    }
    pending_ -= done;
    if (j.r >= j.rows) ++head_;
    return done > 0 ? done : 1;
  }
  Job jobs_[kMaxJobs];
  int n_ = 0, head_ = 0;
  int64_t pending_ = 0, budget_ = 512, steps_ = 0;
};

// ---------------------------------------------------------------------------------------------
// GEMM: C[m x n] (+)= A[m x kd] B[kd x n], row-major, n a multiple of the vector length.

// AT: A given transposed (k-major, A^T[r][k] at A[k * lda + r]); the same register block, its row
// operands broadcast from consecutive elements. `rs` (with acc): C's rows scaled first, C[r] = rs[r] C[r]
// + (A B)[r] (a state's decay folded into its update, without a pass of its own over C). From k = kt on,
// A is lower-triangular (row r uses k <= kt + r only): the zeros above its diagonal are skipped, not
// multiplied in, so a NaN or Inf in B's later rows never reaches earlier rows of C (0 * NaN is NaN).
template <class T, int MR, int NV, bool AT = false>
inline void gemm_block(int64_t kd, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc, bool acc,
                       const T* rs, int64_t kt) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  V c[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      c[r][v] = acc ? (rs ? rs[r] * vload(C + r * ldc + v * L) : vload(C + r * ldc + v * L)) : V{};
  const int64_t kf = kt < kd ? kt : kd;
  for (int64_t k = 0; k < kf; ++k) {
    V b[NV];
    for (int v = 0; v < NV; ++v) b[v] = vload(B + k * ldb + v * L);
    for (int r = 0; r < MR; ++r) {
      const T a = AT ? A[k * lda + r] : A[r * lda + k];
      for (int v = 0; v < NV; ++v) c[r][v] += a * b[v];
    }
  }
  for (int64_t k = kf; k < kd; ++k) {
    V b[NV];
    for (int v = 0; v < NV; ++v) b[v] = vload(B + k * ldb + v * L);
    for (int r = int(k - kt); r < MR; ++r) {
      const T a = AT ? A[k * lda + r] : A[r * lda + k];
      for (int v = 0; v < NV; ++v) c[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) vstore(C + r * ldc + v * L, c[r][v]);
}

template <class T, int NV, int MR = kMR, bool AT = false>
inline void gemm_rows(int mr, int64_t kd, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
                      bool acc, const T* rs, int64_t kt) {
  if constexpr (MR >= 1) {
    if (mr == MR) return gemm_block<T, MR, NV, AT>(kd, A, lda, B, ldb, C, ldc, acc, rs, kt);
    return gemm_rows<T, NV, MR - 1, AT>(mr, kd, A, lda, B, ldb, C, ldc, acc, rs, kt);
  }
}

/// Triangular structure a product may skip: none; A lower-triangular (A[i][k] = 0 for k > i, so row
/// block i0.. needs k < i0 + rows); or only C's lower triangle wanted (C[i][j] for j <= i).
enum class Tri { none, a_lower, c_lower };

/// gemm_rows for a panel of nv <= NV vectors (nv chosen at run time).
template <class T, bool AT, int NV = kNV>
inline void gemm_panel(int nv, int mr, int64_t kd, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
                       int64_t ldc, bool acc, const T* rs, int64_t kt) {
  if constexpr (NV >= 1) {
    if (nv == NV) return gemm_rows<T, NV, kMR, AT>(mr, kd, A, lda, B, ldb, C, ldc, acc, rs, kt);
    return gemm_panel<T, AT, NV - 1>(nv, mr, kd, A, lda, B, ldb, C, ldc, acc, rs, kt);
  }
}

/// The register-block sweep shared by `gemm` and `gemm_at`: column panels of kNV vectors, row blocks
/// of kMR; `krange(i0, mr)` gives the k range [k0, k1) a row block needs, and `cols(i0, mr, j0, nv)` how
/// many of the panel's nv vectors (from column j0 on) it needs (0: none, the block is skipped); `ktri`
/// (a_lower only): the block's k from which A is lower-triangular (gemm_block's kt). AT: A is
/// stored k-major (A^T[r][k] at A[k * lda + r]). `rs`: C's row scales (see gemm_block), or null.
template <class T, bool AT, class KRange, class Cols>
void gemm_sweep(int64_t m, int64_t n, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc, bool acc,
                const T* rs, Trickle<T>* tr, KRange&& krange, Cols&& cols, bool ktri = false) {
  constexpr int L = Vec<T>::L;
  for (int64_t j0 = 0; j0 < n;) {
    const int nv = int(imin(kNV, (n - j0) / L));
    for (int64_t i0 = 0; i0 < m; i0 += kMR) {
      const int mr = int(imin(kMR, m - i0)), nb = cols(i0, mr, j0, nv);
      if (nb <= 0) continue;
      if (tr) tr->step();
      const auto [k0, k1] = krange(i0, mr);
      const T* a = AT ? A + k0 * lda + i0 : A + i0 * lda + k0;
      gemm_panel<T, AT>(nb, mr, k1 - k0, a, lda, B + k0 * ldb + j0, ldb, C + i0 * ldc + j0, ldc, acc,
                        rs ? rs + i0 : nullptr, ktri ? i0 - k0 : k1 - k0);
    }
    j0 += int64_t(nv) * L;
  }
}

/// `tr`, when given, gets one step() per register block (Trickle); `rs`, with acc, scales C's rows first
/// (C = Diag(rs) C + A B).
template <class T>
void gemm(int64_t m, int64_t n, int64_t kd, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
          bool acc, Tri tri = Tri::none, Trickle<T>* tr = nullptr, const T* rs = nullptr) {
  gemm_sweep<T, false>(
      m, n, A, lda, B, ldb, C, ldc, acc, rs, tr,
      [&](int64_t i0, int mr) { return std::pair<int64_t, int64_t>{0, tri == Tri::a_lower ? imin(kd, i0 + mr) : kd}; },
      [&](int64_t i0, int mr, int64_t j0, int nv) {  // c_lower: the vectors reaching column i0 + mr - 1
        constexpr int L = Vec<T>::L;
        return tri == Tri::c_lower ? int(imin(nv, (i0 + mr - j0 + L - 1) / L)) : nv;
      },
      tri == Tri::a_lower);
}

/// C[m x n] (+)= A^T B with A stored k-major (kd x m, row stride lda): as `gemm` without a transpose
/// of A first (the register block broadcasts A^T's rows from consecutive elements). `upper`: A^T is
/// upper-triangular (A[k][i] = 0 for k < i), so row block i0.. starts at k = i0. `tr`, `rs`: as `gemm`.
template <class T>
void gemm_at(int64_t m, int64_t n, int64_t kd, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
             bool acc, bool upper = false, Trickle<T>* tr = nullptr, const T* rs = nullptr) {
  gemm_sweep<T, true>(
      m, n, A, lda, B, ldb, C, ldc, acc, rs, tr,
      [&](int64_t i0, int) { return std::pair<int64_t, int64_t>{upper ? i0 : 0, kd}; },
      [](int64_t, int, int64_t, int nv) { return nv; });
}

// ---------------------------------------------------------------------------------------------

/// Row stride (elements) for scratch matrices of n-element rows (n a multiple of the vector length):
/// n, plus one cache line when the rows would span an even number of lines. Rows a power-of-two
/// number of lines apart map to a fraction of L1's sets (a 128 x 128 float state's 32-column panel,
/// 256 lines, onto 16 of 64 sets: more lines per set than L1 has ways), so the products streaming a
/// panel of such a matrix would reload it from L2.
template <class T>
inline int64_t padded_ld(int64_t n) {
  const int64_t bytes = n * int64_t(sizeof(T));
  return bytes % 64 == 0 && (bytes / 64) % 2 == 0 ? n + 64 / int64_t(sizeof(T)) : n;
}

/// A zero-initialised, 64-byte aligned scratch block owned by one task.
template <class T>
struct Scratch {
  T* base = nullptr;
  explicit Scratch(int64_t n) {
    const size_t bytes = size_t(round_up(n * int64_t(sizeof(T)), 64));
    base = static_cast<T*>(std::aligned_alloc(64, bytes));
    if (base) std::memset(base, 0, bytes);
  }
  ~Scratch() { std::free(base); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

/// Like Scratch, but with 16 KB of inline (stack) storage used when the block fits: a one-token
/// decode task takes a microsecond or two, and an allocation per task showed in its profile.
template <class T>
struct SmallScratch {
  alignas(64) unsigned char local[16384];
  void* heap = nullptr;
  T* base = nullptr;
  explicit SmallScratch(int64_t n) {
    const size_t bytes = size_t(round_up(n * int64_t(sizeof(T)), 64));
    if (bytes <= sizeof(local)) {
      base = reinterpret_cast<T*>(local);
    } else {
      heap = std::aligned_alloc(64, bytes);
      base = static_cast<T*>(heap);
    }
    if (base) std::memset(static_cast<void*>(base), 0, bytes);
  }
  ~SmallScratch() { std::free(heap); }
  SmallScratch(const SmallScratch&) = delete;
  SmallScratch& operator=(const SmallScratch&) = delete;
};

/// Four-element vectors of T (and the matching integer shuffle masks) for the 4 x 4 transpose.
template <class T>
struct Quad {
  typedef T type __attribute__((vector_size(4 * sizeof(T)), aligned(sizeof(T)), may_alias));
  typedef std::conditional_t<sizeof(T) == 4, int32_t, int64_t> I;
  typedef I mask __attribute__((vector_size(4 * sizeof(T))));
};

/// dst[j * ldd + i] = src[i * lds + j] for i < rows, j < cols: 4 x 4 register blocks (eight shuffles
/// each) inside 16 x 16 tiles, scalar edges.
template <class T>
void transpose_quads(int64_t rows, int64_t cols, const T* src, int64_t lds, T* dst, int64_t ldd) {
  using Q = typename Quad<T>::type;
  using M = typename Quad<T>::mask;
  constexpr int64_t B = 16;
  const int64_t r4 = rows / 4 * 4, c4 = cols / 4 * 4;
  for (int64_t i0 = 0; i0 < r4; i0 += B) {
    const int64_t i1 = imin(r4, i0 + B);
    for (int64_t j0 = 0; j0 < c4; j0 += B) {
      const int64_t j1 = imin(c4, j0 + B);
      for (int64_t i = i0; i < i1; i += 4)
        for (int64_t j = j0; j < j1; j += 4) {
          const Q a = *reinterpret_cast<const Q*>(src + i * lds + j);
          const Q b = *reinterpret_cast<const Q*>(src + (i + 1) * lds + j);
          const Q c = *reinterpret_cast<const Q*>(src + (i + 2) * lds + j);
          const Q d = *reinterpret_cast<const Q*>(src + (i + 3) * lds + j);
          const Q t0 = __builtin_shuffle(a, b, M{0, 4, 1, 5}), t1 = __builtin_shuffle(a, b, M{2, 6, 3, 7});
          const Q t2 = __builtin_shuffle(c, d, M{0, 4, 1, 5}), t3 = __builtin_shuffle(c, d, M{2, 6, 3, 7});
          *reinterpret_cast<Q*>(dst + j * ldd + i) = __builtin_shuffle(t0, t2, M{0, 1, 4, 5});
          *reinterpret_cast<Q*>(dst + (j + 1) * ldd + i) = __builtin_shuffle(t0, t2, M{2, 3, 6, 7});
          *reinterpret_cast<Q*>(dst + (j + 2) * ldd + i) = __builtin_shuffle(t1, t3, M{0, 1, 4, 5});
          *reinterpret_cast<Q*>(dst + (j + 3) * ldd + i) = __builtin_shuffle(t1, t3, M{2, 3, 6, 7});
        }
    }
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = i < r4 ? c4 : 0; j < cols; ++j) dst[j * ldd + i] = src[i * lds + j];
}

#if defined(__AVX512F__)
/// One 16 x 16 float tile, dst[j * ldd + i] = src[i * lds + j]: sixteen rows in registers, four
/// shuffle stages (64 shuffles per 256 elements, where the 4 x 4 blocks take 128 and four times the
/// loads and stores).
inline void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  typedef float VFu __attribute__((vector_size(64), aligned(4), may_alias));
  VF r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = *reinterpret_cast<const VFu*>(src + i * lds);
  const VI lo{0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29}, hi = lo + 2;
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved (unpcklps, unpckhps)
    t[i] = __builtin_shuffle(r[i], r[i + 1], lo);
    t[i + 1] = __builtin_shuffle(r[i], r[i + 1], hi);
  }
  const VI s0{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}, s1 = s0 + 2;
  for (int i = 0; i < 16; i += 4) {  // 4 x 4 blocks transposed inside each 128-bit lane (shufps)
    r[i] = __builtin_shuffle(t[i], t[i + 2], s0);
    r[i + 1] = __builtin_shuffle(t[i], t[i + 2], s1);
    r[i + 2] = __builtin_shuffle(t[i + 1], t[i + 3], s0);
    r[i + 3] = __builtin_shuffle(t[i + 1], t[i + 3], s1);
  }
  const VI q0{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}, q1 = q0 + 4;
  for (int i = 0; i < 4; ++i) {  // then the 128-bit lanes, in two stages (shuff32x4)
    t[i] = __builtin_shuffle(r[i], r[i + 4], q0);
    t[i + 4] = __builtin_shuffle(r[i], r[i + 4], q1);
    t[i + 8] = __builtin_shuffle(r[i + 8], r[i + 12], q0);
    t[i + 12] = __builtin_shuffle(r[i + 8], r[i + 12], q1);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = __builtin_shuffle(t[i], t[i + 8], q0);
    r[i + 8] = __builtin_shuffle(t[i], t[i + 8], q1);
  }
  for (int i = 0; i < 16; ++i) *reinterpret_cast<VFu*>(dst + i * ldd) = r[i];
}
#endif

/// dst[j * ldd + i] = src[i * lds + j] for i < rows, j < cols. AVX-512 float: whole 16 x 16 tiles in
/// registers (transpose16), the edges by transpose_quads.
template <class T>
void transpose(int64_t rows, int64_t cols, const T* src, int64_t lds, T* dst, int64_t ldd) {
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) {
    const int64_t r16 = rows / 16 * 16, c16 = cols / 16 * 16;
    for (int64_t i0 = 0; i0 < r16; i0 += 16)
      for (int64_t j0 = 0; j0 < c16; j0 += 16) transpose16(src + i0 * lds + j0, lds, dst + j0 * ldd + i0, ldd);
    if (c16 < cols) transpose_quads(r16, cols - c16, src + c16, lds, dst + c16 * ldd, ldd);
    if (r16 < rows) transpose_quads(rows - r16, cols, src + r16 * lds, lds, dst + r16, ldd);
    return;
  }
#endif
  transpose_quads(rows, cols, src, lds, dst, ldd);
}

/// Scratch memory of one chunkwise task (forward or backward): 64-byte aligned, left uninitialised
/// (the user writes every element it reads first, or zeroes the block). Up to kKeepBytes it is a
/// block kept by the calling thread across tasks and calls (grown on demand, freed at thread exit): a
/// fresh multi-megabyte block per task paid a page fault per 4 KB on first touch. A larger request (a
/// long sequence) gets a block of its own, freed with the loan, so that no thread keeps more than
/// kKeepBytes alive. One loan at a time per thread (the chunkwise tasks run no nested parallel work).
template <class T>
class ScratchLease {
 public:
  static constexpr size_t kKeepBytes = size_t(64) << 20;
  explicit ScratchLease(int64_t n) {
    const size_t bytes = size_t(round_up(n * int64_t(sizeof(T)), 64));
    if (bytes > kKeepBytes) {
      own_ = allocate(bytes);
      ptr_ = own_;
      return;
    }
    Block& blk = kept();
    if (bytes > blk.bytes) {
      std::free(blk.ptr);
      blk.ptr = nullptr;
      blk.bytes = 0;
      blk.ptr = allocate(bytes);
      blk.bytes = bytes;
    }
    ptr_ = blk.ptr;
  }
  ~ScratchLease() { std::free(own_); }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
  /// The block.
  T* get() const { return static_cast<T*>(ptr_); }

 private:
  struct Block {
    void* ptr = nullptr;
    size_t bytes = 0;
    ~Block() { std::free(ptr); }
  };
  static Block& kept() {
    thread_local Block blk;
    return blk;
  }
  static void* allocate(size_t bytes) {
    void* p = std::aligned_alloc(64, bytes);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void* ptr_ = nullptr;
  void* own_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// bf16 / f16 inputs and outputs (DType::bf16, DType::f16): converted to float at load and rounded
// (to nearest even) at store; states and computation stay float. Own copies of the conversions
// (not dgps/types.hpp's inline functions) so that no ISA's code is shared through the linker.

/// Bit patterns of a bfloat16 / IEEE half input (layout-compatible with dgps::bf16 / dgps::f16).
struct Bf16Bits {
  uint16_t bits;
};
struct F16Bits {
  uint16_t bits;
};
template <class In>
inline constexpr bool kHalf = std::is_same_v<In, Bf16Bits> || std::is_same_v<In, F16Bits>;

typedef uint32_t VU __attribute__((vector_size(kVecBytes)));
typedef uint16_t VH __attribute__((vector_size(kVecBytes / 2)));
typedef uint16_t VHu __attribute__((vector_size(kVecBytes / 2), aligned(2), may_alias));

/// L halves (bit patterns widened to 32 bits) to L floats.
inline VF half_to_float_v(VU h, bool bf) {
  if (bf) return (VF)(h << 16);
  const VU sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  const VU normal = ((e + 112u) << 23) | (m << 13);
  const VU infnan = 0x7f800000u | (m << 13);
  const VU sub = (VU)(__builtin_convertvector((VI)m, VF) * 0x1p-24f);
  const VU r = e == 0u ? sub : (e == 0x1fu ? infnan : normal);
  return (VF)(r | sign);
}

/// L floats to L halves (bit patterns in 32-bit lanes), round to nearest even.
inline VU float_to_half_v(VF x, bool bf) {
  const VU u = (VU)x;
  const VU a = u & 0x7fffffffu;
  if (bf) {
    const VU r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return a > 0x7f800000u ? ((u >> 16) | 0x40u) : r;
  }
  const VU sign = (u >> 16) & 0x8000u;
  const VU rn = a - 0x38000000u;
  const VU normal = (rn + 0xfffu + ((rn >> 13) & 1u)) >> 13;
  // Below 2^-14: adding 0.5 leaves a float whose last mantissa bit is worth 2^-24 (a half's
  // subnormal step), so the FPU's round-to-nearest-even does the rounding.
  const VU sub = (VU)((VF)a + 0.5f) - 0x3f000000u;
  VU r = a < 0x38800000u ? sub : normal;
  r = a >= 0x477ff000u ? VU{} + 0x7c00u : r;
  r = a > 0x7f800000u ? (0x7e00u | ((a >> 13) & 0x3ffu)) : r;
  return r | sign;
}

/// One input element as the compute type T.
template <class T, class In>
inline T to_c(In x) {
  if constexpr (std::is_same_v<In, Bf16Bits>) {
    uint32_t u = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else if constexpr (std::is_same_v<In, F16Bits>) {
    const uint32_t h = x.bits, sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    if (e == 0x1f) {
      u = sign | 0x7f800000u | (m << 13);
    } else if (e == 0) {
      const float sub = float(m) * 0x1p-24f;
      std::memcpy(&u, &sub, 4);
      u |= sign;
    } else {
      u = sign | ((e + 112u) << 23) | (m << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else {
    return T(x);
  }
}

/// dst[i] = src[i] converted to T, i < n.
template <class T, class In>
inline void load_cvt(const In* src, int64_t n, T* dst) {
  if constexpr (std::is_same_v<In, T>) {
    std::memcpy(dst, src, size_t(n) * sizeof(T));
  } else {
    static_assert(std::is_same_v<T, float> && kHalf<In>, "half inputs are computed in float");
    constexpr int L = Vec<float>::L;
    constexpr bool bf = std::is_same_v<In, Bf16Bits>;
    int64_t i = 0;
    for (; i + L <= n; i += L) {
      const VH h = *reinterpret_cast<const VHu*>(src + i);
      vstore(dst + i, half_to_float_v(__builtin_convertvector(h, VU), bf));
    }
    for (; i < n; ++i) dst[i] = to_c<T>(src[i]);
  }
}

/// dst[i] = src[i] rounded to the output type Out, i < n.
template <class Out, class T>
inline void store_cvt(const T* src, int64_t n, Out* dst) {
  if constexpr (std::is_same_v<Out, T>) {
    std::memcpy(dst, src, size_t(n) * sizeof(T));
  } else {
    static_assert(std::is_same_v<T, float> && kHalf<Out>, "half outputs are computed in float");
    constexpr int L = Vec<float>::L;
    constexpr bool bf = std::is_same_v<Out, Bf16Bits>;
    int64_t i = 0;
    for (; i + L <= n; i += L)
      *reinterpret_cast<VHu*>(dst + i) = __builtin_convertvector(float_to_half_v(vload(src + i), bf), VH);
    if (i < n) {
      // Tail: through one padded vector (at most L - 1 elements).
      alignas(64) float in[Vec<float>::L] = {};
      for (int64_t j = i; j < n; ++j) in[j - i] = src[j];
      const VU r = float_to_half_v(vload(in), bf);
      for (int64_t j = i; j < n; ++j) dst[j].bits = uint16_t(r[j - i]);
    }
  }
}

template <class T>
inline const T* cptr(const KView& v) {
  return static_cast<const T*>(v.data);
}
template <class T>
inline T* mptr(const KView& v) {
  return static_cast<T*>(v.data);
}

/// Loads one q/k row, L2-normalised (SPEC §1: x / sqrt(sum x^2 + 1e-6)) when `norm`, times `mul`.
/// The sum of squares is accumulated in vector lanes (a tree order, not the sequential one).
/// A bf16/f16 row is converted to float into `out` first. `rstd_out`, when given, gets the factor
/// 1 / sqrt(sum x^2 + 1e-6) (1 without the norm).
template <class T, class In>
inline void load_row(const In* xin, int64_t K, bool norm, T mul, T* out, T* rstd_out = nullptr) {
  if constexpr (!std::is_same_v<In, T>) {
    load_cvt(xin, K, out);
    return load_row<T, T>(out, K, norm, mul, out, rstd_out);
  }
  const T* x = reinterpret_cast<const T*>(xin);
  constexpr int L = Vec<T>::L;
  T rstd = 1;
  if (norm) {
    typename Vec<T>::type acc0{}, acc1{};
    int64_t i = 0;
    for (; i + 2 * L <= K; i += 2 * L) {
      const auto a = vload(x + i), b = vload(x + i + L);
      acc0 += a * a;
      acc1 += b * b;
    }
    for (; i + L <= K; i += L) {
      const auto a = vload(x + i);
      acc0 += a * a;
    }
    acc0 += acc1;
    T ss = 0;
    for (int l = 0; l < L; ++l) ss += acc0[l];
    for (; i < K; ++i) ss += x[i] * x[i];
    rstd = T(1) / std::sqrt(ss + T(1e-6));
  }
  if (rstd_out) *rstd_out = rstd;
  const T f = rstd * mul;
  for (int64_t i = 0; i < K; ++i) out[i] = x[i] * f;
}

/// sum_i a[i] b[i] for i < n (n a multiple of the vector length), in vector lanes: a scalar loop is
/// one dependent add per element (no reassociation without -ffast-math).
template <class T>
inline T dot_padded(const T* a, const T* b, int64_t n) {
  constexpr int L = Vec<T>::L;
  typename Vec<T>::type acc0{}, acc1{};
  int64_t i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {
    acc0 += vload(a + i) * vload(b + i);
    acc1 += vload(a + i + L) * vload(b + i + L);
  }
  for (; i < n; i += L) acc0 += vload(a + i) * vload(b + i);
  acc0 += acc1;
  T s = 0;
  for (int l = 0; l < L; ++l) s += acc0[l];
  return s;
}

/// Prefetches `bytes` bytes starting at `p` into the cache hierarchy (a hint; never faults).
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}

/// Unit-triangular substitution in place on the m x n rows of R (n a multiple of the vector length,
/// row stride `ldr`) for a strictly lower-triangular A (rows of `lda`): with `transposed` false it
/// solves (I + A) X = R forward, X_i = R_i - sum_{j < i} A[i][j] X_j; with `transposed` true it solves
/// (I + A)^T X = R backward, X_i = R_i - sum_{j > i} A[j][i] X_j. Each row's block of up to 8 vectors
/// stays in registers while the other rows stream past.
template <class T>
void unit_solve(int64_t m, int64_t n, const T* A, int64_t lda, T* R, int64_t ldr, bool transposed) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  constexpr int NB = 8;
  // Coefficient of row j in row i's update: A[i][j] (forward) or A[j][i] (transposed).
  const int64_t si = transposed ? 1 : lda, sj = transposed ? lda : 1;
  for (int64_t e0 = 0; e0 < n; e0 += NB * L) {
    const int nb = int(imin(NB, (n - e0) / L));
    for (int64_t r = 1; r < m; ++r) {
      const int64_t i = transposed ? m - 1 - r : r;
      const int64_t j0 = transposed ? i + 1 : 0, j1 = transposed ? m : i;
      V acc[NB];
      T* ri = R + i * ldr + e0;
      for (int v = 0; v < NB; ++v) acc[v] = v < nb ? vload(ri + v * L) : V{};
      for (int64_t j = j0; j < j1; ++j) {
        const T a = A[i * si + j * sj];
        const T* rj = R + j * ldr + e0;
        if (nb == NB) {
          for (int v = 0; v < NB; ++v) acc[v] -= a * vload(rj + v * L);
        } else {
          for (int v = 0; v < nb; ++v) acc[v] -= a * vload(rj + v * L);
        }
      }
      for (int v = 0; v < nb; ++v) vstore(ri + v * L, acc[v]);
    }
  }
}

/// Lanes 0, 1, ..., L - 1 (column offsets for the triangular masks of the intra-chunk matrices).
template <class T>
inline typename Vec<T>::type iota_v() {
  typename Vec<T>::type x{};
  for (int l = 0; l < Vec<T>::L; ++l) x[l] = T(l);
  return x;
}

/// Scalar decay (or none: gates all 0): row i of the intra-chunk gates into out, out[j] =
/// e^{gamma_i - gamma_j} for j <= i and 0 for i < j < Cp (a difference inside each exponent, SPEC §4).
/// Gam holds at least Cp values (those past the chunk are masked).
template <class T>
void gate_row(const T* Gam, int64_t i, int64_t Cp, T* out) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  const V iota = iota_v<T>();
  for (int64_t j = 0; j < Cp; j += L) {
    const V jv = iota + T(j);
    vstore(out + j, jv <= vsplat(T(i)) ? vsplat(Gam[i]) - vload(Gam + j) : vsplat(T(-1000)));
  }
  exp_inplace(out, Cp);
}

/// Intra-chunk matrices of scalar decay or none (SPEC §4), rows i < c of Cp columns: Aq[i,j] =
/// e^{gamma_i - gamma_j} (Qr_i . KW_j) for j <= i and, online, Bm[i,j] = w_i e^{gamma_i - gamma_j}
/// (Kn_i . KW_j) for j < i, with w = beta (w = 1 when beta is null); zero elsewhere. Kn and Qr have rows
/// of ldk, KWT is KW^T (K x Cp, columns >= c zero); tmp holds Cp values. `Bu`, when given (online),
/// gets Bm with w = 1 (the forward's training cache), Bm itself keeping the same rounding.
template <class T>
void intra_scalar(int64_t c, int64_t Cp, int64_t K, const T* Kn, const T* Qr, int64_t ldk, const T* KWT, const T* Gam,
                  const T* beta, bool online, T* Bm, T* Aq, T* tmp, T* Bu = nullptr) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  if (online) gemm(c, Cp, K, Kn, ldk, KWT, Cp, Bm, Cp, false, Tri::c_lower);
  gemm(c, Cp, K, Qr, ldk, KWT, Cp, Aq, Cp, false, Tri::c_lower);
  const V iota = iota_v<T>();
  for (int64_t i = 0; i < c; ++i) {
    gate_row(Gam, i, Cp, tmp);
    const T w = beta ? beta[i] : T(1);
    // Selects, not products: the entries above the diagonal that c_lower skips are stale.
    for (int64_t j = 0; j < Cp; j += L) {
      const V jv = iota + T(j), f = vload(tmp + j);
      vstore(Aq + i * Cp + j, jv <= vsplat(T(i)) ? f * vload(Aq + i * Cp + j) : V{});
      if (online) {
        const V raw = vload(Bm + i * Cp + j);
        if (Bu) vstore(Bu + i * Cp + j, jv < vsplat(T(i)) ? f * raw : V{});
        vstore(Bm + i * Cp + j, jv < vsplat(T(i)) ? (w * f) * raw : V{});
      }
    }
  }
}

/// Diagonal decay: whether the pairs inside the sub-block of rows [i0, i0 + nb) (Gam rows of Kp) may use
/// the factored gates e^{gamma_i - gamma_i0} e^{gamma_i0 - gamma_j} instead of one exponential per pair:
/// |gamma_i - gamma_i0| <= 40 in every channel, so both factors stay far from float overflow and
/// underflow; strong decays (g = -50) fail it.
template <class T>
bool factorable(const T* Gam, int64_t Kp, int64_t i0, int64_t nb) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  constexpr T kFactorRange = 40;
  const T* g0 = Gam + i0 * Kp;
  V mx{};
  for (int64_t i = i0 + 1; i < i0 + nb; ++i)
    for (int64_t ch = 0; ch < Kp; ch += L) {
      const V d = vload(Gam + i * Kp + ch) - vload(g0 + ch), ad = d < V{} ? -d : d;
      mx = ad > mx ? ad : mx;
    }
  bool ok = true;
  for (int l = 0; l < L; ++l) ok = ok && mx[l] <= kFactorRange;
  return ok;
}

/// Diagonal decay, forward: how many leading rows of the sub-block [i0, i0 + nb) stay within the
/// factorable range of row i0 (`factorable` row by row; a NaN gate ends the run). Decided row by row so
/// that a later row's gates never change how an earlier row is computed (outputs stay causal, bitwise).
template <class T>
int64_t factor_rows(const T* Gam, int64_t Kp, int64_t i0, int64_t nb) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  constexpr T kFactorRange = 40;
  const T* g0 = Gam + i0 * Kp;
  for (int64_t i = i0 + 1; i < i0 + nb; ++i) {
    V mx{};
    for (int64_t ch = 0; ch < Kp; ch += L) {
      const V d = vload(Gam + i * Kp + ch) - vload(g0 + ch), ad = d < V{} ? -d : d;
      mx = ad > mx ? ad : mx;
      mx = ad == ad ? mx : vsplat(T(2) * kFactorRange);  // NaN: out of range
    }
    for (int l = 0; l < L; ++l)
      if (!(mx[l] <= kFactorRange)) return i - i0;
  }
  return nb;
}

/// The per-call constants shared by the kernels. `In` is the storage type of the inputs and of `o`
/// (T, or Bf16Bits / F16Bits with T = float); states are T. The row accessors return `In` pointers
/// (convert with load_cvt / to_c), the scalar accessors convert to T.
template <class T, class In = T>
struct Setup {
  const KernelParams& p;
  int64_t K, V, r, Kp, Vp;
  bool online, diag_pre, atk, atq, gain;
  decay::Kind decay;
  T scale, log_x, eps;
  explicit Setup(const KernelParams& pp)
      : p(pp), K(pp.K), V(pp.V), r(pp.HV / pp.H), Kp(round_up(pp.K, Vec<T>::L)), Vp(round_up(pp.V, Vec<T>::L)),
        online(pp.spec.solve == solve::Kind::online),
        diag_pre(pp.spec.precond == precond::Kind::diagonal_atk || pp.spec.precond == precond::Kind::diagonal_atq),
        atk(pp.spec.precond == precond::Kind::diagonal_atk), atq(pp.spec.precond == precond::Kind::diagonal_atq),
        gain(pp.spec.gain == gain::Kind::scalar), decay(pp.spec.decay), scale(T(pp.scale)), log_x(T(std::log(pp.x))),
        eps(T(pp.eps)) {}

  const In* qrow(int64_t b, int64_t t, int64_t h) const {
    return cptr<In>(p.q) + b * p.q.stride[0] + t * p.q.stride[1] + h * p.q.stride[2];
  }
  const In* krow(int64_t b, int64_t t, int64_t h) const {
    return cptr<In>(p.k) + b * p.k.stride[0] + t * p.k.stride[1] + h * p.k.stride[2];
  }
  const In* vrow(int64_t b, int64_t t, int64_t hv) const {
    return cptr<In>(p.v) + b * p.v.stride[0] + t * p.v.stride[1] + hv * p.v.stride[2];
  }
  In* orow(int64_t b, int64_t t, int64_t hv) const {
    return mptr<In>(p.o) + b * p.o.stride[0] + t * p.o.stride[1] + hv * p.o.stride[2];
  }
  /// The gate of token t: one value (scalar decay) or K values (diagonal decay).
  const In* grow(int64_t b, int64_t t, int64_t hv) const {
    return cptr<In>(p.g) + b * p.g.stride[0] + t * p.g.stride[1] + hv * p.g.stride[2];
  }
  T beta(int64_t b, int64_t t, int64_t hv) const {
    return gain ? to_c<T>(cptr<In>(p.beta)[b * p.beta.stride[0] + t * p.beta.stride[1] + hv * p.beta.stride[2]])
                : T(1);
  }
  T gp(int64_t b, int64_t t, int64_t h) const {
    return to_c<T>(cptr<In>(p.g_p)[b * p.g_p.stride[0] + t * p.g_p.stride[1] + h * p.g_p.stride[2]]);
  }
  T bp(int64_t b, int64_t t, int64_t h) const {
    return to_c<T>(cptr<In>(p.beta_p)[b * p.beta_p.stride[0] + t * p.beta_p.stride[1] + h * p.beta_p.stride[2]]);
  }
  T center(int64_t h) const { return to_c<T>(cptr<In>(p.center)[h * p.center.stride[0]]); }
  T* state(const KView& s, int64_t si, int64_t hv) const {
    return mptr<T>(s) + si * s.stride[0] + hv * s.stride[1];
  }
};

// ---------------------------------------------------------------------------------------------
// Chunkwise forward (SPEC §4), one task per (sequence n, value head hv).

/// Sub-block rows of the diagonal-decay intra-chunk matrices (a multiple of every vector length).
constexpr int64_t kSub = 16;

/// Chunkwise forward of task `task` (SPEC §4): the value heads [hv0, hv0 + nh) of sequence n (groups of
/// `group` heads), columns block vb of vsplit. The group's heads advance chunk by chunk together: the
/// rows of one token's heads are adjacent in the [B,T,H,K] inputs, so a chunk of the group reads
/// whole runs of lines (that the hardware prefetchers fetch ahead) where one head alone reads 512
/// bytes of every 8 KB at H = 16, K = 128 (one head at a time was ~15% slower).
/// Per chunk, rows i < c: R = (I + Akk)^{-1} (Diag(beta) V - Kd S_in) (offline: Diag(beta) V), O = Qd S_in +
/// Aqk R, S_out = Diag(e^{gamma_C}) S_in + KWdT R, with Kd = beta ⊙ e^gamma ⊙ K, Qd = e^gamma ⊙ Qr and
/// KWdT = (KW ⊙ e^{gamma_C - gamma})^T.
template <class T, class In = T>
void chunk_task_t(const KernelParams& p, int64_t task, int64_t vsplit, int64_t group) {
  const Setup<T, In> s(p);
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  // The recurrence never mixes value columns: with fewer (sequence, head) pairs than threads the
  // V columns are split into `vsplit` blocks, each a task of its own ([v0, v1), a multiple of L wide).
  const int64_t ng = (p.HV + group - 1) / group;  // head groups per sequence
  const int64_t pair = task / vsplit, vb = task % vsplit;
  const int64_t n = pair / ng, hv0 = pair % ng * group, nh = imin(group, p.HV - hv0);
  const int64_t vw = round_up((p.V + vsplit - 1) / vsplit, L);
  const int64_t v0 = imin(p.V, vb * vw), v1 = imin(p.V, v0 + vw);
  const int64_t b = seq_batch(p, n), t0 = seq_begin(p, n), len = seq_len(p, n), si = state_index(p, n);
  const int64_t K = s.K, Vd = v1 - v0, Kp = s.Kp, Vp = round_up(Vd, L), ldv = padded_ld<T>(Vp);
  // A sequence shorter than the chunk is one chunk of its own length (smaller scratch).
  const int64_t C = imin(p.chunk < 1 ? 1 : p.chunk, len < 1 ? 1 : len);
  const int64_t Cp = round_up(C, L);
  const bool diag = s.decay == decay::Kind::diagonal;

  // Scratch: the thread's reused block, zeroed once per task (padding lanes and columns stay zero).
  // Stg stages rows: the statistics A_t of the chunk (step 2), then KW ⊙ e^{gamma_C - gamma} (step 3),
  // then the sub-block keys of diagonal decay (step 6). RO is [R; O]: the pseudo-values, then the outputs.
  // Each head of the group has its own state S and statistics A. Training cache (KernelParams::saved),
  // when saving: Bu gets the unscaled key products (Akk / beta), Pk the chunk's packed [Aqk lower |
  // Bu^T upper] block.
  const bool saving = p.saved && p.save;
  const bool save_p = saving && vb == 0;  // the value-column blocks share the intra-chunk matrices
  const int64_t nS = K * ldv, nA = Kp, nKQ = 2 * C * Kp, nStg = C * Kp, nKW = C * Kp, nGam = C * Kp, nBeta = Cp,
                nAQ = 2 * C * Kp, nKWT = Kp * Cp, nRO = 2 * C * ldv, nP = 2 * C * Cp, nTmp = 2 * (Kp + Cp),
                nLQ = diag ? 2 * kSub * Kp : 0, nPb = diag ? 2 * kSub * Cp : 0, nBu = save_p && s.online ? C * Cp : 0,
                nPk = save_p ? C * p.saved_pld : 0;
  const int64_t total =
      nh * (nS + nA) + nKQ + nStg + nKW + nGam + nBeta + nAQ + 2 * nKWT + nRO + nP + nTmp + nLQ + nPb + nBu + nPk;
  const ScratchLease<T> mem(total);
  std::memset(static_cast<void*>(mem.get()), 0, size_t(total) * sizeof(T));
  T* Sg = mem.get();     // the group's states, nS each
  T* Ag = Sg + nh * nS;  // the group's statistics, nA each
  T* KQ = Ag + nh * nA;
  T* Stg = KQ + nKQ;
  T* KWb = Stg + nStg;
  T* Gam = KWb + nKW;
  T* Bt = Gam + nGam;
  T* AQ = Bt + nBeta;
  T* KWT = AQ + nAQ;
  T* KWdT = KWT + nKWT;
  T* RO = KWdT + nKWT;
  T* P = RO + nRO;
  T* tmp = P + nP;
  T* LQ = tmp + nTmp;
  T* Pb = LQ + nLQ;
  T* Bu = nBu ? Pb + nPb : nullptr;
  T* Pk = Pb + nPb + nBu;

  for (int64_t j = 0; j < nh; ++j) {
    const int64_t hv = hv0 + j, h = hv / s.r;
    if (p.h0.data) {
      const T* h0 = cptr<T>(p.h0) + si * p.h0.stride[0] + hv * p.h0.stride[1] + v0;
      for (int64_t c = 0; c < K; ++c)
        std::memcpy(Sg + j * nS + c * ldv, h0 + c * p.h0.stride[2], size_t(Vd) * sizeof(T));
    }
    if (s.diag_pre && p.a0.data) {
      const T* a0 = cptr<T>(p.a0) + si * p.a0.stride[0] + h * p.a0.stride[1];
      for (int64_t c = 0; c < K; ++c) Ag[j * nA + c] = a0[c];
    }
  }
  const V iota = iota_v<T>();

  // Memory traffic is spread over the chunk's products (Trickle; `steps` is the number of step() calls
  // of the previous chunk): prefetches of the next chunk's input rows and of its output rows (for
  // writing), and a saving forward's copies into the training cache. The rows of one head are a
  // whole token's stride apart (8 KB at H = 16, K = 128): prefetched in one burst, or not ahead for
  // writing, loading and storing them took about a third of the chunk's time.
  Trickle<T> tr;
  int64_t steps = 160;
  // Queues the prefetch into L2 of `rows` rows of n elements from x on, `ts` elements apart (whole lines).
  const auto prefetch_rows = [&tr](const auto* x, int64_t ts, int64_t rows, int64_t n, bool write) {
    const int64_t mis = int64_t(reinterpret_cast<uintptr_t>(x) & 63);
    tr.prefetch(reinterpret_cast<const char*>(x) - mis, ts * int64_t(sizeof(*x)), rows, n * int64_t(sizeof(*x)) + mis,
                write);
  };
  // Chunk [cs, cs + c) of head hv0 + j; (jn, csn) is the head and chunk that come next (prefetched).
  const auto chunk = [&](int64_t j, int64_t cs, int64_t jn, int64_t csn) {
    const int64_t hv = hv0 + j, h = hv / s.r, hvn = hv0 + jn, hn = hvn / s.r;
    T* S = Sg + j * nS;
    T* A = Ag + j * nA;
    const T ctr = s.diag_pre ? s.center(h) : T(0);
    // This head's first chunk block of the training cache.
    T* sv = saving ? static_cast<T*>(p.saved) + (p.saved_chunk0[n] * p.HV + hv * ((len + C - 1) / C)) * p.saved_block
                   : nullptr;
    const int64_t c = imin(C, len - cs);
    T* Kn = KQ;           // read keys, rows [0, c)
    T* Qr = KQ + c * Kp;  // read queries, rows [c, 2c)
    T* R = RO;            // rows [0, c)
    T* O = RO + c * ldv;  // rows [c, 2c)
    T* blk = sv ? sv + (cs / C) * p.saved_block : nullptr;  // this chunk's block of the training cache
    const int job_s = blk ? tr.copy(blk + v0, p.saved_ld, S, ldv, K, Vp) : -1;  // S_in, before step 8
    if (const int64_t tn = t0 + csn, cn = imin(C, len - csn); cn > 0) {
      prefetch_rows(s.qrow(b, tn, hn), p.q.stride[1], cn, K, false);
      prefetch_rows(s.krow(b, tn, hn), p.k.stride[1], cn, K, false);
      prefetch_rows(s.vrow(b, tn, hvn) + v0, p.v.stride[1], cn, Vd, false);
      if (diag) prefetch_rows(s.grow(b, tn, hvn), p.g.stride[1], cn, K, false);
      prefetch_rows(s.orow(b, tn, hvn) + v0, p.o.stride[1], cn, Vd, true);
    }
    tr.plan(steps, blk ? int64_t(sizeof(T)) * c * ((s.online ? Vp : 0) + (save_p ? p.saved_pld : 0)) : 0);
    // 1. Load and normalise (SPEC §1); R_i = beta_i V_i; chunk-local cumulative gates gamma (SPEC §4).
    for (int64_t i = 0; i < c; ++i) {
      const int64_t t = t0 + cs + i;
      load_row(s.qrow(b, t, h), K, p.l2norm, s.scale, Qr + i * Kp);
      load_row(s.krow(b, t, h), K, p.l2norm, T(1), Kn + i * Kp);
      const T bi = s.beta(b, t, hv);
      Bt[i] = bi;
      T* ri = R + i * ldv;
      load_cvt(s.vrow(b, t, hv) + v0, Vd, ri);
      for (int64_t e = 0; e < Vp; e += L) vstore(ri + e, bi * vload(ri + e));
      if (s.decay == decay::Kind::scalar) {
        Gam[i] = to_c<T>(s.grow(b, t, hv)[0]) + (i ? Gam[i - 1] : T(0));
      } else if (diag) {
        const In* g = s.grow(b, t, hv);
        T* gi = Gam + i * Kp;
        load_cvt(g, K, gi);
        if (i)
          for (int64_t ch = 0; ch < Kp; ch += L) vstore(gi + ch, vload(gi + ch) + vload(gi - Kp + ch));
      }
    }
    if (!diag && s.decay != decay::Kind::scalar)
      for (int64_t i = 0; i < c; ++i) Gam[i] = 0;
    // 2. Diagonal preconditioner (SPEC §2): A_t = exp(g_p) A + beta_p k⊙k, M = squash(A_t) (padding
    //    lanes of A stay 0).
    const T* KW = Kn;
    if (s.diag_pre) {
      if (blk && vb == 0) std::memcpy(blk + p.saved_aoff, A, size_t(Kp) * sizeof(T));  // A entering the chunk
      // The statistics of every row first (8 vectors of channels at a time: independent FMA chains
      // over the tokens), staged in Stg; then the squash of the whole block, 8 vectors at a time
      // (interleaved chains, across token rows), and the preconditioned key (or query).
      T* dst = s.atk ? KWb : Qr;
      const T* src = s.atk ? Kn : Qr;
      T* At = Stg;
      T* ga = tmp;       // e^{g_p} of each row
      T* gb = tmp + Cp;  // beta_p of each row
      for (int64_t i = 0; i < c; ++i) {
        const int64_t t = t0 + cs + i;
        ga[i] = std::exp(s.gp(b, t, h)), gb[i] = s.bp(b, t, h);
      }
      constexpr int NA = 8;  // vectors of channels advanced together (independent chains)
      for (int64_t ch0 = 0; ch0 < Kp; ch0 += NA * L) {
        const int nv = int(imin(NA, (Kp - ch0) / L));
        V x[NA];
        for (int u = 0; u < nv; ++u) x[u] = vload(A + ch0 + u * L);
        for (int64_t i = 0; i < c; ++i) {
          const T ai = ga[i], bi = gb[i];
          for (int u = 0; u < nv; ++u) {
            const V k = vload(Kn + i * Kp + ch0 + u * L);
            x[u] = ai * x[u] + bi * k * k;
            vstore(At + i * Kp + ch0 + u * L, x[u]);
          }
        }
        for (int u = 0; u < nv; ++u) vstore(A + ch0 + u * L, x[u]);
      }
      const int64_t n = c * Kp;
      int64_t i0 = 0;
      if constexpr (sizeof(T) == 4) {
        constexpr int G = 8;  // vectors squashed together
        for (; i0 + G * L <= n; i0 += G * L) {
          V x[G], m[G];
          for (int u = 0; u < G; ++u) x[u] = vload(At + i0 + u * L);
          if (!squash_vn<G>(x, m, ctr, s.log_x, s.eps)) break;  // the vector-by-vector loop takes over
          for (int u = 0; u < G; ++u) vstore(dst + i0 + u * L, vload(src + i0 + u * L) * m[u]);
        }
        for (; i0 < n; i0 += L)
          vstore(dst + i0, vload(src + i0) * squash_v(vload(At + i0), ctr, s.log_x, s.eps));
      } else {
        for (; i0 < n; ++i0) dst[i0] = src[i0] * squash1(At[i0], ctr, s.log_x, s.eps);
      }
      if (s.atk) KW = KWb;
    }
    // 3. Decayed operands: Kd_i = -beta_i e^{gamma_i} ⊙ Kn_i (negated: step 4 subtracts by adding),
    //    Qd_i = e^{gamma_i} ⊙ Qr_i, KWdT = (KW ⊙ e^{gamma_C - gamma})^T and (scalar decay or none) KWT =
    //    KW^T. Every exponent is <= 0 for g <= 0.
    T* Kd = AQ;
    T* Qd = AQ + c * Kp;
    const T* gl = diag ? Gam + (c - 1) * Kp : nullptr;
    if (diag) {
      for (int64_t i = 0; i < c; ++i) {
        T* e = tmp;       // e^{gamma_i}
        T* ed = tmp + Kp;  // e^{gamma_C - gamma_i}
        for (int64_t ch = 0; ch < Kp; ch += L) {
          vstore(e + ch, vload(Gam + i * Kp + ch));
          vstore(ed + ch, vload(gl + ch) - vload(Gam + i * Kp + ch));
        }
        exp_inplace(tmp, 2 * Kp);
        const V negb = vsplat(-Bt[i]);
        for (int64_t ch = 0; ch < Kp; ch += L) {
          const V ev = vload(e + ch);
          vstore(Kd + i * Kp + ch, negb * ev * vload(Kn + i * Kp + ch));
          vstore(Qd + i * Kp + ch, ev * vload(Qr + i * Kp + ch));
          vstore(Stg + i * Kp + ch, vload(KW + i * Kp + ch) * vload(ed + ch));
        }
      }
      transpose(c, K, Stg, Kp, KWdT, Cp);
    } else {
      T* e = tmp;        // e^{gamma_i}, i < Cp
      T* ed = tmp + Cp;  // e^{gamma_C - gamma_j}, j < Cp
      for (int64_t i = 0; i < Cp; ++i) {
        e[i] = i < c ? Gam[i] : T(0);
        ed[i] = i < c ? Gam[c - 1] - Gam[i] : T(0);
      }
      exp_inplace(tmp, 2 * Cp);
      for (int64_t i = 0; i < c; ++i) {
        const V fk = vsplat(-Bt[i] * e[i]), fq = vsplat(e[i]);
        for (int64_t ch = 0; ch < Kp; ch += L) {
          vstore(Kd + i * Kp + ch, fk * vload(Kn + i * Kp + ch));
          vstore(Qd + i * Kp + ch, fq * vload(Qr + i * Kp + ch));
        }
      }
      transpose(c, K, KW, Kp, KWT, Cp);
      if (c < Cp)
        for (int64_t ch = 0; ch < K; ++ch)
          for (int64_t j = c; j < Cp; ++j) KWT[ch * Cp + j] = 0;
      for (int64_t ch = 0; ch < K; ++ch)
        for (int64_t j = 0; j < Cp; j += L) vstore(KWdT + ch * Cp + j, vload(KWT + ch * Cp + j) * vload(ed + j));
    }
    if (diag && c < Cp)
      for (int64_t ch = 0; ch < K; ++ch)
        for (int64_t j = c; j < Cp; ++j) KWdT[ch * Cp + j] = 0;
    // 4. Inter-chunk products with S_in: R += Kd S_in (online: R = beta ⊙ V - beta e^gamma K S_in, the
    //    right-hand side of (I + Akk) R = X), O = Qd S_in.
    if (s.online) gemm(c, Vp, K, Kd, Kp, S, ldv, R, ldv, true, Tri::none, &tr);
    gemm(c, Vp, K, Qd, Kp, S, ldv, O, ldv, false, Tri::none, &tr);
    // 5. Intra-chunk matrices: Akk[i,j] = beta_i sum_c Kn_ic KW_jc e^{gamma_ic - gamma_jc} (j < i),
    //    Aqk[i,j] = sum_c Qr_ic KW_jc e^{gamma_ic - gamma_jc} (j <= i); differences inside exp (SPEC §4).
    T* Akk = P;
    T* Aqk = P + c * Cp;
    if (diag) {
      // Sub-blocks of kSub rows, each block I (first row i0) against the rows j < jn through one
      // product: e^{gamma_i - gamma_j} = e^{gamma_i - gamma_i0} e^{gamma_i0 - gamma_j}, both factors <= 1
      // for j < i0 and g <= 0 (no overflow for any g <= 0), so it is [Kl; Ql] (KW ⊙ e^{gamma_i0 - gamma})^T.
      // jn = i0 + nf: the earlier rows, and the block's own pairs of its first nf rows (those within
      // `factor_rows`' range); the later rows' own pairs get exact per-pair exponent differences.
      for (int64_t i0 = 0; i0 < c; i0 += kSub) {
        const int64_t nb = imin(kSub, c - i0);
        const int64_t nf = factor_rows(Gam, Kp, i0, nb);
        const bool fact = nf == nb;
        const int64_t jn = i0 + nf;
        const T* g0 = Gam + i0 * Kp;
        if (jn > 0) {
          for (int64_t i = 0; i < nb; ++i) {
            for (int64_t ch = 0; ch < Kp; ch += L) vstore(tmp + ch, vload(Gam + (i0 + i) * Kp + ch) - vload(g0 + ch));
            exp_inplace(tmp, Kp);
            for (int64_t ch = 0; ch < Kp; ch += L) {
              const V f = vload(tmp + ch);
              vstore(LQ + i * Kp + ch, vload(Kn + (i0 + i) * Kp + ch) * f);
              vstore(LQ + (nb + i) * Kp + ch, vload(Qr + (i0 + i) * Kp + ch) * f);
            }
          }
          for (int64_t j = 0; j < jn; ++j) {
            T* w = Stg + j * Kp;
            for (int64_t ch = 0; ch < Kp; ch += L) vstore(w + ch, vload(g0 + ch) - vload(Gam + j * Kp + ch));
            exp_inplace(w, Kp);
            for (int64_t ch = 0; ch < Kp; ch += L) vstore(w + ch, vload(w + ch) * vload(KW + j * Kp + ch));
          }
          transpose(jn, K, Stg, Kp, KWT, Cp);
          gemm(2 * nb, round_up(jn, L), K, LQ, Kp, KWT, Cp, Pb, Cp, false);  // columns >= jn unused
        }
        // Rows of the block: the product's columns j < jn (i0 for the rows past nf; masked to the
        // triangles), zero elsewhere.
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t row = i0 + i;
          const V bi = vsplat(Bt[row]), rv = vsplat(T(row)), jnv = vsplat(T(i < nf ? jn : i0));
          for (int64_t j = 0; j < Cp; j += L) {
            const V jv = iota + T(j);
            const V pk = j < jn ? vload(Pb + i * Cp + j) : V{}, pq = j < jn ? vload(Pb + (nb + i) * Cp + j) : V{};
            vstore(Akk + row * Cp + j, (jv < rv) & (jv < jnv) ? bi * pk : V{});
            vstore(Aqk + row * Cp + j, (jv <= rv) & (jv < jnv) ? pq : V{});
            if (Bu) vstore(Bu + row * Cp + j, (jv < rv) & (jv < jnv) ? pk : V{});
          }
        }
        if (fact) continue;
        for (int64_t i = i0 + nf; i < i0 + nb; ++i) {
          const T* gi = Gam + i * Kp;
          for (int64_t j = i0; j <= i; ++j) {
            const T* gj = Gam + j * Kp;
            for (int64_t ch = 0; ch < Kp; ch += L) vstore(tmp + ch, vload(gi + ch) - vload(gj + ch));
            exp_inplace(tmp, Kp);
            V accq{}, acck{};
            for (int64_t ch = 0; ch < Kp; ch += L) {
              const V w = vload(tmp + ch) * vload(KW + j * Kp + ch);
              accq += vload(Qr + i * Kp + ch) * w;
              acck += vload(Kn + i * Kp + ch) * w;
            }
            T sq = 0, sk = 0;
            for (int l = 0; l < L; ++l) {
              sq += accq[l];
              sk += acck[l];
            }
            Aqk[i * Cp + j] = sq;
            if (j < i) Akk[i * Cp + j] = Bt[i] * sk;
            if (Bu && j < i) Bu[i * Cp + j] = sk;
          }
        }
      }
    } else {
      intra_scalar(c, Cp, K, Kn, Qr, Kp, KWT, Gam, Bt, s.online, Akk, Aqk, tmp, Bu);
    }
    if (blk && save_p) {
      // P[i][j] = Aqk[i][j] (j <= i), Bu[j][i] (j > i): Bu^T, then the lower triangle from Aqk.
      const int64_t pld = p.saved_pld;
      if (Bu) transpose(c, c, Bu, Cp, Pk, pld);
      for (int64_t i = 0; i < c; ++i)
        for (int64_t j = 0; j < Cp; j += L) {
          const V jv = iota + T(j);
          vstore(Pk + i * pld + j, jv <= vsplat(T(i)) ? vload(Aqk + i * Cp + j) : (Bu ? vload(Pk + i * pld + j) : V{}));
        }
      tr.copy(blk + K * p.saved_ld + (s.online ? C * p.saved_ld : 0), pld, Pk, pld, c, pld);
    }
    // 6. Unit lower-triangular solve (I + Akk) R = X by forward substitution (online only).
    if (s.online) unit_solve(c, Vp, Akk, Cp, R, ldv, false);
    if (blk && s.online) tr.copy(blk + K * p.saved_ld + v0, p.saved_ld, R, ldv, c, Vp);  // R
    // 7. O = Qd S_in + (Aqk ⊙ causal) R.
    gemm(c, Vp, c, Aqk, Cp, R, ldv, O, ldv, true, Tri::a_lower, &tr);
    for (int64_t i = 0; i < c; ++i) store_cvt(O + i * ldv, Vd, s.orow(b, t0 + cs + i, hv) + v0);
    // 8. S_out = Diag(e^{gamma_C}) S_in + KWdT R (the decay applied by the product, tmp = e^{gamma_C}).
    tr.drain(job_s);  // S_in is in the cache before S changes
    if (diag) {
      for (int64_t ch = 0; ch < Kp; ch += L) vstore(tmp + ch, vload(gl + ch));
      exp_inplace(tmp, Kp);
    } else if (s.decay == decay::Kind::scalar) {
      const V f = vsplat(std::exp(Gam[c - 1]));
      for (int64_t ch = 0; ch < Kp; ch += L) vstore(tmp + ch, f);
    }
    gemm(K, Vp, c, KWdT, Cp, R, ldv, S, ldv, true, Tri::none, &tr, s.decay == decay::Kind::none ? nullptr : tmp);
    steps = tr.steps();
    tr.drain_all();
  };
  for (int64_t cs = 0; cs < len; cs += C)
    for (int64_t j = 0; j < nh; ++j) {
      if (j + 1 < nh)
        chunk(j, cs, j + 1, cs);
      else
        chunk(j, cs, 0, cs + C);
    }

  if (saving) stream_fence();
  for (int64_t j = 0; j < nh; ++j) {
    const int64_t hv = hv0 + j, h = hv / s.r;
    if (p.hT.data) {
      T* hT = s.state(p.hT, si, hv) + v0;
      for (int64_t c = 0; c < K; ++c)
        std::memcpy(hT + c * p.hT.stride[2], Sg + j * nS + c * ldv, size_t(Vd) * sizeof(T));
    }
    if (s.diag_pre && p.aT.data && hv % s.r == 0 && vb == 0) {
      T* aT = mptr<T>(p.aT) + si * p.aT.stride[0] + h * p.aT.stride[1];
      for (int64_t c = 0; c < K; ++c) aT[c] = Ag[j * nA + c];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Decode sweeps over one K x V state (rows of stride ds), columns in register blocks of NB vectors.

/// Columns [e0, e0 + NB*L) of: y1 = sum_c a1[c] S[c,:] and y2 = sum_c a2[c] S[c,:].
template <class T, int NB>
inline void read2_block(const T* S, int64_t ds, int64_t K, const T* a1, const T* a2, T* y1, T* y2) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  V r1[NB], r2[NB];
  for (int v = 0; v < NB; ++v) r1[v] = r2[v] = V{};
  for (int64_t c = 0; c < K; ++c) {
    const T* row = S + c * ds;
    const T x1 = a1[c], x2 = a2[c];
    for (int v = 0; v < NB; ++v) {
      const V s = vload(row + v * L);
      r1[v] += x1 * s;
      r2[v] += x2 * s;
    }
  }
  for (int v = 0; v < NB; ++v) {
    vstore(y1 + v * L, r1[v]);
    vstore(y2 + v * L, r2[v]);
  }
}

/// What a decode write sweep reads besides writing: nothing, the rows it writes (the next token's
/// reads, of the new values), or the same rows of another column block (the first token's reads of
/// the next block: one sweep streams both blocks, about 13% faster than a write sweep then a read one).
enum class SweepRead { none, written, other };

/// Columns [S, S + NB*L) of the write S[c,:] = f[c] S[c,:] + w[c] u and, unless RD is none, the reads
/// y1 = sum_c a1[c] X[c,:], y2 = sum_c a2[c] X[c,:] of X = the new S (written) or of R (other).
template <class T, int NB, SweepRead RD>
inline void write_block(T* S, const T* R, int64_t ds, int64_t K, const T* f, const T* w, const T* u, const T* a1,
                        const T* a2, T* y1, T* y2) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::L;
  V uu[NB], r1[NB], r2[NB];
  for (int v = 0; v < NB; ++v) {
    uu[v] = vload(u + v * L);
    r1[v] = r2[v] = V{};
  }
  if constexpr (RD == SweepRead::none) {
    // Last rows first: the read sweep just left them in L1, while its first rows may have been
    // evicted (with 512-byte rows a 128-row block puts 16 lines in each cache set it uses, more
    // than L1's ways). Elementwise, so the order changes no result.
    for (int64_t c = K - 1; c >= 0; --c) {
      T* row = S + c * ds;
      const T fc = f[c], wc = w[c];
      for (int v = 0; v < NB; ++v) vstore(row + v * L, fc * vload(row + v * L) + wc * uu[v]);
    }
  } else {
    for (int64_t c = 0; c < K; ++c) {
      T* row = S + c * ds;
      const T fc = f[c], wc = w[c], x1 = a1[c], x2 = a2[c];
      for (int v = 0; v < NB; ++v) {
        const V x = fc * vload(row + v * L) + wc * uu[v];
        vstore(row + v * L, x);
        const V rd = RD == SweepRead::written ? x : vload(R + c * ds + v * L);
        r1[v] += x1 * rd;
        r2[v] += x2 * rd;
      }
    }
    for (int v = 0; v < NB; ++v) {
      vstore(y1 + v * L, r1[v]);
      vstore(y2 + v * L, r2[v]);
    }
  }
}

constexpr int kDecodeNB = 4;
/// Columns per decode block: kDecodeNB vectors.
template <class T>
constexpr int64_t kDecodeCols = kDecodeNB * Vec<T>::L;

/// read2_block over columns [e0, e1): register blocks, then single vectors, then a scalar tail.
template <class T>
void read2(const T* S, int64_t ds, int64_t K, int64_t e0, int64_t e1, const T* a1, const T* a2, T* y1, T* y2) {
  constexpr int L = Vec<T>::L;
  int64_t e = e0;
  for (; e + kDecodeNB * L <= e1; e += kDecodeNB * L) read2_block<T, kDecodeNB>(S + e, ds, K, a1, a2, y1 + e, y2 + e);
  for (; e + L <= e1; e += L) read2_block<T, 1>(S + e, ds, K, a1, a2, y1 + e, y2 + e);
  for (; e < e1; ++e) {
    T s1 = 0, s2 = 0;
    for (int64_t c = 0; c < K; ++c) {
      s1 += a1[c] * S[c * ds + e];
      s2 += a2[c] * S[c * ds + e];
    }
    y1[e] = s1;
    y2[e] = s2;
  }
}

/// write_block over columns [e0, e1) (see there); a1 == nullptr skips the fused reads.
template <class T>
void write2(T* S, int64_t ds, int64_t K, int64_t e0, int64_t e1, const T* f, const T* w, const T* u, const T* a1,
            const T* a2, T* y1, T* y2) {
  constexpr int L = Vec<T>::L;
  int64_t e = e0;
  for (; e + kDecodeNB * L <= e1; e += kDecodeNB * L) {
    if (a1)
      write_block<T, kDecodeNB, SweepRead::written>(S + e, S + e, ds, K, f, w, u + e, a1, a2, y1 + e, y2 + e);
    else
      write_block<T, kDecodeNB, SweepRead::none>(S + e, S + e, ds, K, f, w, u + e, a1, a2, y1 + e, y2 + e);
  }
  for (; e + L <= e1; e += L) {
    if (a1)
      write_block<T, 1, SweepRead::written>(S + e, S + e, ds, K, f, w, u + e, a1, a2, y1 + e, y2 + e);
    else
      write_block<T, 1, SweepRead::none>(S + e, S + e, ds, K, f, w, u + e, a1, a2, y1 + e, y2 + e);
  }
  for (; e < e1; ++e) {
    T s1 = 0, s2 = 0;
    for (int64_t c = 0; c < K; ++c) {
      const T x = f[c] * S[c * ds + e] + w[c] * u[e];
      S[c * ds + e] = x;
      if (a1) {
        s1 += a1[c] * x;
        s2 += a2[c] * x;
      }
    }
    if (a1) {
      y1[e] = s1;
      y2[e] = s2;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Decode (SPEC §2 token by token), one task per (sequence n, key head h) with its HV/H value heads.
// Per token and value head the state is read once (residual S̄^T k and readout S̄^T qr together) and
// written once (decay and rank-1 write together); the read of token t+1 is fused into the write of
// token t, and the last write of a column block reads the next block, so T tokens cost about T sweeps
// over the state (plus one block). o_t = S̄^T qr + b (kw . qr) u.

template <class T, class In = T>
void decode_task_t(const KernelParams& p, int64_t task) {
  const Setup<T, In> s(p);
  const int64_t n = task / p.H, h = task % p.H;
  const int64_t b = seq_batch(p, n), t0 = seq_begin(p, n), len = seq_len(p, n), si = state_index(p, n);
  const int64_t K = s.K, Vd = s.V, Kp = s.Kp, Vp = s.Vp, r = s.r;
  const bool exact = p.spec.precond == precond::Kind::exact_atk || p.spec.precond == precond::Kind::exact_atq;
  const bool key_target = p.spec.precond == precond::Kind::diagonal_atk || p.spec.precond == precond::Kind::exact_atk;
  const bool query_target = p.spec.precond == precond::Kind::diagonal_atq || p.spec.precond == precond::Kind::exact_atq;
  const int64_t Tn = len > 0 ? len : 0;
  const int64_t PS = exact ? K * K : Kp;
  // Per token: qn, kn, qr, kw (K each), then per value head: fac (K), the two read coefficients (K each).
  const int64_t per_tok = 4 * Kp, per_head = 3 * Kp;
  // bf16/f16: the value rows converted to float (Tn * r rows) and one output row staged for rounding.
  constexpr bool half = !std::is_same_v<In, T>;
  const int64_t nvc = half ? Tn * r * Vp + Vp : 0;
  SmallScratch<T> mem(PS + 4 * Kp + Tn * per_tok + Tn * r * per_head + 3 * Vp + Tn * r + Tn + nvc);
  T* Pst = mem.base;
  T* work = Pst + PS;
  T* tokv = work + 4 * Kp;
  T* headv = tokv + Tn * per_tok;
  T* y1 = headv + Tn * r * per_head;
  T* y2 = y1 + Vp;
  T* u = y2 + Vp;
  T* bet = u + Vp;
  T* kqv = bet + Tn * r;  // kw . qr of each token
  T* vcv = kqv + Tn;       // half inputs: v rows as float, then the staged o row
  T* ocv = vcv + Tn * r * Vp;

  // Preconditioner state (diagonal A or inverse Gram P), from a0 or the default (A = 0, P = I / lambda).
  if (s.diag_pre) {
    if (p.a0.data) {
      const T* a0 = cptr<T>(p.a0) + si * p.a0.stride[0] + h * p.a0.stride[1];
      for (int64_t c = 0; c < K; ++c) Pst[c] = a0[c];
    }
  } else if (exact) {
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < K; ++j)
        Pst[i * K + j] = p.a0.data ? cptr<T>(p.a0)[si * p.a0.stride[0] + h * p.a0.stride[1] + i * p.a0.stride[2] + j]
                                   : (i == j ? T(1) / T(p.lambda) : T(0));
  }
  const T ctr = s.diag_pre ? s.center(h) : T(0);

  // Token vectors, shared by the group's value heads (SPEC §2 preconditioner axis).
  for (int64_t t = 0; t < Tn; ++t) {
    const int64_t ti = t0 + t;
    T* qn = tokv + t * per_tok;
    T* kn = qn + Kp;
    T* qr = kn + Kp;
    T* kw = qr + Kp;
    load_row(s.qrow(b, ti, h), K, p.l2norm, s.scale, qn);
    load_row(s.krow(b, ti, h), K, p.l2norm, T(1), kn);
    std::memcpy(qr, qn, size_t(K) * sizeof(T));
    std::memcpy(kw, kn, size_t(K) * sizeof(T));
    if (s.diag_pre) {
      const T a = std::exp(s.gp(b, ti, h)), bb = s.bp(b, ti, h);
      T* m = work;
      for (int64_t c = 0; c < K; ++c) m[c] = Pst[c] = a * Pst[c] + bb * kn[c] * kn[c];
      squash_inplace(m, Kp, ctr, s.log_x, s.eps);
      for (int64_t c = 0; c < K; ++c) {
        if (key_target) kw[c] = kn[c] * m[c];
        if (query_target) qr[c] = qn[c] * m[c];
      }
    } else if (exact) {
      // P_t = (P - f y z^T) / a, y = P k, z = P^T k, f = beta_p / (a + beta_p k^T y) (Sherman-Morrison).
      const T a = std::exp(s.gp(b, ti, h)), bb = s.bp(b, ti, h);
      T* y = work;
      T* z = work + Kp;
      for (int64_t i = 0; i < K; ++i) y[i] = z[i] = 0;
      for (int64_t i = 0; i < K; ++i) {
        T sy = 0;
        const T* pr = Pst + i * K;
        for (int64_t j = 0; j < K; ++j) {
          sy += pr[j] * kn[j];
          z[j] += pr[j] * kn[i];
        }
        y[i] = sy;
      }
      T kty = 0;
      for (int64_t i = 0; i < K; ++i) kty += kn[i] * y[i];
      const T f = bb / (a + bb * kty), ia = T(1) / a;
      for (int64_t i = 0; i < K; ++i) {
        T* pr = Pst + i * K;
        const T fy = f * y[i];
        for (int64_t j = 0; j < K; ++j) pr[j] = (pr[j] - fy * z[j]) * ia;
      }
      const T* src = key_target ? kn : qn;
      T* dst = key_target ? kw : qr;
      for (int64_t i = 0; i < K; ++i) {
        T acc = 0;
        const T* pr = Pst + i * K;
        for (int64_t j = 0; j < K; ++j) acc += pr[j] * src[j];
        dst[i] = acc;
      }
    }
    kqv[t] = dot_padded(kw, qr, Kp);
    for (int64_t j = 0; j < r; ++j) {
      const int64_t hvj = h * r + j;
      T* fac = headv + (t * r + j) * per_head;
      T* ck = fac + Kp;  // fac ⊙ kn: residual read coefficients
      T* cq = ck + Kp;   // fac ⊙ qr: readout coefficients
      if (s.decay == decay::Kind::diagonal) {
        load_cvt(s.grow(b, ti, hvj), K, fac);
        exp_inplace(fac, Kp);  // padding lanes become 1; they only meet zero padding of kn and qr
      } else {
        const T f = s.decay == decay::Kind::scalar ? std::exp(to_c<T>(s.grow(b, ti, hvj)[0])) : T(1);
        for (int64_t c = 0; c < K; ++c) fac[c] = f;
      }
      if constexpr (half) load_cvt(s.vrow(b, ti, hvj), Vd, vcv + (t * r + j) * Vp);
      for (int64_t c = 0; c < K; ++c) {
        ck[c] = fac[c] * kn[c];
        cq[c] = fac[c] * qr[c];
      }
      bet[t * r + j] = s.beta(b, ti, hvj);
    }
  }

  for (int64_t j = 0; j < r; ++j) {
    const int64_t hvj = h * r + j;
    const T* src = s.state(p.h0, si, hvj);
    T* S = s.state(p.hT, si, hvj);
    const int64_t ss = p.h0.stride[2], ds = p.hT.stride[2];
    if (src != S)
      for (int64_t c = 0; c < K; ++c) std::memcpy(S + c * ds, src + c * ss, size_t(Vd) * sizeof(T));
    if (Tn == 0) continue;
    // Value columns are independent (SPEC §2): run all tokens on one block of kDecodeCols columns
    // (32 KB of a 128-row float state) at a time, so the write sweep finds the block in L1. The
    // last token's write sweep of a block also reads the next block for the first token.
    constexpr int64_t BC = kDecodeCols<T>;
    const T* f0 = headv + j * per_head;
    bool read_ahead = false;  // the block's first reads were done by the previous block's last write
    for (int64_t e0 = 0; e0 < Vd; e0 += BC) {
      const int64_t e1 = imin(Vd, e0 + BC);
      if (!read_ahead) read2(S, ds, K, e0, e1, f0 + Kp, f0 + 2 * Kp, y1, y2);
      read_ahead = false;
      for (int64_t t = 0; t < Tn; ++t) {
        const int64_t ti = t0 + t;
        const T* qr = tokv + t * per_tok + 2 * Kp;
        const T* kw = qr + Kp;
        const T* fac = headv + (t * r + j) * per_head;
        const T bt = bet[t * r + j];
        const T* v;
        if constexpr (half)
          v = vcv + (t * r + j) * Vp;
        else
          v = s.vrow(b, ti, hvj);
        for (int64_t e = e0; e < e1; ++e) u[e] = bt * (v[e] - (s.online ? y1[e] : T(0)));
        const T kq = kqv[t];
        if constexpr (half) {
          for (int64_t e = e0; e < e1; ++e) ocv[e] = y2[e] + kq * u[e];
          store_cvt(ocv + e0, e1 - e0, s.orow(b, ti, hvj) + e0);
        } else {
          T* o = s.orow(b, ti, hvj);
          for (int64_t e = e0; e < e1; ++e) o[e] = y2[e] + kq * u[e];
        }
        // Write sweep S_t = Diag(fac) S + kw u^T, fused with the read sweep of token t + 1, or for
        // the last token with the first token's reads of the next (whole) block.
        const T* nf = t + 1 < Tn ? headv + ((t + 1) * r + j) * per_head : nullptr;
        if (!nf && e1 - e0 == BC && e1 + BC <= Vd) {
          write_block<T, kDecodeNB, SweepRead::other>(S + e0, S + e1, ds, K, fac, kw, u + e0, f0 + Kp, f0 + 2 * Kp,
                                                      y1 + e1, y2 + e1);
          read_ahead = true;
        } else {
          write2(S, ds, K, e0, e1, fac, kw, u, nf ? nf + Kp : nullptr, nf ? nf + 2 * Kp : nullptr, y1, y2);
        }
      }
    }
  }
  if ((s.diag_pre || exact) && p.aT.data) {
    if (s.diag_pre) {
      T* aT = mptr<T>(p.aT) + si * p.aT.stride[0] + h * p.aT.stride[1];
      for (int64_t c = 0; c < K; ++c) aT[c] = Pst[c];
    } else {
      for (int64_t i = 0; i < K; ++i)
        for (int64_t jj = 0; jj < K; ++jj)
          mptr<T>(p.aT)[si * p.aT.stride[0] + h * p.aT.stride[1] + i * p.aT.stride[2] + jj] = Pst[i * K + jj];
    }
  }
}

void chunk_task(const KernelParams& p, int64_t task, int64_t vsplit, int64_t group) {
  switch (p.dtype) {
    case DType::f64: return chunk_task_t<double>(p, task, vsplit, group);
    case DType::bf16: return chunk_task_t<float, Bf16Bits>(p, task, vsplit, group);
    case DType::f16: return chunk_task_t<float, F16Bits>(p, task, vsplit, group);
    default: return chunk_task_t<float>(p, task, vsplit, group);
  }
}

void decode_task(const KernelParams& p, int64_t task) {
  switch (p.dtype) {
    case DType::f64: return decode_task_t<double>(p, task);
    case DType::bf16: return decode_task_t<float, Bf16Bits>(p, task);
    case DType::f16: return decode_task_t<float, F16Bits>(p, task);
    default: return decode_task_t<float>(p, task);
  }
}

#define DGPS_STR2(x) #x
#define DGPS_STR(x) DGPS_STR2(x)

}  // namespace
}  // namespace dgps::cpu::kernels::DGPS_ISA_NS

// The chunkwise backward (SPEC §4, App. D) reuses the primitives above (same anonymous namespace).
#include "backward_impl.hpp"

namespace dgps::cpu::kernels::DGPS_ISA_NS {

IsaKernels table() { return {DGPS_STR(DGPS_ISA_NS), &chunk_task, &decode_task, &backward_task}; }

}  // namespace dgps::cpu::kernels::DGPS_ISA_NS
