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

// Flat element offset of [i0, i1, i2, i3, i4] in a 5-D array with the given strides.
#define OFFSET5(strides, i0, i1, i2, i3, i4) \
  (OFFSET4(strides, i0, i1, i2, i3) + (int64_t)(i4) * (strides)[4])

// This lane's PER_LANE elements (from d0) of row t of one head of a dense [B, H, L, D].
#define LOAD_LANE(dst, x, x_strides, b, h, t)                  \
  {                                                            \
    for (int i_ = 0; i_ < PER_LANE; i_++) {                    \
      dst[i_] = TO_F32(x[OFFSET4(x_strides, b, h, t, d0 + i_)]); \
    }                                                          \
  }

// KVarN tiles (kernels/kvarn.py has the layout), token u of tile j, this lane's channels.
// Keys are channels x tokens, KEY_BITS-wide fields in one affine group per channel, times
// the tile's token factor: k[u, c] = (code * scale[c] + bias[c]) * factor[u].
#define DEQUANTIZE_KVARN_KEY(dst, words, words_strides, scales, scales_strides, biases,    \
                             biases_strides, factors, factors_strides, b, h, j, u)         \
  {                                                                                      \
    constexpr int FIELDS_PER_WORD = 32 / KEY_BITS;                                       \
    constexpr uint32_t FIELD_MASK = (1u << KEY_BITS) - 1u;                               \
    const float factor_ = TO_F32(factors[OFFSET4(factors_strides, b, h, j, u)]);         \
    const int shift_ = (u % FIELDS_PER_WORD) * KEY_BITS;                                 \
    for (int i_ = 0; i_ < PER_LANE; i_++) {                                              \
      const int c_ = d0 + i_;                                                            \
      const uint32_t word_ =                                                             \
          words[OFFSET5(words_strides, b, h, j, c_, u / FIELDS_PER_WORD)];               \
      const float scale_ = TO_F32(scales[OFFSET5(scales_strides, b, h, j, c_, 0)]);      \
      const float bias_ = TO_F32(biases[OFFSET5(biases_strides, b, h, j, c_, 0)]);       \
      dst[i_] = (scale_ * float((word_ >> shift_) & FIELD_MASK) + bias_) * factor_;      \
    }                                                                                    \
  }

// Values are tokens x channels, VALUE_BITS-wide fields in groups of GROUP_SIZE channels,
// times the tile's channel factor: v[u, c] = (code * scale[u] + bias[u]) * factor[c].
#define DEQUANTIZE_KVARN_VALUE(dst, words, words_strides, scales, scales_strides, biases,  \
                               biases_strides, factors, factors_strides, b, h, j, u)       \
  {                                                                                      \
    constexpr int FIELDS_PER_WORD = 32 / VALUE_BITS;                                     \
    constexpr uint32_t FIELD_MASK = (1u << VALUE_BITS) - 1u;                             \
    const int group_ = d0 / GROUP_SIZE;                                                  \
    const float scale_ = TO_F32(scales[OFFSET5(scales_strides, b, h, j, u, group_)]);    \
    const float bias_ = TO_F32(biases[OFFSET5(biases_strides, b, h, j, u, group_)]);     \
    for (int i_ = 0; i_ < PER_LANE; i_++) {                                              \
      const int c_ = d0 + i_;                                                            \
      const uint32_t word_ =                                                             \
          words[OFFSET5(words_strides, b, h, j, u, c_ / FIELDS_PER_WORD)];               \
      const uint32_t field_ = (word_ >> ((c_ % FIELDS_PER_WORD) * VALUE_BITS)) & FIELD_MASK; \
      const float factor_ = TO_F32(factors[OFFSET4(factors_strides, b, h, j, c_)]);      \
      dst[i_] = (scale_ * float(field_) + bias_) * factor_;                              \
    }                                                                                    \
  }
