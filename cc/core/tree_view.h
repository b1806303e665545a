// Framework-agnostic view of a class tree and the parallel-for callback the core runs on.
// Nothing here knows TensorFlow: the op kernels, the C++ tests and the CUDA harness all
// fill these plain structs from their own buffers.
#ifndef TF_HSM_CC_CORE_TREE_VIEW_H_
#define TF_HSM_CC_CORE_TREE_VIEW_H_

#include <cstdint>
#include <functional>

namespace tf_hsm {

using int64 = std::int64_t;

// Layout contract (see tf_hsm/tree/layout.py): classes 0..C-1 are leaves, internal nodes 0..M-1
// with root 0. Node n's children own the weight rows ("slots")
// [child_begin[n], child_begin[n+1]). slot_child[s] is the class id (< C) or C + node.
// Class c's root-to-leaf path is steps path_begin[c]..path_begin[c+1]-1 of
// (path_nodes, path_slots).
struct TreeView {
  int64 num_classes = 0;
  int64 num_nodes = 0;
  int64 num_slots = 0;
  int64 path_length = 0;
  const int64* child_begin = nullptr;  // [num_nodes + 1]
  const int64* slot_child = nullptr;   // [num_slots]; only the inference ops read it
  const int64* path_begin = nullptr;   // [num_classes + 1]
  const int64* path_nodes = nullptr;   // [path_length]
  const int64* path_slots = nullptr;   // [path_length]
};

// Runs work(begin, end) over disjoint ranges covering [0, total). cost_per_item is a rough
// count of scalar operations per item, used to choose shard sizes. Results of the core never
// depend on how the range is split, so any implementation (serial included) is correct.
using ParallelFor = std::function<void(int64 total, int64 cost_per_item,
                                       const std::function<void(int64, int64)>& work)>;

// A ParallelFor that runs everything on the calling thread.
inline void SerialFor(int64 total, int64 /*cost_per_item*/,
                      const std::function<void(int64, int64)>& work) {
  if (total > 0) work(0, total);
}

}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_TREE_VIEW_H_
