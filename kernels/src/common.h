// Dialect-neutral helpers shared by every kernel body; written only with the
// dialect macros, so the Metal and CUDA kernels compile the same text.

DEVICE_FN int imin(int a, int b) {
  return a < b ? a : b;
}

// Flat element offset of [i0, i1, i2, i3] in a 4-D array with the given strides.
#define OFFSET4(strides, i0, i1, i2, i3)                                       \
  ((int64_t)(i0) * (strides)[0] + (int64_t)(i1) * (strides)[1] +              \
   (int64_t)(i2) * (strides)[2] + (int64_t)(i3) * (strides)[3])

// This lane's PER_LANE elements (from d0) of row t of one head of a tensor packed by
// mx.quantize: BITS-wide fields, lowest bits first, 32 / BITS of them per uint32, and
// one (scale, bias) per GROUP_SIZE elements. A lane's elements never straddle a group.
#define DEQUANTIZE_LANE(dst, words, words_strides, scales, scales_strides, biases,       \
                        biases_strides, b, h, t)                                         \
  {                                                                                      \
    constexpr int FIELDS_PER_WORD = 32 / BITS;                                           \
    constexpr uint32_t FIELD_MASK = (1u << BITS) - 1u;                                   \
    const int group_ = d0 / GROUP_SIZE;                                                  \
    const float scale_ = TO_F32(scales[OFFSET4(scales_strides, b, h, t, group_)]);       \
    const float bias_ = TO_F32(biases[OFFSET4(biases_strides, b, h, t, group_)]);        \
    for (int i_ = 0; i_ < PER_LANE; i_++) {                                              \
      const int e_ = d0 + i_;                                                            \
      const uint32_t word_ = words[OFFSET4(words_strides, b, h, t, e_ / FIELDS_PER_WORD)]; \
      const uint32_t field_ = (word_ >> ((e_ % FIELDS_PER_WORD) * BITS)) & FIELD_MASK;   \
      dst[i_] = scale_ * float(field_) + bias_;                                          \
    }                                                                                    \
  }
