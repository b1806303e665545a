#include "cc/kernels/hsm_inputs.h"

#include <atomic>
#include <memory>

#include "cc/kernels/tf_names.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/lib/core/errors.h"

namespace tf_hsm {

Status ReadSoftmaxInputs(OpKernelContext* ctx, SoftmaxInputs* in) {
  return CheckSoftmaxTensors(ctx->input(0), ctx->input(1), ctx->input(2), in);
}

Status CheckSoftmaxTensors(const Tensor& hidden, const Tensor& weights, const Tensor& biases,
                           SoftmaxInputs* in) {
  in->hidden = &hidden;
  in->weights = &weights;
  in->biases = &biases;
  if (in->hidden->dims() < 1) {
    return errors::InvalidArgument("hidden must have rank >= 1, got shape ",
                                   in->hidden->shape().DebugString());
  }
  if (in->weights->dims() != 2) {
    return errors::InvalidArgument("weights must be a matrix [num_slots, D], got shape ",
                                   in->weights->shape().DebugString());
  }
  in->dim = in->hidden->dim_size(in->hidden->dims() - 1);
  if (in->weights->dim_size(1) != in->dim) {
    return errors::InvalidArgument("hidden size mismatch: hidden has D = ", in->dim,
                                   " but weights has ", in->weights->dim_size(1), " columns");
  }
  const int64 num_slots = in->weights->dim_size(0);
  if (in->biases->dims() != 1 ||
      (in->biases->dim_size(0) != 0 && in->biases->dim_size(0) != num_slots)) {
    return errors::InvalidArgument(
        "biases must be a vector of ", num_slots, " (one per weight row: weights has ",
        num_slots, " rows, and both need one per tree slot) or empty, got shape ",
        in->biases->shape().DebugString());
  }
  in->has_bias = in->biases->dim_size(0) != 0;
  in->num_tokens = in->dim == 0 ? BatchShape(*in->hidden).num_elements()
                                : in->hidden->NumElements() / in->dim;
  return Status();
}

Status ReadTree(OpKernelContext* ctx, int first, int slot_child_input, int64 num_slots,
                TreeView* tree) {
  static const char* kNames[] = {"child_begin", "path_begin", "path_nodes", "path_slots"};
  for (int i = 0; i < 4; ++i) {
    const Tensor& t = ctx->input(first + i);
    if (t.dims() != 1) {
      return errors::InvalidArgument(kNames[i], " must be a vector, got shape ",
                                     t.shape().DebugString());
    }
  }
  const Tensor& child_begin = ctx->input(first);
  const Tensor& path_begin = ctx->input(first + 1);
  const Tensor& path_nodes = ctx->input(first + 2);
  const Tensor& path_slots = ctx->input(first + 3);
  if (child_begin.NumElements() < 2 || path_begin.NumElements() < 2) {
    return errors::InvalidArgument(
        "malformed tree: child_begin and path_begin need at least 2 entries, got ",
        child_begin.NumElements(), " and ", path_begin.NumElements());
  }
  if (path_nodes.NumElements() != path_slots.NumElements()) {
    return errors::InvalidArgument("malformed tree: path_nodes has ", path_nodes.NumElements(),
                                   " entries but path_slots has ", path_slots.NumElements());
  }
  tree->num_nodes = child_begin.NumElements() - 1;
  tree->num_classes = path_begin.NumElements() - 1;
  tree->num_slots = num_slots;
  tree->path_length = path_nodes.NumElements();
  tree->child_begin = child_begin.flat<int64_t>().data();
  tree->path_begin = path_begin.flat<int64_t>().data();
  tree->path_nodes = path_nodes.flat<int64_t>().data();
  tree->path_slots = path_slots.flat<int64_t>().data();
  if (tree->child_begin[tree->num_nodes] != num_slots) {
    return errors::InvalidArgument("the tree has ", tree->child_begin[tree->num_nodes],
                                   " slots (child_begin[-1]) but weights has ", num_slots,
                                   " rows");
  }
  if (slot_child_input >= 0) {
    const Tensor& slot_child = ctx->input(slot_child_input);
    if (slot_child.dims() != 1 || slot_child.NumElements() != num_slots) {
      return errors::InvalidArgument("slot_child must be a vector of ", num_slots,
                                     " entries, got shape ", slot_child.shape().DebugString());
    }
    tree->slot_child = slot_child.flat<int64_t>().data();
  }
  return Status();
}

Status ReadClassIds(const Tensor& ids, const char* name, const TensorShape& batch,
                    std::vector<int64>* out) {
  if (ids.shape() != batch) {
    return errors::InvalidArgument(name, " must have hidden's leading shape ",
                                   batch.DebugString(), ", got ", ids.shape().DebugString());
  }
  out->resize(ids.NumElements());
  if (ids.dtype() == DT_INT32) {
    auto v = ids.flat<int32_t>();
    for (int64 i = 0; i < ids.NumElements(); ++i) (*out)[i] = v(i);
  } else {
    auto v = ids.flat<int64_t>();
    for (int64 i = 0; i < ids.NumElements(); ++i) (*out)[i] = v(i);
  }
  return Status();
}

Status CheckTopK(int64 k, const TreeView& tree) {
  if (k > tree.num_classes) {
    return errors::InvalidArgument("k = ", k, " must be in [1, num_classes] = [1, ",
                                   tree.num_classes, "]");
  }
  return Status();
}

Status ReadClassRange(const Tensor& range, const TreeView& tree, int64* begin, int64* end) {
  if (range.dims() != 1 || range.NumElements() != 2) {
    return errors::InvalidArgument("class_range must be a vector (begin, end), got shape ",
                                   range.shape().DebugString());
  }
  *begin = range.flat<int64_t>()(0);
  *end = range.flat<int64_t>()(1);
  if (!(0 <= *begin && *begin <= *end && *end <= tree.num_classes)) {
    return errors::InvalidArgument("class_range = [", *begin, ", ", *end,
                                   ") must satisfy 0 <= begin <= end <= num_classes = ",
                                   tree.num_classes);
  }
  return Status();
}

Status ReadCandidates(const Tensor& candidates, const TensorShape& batch, const TreeView& tree,
                      std::vector<int64>* ids, int64* num_candidates) {
  TensorShape lead = candidates.shape();
  if (lead.dims() > 0) lead.RemoveLastDims(1);
  if (candidates.dims() != batch.dims() + 1 || lead != batch) {
    return errors::InvalidArgument("candidates must have shape [..., M] with hidden's "
                                   "leading shape ", batch.DebugString(), ", got ",
                                   candidates.shape().DebugString());
  }
  TF_RETURN_IF_ERROR(ReadClassIds(candidates, "candidates", candidates.shape(), ids));
  *num_candidates = candidates.dim_size(candidates.dims() - 1);
  for (int64 i = 0; i < static_cast<int64>(ids->size()); ++i) {
    if ((*ids)[i] < 0 || (*ids)[i] >= tree.num_classes) {
      return errors::InvalidArgument(
          "candidates[", i / *num_candidates, ", ", i % *num_candidates, "] = ", (*ids)[i],
          " is not a class id in [0, ", tree.num_classes,
          ") (indices over hidden's flattened leading dimensions)");
    }
  }
  return Status();
}

ParallelFor CpuParallelFor(OpKernelContext* ctx) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [workers](int64 total, int64 cost, const std::function<void(int64, int64)>& work) {
    if (total <= 0) return;
    // Below this much work (in the cost's units, about cycles) the threads' start-up is
    // not worth it; one call takes all.
    constexpr int64 kMinParallelCost = int64{1} << 16;
    const int64 threads = workers->NumThreads();
    if (threads <= 1 || total == 1 || total * std::max<int64>(cost, 1) < kMinParallelCost) {
      work(0, total);
      return;
    }
    // About 8 takes per thread, so the last ones are short; one item at a time where each
    // is worth a thread's start-up on its own (log_prob_all's 1,000 clusters of ~60 us
    // each went 41 at a time: the two cores were busy 96.6% of a call, 97.5% this way).
    const int64 take = cost >= kMinParallelCost ? 1 : std::max<int64>(1, total / ((threads + 1) * 8));
    // Helpers may start late, even after the caller has returned (the pool may be busy, or
    // its threads may be callers themselves): one that finds no item left returns without
    // touching `work`, so the caller waits only for helpers holding an item, never for one
    // still queued.
    struct Shared {
      std::atomic<int64> next{0}, active{0};
      ::tensorflow::mutex mu;
      ::tensorflow::condition_variable idle;
    };
    auto shared = std::make_shared<Shared>();
    const std::function<void(int64, int64)>* items = &work;
    auto run = [shared, items, total, take]() {
      shared->active.fetch_add(1);
      for (int64 b = shared->next.fetch_add(take); b < total; b = shared->next.fetch_add(take)) {
        (*items)(b, std::min(total, b + take));
      }
      if (shared->active.fetch_sub(1) == 1) {
        ::tensorflow::mutex_lock lock(shared->mu);
        shared->idle.notify_all();
      }
    };
    // The caller takes items too, so it replaces one of the pool's threads: with every
    // pool thread as a helper besides, an op called from outside the pool (TF's inter-op
    // threads) ran one thread more than there are cores.
    const int64 helpers = std::min(threads - 1, (total + take - 1) / take - 1);
    for (int64 t = 0; t < helpers; ++t) workers->Schedule(run);
    run();  // returns once every item is taken
    ::tensorflow::mutex_lock lock(shared->mu);
    while (shared->active.load() != 0) shared->idle.wait(lock);
  };
}

Status ReusableOutput::Allocate(OpKernelContext* ctx, int index,
                                              const TensorShape& shape, Tensor** out) {
  constexpr int64 kMinReuseBytes = int64{4} << 20;
  const ::tensorflow::DataType dtype = ctx->expected_output_dtype(index);
  const int64 bytes = shape.num_elements() * static_cast<int64>(::tensorflow::DataTypeSize(dtype));
  if (shape.dims() == 0 || bytes < kMinReuseBytes) return ctx->allocate_output(index, shape, out);
  const int64 rows = shape.dim_size(0);
  ::tensorflow::mutex_lock lock(mu_);
  bool reusable = buffer_.IsInitialized() && buffer_.RefCountIsOne() && buffer_.dtype() == dtype &&
                  buffer_.dims() == shape.dims() && buffer_.dim_size(0) >= rows;
  for (int d = 1; reusable && d < shape.dims(); ++d) reusable = buffer_.dim_size(d) == shape.dim_size(d);
  if (!reusable) {
    // Some headroom: the number of touched rows varies from batch to batch.
    TensorShape roomy = shape;
    roomy.set_dim(0, rows + rows / 4);
    Tensor fresh;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(dtype, roomy, &fresh));
    buffer_ = fresh;
  }
  ctx->set_output(index, buffer_.Slice(0, rows));
  *out = ctx->mutable_output(index);
  return Status();
}

TensorShape BatchShape(const Tensor& hidden) {
  TensorShape batch = hidden.shape();
  batch.RemoveLastDims(1);
  return batch;
}

}  // namespace tf_hsm
