// cuflash: combine the split partials of decode_split (decode.cu) into the output.
//
// For one packed query row with partials (o_s, lse_s), s = 0 .. S-1 (o_s normalised, lse_s
// natural log, -inf for a split that saw no visible key):
//     M = max_s lse_s,  w_s = exp(lse_s - M),  L = sum_s w_s
//     o = sum_s w_s o_s / L,  lse = M + log(L)
// the same formula as cuflash.merge_states. A row whose every lse_s is -inf gets o = 0 and
// lse = -inf (M is replaced by 0 in the exponentials, so no -inf - -inf arises). Splits are
// summed in order: bitwise reproducible.
//
// One warp per packed row; lanes over the splits for M and L, then over the columns for o.
#include "decode_params.cuh"

namespace cuflash {
namespace decode {

template <typename T>
__global__ void __launch_bounds__(128)
decode_combine(const DecodeParams p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rows_total = p.G * p.Lq;
  const long long prow = static_cast<long long>(blockIdx.x) * 4 + warp;   // packed row
  if (prow >= static_cast<long long>(p.B) * p.Hkv * rows_total) return;
  const int S = p.num_splits;
  const float* lse_part = reinterpret_cast<const float*>(p.lse_part) + prow * S;
  const float* o_part = reinterpret_cast<const float*>(p.o_part) + prow * S * p.dv;

  float mx = kNegInf;
  for (int s = lane; s < S; s += 32) mx = fmaxf(mx, lse_part[s]);
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  const float ref = mx == kNegInf ? 0.f : mx;
  // L summed by every lane in split order (not by a butterfly) so that each lane's weights and
  // total are the same numbers
  float lsum = 0.f;
  for (int s = 0; s < S; ++s) lsum += __expf(lse_part[s] - ref);

  const int row = static_cast<int>(prow % rows_total);
  const int bh = static_cast<int>(prow / rows_total);
  const int b = bh / p.Hkv, h = bh % p.Hkv;
  const int g = row / p.Lq, i = row % p.Lq;
  T* o = reinterpret_cast<T*>(p.o) + b * p.o_b + h * p.o_h + g * p.o_g + i * p.o_row;
  const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
  for (int c = lane; c < p.dv; c += 32) {
    float acc = 0.f;
    for (int s = 0; s < S; ++s) acc = fmaf(__expf(lse_part[s] - ref), o_part[s * p.dv + c], acc);
    o[c] = from_float<T>(acc * inv);
  }
  if (lane == 0)
    reinterpret_cast<float*>(p.lse)[b * p.lse_b + h * p.lse_h + g * p.lse_g + i] =
        lsum > 0.f ? ref + __logf(lsum) : kNegInf;
}

}  // namespace decode
}  // namespace cuflash
