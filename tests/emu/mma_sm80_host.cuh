// Host emulation of cuda_src/mma_sm80.cuh's warp-level wrappers (tests/emu): cp.async (landing
// at cp.async.wait_group, as late as the hardware may), ldmatrix .x4 with and without .trans,
// mma.sync m16n8k16 with float32 accumulation, pack2, ex2.approx, rcp.approx, tanh.approx. The fragment layouts are the
// PTX ISA's (see mma_sm80.cuh's header comment). Every other definition of mma_sm80.cuh
// (SwizzledTile, the tile I/O helpers) is not emulated: tests/_emu_sm80.py splices the real
// ones in at the end.
#pragma once
#include <cstring>
#include "common.cuh"

namespace cuflash {

namespace emu_detail {

inline uint16_t ld16(unsigned addr) {
  ::emu::check_smem(addr, 2);
  uint16_t v;
  std::memcpy(&v, ::emu::st().smem + addr, 2);
  return v;
}

template <typename T> inline float to_float(uint16_t bits);
template <> inline float to_float<__half>(uint16_t bits) { return __half2float(__half{bits}); }
template <> inline float to_float<__nv_bfloat16>(uint16_t bits) { return __bfloat162float(__nv_bfloat16{bits}); }

inline void st_shared_b32(unsigned addr, unsigned val) {
  if (addr % 4) ::emu::fail("st.shared.b32 address not 4-byte aligned");
  ::emu::check_smem(addr, 4);
  std::memcpy(::emu::st().smem + addr, &val, 4);
}

inline void land(const ::emu::State::Copy& c) {
  ::emu::check_smem(c.dst, 16);
  if (c.bytes == 16) std::memcpy(::emu::st().smem + c.dst, c.src, 16);
  else std::memset(::emu::st().smem + c.dst, 0, 16);
}

inline void ldmatrix(unsigned (&r)[4], unsigned addr, bool trans) {
  if (addr % 16) ::emu::fail("ldmatrix row address not 16-byte aligned");
  ::emu::check_smem(addr, 16);
  ::emu::my_xchg()[0] = addr;
  const int parity = ::emu::warp_sync();
  const int lane = int(threadIdx.x) % 32;
  for (int i = 0; i < 4; ++i) {
    uint32_t lo, hi;
    if (!trans) {   // row lane/4 of matrix i, elements 2 (lane%4), +1
      const unsigned a = ::emu::lane_xchg(parity, 8 * i + lane / 4)[0];
      lo = ld16(a + 4 * (lane % 4));
      hi = ld16(a + 4 * (lane % 4) + 2);
    } else {        // rows 2 (lane%4), +1 of matrix i, element lane/4
      const unsigned a0 = ::emu::lane_xchg(parity, 8 * i + 2 * (lane % 4))[0];
      const unsigned a1 = ::emu::lane_xchg(parity, 8 * i + 2 * (lane % 4) + 1)[0];
      lo = ld16(a0 + 2 * (lane / 4));
      hi = ld16(a1 + 2 * (lane / 4));
    }
    r[i] = lo | (hi << 16);
  }
}

}  // namespace emu_detail

inline unsigned smem_u32(const void* p) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  if (c < ::emu::st().smem || c > ::emu::st().smem + ::emu::kSmemBytes) ::emu::fail("smem_u32 of a non-shared pointer");
  return unsigned(c - ::emu::st().smem);
}

inline void cp_async_16(unsigned dst, const void* src, int src_bytes) {
  if (dst % 16) ::emu::fail("cp.async destination not 16-byte aligned");
  ::emu::check_smem(dst, 16);
  if (src_bytes != 0 && src_bytes != 16) ::emu::fail("cp.async src-size other than 0 or 16");
  if (src_bytes) {
    if (reinterpret_cast<uintptr_t>(src) % 16) ::emu::fail("cp.async source not 16-byte aligned");
    ::emu::check_readable(src, 16);
    ::emu::count_watched(src);
  }
  if (::emu::st().eager) emu_detail::land({dst, src, src_bytes});
  else ::emu::st().open[::emu::st().cur].push_back({dst, src, src_bytes});
}
inline void cp_async_commit() {
  ::emu::State& s = ::emu::st();
  s.groups[s.cur].push_back(std::move(s.open[s.cur]));
  s.open[s.cur].clear();
}
template <int N> inline void cp_async_wait() {
  ::emu::State& s = ::emu::st();
  auto& g = s.groups[s.cur];
  while (int(g.size()) > N) {
    for (auto& c : g.front()) emu_detail::land(c);
    g.erase(g.begin());
  }
}

inline void ldmatrix_x4(unsigned (&r)[4], unsigned addr) { emu_detail::ldmatrix(r, addr, false); }
inline void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) { emu_detail::ldmatrix(r, addr, true); }

// D = A B + D, A 16x16 (row), B 16x8 (col), lane l: g = l/4, t = l%4.
//   a0 = A(g, 2t..2t+1)  a1 = A(g+8, 2t..)  a2 = A(g, 2t+8..)  a3 = A(g+8, 2t+8..)
//   b0 = B(2t..2t+1, g)  b1 = B(2t+8..2t+9, g)
//   d0, d1 = D(g, 2t..2t+1)  d2, d3 = D(g+8, 2t..2t+1)
template <typename T> struct Mma {
  static void run(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    uint32_t* mine = ::emu::my_xchg();
    for (int i = 0; i < 4; ++i) mine[i] = a[i];
    mine[4] = b0;
    mine[5] = b1;
    const int parity = ::emu::warp_sync();
    const int lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
    auto half = [](uint32_t w, int k) { return to_float(uint16_t(k & 1 ? w >> 16 : w & 0xffff)); };
    auto A = [&](int row, int k) {   // row in {g, g + 8}
      const uint32_t* x = ::emu::lane_xchg(parity, 4 * (row % 8) + (k % 8) / 2);
      return half(x[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k);
    };
    auto B = [&](int k, int n) {
      const uint32_t* x = ::emu::lane_xchg(parity, 4 * n + (k % 8) / 2);
      return half(x[k >= 8 ? 5 : 4], k);
    };
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i / 2), col = 2 * t + (i % 2);
      float acc = d[i];
      for (int k = 0; k < 16; ++k) acc = std::fma(A(row, k), B(k, col), acc);
      d[i] = acc;
    }
  }
  static float to_float(uint16_t bits) { return emu_detail::to_float<T>(bits); }
};

template <typename T> inline unsigned pack2(float lo, float hi);
template <> inline unsigned pack2<__half>(float lo, float hi) {
  return unsigned(__float2half_rn(lo).x) | (unsigned(__float2half_rn(hi).x) << 16);
}
template <> inline unsigned pack2<__nv_bfloat16>(float lo, float hi) {
  return unsigned(__float2bfloat16_rn(lo).x) | (unsigned(__float2bfloat16_rn(hi).x) << 16);
}

// ex2.approx.ftz.f32: exact here; subnormal results flush to +0 as on the GPU.
inline float ex2_approx(float x) {
  const float y = std::exp2(x);
  return (y != 0.f && std::fabs(y) < 1.17549435e-38f) ? 0.f : y;
}

// rcp.approx.ftz.f32: exact here; a subnormal argument counts 0 (1/0 = +inf) as on the GPU.
inline float rcp_approx(float x) {
  return (x != 0.f && std::fabs(x) < 1.17549435e-38f) ? std::copysign(INFINITY, x) : 1.f / x;
}

// tanh.approx.f32: the GPU's documented worst case, a relative error of 2^-11, with a sign
// that a hash of x's bits picks (not exact on purpose: the emulated tests then check that the
// kit's tolerance holds for the bfloat16 softcap on tanh.approx at that bound; float16's
// softcap does not take it, cuflash/_variant.py). tanh(+-inf) = +-1 (1 +- 2^-11: the error
// path saturates like the GPU's only to within that bound).
inline float tanh_approx(float x) {
  unsigned u;
  std::memcpy(&u, &x, sizeof u);
  const float e = ((u ^ (u >> 7) ^ (u >> 13)) & 1u) ? 0x1p-11f : -0x1p-11f;
  return std::tanh(x) * (1.f + e);
}

// Every other definition of mma_sm80.cuh, verbatim (tests/_emu_sm80.py splices it here):
// @@SPLICE@@

}  // namespace cuflash
