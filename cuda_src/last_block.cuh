// cuflash: "the last block to arrive" (the threadfence reduction of the CUDA samples), for a
// result that one block finishes from what other blocks of the grid wrote, without a second
// launch: bwd_sm90's dQ rounding (bwd_io::finish_dq_tiles) and the decode kernels' fused
// combine (merge_splits_if_last, decode_params.cuh).
//
//   publish_block_writes(): each thread fences its own global writes (release: they reach L2
// before anything this thread does next), and the barrier orders every thread's fence before
// any arrival made after it (by one thread or by many).
//   arrive_is_last(count, arrivals, reset): one arrival at `count`; true for the one that
// completes `arrivals`. That thread then fences again (acquire): after the block's next
// barrier the others' writes are visible to the whole block (read them through L2, ld.cg:
// they never went through this SM's L1). With `reset` it sets the count back to 0, so the next
// launch on the stream finds it zeroed (no memset a call); without, the launcher zeroes it.
//   Cost: the fence waits until the thread's earlier global writes have landed, and ptxas
// then tracks the completion of every earlier atomic of the kernel (ATOMG for REDG): call it
// at the end of a block, never inside a hot loop.
#pragma once

namespace cuflash {

__device__ __forceinline__ void publish_block_writes() {
  __threadfence();
  __syncthreads();
}

__device__ __forceinline__ bool arrive_is_last(unsigned* count, unsigned arrivals, bool reset) {
  const bool last = atomicAdd(count, 1u) == arrivals - 1u;
  if (last) {
    if (reset) atomicExch(count, 0u);
    __threadfence();
  }
  return last;
}

}  // namespace cuflash
