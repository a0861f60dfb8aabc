// DFlash 2's dynamic short convolution, one thread per output element (channel c of row r):
//   out[r, c] = sum_o (base[o, c] + dyn[r, o, c / G]) * x[r - o, c],  rows before the block's row 0 read zero.
// x [..., L, D]; base [K, D]; dyn [..., L, K, D / G]. The base tap, the per-group dynamic correction and
// the shift are one pass over x, accumulated in float32. Grid (D, rows); T: the output dtype.
const int c = int(thread_position_in_grid.x);
const int row = int(thread_position_in_grid.y);
const int L = x_shape[x_ndim - 2];
const int D = x_shape[x_ndim - 1];
const int K = base_shape[0];
const int groups = dyn_shape[dyn_ndim - 1];
const int t = row % L;
const int g = c / (D / groups);
float acc = 0.0f;
for (int o = 0; o < K && o <= t; ++o) {
  const float tap = float(base[o * D + c]) + float(dyn[(row * K + o) * groups + g]);
  acc += tap * float(x[(row - o) * D + c]);
}
out[row * D + c] = static_cast<T>(acc);
