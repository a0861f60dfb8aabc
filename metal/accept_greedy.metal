// Greedy (T = 0) acceptance in one threadgroup: walk the verify rows in order, take each row's argmax
// (first maximum, as mx.argmax) and stop at the first row whose argmax differs from its draft or at the
// last row. accepted = that row's index (the drafts accepted), bonus = its argmax. Only the rows up to
// the first rejection are read. drafts [B - 1]; logits [B, V].
constexpr int MAX_SIMDGROUPS = 32;
threadgroup float group_best[MAX_SIMDGROUPS];
threadgroup uint group_index[MAX_SIMDGROUPS];
threadgroup uint row_choice[1];
const int B = logits_shape[0];
const int V = logits_shape[1];
const uint lane = thread_index_in_simdgroup;
const uint simd = simdgroup_index_in_threadgroup;
const uint simd_count = simdgroups_per_threadgroup;

for (int row = 0;; ++row) {
  // this thread's first maximum over its strided share of the row
  float best = -INFINITY;
  uint index = 0xFFFFFFFFu;
  for (uint i = thread_index_in_threadgroup; i < uint(V); i += threads_per_threadgroup.x) {
    const float v = float(logits[row * V + int(i)]);
    if (v > best || index == 0xFFFFFFFFu) {
      best = v;
      index = i;
    }
  }
  const ArgMax simd_best = simd_argmax(best, index);
  if (lane == 0) {
    group_best[simd] = simd_best.value;
    group_index[simd] = simd_best.index;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (simd == 0) {
    const bool real = lane < simd_count;
    const ArgMax row_best = simd_argmax(real ? group_best[lane] : -INFINITY, real ? group_index[lane] : 0xFFFFFFFFu);
    if (lane == 0) {
      row_choice[0] = row_best.index;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint choice = row_choice[0];
  if (row == B - 1 || choice != uint(drafts[row])) {
    if (thread_index_in_threadgroup == 0) {
      accepted[0] = row;
      bonus[0] = choice;
    }
    return;
  }
}
