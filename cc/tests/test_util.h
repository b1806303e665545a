// Helpers shared by the C++ unit tests: an EXPECT macro, trees in the layout contract built
// independently of the Python builders, a many-threaded ParallelFor, and a test runner.
#ifndef TF_HSM_CC_TESTS_TEST_UTIL_H_
#define TF_HSM_CC_TESTS_TEST_UTIL_H_

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "cc/core/tree_view.h"

namespace tf_hsm {
namespace testing {

inline int failures = 0;
#define EXPECT(cond, ...)                                                    \
  do {                                                                       \
    if (!(cond)) {                                                           \
      ++::tf_hsm::testing::failures;                                         \
      std::fprintf(stderr, "%s:%d: FAILED %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                     \
      std::fprintf(stderr, "\n");                                            \
    }                                                                        \
  } while (0)

// A tree in the layout contract, owning its arrays.
struct Layout {
  int64 num_classes = 0;
  std::vector<int64> child_begin, slot_child, path_begin, path_nodes, path_slots;

  int64 num_nodes() const { return static_cast<int64>(child_begin.size()) - 1; }
  int64 num_slots() const { return static_cast<int64>(slot_child.size()); }
  TreeView view() const {
    TreeView v;
    v.num_classes = num_classes;
    v.num_nodes = num_nodes();
    v.num_slots = num_slots();
    v.path_length = static_cast<int64>(path_nodes.size());
    v.child_begin = child_begin.data();
    v.slot_child = slot_child.data();
    v.path_begin = path_begin.data();
    v.path_nodes = path_nodes.data();
    v.path_slots = path_slots.data();
    return v;
  }
};

// Fills the per-class paths from child_begin and slot_child by climbing parent slots.
inline void DerivePaths(Layout* t) {
  const int64 C = t->num_classes, M = t->num_nodes();
  std::vector<int64> owner(t->num_slots()), up_slot(C + M, -1);
  for (int64 n = 0; n < M; ++n)
    for (int64 s = t->child_begin[n]; s < t->child_begin[n + 1]; ++s) owner[s] = n;
  for (int64 s = 0; s < t->num_slots(); ++s) up_slot[t->slot_child[s]] = s;
  t->path_begin.assign(1, 0);
  t->path_nodes.clear();
  t->path_slots.clear();
  for (int64 c = 0; c < C; ++c) {
    std::vector<int64> slots;
    for (int64 s = up_slot[c]; s >= 0; s = up_slot[C + owner[s]]) slots.push_back(s);
    for (auto it = slots.rbegin(); it != slots.rend(); ++it) {
      t->path_nodes.push_back(owner[*it]);
      t->path_slots.push_back(*it);
    }
    t->path_begin.push_back(static_cast<int64>(t->path_nodes.size()));
  }
}

// A random tree generated breadth first (so nodes come out in BFS order): each node gets
// 1..max_branching children, each a new node with probability p_node while the depth
// allows, else a class; class ids are then shuffled.
inline Layout RandomLayout(std::mt19937_64& rng, int64 max_branching, int64 max_depth, double p_node,
                    int64 max_classes = 2000) {
  std::uniform_real_distribution<double> unit(0, 1);
  std::vector<int64> depth = {0};
  std::vector<int64> codes;  // class ordinal c >= 0, node m as -1 - m
  Layout t;
  t.child_begin.push_back(0);
  int64 classes = 0;
  for (size_t n = 0; n < depth.size(); ++n) {
    const int64 k = 1 + static_cast<int64>(rng() % max_branching);
    for (int64 j = 0; j < k; ++j) {
      if (depth[n] + 1 < max_depth && classes < max_classes && unit(rng) < p_node) {
        codes.push_back(-1 - static_cast<int64>(depth.size()));
        depth.push_back(depth[n] + 1);
      } else {
        codes.push_back(classes++);
      }
    }
    t.child_begin.push_back(static_cast<int64>(codes.size()));
  }
  std::vector<int64> id(classes);
  for (int64 c = 0; c < classes; ++c) id[c] = c;
  std::shuffle(id.begin(), id.end(), rng);
  t.num_classes = classes;
  for (int64 code : codes) t.slot_child.push_back(code >= 0 ? id[code] : classes + (-1 - code));
  DerivePaths(&t);
  return t;
}

// A tree from explicit (child_begin, slot_child).
inline Layout MakeLayout(int64 num_classes, std::vector<int64> child_begin, std::vector<int64> slot_child) {
  Layout t;
  t.num_classes = num_classes;
  t.child_begin = std::move(child_begin);
  t.slot_child = std::move(slot_child);
  DerivePaths(&t);
  return t;
}

// A complete tree over classes 0..C-1 in order: each node splits its class range into up
// to `branching` equal parts, built top-down in BFS order.
inline Layout Balanced(int64 C, int64 branching) {
  std::vector<std::pair<int64, int64>> ranges = {{0, C}};  // class range of each node
  Layout t;
  t.num_classes = C;
  t.child_begin.push_back(0);
  for (size_t n = 0; n < ranges.size(); ++n) {
    const int64 lo = ranges[n].first, hi = ranges[n].second;
    const int64 part = (hi - lo + branching - 1) / branching;
    for (int64 a = lo; a < hi; a += part) {
      const int64 b = std::min(hi, a + part);
      if (b - a == 1) {
        t.slot_child.push_back(a);
      } else {
        t.slot_child.push_back(C + static_cast<int64>(ranges.size()));
        ranges.push_back({a, b});
      }
    }
    t.child_begin.push_back(static_cast<int64>(t.slot_child.size()));
  }
  DerivePaths(&t);
  return t;
}

// A ParallelFor on `threads` std::threads handing out single items, so work is split very
// differently from the serial run.
inline ParallelFor ThreadedFor(int threads) {
  return [threads](int64 total, int64, const std::function<void(int64, int64)>& work) {
    std::atomic<int64> next(0);
    std::vector<std::thread> pool;
    for (int k = 0; k < threads; ++k) {
      pool.emplace_back([&] {
        for (int64 i = next++; i < total; i = next++) work(i, i + 1);
      });
    }
    for (auto& th : pool) th.join();
  };
}

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

struct NamedTest {
  const char* name;
  void (*fn)();
};

// Runs every test, prints one line each and the closing "N passed, N failed" line.
template <size_t N>
int RunTests(const NamedTest (&tests)[N]) {
  int passed = 0, failed = 0;
  for (const NamedTest& t : tests) {
    const int before = failures;
    t.fn();
    const bool ok = failures == before;
    std::printf("[%s] %s\n", ok ? "PASS" : "FAIL", t.name);
    (ok ? passed : failed)++;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace testing
}  // namespace tf_hsm

#endif  // TF_HSM_CC_TESTS_TEST_UTIL_H_
