// Host stand-in for <cuda_fp16.h> (tests/emu): the storage type and the conversions
// cuda_src/ uses, rounding to nearest even (GCC's _Float16).
#pragma once
#include <cstdint>
#include <cstring>

struct __half { uint16_t x; };
struct __half2 { __half x, y; };

inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.x, 2);
  return float(f);
}
inline __half __float2half_rn(float v) {
  const _Float16 f = static_cast<_Float16>(v);
  __half h;
  std::memcpy(&h.x, &f, 2);
  return h;
}
inline __half2 __floats2half2_rn(float lo, float hi) { return {__float2half_rn(lo), __float2half_rn(hi)}; }
