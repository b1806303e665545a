// log P(target | h) of a hierarchical softmax and its gradient, on the CPU.
//
//   log P(c | h) = sum over the steps (n, s) of c's path of  z_s - logsumexp_{s' in n} z_s',
//   z_s = W[s] . h + b[s].
//
// Work is organised by VisitPlan groups: for a node n with tokens G, the logits are one
// |G| x K_n block against n's contiguous weight rows, computed in tiles of kTokenTile tokens
// x kSlotTile slots with an online logsumexp, so no [tokens, depth, branching, D] tensor ever
// exists and a node with 10^6 children needs only a tile of scratch.
#ifndef TF_HSM_CC_CORE_LOG_PROB_H_
#define TF_HSM_CC_CORE_LOG_PROB_H_

#include <algorithm>
#include <memory>

#include "cc/core/sparse_rows.h"
#include "cc/core/tree_view.h"
#include "cc/core/visit_plan.h"

namespace tf_hsm {

// Dense inputs shared by the forward and backward passes.
template <typename T>
struct SoftmaxParams {
  const T* hidden = nullptr;   // [num_tokens, dim]
  const T* weights = nullptr;  // [num_slots, dim]
  const T* biases = nullptr;   // [num_slots], or nullptr for no bias
  int64 dim = 0;
};

// The number of values LogProbForward saves for LogProbBackward (its saved_logits): the
// logits of the grouped nodes' visits (one per visit and child) and the unit coefficients
// of the walked steps (plan.max_walked_branching per path step).
int64 SavedLogitsSize(const VisitPlan& plan, const TreeView& tree);

// log_prob[i] for every token of the plan. With saved_logits (SavedLogitsSize values) and
// saved_directions ([num_tokens, dim]), also what the backward pass needs that does not
// depend on the upstream gradient: the grouped nodes' logits, the walked steps' unit
// coefficients (onehot(taken) - softmax), and each token's direction, the gradient of its
// log-probability with respect to its hidden row (sum over its path of W[taken] -
// sum_s p_s W[s]). A backward pass given both reads no weight row for dh, computes no logit
// of a grouped node and walks no path, getting the same bits as one that computes them.
// log_prob is then the backward's own (LogProbGrads::log_prob_from_backward), equal to the
// plain forward's up to rounding.
template <typename T>
void LogProbForward(const VisitPlan& plan, const TreeView& tree, const SoftmaxParams<T>& p,
                    const ParallelFor& parallel_for, T* log_prob, T* saved_logits = nullptr,
                    T* saved_directions = nullptr);

// Where the backward keeps the softmax coefficients of a level between its two phases (up
// to coef_budget elements). A caller making many calls keeps one across them: allocated
// afresh, a store of more than 32 MB is mapped from the OS, and every call page-faults
// and clears all of it (40 MB at 10M classes and 3,200 tokens, ~30 ms of a 400 ms step
// on two cores, faulting together). Never shrinks; not zeroed.
template <typename T>
struct CoefficientStore {
  std::unique_ptr<T[]> data;
  int64 capacity = 0;
  T* Reserve(int64 n) {
    if (capacity < n) {
      data.reset();  // the old block goes before the new one is taken
      data.reset(new T[n]);
      capacity = n;
    }
    return data.get();
  }
};

// Outputs of the backward pass. The weight and bias gradients are sparse: row r of
// weight_rows / bias_rows is the gradient of weight row row_ids[r]; there are
// plan.num_rows() of them (every child slot of every visited node).
template <typename T>
struct LogProbGrads {
  T* hidden = nullptr;       // [num_tokens, dim]
  T* weight_rows = nullptr;  // [num_rows, dim]
  T* bias_rows = nullptr;    // [num_rows], or nullptr when there is no bias
  int64* row_ids = nullptr;  // [num_rows]

  // In-place SGD instead of sparse gradient rows: when sgd_update is set, every visited
  // weight row of sgd_weights is updated as W[s] -= sgd_learning_rate * dW[s] (biases
  // likewise when sgd_biases is set) and weight_rows / bias_rows / row_ids are not
  // written. A flag rather than a test of sgd_weights, which is null for an empty table
  // (a hidden size of 0) as well as when no update is asked for. sgd_weights
  // may alias SoftmaxParams::weights: a row is only updated after its last read. No
  // gradient tensor is ever materialised, so a training step needs no memory beyond the
  // table, the batch and a bounded scratch.
  bool sgd_update = false;
  T* sgd_weights = nullptr;
  T* sgd_biases = nullptr;
  T sgd_learning_rate = 0;

  // With sgd_update: Adam's update in place of SGD's when adam_update is set (the fused
  // LazyAdam step). Every visited row of sgd_weights (and sgd_biases) gets AdamRow with
  // adam_step and its moments' rows of adam_m, adam_v (adam_bias_m, adam_bias_v): the
  // update `tf_hsm.optimizers.LazyAdam` gives the rows of this step's gradient, once
  // each, as each row's gradient is complete when its block ends. A flag, as sgd_update
  // is: adam_m is null for a hidden size of 0, whose biases still get Adam's update.
  bool adam_update = false;
  T* adam_m = nullptr;
  T* adam_v = nullptr;
  T* adam_bias_m = nullptr;
  T* adam_bias_v = nullptr;
  AdamStep<T> adam_step{};

  // When set, receives log_prob[num_tokens] from the logsumexps the backward computes
  // anyway, with no forward pass over the grouped nodes: equal to LogProbForward's up to
  // rounding (the backward sums its exponentials in other tiles). For a loss whose value
  // and gradient are wanted together, and for the fused SGD step (each value is taken
  // before the rows it reads are updated).
  T* log_prob_from_backward = nullptr;

  // Inputs, optional: the logits, coefficients and directions LogProbForward saved for the
  // same plan and inputs (the weights unchanged since); the backward then computes no
  // logits of grouped nodes, walks no path and reads no weight row for dh.
  // saved_directions is used only with saved_logits.
  const T* saved_logits = nullptr;
  const T* saved_directions = nullptr;

  // Optional: the coefficient store to use (and grow); null: one allocated for the call.
  // Concurrent calls need one each.
  CoefficientStore<T>* coefficient_store = nullptr;
};

// Upper bound (in elements) on the softmax coefficients kept between the dh and dW phases
// of one level; beyond it they are recomputed. Either way the results are bit-identical.
constexpr int64 kDefaultCoefBudget = int64{1} << 25;

// The budget the ops give LogProbBackward, and the most values log_prob's forward keeps
// for its gradient by default: kDefaultCoefBudget, or the size of the weight gradient
// (plan.num_rows() x dim values; a forward plan counts only the grouped nodes' rows, a
// lower bound) where that is larger. Neither then takes more memory than
// the gradient it serves (which sgd_step applies without storing), and a large batch keeps
// its values instead of computing every logit of its large nodes twice: at V=1M, D=300 and
// 40,000 tokens (one output per step of 400 sequences of 100) the root's coefficients
// alone are 40M values, and recomputing them made the step 1.16x slower.
inline int64 CoefficientBudget(const VisitPlan& plan, int64 dim) {
  return std::max(kDefaultCoefBudget, plan.num_rows() * dim);
}

// Gradients of sum_i upstream[i] * log_prob[i]. The plan must be built for
// PlanFor::kBackward (LogProbForward takes either).
template <typename T>
void LogProbBackward(const VisitPlan& plan, const TreeView& tree, const SoftmaxParams<T>& p,
                     const T* upstream, const ParallelFor& parallel_for,
                     const LogProbGrads<T>& grads, int64 coef_budget = kDefaultCoefBudget);

}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_LOG_PROB_H_
