/// @brief Host side of the exact preconditioners' kernels: the workspace layout.
#include "launch/exact.cuh"

namespace dgps::cuda::kernels {

size_t exact_workspace(ExactArgs& e, bool backward, void* base) {
  const RecArgs& a = e.b.a;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += (bytes + 255) / 256 * 256;
    return base ? static_cast<void*>(static_cast<char*>(base) + at) : nullptr;
  };
  const size_t rows = size_t(e.rows), H = size_t(a.H), HV = size_t(a.HV), KP = size_t(e.KP), ncb = size_t(e.ncb);
  e.keys = static_cast<float*>(take(sizeof(float) * rows * H * 4 * KP));
  if (!backward) return off;
  e.yw = static_cast<double*>(take(sizeof(double) * rows * H * 2 * KP));
  e.scal = static_cast<double*>(take(sizeof(double) * rows * H * 8));
  e.PT = static_cast<double*>(take(sizeof(double) * size_t(a.N) * H * KP * KP));
  const size_t tile = KP * kExactCols;
  e.ck = static_cast<float*>(take(sizeof(float) * size_t(e.slots) * HV * ncb * tile));
  e.held = static_cast<float*>(take(sizeof(float) * size_t(a.N) * HV * ncb * kExactChunk * tile));
  e.part = static_cast<float*>(take(sizeof(float) * rows * HV * ncb * 4 * KP));
  e.pdb = static_cast<float*>(take(sizeof(float) * rows * HV * ncb));
  e.dmq = static_cast<float*>(take(sizeof(float) * rows * H * 3 * KP));
  e.dqk = static_cast<float*>(take(sizeof(float) * rows * H * 2 * KP));
  return off;
}

}  // namespace dgps::cuda::kernels
