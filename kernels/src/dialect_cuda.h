// CUDA dialect for the shared kernel bodies (mx.fast.cuda_kernel, compiled by NVRTC).
// MLX's own kernel header, included before this one, brings the half/bfloat16 types
// and the fixed-width integers.

#define DEVICE_FN __device__ __forceinline__
#define SHARED __shared__
#define BARRIER() __syncthreads()
#define EXP(x) expf(x)
#define FMAX(a, b) fmaxf((a), (b))
#define NEG_INF (-__int_as_float(0x7f800000))
#define TO_F32(x) static_cast<float>(x)
#define FROM_F32(T, x) static_cast<T>(x)

// Butterfly reduction: every lane ends with the same (bitwise identical) sum.
DEVICE_FN float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}
