// Metal dialect for the shared kernel bodies (mx.fast.metal_kernel).
// Apple GPUs run 32-wide SIMD groups, the width the bodies assume.
#include <metal_simdgroup>
#include <metal_stdlib>

#define DEVICE_FN inline
#define SHARED threadgroup
#define BARRIER() metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup)
#define EXP(x) metal::precise::exp(x)
#define FMAX(a, b) metal::max((a), (b))
#define NEG_INF (-INFINITY)
#define TO_F32(x) static_cast<float>(x)
#define FROM_F32(T, x) static_cast<T>(x)

// Every lane of the SIMD group receives the reduced value.
DEVICE_FN float warp_sum(float x) {
  return metal::simd_sum(x);
}
