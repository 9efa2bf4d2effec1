// Host emulation of cuda_src/sm80_ops.cuh (tests/emu).
#pragma once

namespace cuflash {

inline void st_shared_b32(unsigned addr, unsigned val) {
  if (addr % 4) ::emu::fail("st.shared.b32 address not 4-byte aligned");
  ::emu::check_smem(addr, 4);
  std::memcpy(::emu::st().smem + addr, &val, 4);
}

inline void st_shared_zero16(unsigned addr) {
  if (addr % 16) ::emu::fail("st.shared.v4 address not 16-byte aligned");
  ::emu::check_smem(addr, 16);
  std::memset(::emu::st().smem + addr, 0, 16);
}

inline unsigned dynamic_smem_size() { return ::emu::st().dyn_smem; }

// Blocks run one after another in blockIdx order, so a correct ordering never waits here: a
// thread that keeps reading a value that cannot change is a deadlock on the GPU.
inline int ld_acquire_gpu(const int* p) {
  if (++::emu::st().spins[::emu::st().cur] > 100000)
    ::emu::fail("spinning on a semaphore no earlier block will release (deadlock on a GPU)");
  return *p;
}

inline void red_release_gpu_add(int* p, int v) { *p += v; }

}  // namespace cuflash
