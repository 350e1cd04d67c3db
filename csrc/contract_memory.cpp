// The planner's checkpoint placement and memory model (torch_gradops/tensornet/slicer.py's
// memory_model and place_checkpoints document them): the backward checkpoints of one slice's
// steps that keep the executor's modelled memory within a cap with the least recomputation. The
// planner places checkpoints for every candidate slicing and tree of its search (200-300 times
// for a 36-tensor lattice), so this runs here rather than in Python.
#include <algorithm>
#include <limits>
#include <vector>

#include "contract_program.h"

namespace torch_gradops {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// One entry per step in each table, every consumer a later step (or n) and, when
// `with_producers`, every producer an earlier step (or -1): the tables index each other.
void check_steps(const StepMemory& c, bool with_producers, const char* fn) {
  const int64_t n = static_cast<int64_t>(c.result.size());
  TORCH_CHECK(c.trans.size() == c.result.size() && c.consumer.size() == c.result.size() &&
                  (!with_producers || c.from_step.size() == c.result.size()),
              fn, ": result, trans, consumer", with_producers ? " and from_step" : "",
              " must have one entry per step");
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(c.consumer[j] > j && c.consumer[j] <= n, fn, ": consumer of step ", j, " out of range");
    if (with_producers)
      for (int64_t p : {c.from_step[j].first, c.from_step[j].second})
        TORCH_CHECK(p >= -1 && p < j, fn, ": producer of step ", j, " out of range");
  }
}

// made[j]: elements of the results of steps 0..j-1.
std::vector<double> prefix_made(const StepMemory& c) {
  const size_t n = c.result.size();
  std::vector<double> made(n + 1, 0);
  for (size_t j = 0; j < n; ++j) made[j + 1] = made[j] + c.result[j];
  return made;
}

// The checkpoints of the placement within `cap` whose last checkpoint is earliest (the least
// recomputation), or false when none fits: a pass over the boundaries keeping, for each boundary
// b, the least `cross` (elements checkpointed there: made earlier, read at or after b) of any
// placement of earlier checkpoints whose segments all fit. A later segment's memory grows with
// `cross` and with nothing else from before b, so this is exact. `tail[b]`: what steps b.. hold
// as one segment; `last`: the last boundary at which the last segment fits with only what must
// be checkpointed there.
bool fewest_recomputed(const StepMemory& c, const std::vector<double>& tail, int64_t last, double cap,
                       std::vector<int64_t>& out) {
  const std::vector<double> made = prefix_made(c);
  std::vector<double> best(last + 1, kInf);
  std::vector<int64_t> back(last + 1, 0);
  best[0] = 0;
  for (int64_t b = 1; b <= last; ++b) {
    double top = -kInf, crossing = 0, least = kInf;
    int64_t at = 0;
    for (int64_t p = b - 1; p >= 0; --p) {  // the segment [p, b), longer and longer
      top = std::max(top, made[p + 1] + c.trans[p]);
      const double seg = top - made[p];  // its peak: a step's transients over the steps up to it
      if (seg > cap) break;               // longer segments hold more
      if (c.consumer[p] >= b) crossing += c.result[p];
      if (best[p] + seg <= cap && best[p] + crossing < least) {
        least = best[p] + crossing;
        at = p;
      }
    }
    best[b] = least;
    back[b] = at;
    if (least + tail[b] <= cap) {  // the last segment [b, n) fits: b is the earliest
      out.assign(1, b);
      while (back[out.back()] > 0) out.push_back(back[out.back()]);
      std::reverse(out.begin(), out.end());
      return true;
    }
  }
  return false;
}

// checkpointed_peak on tables already checked.
double peak_with(const StepMemory& c, const std::vector<int64_t>& checkpoints) {
  const int64_t n = static_cast<int64_t>(c.result.size());
  std::vector<int64_t> bounds{0};
  for (int64_t b : checkpoints)
    if (b > 0 && b < n) bounds.push_back(b);
  std::sort(bounds.begin(), bounds.end());
  bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  bounds.push_back(n);
  double peak = 0, cross = 0;
  for (size_t s = 0; s + 1 < bounds.size(); ++s) {
    const int64_t lo = bounds[s], hi = bounds[s + 1];
    double held = 0;
    for (int64_t j = lo; j < hi; ++j) {  // step j's transients come while the segment holds steps lo..j
      held += c.result[j];
      peak = std::max(peak, cross + held + c.trans[j]);
    }
    for (int64_t j = lo; j < hi; ++j)
      if (c.consumer[j] >= hi) cross += c.result[j];
  }
  return peak;
}

}  // namespace

std::vector<double> step_transients(const std::vector<std::pair<double, double>>& inputs,
                                    const std::vector<double>& result,
                                    const std::vector<std::pair<std::vector<int64_t>, bool>>* copies, bool is_complex) {
  const size_t n = inputs.size();
  TORCH_CHECK(result.size() == n && (copies == nullptr || copies->size() == n),
              "step_transients: inputs, result and copies must have one entry per step");
  std::vector<double> out(n);
  for (size_t j = 0; j < n; ++j) {
    const auto [ia, ib] = inputs[j];
    if (copies == nullptr) {
      out[j] = is_complex ? ia + ib : std::min(ia, ib);
      continue;
    }
    const auto& [copied_in, copied_out] = (*copies)[j];
    double t = std::min(ia, ib);
    if (copied_out) t += result[j];
    if (!copied_in.empty()) {
      double in = 0;
      for (int64_t p : copied_in) {
        TORCH_CHECK(p >= 0 && static_cast<size_t>(p) < n, "step_transients: copied step ", p, " out of range");
        in += result[p];
      }
      t = std::max(t, in);
    }
    if (is_complex) t += std::max(ia, ib);
    out[j] = t;
  }
  return out;
}

double checkpointed_peak(const StepMemory& c, const std::vector<int64_t>& checkpoints) {
  check_steps(c, /*with_producers=*/false, "checkpointed_peak");
  return peak_with(c, checkpoints);
}

CheckpointPlacement place_checkpoints(const StepMemory& c, std::optional<double> cap) {
  const int64_t n = static_cast<int64_t>(c.result.size());
  check_steps(c, /*with_producers=*/true, "place_checkpoints");
  CheckpointPlacement r;
  if (n == 0) return r;
  std::vector<double> tail(n + 1, 0);  // tail[b]: what steps b.. hold as one segment
  for (int64_t b = n - 1; b >= 0; --b) tail[b] = c.result[b] + std::max(c.trans[b], tail[b + 1]);
  r.peak = tail[0];  // the model without checkpoints
  if (!cap || r.peak <= *cap || n <= 1) return r;
  // live[b]: results made before step b and read at or after it (every placement checkpoints
  // them at b): no placement ends past the last b at which the last segment fits with just that
  std::vector<double> live(n + 1, 0), consumed_at(n + 1, 0);
  for (int64_t j = 0; j < n; ++j) consumed_at[c.consumer[j]] += c.result[j];
  for (int64_t b = 0; b < n; ++b) live[b + 1] = live[b] + c.result[b] - consumed_at[b];
  int64_t last = 0;
  for (int64_t b = 1; b < n; ++b)
    if (live[b] + tail[b] <= *cap) last = b;
  if (fewest_recomputed(c, tail, last, *cap, r.checkpoints)) {
    r.peak = peak_with(c, r.checkpoints);
    return r;
  }
  // Nothing fits: the lowest peak of one greedy pass (each segment as long as the cap allows)
  // cut at each b up to `last`. The current segment starts at `lo` (`starts`: every segment's
  // start) and holds `held` elements, at most `top` with a step's transients, on top of `cross`
  // checkpointed elements of the earlier segments, whose peaks were `prior_peak`; `out_of`:
  // elements made in [lo, b) and read at or after b (checkpointed at b).
  std::vector<int64_t> starts{0};
  int64_t lo = 0;
  double cross = 0, prior_peak = 0, held = 0, top = 0, out_of = 0;
  bool found = false;
  for (int64_t b = 1; b <= last; ++b) {
    const int64_t j = b - 1;  // the step that joins the current segment, or starts the next
    const double rj = c.result[j], tj = c.trans[j];
    if (j > lo && cross + std::max(top, held + rj + tj) > *cap) {  // close segment [lo, j)
      prior_peak = std::max(prior_peak, cross + top);
      cross += out_of;
      lo = j;
      held = top = out_of = 0;
      starts.push_back(lo);
    }
    held += rj;
    top = std::max(top, held + tj);
    out_of += rj;  // step j reads its operands (no longer read after it), makes a result read later
    for (int64_t p : {c.from_step[j].first, c.from_step[j].second})
      if (p >= lo) out_of -= c.result[p];
    if (j == lo && cross + top > *cap) break;  // a step alone does not fit: no later b does
    if (live[b] + tail[b] > *cap) continue;   // the last segment does not fit even so
    const double peak = std::max({prior_peak, cross + top, cross + out_of + tail[b]});
    if (peak < r.peak) {
      r.peak = peak;
      r.checkpoints.assign(starts.begin() + 1, starts.end());
      r.checkpoints.push_back(b);
      found = true;
    }
  }
  if (!found) {  // the lowest-peak placement: a checkpoint per step, every earlier result checkpointed
    double peak = 0, made = 0;
    for (int64_t j = 0; j < n; ++j) {
      peak = std::max(peak, made + c.result[j] + c.trans[j]);
      made += c.result[j];
    }
    if (peak < r.peak) {
      r.peak = peak;
      r.checkpoints.clear();
      for (int64_t b = 1; b < n; ++b) r.checkpoints.push_back(b);
    }
  }
  return r;
}

}  // namespace torch_gradops
