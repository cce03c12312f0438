/// @brief Host side of the backward: the workspace layout.
#include "launch/backward.cuh"

namespace dgps::cuda::kernels {

size_t bwd_workspace(BwdArgs& b, void* base) {
  const RecArgs& a = b.a;
  size_t off = 0;
  auto take = [&](size_t floats) {
    const size_t at = off;
    off += (sizeof(float) * floats + 255) / 256 * 256;
    return base ? reinterpret_cast<float*>(static_cast<char*>(base) + at) : nullptr;
  };
  const bool diag = a.precond != kPrecondIdentity;
  const size_t rows = size_t(b.rows), key = rows * size_t(a.H) * size_t(b.Kp);
  const size_t val = rows * size_t(a.HV) * size_t(a.V), vkey = rows * size_t(a.HV) * size_t(b.Kp);
  const size_t ckpt = size_t(b.slots) * size_t(a.HV) * size_t(b.Kp) * size_t(a.V);
  const bool rec = b.chunk == nullptr;    // the chunkwise backward keeps its own 16-bit tiles instead
  const bool keys = !fused_key_grads(b);  // the key-side gradient arrays dQ, dKn, dKW are needed
  // The per-token float32 passes (recurrent backward only; the chunkwise one recomputes them per chunk).
  b.qn = rec ? take(key) : nullptr;
  b.kn = rec ? take(key) : nullptr;
  b.rq = take(rows * size_t(a.H));
  b.rk = take(rows * size_t(a.H));
  b.A = diag && rec ? take(key) : nullptr;
  b.M = diag && rec ? take(key) : nullptr;
  b.R = rec ? take(val) : nullptr;
  b.dR = rec ? take(val) : nullptr;
  b.S = rec ? take(ckpt) : nullptr;
  b.G = rec ? take(ckpt) : nullptr;
  b.dQ = keys ? take(vkey) : nullptr;
  b.dKn = keys ? take(vkey) : nullptr;
  b.dKW = keys ? take(vkey) : nullptr;
  b.dA = diag && rec ? take(key) : nullptr;
  // Per-token dcenter terms (recurrent), or per-chunk ones (chunkwise: chunk_bound <= slots).
  b.dcen = diag ? take((rec ? rows : size_t(b.slots)) * size_t(a.H)) : nullptr;
  const size_t per_chunk = size_t(b.slots) * size_t(a.H) * size_t(b.Kp);
  b.sums = diag ? reinterpret_cast<float2*>(take(2 * per_chunk)) : nullptr;
  b.carry = diag ? take(per_chunk) : nullptr;
  return off;
}

}  // namespace dgps::cuda::kernels
