// Programmatic dependent launch (sm_90): a kernel launched with programmatic stream
// serialization may start once every CTA of the kernel before it has called
// launch_dependent_grids (or exited); wait_for_prior_grids blocks until that kernel has
// completed and its writes are visible. Both are no-ops without such a launch.
#pragma once

namespace flashattn::sm90 {

__device__ __forceinline__ void launch_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace flashattn::sm90
