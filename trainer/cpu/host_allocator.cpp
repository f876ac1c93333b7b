// torch's CPU allocator for shardlm's ranks: freed pages are kept and handed to later
// tensors of any size, as CUDA's caching allocator keeps device memory. Built and
// installed by trainer/cpu/host_allocator.py; why it exists is explained there.
//
// Blocks of at least `min_bytes` are anonymous mappings. A freed block is kept, with its
// pages. A request is served from the kept blocks before any page is newly mapped:
//   1. the smallest kept block that holds it: its head is the tensor, the rest stays kept;
//   2. else kept blocks, largest first, are moved into one new range with mremap (the
//      kernel moves their page-table entries; nothing is copied, nothing faults), and only
//      what they do not cover is fresh memory.
// So the mapped bytes never exceed the most bytes ever live at once: the resident peak is
// the same as when every free returns its pages, and after the first update of a training
// loop (whose peak is reached every update) nothing faults. Kept pages are returned only
// by release_cached(). Smaller requests go to glibc (c10::alloc_cpu), as before.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>

namespace {

constexpr size_t kPage = 4096;

// Read by trainer/cpu/host_allocator.py as an array of size_t, in this order.
struct Stats {
  size_t served_exact;    // requests that found a kept block of their size
  size_t served_split;    // ... the head of a larger kept block
  size_t served_moved;    // ... kept blocks moved together (mremap)
  size_t fresh_bytes;     // bytes newly mapped (they fault on first touch)
  size_t moved_bytes;     // bytes moved by mremap
  size_t mapped_bytes;    // mapped now: live + kept
  size_t kept_bytes;      // freed, kept for reuse
  size_t live_bytes;      // held by tensors
  size_t peak_live_bytes;
  size_t released_bytes;  // returned to the OS by release_cached()
};

class PageKeepingAllocator final : public c10::Allocator {
 public:
  explicit PageKeepingAllocator(size_t min_bytes) : min_bytes_(min_bytes) {}

  c10::DataPtr allocate(size_t n) override {
    void* p;
    if (n < min_bytes_) {
      p = c10::alloc_cpu(n);
    } else {
      size_t size = (n + kPage - 1) / kPage * kPage;
      std::lock_guard<std::mutex> lock(mu_);
      p = take(size);
      live_[p] = size;
      st_.live_bytes += size;
      st_.peak_live_bytes = std::max(st_.peak_live_bytes, st_.live_bytes);
    }
    return {p, p, &Free, c10::Device(c10::DeviceType::CPU)};
  }

  // The same deleter for both kinds of block, with context == data: raw_allocate works.
  c10::DeleterFnPtr raw_deleter() const override { return &Free; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  static void Free(void* p);

  void release(void* p) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(p);
      if (it != live_.end()) {
        keep(static_cast<char*>(p), it->second);
        st_.live_bytes -= it->second;
        live_.erase(it);
        return;
      }
    }
    c10::free_cpu(p);  // a small block, from glibc
  }

  void release_cached() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [size, p] : kept_) {
      munmap(p, size);
      st_.released_bytes += size;
      st_.mapped_bytes -= size;
    }
    kept_.clear();
    st_.kept_bytes = 0;
  }

  Stats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return st_;
  }

  // fork() while another thread holds the lock would leave it held forever in the child
  // (DataLoader workers are forked from a rank).
  void lock() { mu_.lock(); }
  void unlock() { mu_.unlock(); }

 private:
  void keep(char* p, size_t size) {
    kept_.emplace(size, p);
    st_.kept_bytes += size;
  }

  char* unkeep(std::multimap<size_t, char*>::iterator it) {
    char* p = it->second;
    st_.kept_bytes -= it->first;
    kept_.erase(it);
    return p;
  }

  char* take(size_t size) {
    auto fit = kept_.lower_bound(size);
    if (fit != kept_.end()) {
      size_t have = fit->first;
      char* p = unkeep(fit);
      if (have == size) {
        ++st_.served_exact;
      } else {
        ++st_.served_split;
        keep(p + size, have - size);
      }
      return p;
    }
    // Every kept block is smaller than the request. The new range is only reserved until
    // the kept pages are moved over it (mremap's MREMAP_FIXED replaces what lies there).
    char* dst = static_cast<char*>(mmap(nullptr, size, PROT_READ | PROT_WRITE,
                                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    TORCH_CHECK(dst != MAP_FAILED, "out of host memory: could not map ", size, " bytes (",
                st_.mapped_bytes, " bytes mapped by tensors already)");
    size_t filled = 0;
    while (filled < size && !kept_.empty()) {
      auto largest = std::prev(kept_.end());
      size_t have = largest->first;
      char* src = unkeep(largest);
      size_t use = std::min(have, size - filled);
      void* moved = mremap(src, use, use, MREMAP_MAYMOVE | MREMAP_FIXED, dst + filled);
      if (moved == MAP_FAILED) {  // e.g. the process's mapping limit: keep the rest fresh
        keep(src, have);
        break;
      }
      if (use < have) keep(src + use, have - use);
      filled += use;
      st_.moved_bytes += use;
    }
    if (filled) ++st_.served_moved;
    st_.fresh_bytes += size - filled;
    st_.mapped_bytes += size - filled;
    return dst;
  }

  const size_t min_bytes_;
  std::mutex mu_;
  std::unordered_map<void*, size_t> live_;  // block -> its size, for the large blocks only
  std::multimap<size_t, char*> kept_;       // size -> freed block
  Stats st_{};
};

// Never destroyed: tensors may be freed after static destructors have run.
PageKeepingAllocator* g_allocator = nullptr;

void PageKeepingAllocator::Free(void* p) { g_allocator->release(p); }

}  // namespace

extern "C" {

// Makes the allocator torch's CPU allocator; 1 when it is (another one of a higher
// priority may be registered). Tensors made before keep their own deleter.
int shardlm_host_allocator_install(size_t min_bytes) {
  if (!g_allocator) {
    g_allocator = new PageKeepingAllocator(min_bytes);
    pthread_atfork([] { g_allocator->lock(); }, [] { g_allocator->unlock(); },
                   [] { g_allocator->unlock(); });
  }
  c10::SetCPUAllocator(g_allocator, /*priority=*/1);
  return c10::GetCPUAllocator() == g_allocator;
}

void shardlm_host_allocator_stats(size_t* out) {
  Stats s = g_allocator ? g_allocator->stats() : Stats{};
  std::memcpy(out, &s, sizeof s);
}

void shardlm_host_allocator_release_cached() {
  if (g_allocator) g_allocator->release_cached();
}

}  // extern "C"
