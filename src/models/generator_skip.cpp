// See generator_skip.h. torch's mt19937 (ATen/core/MT19937RNGEngine.h) keeps 624 untempered words x_b..x_b+623 of
// the sequence x_{k+624} = x_{k+397} ^ twist(x_k, x_{k+1}) and regenerates them 624 at a time. A window of 624
// consecutive words is a state of that recurrence; one step (drop the first word, append the next) is a linear map
// A over GF(2). A jump by D steps is A^D = g(A) with g = t^D mod the minimal polynomial of A, t * phi(t): phi
// (degree 19937) is found once by Berlekamp-Massey on one bit of the sequence, and g(A) applied to a window is the
// XOR of the windows starting at the exponents of g's terms.
#include "models/generator_skip.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/DistributionsHelper.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <vector>

namespace fsdp::models::detail {
namespace {

constexpr int kStateWords = 624;  // at::MERSENNE_STATE_N
constexpr int kLag = 397;         // at::MERSENNE_STATE_M
constexpr int kDegree = 19937;    // the degree of MT19937's characteristic polynomial
// Below this, stepping the engine (about a nanosecond an output) is cheaper than a jump (tens of milliseconds).
constexpr uint64_t kStepLimit = uint64_t(1) << 22;

using Window = std::array<uint32_t, kStateWords>;
using Poly = std::vector<uint64_t>;  // GF(2) polynomial, bit i of word i / 64 = coefficient of t^i

// The words of the sequence that starts with `window`, `count` of them (the window first).
std::vector<uint32_t> continue_sequence(const Window& window, size_t count) {
  std::vector<uint32_t> x(std::max<size_t>(count, kStateWords));
  std::copy(window.begin(), window.end(), x.begin());
  for (size_t k = kStateWords; k < x.size(); ++k) {
    const uint32_t mixed = (x[k - kStateWords] & at::UMASK) | (x[k - kStateWords + 1] & at::LMASK);
    x[k] = x[k - kStateWords + kLag] ^ (mixed >> 1) ^ ((x[k - kStateWords + 1] & 1u) ? at::MATRIX_A : 0u);
  }
  return x;
}

bool bit(const Poly& p, size_t i) { return (p[i / 64] >> (i % 64)) & 1u; }

// phi, the characteristic polynomial of the recurrence on its 19937-dimensional state space: the shortest linear
// recurrence of bit 0 of the sequence (Berlekamp-Massey over 2 x 19937 terms; the sequence of a seeded engine,
// past its first window, whose low bits of the first word are outside that space).
Poly characteristic_polynomial() {
  const size_t terms = 2 * kDegree;
  at::mt19937 engine(5489);
  Window seeded;
  std::copy(engine.data().state_.begin(), engine.data().state_.end(), seeded.begin());
  const std::vector<uint32_t> x = continue_sequence(seeded, kStateWords + terms);
  // s reversed, so that the discrepancy below is a dot product of two contiguous byte runs.
  std::vector<uint8_t> s_reversed(terms);
  for (size_t n = 0; n < terms; ++n) s_reversed[terms - 1 - n] = x[kStateWords + n] & 1u;
  // Connection polynomial C (s_n = sum_{i=1..L} c_i s_{n-i}), one byte a coefficient.
  std::vector<uint8_t> c(terms + 1, 0), b(terms + 1, 0), previous;
  c[0] = b[0] = 1;
  size_t length = 0, shift = 1;
  for (size_t n = 0; n < terms; ++n) {
    const uint8_t* s_at = s_reversed.data() + (terms - 1 - n);  // s_at[i] = s_{n-i}
    uint8_t d = s_at[0];
    for (size_t i = 1; i <= length; ++i) d ^= c[i] & s_at[i];
    if (d == 0) {
      ++shift;
      continue;
    }
    const bool grow = 2 * length <= n;
    if (grow) previous = c;
    for (size_t i = 0; i <= length && i + shift <= terms; ++i) c[i + shift] ^= b[i];  // deg b <= length
    if (grow) {
      length = n + 1 - length;
      b = std::move(previous);
      shift = 1;
    } else {
      ++shift;
    }
  }
  TORCH_CHECK(length == kDegree, "mt19937 jump-ahead: the recurrence found has degree ", length, ", expected ",
              kDegree);
  Poly phi((kDegree + 64) / 64, 0);
  for (size_t j = 0; j <= length; ++j) {  // phi(t) = t^L + c_1 t^(L-1) + ... + c_L
    if (c[length - j]) phi[j / 64] |= uint64_t(1) << (j % 64);
  }
  return phi;
}

const Poly& phi() {
  static const Poly cached = characteristic_polynomial();
  return cached;
}

// a (any degree below 2 x 19937) reduced mod phi, in place; a keeps its size.
void reduce(Poly& a) {
  const Poly& p = phi();
  for (size_t pos = a.size() * 64; pos-- > kDegree;) {
    if (!bit(a, pos)) continue;
    const size_t sh = pos - kDegree, word = sh / 64, offset = sh % 64;
    for (size_t k = 0; k < p.size(); ++k) {
      a[word + k] ^= p[k] << offset;
      if (offset != 0 && word + k + 1 < a.size()) a[word + k + 1] ^= p[k] >> (64 - offset);
    }
  }
}

// Spreads the 32 bits of v over the even bits of a 64-bit word (squaring over GF(2)).
uint64_t spread(uint64_t v) {
  v = (v | (v << 16)) & 0x0000FFFF0000FFFFull;
  v = (v | (v << 8)) & 0x00FF00FF00FF00FFull;
  v = (v | (v << 4)) & 0x0F0F0F0F0F0F0F0Full;
  v = (v | (v << 2)) & 0x3333333333333333ull;
  v = (v | (v << 1)) & 0x5555555555555555ull;
  return v;
}

// t^e mod phi.
Poly power_of_t(uint64_t e) {
  const size_t words = phi().size();
  Poly r(2 * words + 1, 0);
  r[0] = 1;
  int top = 63;
  while (top >= 0 && !((e >> top) & 1u)) --top;
  for (int i = top; i >= 0; --i) {
    Poly squared(r.size(), 0);
    for (size_t w = 0; w < words; ++w) {
      squared[2 * w] = spread(r[w] & 0xFFFFFFFFull);
      squared[2 * w + 1] = spread(r[w] >> 32);
    }
    reduce(squared);
    r = std::move(squared);
    if ((e >> i) & 1u) {
      for (size_t w = r.size(); w-- > 0;) r[w] = (r[w] << 1) | (w > 0 ? r[w - 1] >> 63 : 0);
      reduce(r);
    }
  }
  return r;
}

// The window D >= 1 steps after `window`: g(A) window with g = t * (t^(D-1) mod phi) = t^D mod (t * phi).
Window jump(const Window& window, uint64_t steps) {
  const Poly h = power_of_t(steps - 1);
  const std::vector<uint32_t> x = continue_sequence(window, kDegree + kStateWords + 1);
  Window out{};
  for (size_t i = 0; i < kDegree; ++i) {
    if (!bit(h, i)) continue;
    const uint32_t* from = x.data() + i + 1;
    for (int j = 0; j < kStateWords; ++j) out[j] ^= from[j];
  }
  return out;
}

}  // namespace

void skip_generator_outputs(at::Generator& gen, uint64_t n) {
  if (n == 0) return;
  auto* cpu = at::check_generator<at::CPUGeneratorImpl>(gen);
  std::lock_guard<std::mutex> lock(gen.mutex());
  at::mt19937 engine = cpu->engine();
  if (n < kStepLimit) {
    for (uint64_t i = 0; i < n; ++i) engine();
    cpu->set_engine(engine);
    return;
  }
  // The engine holds the window x_b.. and has handed out 625 - left_ of it (624 right after seeding, whose first
  // twist comes before any output), so its next output is x_{b + 625 - left_}. The state left below is the window
  // 624 words before the target with nothing of it left to hand out: the next call twists it into the window
  // that starts at x_{b + 625 - left_ + n} and returns that word.
  at::mt19937_data_pod data = engine.data();
  TORCH_CHECK(data.seeded_ && data.left_ >= 1 && data.left_ <= kStateWords, "skip_generator_outputs: the CPU "
              "generator's mt19937 state is not one torch leaves (left_ = ", data.left_, ")");
  Window window;
  std::copy(data.state_.begin(), data.state_.end(), window.begin());
  const uint64_t steps = n + 1 - static_cast<uint64_t>(data.left_);
  const Window target = jump(window, steps);
  std::copy(target.begin(), target.end(), data.state_.begin());
  data.left_ = 1;
  data.next_ = 0;
  engine.set_data(data);
  cpu->set_engine(engine);
}

namespace {
thread_local MetaDrawSkipping* active_skipping = nullptr;
thread_local uint64_t skipped_outputs_total = 0;
}  // namespace

MetaDrawSkipping::MetaDrawSkipping(const at::Generator& gen) : gen_(gen), outer_(active_skipping) {
  active_skipping = this;
}

MetaDrawSkipping::~MetaDrawSkipping() { active_skipping = outer_; }  // outputs still counted: nothing draws after

bool MetaDrawSkipping::skip_draw(const at::Tensor& param, std::optional<uint64_t> outputs, at::Generator& gen) {
  MetaDrawSkipping* skipping = active_skipping;
  if (skipping == nullptr || skipping->gen_ != gen) return false;
  if (param.is_meta() && outputs) {
    skipping->pending_outputs_ += *outputs;
    skipped_outputs_total += *outputs;
    return true;
  }
  skip_generator_outputs(gen, skipping->pending_outputs_);
  skipping->pending_outputs_ = 0;
  return false;
}

uint64_t MetaDrawSkipping::skipped_outputs_on_this_thread() { return skipped_outputs_total; }

}  // namespace fsdp::models::detail
