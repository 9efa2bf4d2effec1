// cuflash: thin wrappers over the sm_80 warp-level instructions the tensor-core kernels use.
//
//   cp.async   16-byte global -> shared copies that bypass registers (and zero-fill when the
//              source is out of bounds),
//   ldmatrix   four 8x8 b16 matrices from shared memory into the mma fragment layout,
//   mma.sync   m16n8k16 with float32 accumulation.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"): lane l, g = l / 4, t = l % 4.
//   A (16x16, row):  a0 = (g, 2t..2t+1)  a1 = (g+8, 2t..)  a2 = (g, 2t+8..)  a3 = (g+8, 2t+8..)
//   B (16x8,  col):  b0 = (k 2t..2t+1, n g)              b1 = (k 2t+8..2t+9, n g)
//   C (16x8, f32):   c0,c1 = (g, 2t..2t+1)                c2,c3 = (g+8, 2t..2t+1)
#pragma once
#include "common.cuh"

namespace cuflash {

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes == 0 writes zeros (the source address must still be valid).
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// D = A * B + D for one m16n8k16 tile; T selects f16 or bf16 operands.
template <typename T> struct Mma;
template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Two floats -> one register of two T, low half first (the A-fragment element order).
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

// 2^x on the special-function unit; exp2(-inf) = +0, which is what masked scores rely on.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1/x on the special-function unit (rcp.approx.ftz: 1 ulp; +inf gives +0, subnormal x counts 0).
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh on the special-function unit (tanh.approx.f32, sm_75+: one MUFU.TANH; maximum relative
// error 2^-11 over the whole range by the PTX ISA; +-inf gives +-1, NaN stays NaN). Only the
// half-type kernels use it (softcap: variant.cuh softcap_of, bwd_io.cuh p_ds_pair).
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// A row-major shared-memory tile of ROWS x COLS b16 elements stored in 16-byte chunks, with the
// chunk index XOR-swizzled by the row so that the 8 row addresses of one ldmatrix matrix, and
// the 8 chunks one cp.async wavefront writes, fall in 8 different 16-byte bank groups.
//   COLS % 64 == 0 (a multiple of 8 chunks a row): chunk ^= row % 8
//   COLS % 64 == 32 (4 mod 8 chunks a row):        chunk ^= (row / 2) % 4, rows pair up in 128 B
// Because a row starts on a multiple of 64 bytes (and the XOR only touches address bits 4..6,
// or 4..5), the swizzle is an XOR on the byte address: addr = (base + row*kRowBytes + chunk*16)
// ^ (sw(row) * 16), and sw depends on row % 8 alone. FragAddr below relies on that to keep
// ldmatrix addresses as one register plus an immediate.
template <int ROWS, int COLS> struct SwizzledTile {
  static constexpr int kChunks = COLS / 8;
  static constexpr int kRowBytes = COLS * 2;
  static constexpr int kWindow = (kChunks % 8 == 0) ? 8 : 4;   // chunks one XOR permutes
  static_assert(COLS % 32 == 0, "rows must be a multiple of four 16-byte chunks");
  static constexpr int kBytes = ROWS * kRowBytes;
  __device__ static __forceinline__ int swz(int row) { return (kWindow == 8) ? (row & 7) : ((row >> 1) & 3); }
  __device__ static __forceinline__ int chunk_offset(int row, int chunk) {  // in 16-byte units
    return row * kChunks + (chunk ^ swz(row));
  }
  __device__ static __forceinline__ unsigned addr(unsigned base, int row, int chunk) {
    return base + 16u * static_cast<unsigned>(chunk_offset(row, chunk));
  }

  // ldmatrix address of one lane: the lane's (row, chunk) inside a 16x16 block is fixed, and
  // at(row_off, chunk_off) moves to the block at row_off (a multiple of 8) and chunk_off (even).
  // With compile-time offsets this is kWindow/2 XORed registers and immediate offsets, instead
  // of one register per (row_off, chunk_off) pair.
  struct FragAddr {
    unsigned lane_addr;  // base + lane_row * kRowBytes + lane_chunk * 16, lane_chunk in {0, 1}
    unsigned sw;         // swz(lane_row) * 16
    __device__ __forceinline__ FragAddr(unsigned base, int lane_row, int lane_chunk)
        : lane_addr(base + lane_row * kRowBytes + lane_chunk * 16), sw(16u * swz(lane_row)) {}
    __device__ __forceinline__ unsigned at(int row_off, int chunk_off) const {
      const int inner = chunk_off % kWindow;
      return ((lane_addr + 16u * inner) ^ sw) + 16u * (chunk_off - inner) + row_off * kRowBytes;
    }
  };
};

// ---------------------------------------------------------------------------------------------
// Tile I/O shared by the tensor-core kernels. `Tile` is any shared-memory tile type with
// kChunks (16-byte chunks a row) and addr(base, row, chunk) / chunk_offset(row, chunk).
// ---------------------------------------------------------------------------------------------

// Copy rows [row0, row0 + ROWS) x columns [0, cols) of a row-major global tile into the
// swizzled shared tile; rows >= nrows and columns >= cols land as zeros (cp.async zero-fill).
template <typename Tile, int ROWS, int THREADS, bool EVEN, typename T>
__device__ __forceinline__ void load_tile(unsigned sbase, const T* __restrict__ g, long long row_stride,
                                          int row0, int nrows, int cols) {
  constexpr int kChunks = Tile::kChunks;
  constexpr int kIters = (ROWS * kChunks + THREADS - 1) / THREADS;
  // Unrolled by at most 4: a fully unrolled loop issues its copies back to back (measured
  // faster than a rolled one at 8 warps), but ptxas keeps one 64-bit source address per copy
  // live across the key loop, and the 8 copies a 4-warp block makes would spill.
#pragma unroll 4
  for (int it = 0; it < kIters; ++it) {
    const int idx = threadIdx.x + it * THREADS;
    if ((ROWS * kChunks) % THREADS == 0 || idx < ROWS * kChunks) {
      const int r = idx / kChunks, c = idx % kChunks;
      const bool ok = EVEN || (row0 + r < nrows && c * 8 < cols);
      const T* src = ok ? g + (row0 + r) * row_stride + c * 8 : g;
      cp_async_16(Tile::addr(sbase, r, c), src, ok ? 16 : 0);
    }
  }
}

// Write rows srow0 + lane/4 and srow0 + lane/4 + 8 of O (accumulator layout, NO 8-column tiles)
// times 1/l into the shared tile as T; the caller then stores the tile with store_o_tile, so
// that global stores are whole 16-byte chunks.
template <typename Tile, typename T, int NO>
__device__ __forceinline__ void stage_o_slice(unsigned sbase, int srow0, const float (&o)[NO][4],
                                              const float (&inv_l)[2]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int t = 0; t < NO; ++t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int srow = srow0 + lane / 4 + 8 * r;
      const int col = t * 8 + 2 * (lane % 4);
      const unsigned addr = Tile::addr(sbase, srow, col / 8) + 2u * (col % 8);
      const unsigned val = pack2<T>(o[t][2 * r] * inv_l[r], o[t][2 * r + 1] * inv_l[r]);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(val));
    }
  }
}

// Rows [0, ROWS) of a staged shared tile (generic pointer `stile`) -> output rows m0.. of `out`
// (already offset to its batch item by off_o elements): 16-byte stores when the layout allows,
// element stores with any strides otherwise; rows >= Lq and columns >= dv are not written.
template <typename Tile, int ROWS, int THREADS, typename T>
__device__ __forceinline__ void store_o_tile(const unsigned char* stile, T* __restrict__ out,
                                             const Params& p, long long off_o, int m0) {
  const bool vec = p.o_col_stride == 1 && p.o_row_stride % 8 == 0 && off_o % 8 == 0 &&
                   p.o % 16 == 0 && p.dv % 8 == 0;
  constexpr int kChunks = Tile::kChunks;
  for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += THREADS) {
    const int r = idx / kChunks, c = idx % kChunks;
    const int gi = m0 + r;
    if (gi >= p.Lq || c * 8 >= p.dv) continue;
    const unsigned char* src = stile + 16 * Tile::chunk_offset(r, c);
    if (vec) {
      *reinterpret_cast<uint4*>(out + gi * p.o_row_stride + c * 8) = *reinterpret_cast<const uint4*>(src);
    } else {
      const T* e = reinterpret_cast<const T*>(src);
      for (int u = 0; u < 8 && c * 8 + u < p.dv; ++u) out[gi * p.o_row_stride + (c * 8 + u) * p.o_col_stride] = e[u];
    }
  }
}

// store_o_tile with the addresses advanced by constants (fwd_sm90's LEAN builds, session 11:
// the window's and short block-mask lists' query tiles, whose epilogue is a large share of
// them): where THREADS is a multiple of a row's chunks and the rows between a thread's copies
// (THREADS / kChunks) a multiple of the swizzle's 8, a thread copies the same chunk column c of
// rows r0, r0 + kStep, ...: the shared offset and the global address of its next copy are the
// last one's plus a constant, where store_o_tile recomputes the row, the swizzle and the 64-bit
// row offset of every copy (~45 instructions a copy at d = 128 against ~7). The same copies:
// rows >= Lq and columns >= dv are not written; strides that forbid 16-byte stores go to
// store_o_tile.
template <typename Tile, int ROWS, int THREADS, typename T>
__device__ __forceinline__ void store_o_rows(const unsigned char* stile, T* __restrict__ out,
                                             const Params& p, long long off_o, int m0) {
  constexpr int kChunks = Tile::kChunks;
  constexpr int kStep = THREADS / kChunks;
  static_assert(THREADS % kChunks == 0 && kStep % 8 == 0 && ROWS % kStep == 0 && kChunks % 8 == 0,
                "a thread's copies one chunk column, rows kStep apart, the swizzle repeating");
  const bool vec = p.o_col_stride == 1 && p.o_row_stride % 8 == 0 && off_o % 8 == 0 &&
                   p.o % 16 == 0 && p.dv % 8 == 0;
  if (!vec) {
    store_o_tile<Tile, ROWS, THREADS>(stile, out, p, off_o, m0);
    return;
  }
  const int c = threadIdx.x % kChunks, r0 = threadIdx.x / kChunks;
  if (c * 8 >= p.dv) return;
  const unsigned char* src = stile + 16 * Tile::chunk_offset(r0, c);
  // the global address of this thread's copy it (row m0 + r0 + it kStep), a byte step apart
  unsigned long long addr = static_cast<unsigned long long>(
      __cvta_generic_to_global(out + static_cast<long long>(m0 + r0) * p.o_row_stride + c * 8));
  const unsigned long long step = static_cast<unsigned long long>(kStep * p.o_row_stride) * sizeof(T);
  const int rows_left = p.Lq - m0 - r0;   // copy it is written while it kStep < rows_left
#pragma unroll
  for (int it = 0; it < ROWS / kStep; ++it) {
    if (it * kStep < rows_left) {
      const uint4 x = *reinterpret_cast<const uint4*>(src + 16 * it * kStep * kChunks);
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(addr), "r"(x.x), "r"(x.y), "r"(x.z),
                   "r"(x.w) : "memory");
    }
    addr += step;
    // (an opaque step: without it the compiler folds the address back into (m0 + r0 + it kStep)
    // stride, a 64-bit product a copy again)
    asm volatile("" : "+l"(addr));
  }
}

}  // namespace cuflash
