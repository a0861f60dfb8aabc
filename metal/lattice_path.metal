// DFlash 2's path selector for one block, in one threadgroup: every adjacent pair score, then the walk.
//   scores[t, a, b] = unary[t, b] + sum_r pred_rows[t, a, r] * h[t, r] * succ[t, b, r]
// pred_rows / succ [T, k, R]: the predecessor / successor codes of the candidates (row 0: the anchor);
// h [T, R]; unary [T, k]. Each SIMD group takes (t, a) rows of the lattice, its lanes split R and a
// simd_sum finishes each score; the scores stay in threadgroup memory for the walk, which SIMD group 0
// runs with one lane per candidate. VITERBI picks the walk: the maximum-total path (max-sum dynamic
// programming) or the greedy argmax walk. Ties break to the first maximum, as mx.argmax.
// Limits (checked by the caller): T <= MAX_ROWS, k <= MAX_K, R <= MAX_RANK.
constexpr int MAX_ROWS = 16, MAX_K = 16, MAX_RANK = 256;
threadgroup float lattice[MAX_ROWS * MAX_K * MAX_K];
const int T = unary_shape[0];
const int k = unary_shape[1];
const int R = h_shape[1];
const uint lane = thread_index_in_simdgroup;
const uint simd = simdgroup_index_in_threadgroup;

for (int row = int(simd); row < T * k; row += int(simdgroups_per_threadgroup)) {
  const int t = row / k;
  float pred_h[MAX_RANK / 32];
  for (int j = 0; j < MAX_RANK / 32; ++j) {
    const int r = int(lane) + 32 * j;
    pred_h[j] = r < R ? pred_rows[row * R + r] * h[t * R + r] : 0.0f;
  }
  for (int b = 0; b < k; ++b) {
    float part = 0.0f;
    for (int j = 0; j < MAX_RANK / 32; ++j) {
      const int r = int(lane) + 32 * j;
      if (r < R) {
        part += pred_h[j] * succ[(t * k + b) * R + r];
      }
    }
    const float dot = simd_sum(part);
    if (lane == 0) {
      const float score = unary[t * k + b] + dot;
      lattice[row * k + b] = score;
      scores[row * k + b] = score;
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (simd != 0) {
  return;
}

// Lane b stands for candidate b; lanes past k repeat the last candidate and never win an argmax.
const bool real = int(lane) < k;
const int b = real ? int(lane) : k - 1;
if (VITERBI) {
  // this lane's best total of a path ending in candidate b, and where it came from in each row
  float best = lattice[b];  // row 0: from the anchor
  uint from[MAX_ROWS];
  for (int t = 1; t < T; ++t) {
    float top = 0.0f;
    for (int a = 0; a < k; ++a) {
      const float total = simd_shuffle(best, ushort(a)) + lattice[(t * k + a) * k + b];
      if (a == 0 || total > top) {
        top = total;
        from[t] = uint(a);
      }
    }
    best = top;
  }
  uint at = simd_argmax(real ? best : -INFINITY, real ? lane : 0xFFFFFFFFu).index;
  if (lane == 0) {
    path[T - 1] = at;
  }
  for (int t = T - 1; t > 0; --t) {
    at = simd_shuffle(from[t], ushort(at));
    if (lane == 0) {
      path[t - 1] = at;
    }
  }
} else {
  uint at = 0;  // row 0's predecessor: the anchor
  for (int t = 0; t < T; ++t) {
    at = simd_argmax(real ? lattice[(t * k + int(at)) * k + b] : -INFINITY, real ? lane : 0xFFFFFFFFu).index;
    if (lane == 0) {
      path[t] = at;
    }
  }
}
