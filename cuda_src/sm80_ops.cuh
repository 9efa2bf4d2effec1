// cuflash: small PTX wrappers the tensor-core backward needs besides mma_sm80.cuh's:
// 32- and 128-bit shared-memory stores by shared address, the dynamic shared-memory size, and
// the gpu-scope acquire load / release add of the ordered (deterministic) dQ accumulation.
//
// Every inline-asm statement of bwd_sm80.cu lives here (or in mma_sm80.cuh), so that a host
// emulation (tests/emu/) can replace these few functions and run the kernel's C++ as it is.
#pragma once

namespace cuflash {

// One 32-bit word (two b16 elements) into shared memory at shared address `addr`.
__device__ __forceinline__ void st_shared_b32(unsigned addr, unsigned val) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(val));
}

// 16 zero bytes into shared memory at `addr` (16-byte aligned).
__device__ __forceinline__ void st_shared_zero16(unsigned addr) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0));
}

// Bytes of dynamic shared memory this launch was given.
__device__ __forceinline__ unsigned dynamic_smem_size() {
  unsigned dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  return dyn;
}

// Load with acquire semantics at gpu scope: the writes another block made before its release
// of this location are visible to this thread once it reads the released value.
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// *p += v with release semantics at gpu scope (no return value: a `red`).
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

}  // namespace cuflash
