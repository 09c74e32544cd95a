// The fa2 backward's working memory, kept from call to call (included by kernels.inl).
//
// A small backward allocated all of it afresh: Q and dO converted for every head, lse and D, the
// threads' partial sums, and each thread's tile buffers (K, K^T, V^T, dK, dV, S, dS, ...). glibc
// serves allocations over 128 KiB by mmap, so every call faulted those pages in again (128 x 16
// d 64: a third of the one-thread backward's samples in the kernel's page-fault path), and the
// small ones were zero-filled as they grew. Kept, a stream of calls (a training loop) stops
// allocating them.

// What a call keeps whose size follows seqlen: Q, dO, lse and D of the heads (BackwardInputs)
// and the threads' partial sums. One workspace per backward in flight, taken from a free list
// (Workspaces) and given back after the call: calls from two caller threads at once never share
// one, and a workspace outlives each of the call's parallel regions.
template <typename T>
struct BackwardRows {
  RawBuffer<T> Q, dO, L2, D;  // every row written by load_query_tile before it is read
  RawBuffer<T> Qt, dOt;       // their transposes, where the products take them
  size_t size() const {
    return Q.data.capacity() + dO.data.capacity() + L2.data.capacity() + D.data.capacity() +
           Qt.data.capacity() + dOt.data.capacity();
  }
};

template <typename T>
struct BackwardWorkspace {
  BackwardRows<T> all;               // every head's (prepare_backward_inputs)
  std::vector<BackwardRows<T>> own;  // per thread: one kv head group's (fa2_backward_by_keys)
  std::vector<std::vector<T>> part;  // per thread: dQ partials (by keys), dK and dV (by queries)

  int64_t bytes() const {
    size_t n = all.size();
    for (const auto& x : own) n += x.size();
    for (const auto& x : part) n += x.capacity();
    return static_cast<int64_t>(n * sizeof(T));
  }
};

// Workspaces over kKeptWorkspaceBytes are freed after their call (the page faults they would
// save are a small part of a call that size: 512 x 512 d 64 needs 2.3 MiB, 2,048 x 2,048 12 MiB);
// at most kKeptWorkspaces wait in the free list.
constexpr int64_t kKeptWorkspaceBytes = int64_t{16} << 20;
constexpr size_t kKeptWorkspaces = 4;

template <typename T>
class Workspace {
 public:
  Workspace() {
    std::lock_guard<std::mutex> lock(mu());
    auto& list = free_list();
    if (list.empty()) {
      ws_.reset(new BackwardWorkspace<T>());
    } else {
      ws_ = std::move(list.back());
      list.pop_back();
    }
  }
  ~Workspace() {
    if (ws_->bytes() > kKeptWorkspaceBytes) return;  // freed with ws_
    std::lock_guard<std::mutex> lock(mu());
    if (free_list().size() < kKeptWorkspaces) free_list().push_back(std::move(ws_));
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  BackwardWorkspace<T>& operator*() { return *ws_; }
  BackwardWorkspace<T>* operator->() { return ws_.get(); }

 private:
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::vector<std::unique_ptr<BackwardWorkspace<T>>>& free_list() {
    static auto* list = new std::vector<std::unique_ptr<BackwardWorkspace<T>>>();  // never freed:
    return *list;  // a worker may finish a call during static destruction
  }
  std::unique_ptr<BackwardWorkspace<T>> ws_;
};

// One thread's tile buffers, sized by the tile table (not the sequences), kept from call to call
// like the forward's ForwardTiles: a thread runs one slice of one parallel region at a time, and
// every buffer is written before it is read within a task (they were reused from task to task
// already; valgrind memcheck of test_backward with them uninitialised: no uninitialised reads).
template <typename T>
struct BackwardTiles {
  KeyBlock<T> kb;
  std::vector<KeyBlock<T>> slots;  // fa2_backward_by_queries' kept key tiles
  RawBuffer<T> dk, dv, q, dout, l2, d, o, dq, acc, st;
  BackwardScratch<T> scratch;
#if FLASHDL_HAVE_BF16_DOT
  Bf16BackwardProducts bprod;
  std::vector<Bf16BackwardProducts> bprods;  // one a slot
#endif

  // Gives the key-tile slots back when they hold more than kKeptSlotBytes (by_queries keeps up
  // to 4 MiB of key tiles, or one tile a kv head): the rest is a few tiles' worth.
  void release_slots_if_over() {
    constexpr int64_t kKeptSlotBytes = int64_t{8} << 20;
    size_t n = 0;
    for (const auto& s : slots)
      n += s.K.data.capacity() + s.Kt.data.capacity() + s.Vt.data.capacity() + s.V.data.capacity();
    if (static_cast<int64_t>(n * sizeof(T)) > kKeptSlotBytes) {
      slots = std::vector<KeyBlock<T>>();
#if FLASHDL_HAVE_BF16_DOT
      bprods = std::vector<Bf16BackwardProducts>();
#endif
    }
  }
};

template <typename T>
BackwardTiles<T>& backward_tiles() {
  thread_local BackwardTiles<T> tiles;
  return tiles;
}
