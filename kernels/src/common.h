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

// This lane's PER_LANE elements (channels c_ from d0) of one token of a KVarN tile j
// (kernels/kvarn.py has the layout): BITS_-wide fields in mx.quantize's packing, each
// (code * scale + bias) * factor. The caller says where, as expressions of c_: the word
// [word_row, word_col] and the field's shift in it, the scale and bias [scale_row,
// scale_col], the factor [factor_at] (keys: channels x tokens, a group per channel, a
// factor per token; values: tokens x channels, GROUP_SIZE channels a group, a factor
// per channel).
#define DEQUANTIZE_KVARN(dst, BITS_, words, words_strides, word_row, word_col, shift, scales, \
                         scales_strides, biases, biases_strides, scale_row, scale_col,        \
                         factors, factors_strides, factor_at, b, h, j)                        \
  {                                                                                          \
    for (int i_ = 0; i_ < PER_LANE; i_++) {                                                  \
      const int c_ = d0 + i_;                                                                \
      const uint32_t word_ = words[OFFSET5(words_strides, b, h, j, word_row, word_col)];     \
      const float code_ = float((word_ >> (shift)) & ((1u << BITS_) - 1u));                  \
      const float scale_ = TO_F32(scales[OFFSET5(scales_strides, b, h, j, scale_row, scale_col)]); \
      const float bias_ = TO_F32(biases[OFFSET5(biases_strides, b, h, j, scale_row, scale_col)]);  \
      const float factor_ = TO_F32(factors[OFFSET4(factors_strides, b, h, j, factor_at)]);   \
      dst[i_] = (scale_ * code_ + bias_) * factor_;                                          \
    }                                                                                        \
  }
