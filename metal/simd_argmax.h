// The first maximum across a SIMD group: the largest value, ties to the smallest index, as mx.argmax.
// Lanes without a candidate pass -INFINITY and 0xFFFFFFFF, so they never win over a real one.
struct ArgMax {
  float value;
  uint index;
};

inline ArgMax simd_argmax(float value, uint index) {
  const float best = simd_max(value);
  return {best, simd_min(value == best ? index : 0xFFFFFFFFu)};
}
